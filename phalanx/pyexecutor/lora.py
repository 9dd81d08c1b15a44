"""A rank's LoRA adapters: read from disk when a request first names one, kept in host memory
while requests use them (and up to ``max_cpu_loras`` more, least recently used first out), and
written into the model's ``max_loras`` slots as steps need them (models/lora.py).

The scheduler lets a step run requests of at most ``max_loras`` adapters, so ``slots`` always
finds room. Every rank sees the same requests in the same order and the same steps, so every rank
puts the same adapter in the same slot; a read from disk that fails on any rank fails on all
(``agree``: the ranks' outcomes gathered), so their schedulers keep the same requests. A slot is
written on the step's stream, after the steps queued before it: a slot taken from an adapter the
previous (still running) step reads is written once that step is done with it. Host copies are in
the model's dtype, pinned on a GPU, so that writing a slot does not wait for the step in flight.

A ``lora_int_id`` names one adapter (its name and directory) for the engine's life: its prefix
cache is keyed by the id, so the id is never given to another adapter, held or not.

``add`` (``LLM.add_lora``, the control op of that name) reads an adapter now — from its directory,
or from a trainer's tensors handed over in place (``weight_transfer.share_tensors``) with its
PEFT config — and holds it until ``remove``: requests then name it by id and name alone (an empty
``lora_path``). Adding again under the same id replaces its weights (an RL trainer's next policy):
it is refused while requests run with the adapter, and the id's prefix cache starts anew, since
the cache key holds the id's generation (``cache_key``).
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from phalanx.config import LoraConfig
from phalanx.llmapi.lora_request import LoRARequest
from phalanx.llmapi.weight_transfer import DTYPES, open_tensors
from phalanx.models.config import ModelConfig
from phalanx.models.lora import Adapter, LoraState, adapter_from_tensors_for, read_adapter_for, write_slot

MAX_ADAPTER_TENSORS = 10_000   # (a Llama layer has 7 projections, 2 tensors each)


def check_lora_request(lora: object) -> tuple[str, int, str]:
    """A request's ``lora`` as it crossed the wire, [name, int id, path], checked as the ``LLM``
    class checks its ``LoRARequest``."""
    if not (isinstance(lora, (list, tuple)) and len(lora) == 3):
        raise TypeError("lora_request must be [lora_name, lora_int_id, lora_path]")
    r = LoRARequest(*lora)
    return r.lora_name, r.lora_int_id, r.lora_path


class LoraManager:
    def __init__(self, state: LoraState, cfg: LoraConfig, model_cfg: ModelConfig) -> None:
        self.state, self.cfg = state, cfg
        self.max_cpu = cfg.max_cpu_loras or cfg.max_loras
        self.model_cfg = model_cfg
        self.adapters: OrderedDict[int, Adapter] = OrderedDict()   # lora id -> adapter, least recent first
        self.users: dict[int, int] = {}          # lora id -> live requests naming it
        self.of_request: dict[int, int] = {}     # request id -> its lora id
        self.slot_of: OrderedDict[int, int] = OrderedDict()   # lora id -> slot, least recent first
        self.free_slots: list[int] = []
        self.forget_slots()   # (all free)
        self.known: dict[int, tuple[str, str]] = {}   # lora id -> (name, directory or "" for tensors), engine's life
        self.added: set[int] = set()             # ids ``add`` holds until ``remove``
        self.dropping: set[int] = set()          # ids removed while requests still ran with them
        self.generation: dict[int, int] = {}     # lora id -> times ``add`` (re)loaded it: in its cache key
        # the ranks' outcomes of one read, gathered (set by a multi-rank executor): each rank's error or ""
        self.agree: Callable[[str], list[str]] | None = None
        self.num_loads = 0                       # adapters read from disk
        self.num_slot_writes = 0                 # adapters written into a slot

    def register(self, request_id: int, lora: object) -> int:
        """A new request names ``lora``: read it unless held; its lora id. A ValueError or
        TypeError naming the field where it cannot be served (the request fails alone, on every
        rank); nothing changes then."""
        name, lid, path = check_lora_request(lora)
        if request_id in self.of_request:
            raise ValueError(f"request id {request_id} is already running")
        if lid in self.added:
            known_name, where = self.known[lid]
            if name != known_name:
                raise ValueError(f"lora_request.lora_int_id {lid} names adapter {known_name!r}, not {name!r}")
            if path and os.path.realpath(path) != where:
                raise ValueError(f"lora_request.lora_path: adapter {name!r} (lora_int_id {lid}) was added from "
                                 f"{'tensors' if not where else 'another directory'}; leave lora_path empty")
        else:
            if not path:
                raise ValueError(f"lora_request {name!r}: lora_path is empty and no adapter with lora_int_id {lid} "
                                 "is added (LLM.add_lora)")
            where = os.path.realpath(path)
            known_name, known_where = self.known.get(lid, (name, where))
            if known_name != name:
                raise ValueError(f"lora_request.lora_int_id {lid} names adapter {known_name!r} already; "
                                 "another adapter needs another id")
            if known_where != where:
                how = "added from tensors" if not known_where else "read from another directory"
                raise ValueError(f"lora_request.lora_int_id {lid} was {how}; another adapter needs another id")
            self.dropping.discard(lid)
            if lid not in self.adapters:
                self.adapters[lid] = self._read(name, lambda: read_adapter_for(name, path, self.model_cfg, self.cfg))
                self.known[lid] = (name, where)
                self.num_loads += 1
        self.adapters.move_to_end(lid)
        self.users[lid] = self.users.get(lid, 0) + 1
        self.of_request[request_id] = lid
        self._trim()
        return lid

    def cache_key(self, lid: int) -> bytes:
        """What a request's prefix cache is keyed by: the id and its generation (0xff: never in UTF-8)."""
        return b"\xff%d.%d\xff" % (lid, self.generation.get(lid, 0))

    def add(self, name: str, lid: int, path: str = "", config: Any = None, specs: Any = None) -> str:
        """Read an adapter now and hold it until ``remove``: from ``path``, or from tensors
        shared in place (``specs``) with their PEFT ``config``; under an id already added, its
        weights are replaced (refused while requests run with it). A ValueError naming what
        cannot be served; nothing changes then."""
        name, lid, path = check_lora_request([name, lid, path or ""])
        if (specs is None) == (not path):
            raise ValueError("give either lora_path or the adapter's tensors (with its peft_config)")
        if lid in self.known and self.known[lid][0] != name:
            raise ValueError(f"lora_request.lora_int_id {lid} names adapter {self.known[lid][0]!r} already; another "
                             "adapter needs another id")
        if self.users.get(lid):
            raise ValueError(f"adapter {name!r} (lora_int_id {lid}) is in use by {self.users[lid]} "
                             "requests; let them finish (or pause_generation('abort') end them) before replacing "
                             "it, or use another id")
        if path:
            where = os.path.realpath(path)
            adapter = self._read(name, lambda: read_adapter_for(name, path, self.model_cfg, self.cfg))
        else:
            where = ""
            adapter = self._read(name, lambda: adapter_from_tensors_for(
                name, config, _received_tensors(specs), self.model_cfg, self.cfg))
        self.adapters[lid] = adapter
        self.adapters.move_to_end(lid)
        self.known[lid] = (name, where)
        self.generation[lid] = self.generation.get(lid, 0) + 1
        self.added.add(lid)
        self.dropping.discard(lid)
        self.num_loads += 1
        self._free_slot(lid)   # its old weights: written anew when a step needs it
        self._trim()
        return json.dumps({"lora_int_id": lid, "generation": self.generation[lid], "bytes": adapter.nbytes})

    def remove(self, lid: int) -> str:
        """Stop holding an adapter ``add`` held: dropped now, or once the requests that hold it
        end (those sent before, too: the loop takes them in first). The id stays its adapter's
        (``known``): later requests naming it need it added again — or, for one read from a
        directory, to name that directory."""
        if isinstance(lid, bool) or not isinstance(lid, int) or lid not in self.added:
            raise ValueError(f"no adapter with lora_int_id {lid!r} is added")
        self.added.discard(lid)
        if lid in self.users:
            self.dropping.add(lid)
        else:
            self._drop(lid)
        return "ok"

    def listing(self) -> str:
        """The adapters held on this rank: id, name, directory ("" for tensors), added or not,
        requests running with it."""
        return json.dumps([{"lora_int_id": lid, "lora_name": self.known[lid][0], "lora_path": self.known[lid][1],
                            "added": lid in self.added, "requests": self.users.get(lid, 0)}
                           for lid in self.adapters])

    def forget_slots(self) -> None:
        """The slots' device memory was given back (sleep): every adapter is written again when a
        step next needs it."""
        self.slot_of.clear()
        self.free_slots = list(range(self.cfg.max_loras - 1, -1, -1))

    def _drop(self, lid: int) -> None:
        self.dropping.discard(lid)
        del self.adapters[lid]
        self._free_slot(lid)

    def _free_slot(self, lid: int) -> None:
        slot = self.slot_of.pop(lid, None)
        if slot is not None:
            self.free_slots.append(slot)

    def _read(self, name: str, read: Callable[[], Adapter]) -> Adapter:
        """The adapter ``read`` gives, in the model's dtype (pinned on a GPU), or the error of the
        first rank that could not read it, on every rank."""
        adapter, error = None, ""
        try:   # (the readers turn whatever goes wrong into a ValueError naming the adapter)
            adapter = read()
            pin = self.state.device.type == "cuda"
            dtype = self.state.dtype
            adapter.weights = {k: tuple(t.to(dtype).pin_memory() if pin else t.to(dtype)   # type: ignore[misc]
                                        for t in ab) for k, ab in adapter.weights.items()}
            for (layer, module), ab in adapter.weights.items():   # (a float16 model's range is narrower)
                if not all(torch.isfinite(t).all() for t in ab):
                    raise ValueError(f"lora_request {name!r}: layer {layer} {module} holds a value that is not "
                                     f"finite in the model's dtype ({str(dtype).removeprefix('torch.')})")
        except Exception as e:  # noqa: BLE001 - decided on every rank alike below
            adapter, error = None, str(e) or type(e).__name__
        if self.agree is not None:
            error = next((e for e in self.agree(error) if e), "")
        if error or adapter is None:
            raise ValueError(error or f"lora_request {name!r}: not readable on another rank")
        return adapter

    def release(self, request_id: int) -> None:
        """A request ended (or was refused after ``register``)."""
        lid = self.of_request.pop(request_id, None)
        if lid is None:
            return
        self.users[lid] -= 1
        if not self.users[lid]:
            del self.users[lid]
            if lid in self.dropping:
                self._drop(lid)
        self._trim()

    def _trim(self) -> None:
        idle = [lid for lid in self.adapters if lid not in self.users and lid not in self.added]
        for lid in idle[:max(0, len(idle) - self.max_cpu)]:
            self._drop(lid)

    def stats(self) -> dict[str, int]:
        """For the heartbeat (SGLang's load report): adapter slots holding an adapter, of all."""
        return {"lora_slots_used": len(self.slot_of), "lora_slots_total": self.cfg.max_loras,
                "lora_adapters_held": len(self.adapters), "lora_adapters_added": len(self.added),
                "lora_loads": self.num_loads}

    def slots(self, lora_ids: list[int]) -> list[int]:
        """Each row's slot (-1: no adapter), every adapter of the step written into one."""
        need = {lid for lid in lora_ids if lid}
        if len(need) > self.cfg.max_loras:
            raise RuntimeError(f"a step with {len(need)} adapters; max_loras is {self.cfg.max_loras}")
        for lid in need:
            if lid in self.slot_of:
                self.slot_of.move_to_end(lid)
        for lid in sorted(need - self.slot_of.keys()):
            if self.free_slots:
                slot = self.free_slots.pop()
            else:   # the least recently used slot the step does not need
                victim = next(v for v in self.slot_of if v not in need)
                slot = self.slot_of.pop(victim)
            write_slot(self.state, slot, self.adapters[lid])
            self.num_slot_writes += 1
            self.slot_of[lid] = slot
        return [self.slot_of[lid] if lid else -1 for lid in lora_ids]


def _received_tensors(specs: Any) -> dict[str, Any]:
    """An adapter's tensors shared in place (``weight_transfer.share_tensors``'s specs), copied
    into this rank's memory; a ValueError naming the first spec that is not one."""
    if not isinstance(specs, list) or not 1 <= len(specs) <= MAX_ADAPTER_TENSORS:
        raise ValueError(f"the adapter's tensors must be a list of 1 to {MAX_ADAPTER_TENSORS} specs")
    for i, spec in enumerate(specs):
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise ValueError(f"tensor {i} needs a name")
        if spec.get("dtype") not in DTYPES:
            raise ValueError(f"tensor {spec['name']!r}: dtype {spec.get('dtype')!r} is not one of "
                             f"{', '.join(DTYPES)}")
        shape = spec.get("shape")
        if not (isinstance(shape, list) and len(shape) == 2 and
                all(isinstance(d, int) and not isinstance(d, bool) and 0 < d < 2**31 for d in shape)):
            raise ValueError(f"tensor {spec['name']!r}: shape {shape!r} must be two positive integers")
    out: dict[str, Any] = {}
    for name, t in open_tensors(specs):
        if name in out:
            raise ValueError(f"tensor {name!r} is given twice")
        out[name] = t.to("cpu", copy=True)
    return out
