"""What crosses a process or rank boundary: small dataclasses with a msgpack form.

Pure Python: no torch. New requests travel once; afterwards only ids (cancel) and diffs
(new tokens) move. ``pack``/``unpack`` use msgpack only: no pickle, no class loading — a
message names its type with a short tag that maps to one of the classes below.
"""

from __future__ import annotations

import dataclasses
import sys
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgpack

from phalanx.kv_manager.radix_tree import DEFAULT_PRIORITY


@dataclass
class GenerationRequest:
    """A new request for the ranks (token ids only: text never leaves the user process)."""

    request_id: int
    prompt_token_ids: Sequence[int]           # a list; after unpack an array("I"), or what ``ids_from_wire`` left
    sampling_params: dict[str, Any]           # SamplingParams.to_dict()
    eos_token_ids: list[int] = field(default_factory=list)
    max_total_tokens: int = 0                 # finish by length at this many tokens
    cache_salt: str | None = None
    priority: int = DEFAULT_PRIORITY
    arrival_time: float = 0.0
    lora: list[Any] | None = None             # its LoRA adapter: [lora_name, lora_int_id, lora_path]


@dataclass
class CancelRequest:
    request_id: int


@dataclass
class Response:
    """Rank 0 -> user: new tokens of one request since its last response."""

    request_id: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] | None = None         # per token: [chosen logprob, its rank, [[id, logprob], ...]]
    finish_reason: str | None = None          # "stop" | "length" | "abort" | "error"
    stop_reason: int | None = None
    num_cached_tokens: int = 0
    num_prompt_tokens: int = 0
    error: str | None = None
    first_scheduled_time: float = 0.0         # monotonic seconds (queue-time metric)
    rank: int = -1                            # the rank serving the request (attention DP)
    prompt_logprobs: list[Any] | None = None  # per prompt position from prompt_logprobs_start:
    prompt_logprobs_start: int = 0            # [logprob of the next prompt token, its rank, [[id, lp], ...]]
    weight_version: str = ""                  # the weights that produced token_ids


class FirstToken(NamedTuple):
    """A TokenBatch row for a request's first output token: what is reported about it once."""

    request_id: int
    num_cached_tokens: int
    num_prompt_tokens: int
    first_scheduled_time: float     # monotonic seconds (queue-time metric)
    rank: int                       # the rank serving the request (attention DP)


class Finished(NamedTuple):
    """A TokenBatch row for a request that finished at this step."""

    request_id: int
    finish_reason: str
    stop_reason: int | None


@dataclass
class TokenBatch:
    """Rank 0 -> user: one step's new tokens for many requests, column by column (cheap to
    pack at hundreds of requests per step). Rows travel as msgpack arrays."""

    request_ids: list[int] = field(default_factory=list)
    token_ids: list[int | list[int]] = field(default_factory=list)   # a list: a verify step's accepted tokens
    logprobs: list[Any] | None = None     # aligned with request_ids: None or [chosen, rank, [[id, lp], ...]]
    finished: list[Finished] = field(default_factory=list)
    first: list[FirstToken] = field(default_factory=list)
    weight_version: str = ""              # the weights that produced this step's tokens

    def __post_init__(self) -> None:   # from the wire, rows arrive as lists
        self.finished = [f if isinstance(f, Finished) else Finished(*f) for f in self.finished]
        self.first = [f if isinstance(f, FirstToken) else FirstToken(*f) for f in self.first]

    def rows(self) -> Iterator[tuple[int, list[int], list[Any] | None, Finished | None, FirstToken | None]]:
        """Row by row: (request id, its new tokens, their logprobs or None, its Finished row or
        None, its FirstToken row or None)."""
        done = {f.request_id: f for f in self.finished}
        first = {f.request_id: f for f in self.first}
        lps = self.logprobs
        for i, (rid, tok) in enumerate(zip(self.request_ids, self.token_ids, strict=True)):
            lp = lps[i] if lps is not None else None
            yield (rid, tok if isinstance(tok, list) else [tok], [lp] if lp is not None else None,
                   done.get(rid) if done else None, first.get(rid) if first else None)

    def responses(self) -> list[Response]:
        """The rows as Response messages (the user side applies ``rows`` without making these)."""
        out = []
        for rid, toks, lps, fin, fst in self.rows():
            resp = Response(rid, toks, lps, weight_version=self.weight_version)
            if fin is not None:
                resp.finish_reason, resp.stop_reason = fin.finish_reason, fin.stop_reason
            if fst is not None:
                resp.num_cached_tokens, resp.num_prompt_tokens = fst.num_cached_tokens, fst.num_prompt_tokens
                resp.first_scheduled_time, resp.rank = fst.first_scheduled_time, fst.rank
            out.append(resp)
        return out


@dataclass
class IterationInput:
    """What rank 0 broadcasts each iteration: {new, cancel, shutdown} (+ inspection requests)."""

    new: list[GenerationRequest] = field(default_factory=list)
    cancel: list[int] = field(default_factory=list)
    shutdown: bool = False
    control: list[Any] = field(default_factory=list)   # Control messages

    def __bool__(self) -> bool:
        return bool(self.new or self.cancel or self.shutdown or self.control)


@dataclass
class Heartbeat:
    """Rank -> user, at most every ``HEARTBEAT_INTERVAL`` seconds while its loop makes progress:
    the loop's iteration and the rank's engine counters (as ``PyExecutor.stats``). Silence
    longer than ``engine_iteration_timeout`` means the engine is stalled."""

    rank: int
    iteration: int
    stats: dict[str, Any] = field(default_factory=dict)


HEARTBEAT_INTERVAL = 0.25


@dataclass
class Init:
    """User -> rank 0 (then every rank): build the engine with these LLM arguments.
    ``model_source``: the model (and a DraftTarget draft) as the user's process resolved it
    (``ModelSource.to_wire``), so that no rank reads a configuration again through transformers
    (seconds of imports a rank); None: each rank resolves ``llm_args["model"]`` (and the draft)
    itself."""

    llm_args: dict[str, Any]
    model_source: dict[str, Any] | None = None


@dataclass
class Ready:
    """Rank 0 -> user: every rank built its engine."""

    info: dict[str, Any]


@dataclass
class Fatal:
    """Rank 0 -> user: a rank failed (at start-up or later); the engine is gone."""

    rank: int
    error: str


@dataclass
class Shutdown:
    pass


@dataclass
class Control:
    """User -> ranks: an operation every rank applies between the same two iterations
    (inspection, pause, sleep, weight updates); ``args`` are plain msgpack values."""

    op: str
    control_id: int = 0
    args: dict[str, Any] = field(default_factory=dict)


@dataclass
class ControlResult:
    control_id: int
    ok: bool
    per_rank: list[str] = field(default_factory=list)


_TYPES: dict[str, type] = {
    "req": GenerationRequest, "cancel": CancelRequest, "resp": Response, "iter": IterationInput, "tok": TokenBatch,
    "init": Init, "ready": Ready, "fatal": Fatal, "shutdown": Shutdown, "ctl": Control,
    "ctl_result": ControlResult, "beat": Heartbeat,
}
_TAGS = {cls: tag for tag, cls in _TYPES.items()}
_FIELDS = {cls: tuple(f.name for f in dataclasses.fields(cls)) for cls in _TYPES.values()}
# the fields that hold lists of messages; every other field is plain msgpack values and crosses
# as it is (a prompt's token ids are not walked element by element: ~0.25 ms a side at 2k tokens)
_NESTED: dict[type, tuple[str, ...]] = {IterationInput: ("new", "control")}

WIRE_IDS = "I"                     # array typecode of token ids on the wire: 4-byte unsigned
assert array(WIRE_IDS).itemsize == 4
_SWAP = sys.byteorder != "little"  # the wire is little-endian


def ids_to_wire(ids: Sequence[int]) -> bytes | list[int]:
    """Token ids as one msgpack bin of little-endian uint32: a C loop each way, where msgpack
    packs and unpacks a list of 2k ints as 2k Python objects (~50 µs a side on a 2-core CPU).
    Ids that are not all integers in [0, 2**32) cross as a list, for the receiver's check to
    name the bad one. Bytes that ``ids_from_wire`` could not read cross again as they came (rank
    0 forwards what it received to the other ranks, where the check fails as it did on rank 0)."""
    if isinstance(ids, bytes | bytearray):
        return bytes(ids)
    try:
        packed = array(WIRE_IDS, ids)
    except (OverflowError, TypeError):
        try:
            return list(ids)
        except TypeError:   # not a sequence at all: as it is, for the check to refuse
            return ids      # type: ignore[return-value]
    if _SWAP:
        packed.byteswap()
    return packed.tobytes()


def ids_from_wire(value: Any) -> Any:
    """``ids_to_wire``'s bytes as an array("I") (ints in [0, 2**32) by construction: the rank's
    check only compares them with the vocabulary). Bytes that are not whole uint32 ids (no proxy
    sends them) stay bytes, for the rank's prompt check to refuse that one request: raising here
    would stop the loop that reads every request. Anything else a client of the socket sent (a
    list, a string, a map) is made what another crossing would make of it (ids_to_wire, then
    this), so that a message decoded once equals itself decoded again: rank 0 keeps what it read
    and the other ranks unpack its broadcast of it (``BroadcastRequestQueue``)."""
    if not isinstance(value, bytes | bytearray):
        value = ids_to_wire(value)
        if not isinstance(value, bytes):
            return value
    if len(value) % 4:
        return value
    ids = array(WIRE_IDS)
    ids.frombytes(value)
    if _SWAP:
        ids.byteswap()
    return ids


# fields with a wire form of their own: (name, to the wire, from the wire)
_CODECS: dict[type, tuple[tuple[str, Callable[[Any], Any], Callable[[Any], Any]], ...]] = {
    GenerationRequest: (("prompt_token_ids", ids_to_wire, ids_from_wire),)}


def to_wire(obj: Any) -> Any:
    """A message (or list of messages) as plain msgpack-able values."""
    if isinstance(obj, list):
        return [to_wire(o) for o in obj]
    cls = type(obj)
    tag = _TAGS.get(cls)
    if tag is None:
        return obj
    body = {name: getattr(obj, name) for name in _FIELDS[cls]}
    for name in _NESTED.get(cls, ()):
        body[name] = [to_wire(o) for o in body[name]]
    for name, encode, _ in _CODECS.get(cls, ()):
        body[name] = encode(body[name])
    return {"t": tag, "b": body}


def from_wire(value: Any) -> Any:
    if isinstance(value, list):
        return [from_wire(v) for v in value]
    if isinstance(value, dict) and value.keys() == {"t", "b"} and value["t"] in _TYPES:
        cls = _TYPES[value["t"]]
        names = _FIELDS[cls]
        body = {k: v for k, v in value["b"].items() if k in names}
        for name in _NESTED.get(cls, ()):
            if isinstance(body.get(name), list):
                body[name] = [from_wire(v) for v in body[name]]
        for name, _, decode in _CODECS.get(cls, ()):
            if name in body:
                body[name] = decode(body[name])
        return cls(**body)
    return value


def pack(obj: Any) -> bytes:
    data: bytes = msgpack.packb(to_wire(obj), use_bin_type=True)
    return data


def unpack(data: bytes) -> Any:
    return from_wire(msgpack.unpackb(data, raw=False, strict_map_key=False))
