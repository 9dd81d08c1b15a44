"""SamplingParams: how one request is decoded, and the check of a prompt's token ids. Pure Python
(it crosses process boundaries).

Defaults follow TensorRT-LLM: ``temperature``, ``top_k`` and ``top_p`` unset means greedy
decoding; setting any sampling knob without a temperature samples at temperature 1.0.

One validation serves every entry point (the LLM class, the HTTP server, and the ranks, which
check again whatever arrives on the socket): ``validate`` raises ``ValueError`` naming the field
and its allowed range. Types are strict (a bool is not an integer, a string is not a number)
and every bound is one the engine can represent: counts fit in 32 bits, seeds in 64, floats are
finite. Token ids are checked against the vocabulary by ``check_vocab`` once it is known.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import struct
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

MAX_LOGPROBS = 20
MAX_N = 128
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_LEN = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024
MAX_ALLOWED_TOKEN_IDS = 16384
MAX_BAD_WORDS = 128          # bad_words
MAX_BAD_WORD_SEQUENCES = 2 * MAX_BAD_WORDS    # token sequences (a word gives one or two; bad_words_token_ids)
MAX_BAD_WORD_TOKENS = 64     # tokens in one bad word's sequence
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

_TOKEN_ID_KEY = re.compile(r"-?[0-9]+")
MAX_GRAMMAR_CHARS = 64 * 1024
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024


@dataclass
class GuidedDecodingParams:
    """Constrain the output to a grammar (TensorRT-LLM's name). Exactly one of:

    json: a JSON schema (a dict, or its JSON text) the output must validate against;
    json_object: any JSON object; regex: a regular expression the whole output matches;
    grammar: an EBNF grammar (xgrammar's dialect, ``root ::= ...``); choice: one of these strings;
    structural_tag: xgrammar's structural tag (a dict, or its JSON text: ``{"type":
    "structural_tag", "format": ...}``), e.g. text running free until a trigger such as
    ``<tool_call>``, then a tag whose content follows a JSON schema (how the server holds
    ``strict`` tools to their parameters under ``tool_choice: "auto"``).

    The ranks compile it with xgrammar (cached by its text) and, every step, mask the tokens that
    cannot continue it before sampling; generation ends when the grammar is complete."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None
    structural_tag: dict[str, Any] | str | None = None

    def __post_init__(self) -> None:
        set_ = [name for name in ("json", "regex", "grammar", "choice", "structural_tag")
                if getattr(self, name) is not None]
        set_ += ["json_object"] if self.json_object is True else []
        _check(len(set_) == 1, "guided_decoding",
               "must set exactly one of json, json_object, regex, grammar, choice, structural_tag", set_)
        _check(isinstance(self.json_object, bool), "guided_decoding.json_object", "must be true or false",
               self.json_object)
        if self.json is not None:
            _check(isinstance(self.json, (dict, str)), "guided_decoding.json", "must be a JSON schema", self.json)
            text = self.json if isinstance(self.json, str) else _dumps(self.json)
            _check(len(text) <= MAX_GRAMMAR_CHARS, "guided_decoding.json",
                   f"must be at most {MAX_GRAMMAR_CHARS} characters of JSON", len(text))
            if isinstance(self.json, str):
                try:
                    self.json = json.loads(self.json)
                except ValueError as e:
                    raise ValueError(f"guided_decoding.json is not valid JSON: {e}") from None
            _check(isinstance(self.json, dict), "guided_decoding.json", "must be a JSON object (a schema)",
                   type(self.json).__name__)
        if self.structural_tag is not None:
            tag = self.structural_tag
            _check(isinstance(tag, (dict, str)), "guided_decoding.structural_tag", "must be a structural tag",
                   type(tag).__name__)
            text = tag if isinstance(tag, str) else _dumps(tag)
            _check(len(text) <= MAX_GRAMMAR_CHARS, "guided_decoding.structural_tag",
                   f"must be at most {MAX_GRAMMAR_CHARS} characters of JSON", len(text))
            if isinstance(tag, str):
                try:
                    self.structural_tag = tag = json.loads(tag)
                except ValueError as e:
                    raise ValueError(f"guided_decoding.structural_tag is not valid JSON: {e}") from None
            _check(isinstance(tag, dict) and tag.get("type") == "structural_tag", "guided_decoding.structural_tag",
                   'must be a JSON object of "type": "structural_tag"', tag if not isinstance(tag, dict) else
                   tag.get("type"))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None:
                _check(isinstance(value, str) and 0 < len(value) <= MAX_GRAMMAR_CHARS, f"guided_decoding.{name}",
                       f"must be a non-empty string of at most {MAX_GRAMMAR_CHARS} characters", value)
        if self.choice is not None:
            _check(isinstance(self.choice, list) and 0 < len(self.choice) <= MAX_CHOICES, "guided_decoding.choice",
                   f"must be a list of 1 to {MAX_CHOICES} strings", self.choice)
            for c in self.choice:
                _check(isinstance(c, str) and 0 < len(c) <= MAX_CHOICE_CHARS, "guided_decoding.choice",
                       f"each must be a non-empty string of at most {MAX_CHOICE_CHARS} characters", c)

    @property
    def kind(self) -> str:
        """Which constraint this is: "json", "json_object", "regex", "grammar", "choice" or
        "structural_tag"."""
        return "json_object" if self.json_object else next(
            n for n in ("json", "regex", "grammar", "choice", "structural_tag") if getattr(self, n) is not None)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def _dumps(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


MAX_CACHE_SALT = 256   # characters of a request's cache_salt (LLM and the server alike)

@dataclass
class SamplingParams:
    """Decoding settings of one request (names as TensorRT-LLM's ``SamplingParams``).

    max_tokens: tokens to generate (None: up to max_seq_len). min_tokens: EOS and
    stop_token_ids are suppressed, and stop strings not matched, until this many tokens exist
    (with a grammar, only while it allows another token: a complete grammar ends the output). temperature 0 is greedy.
    top_k 0/None/-1 disables (values above the vocabulary size keep every token); top_p in
    (0, 1]; min_p in [0, 1]. seed makes sampling reproducible for this request whatever else
    is in the batch. n > 1 returns n sequences. stop: strings that end the output (cut from
    the text unless include_stop_str_in_output). logprobs: return the log-probability of each
    generated token and this many top alternatives. prompt_logprobs: the same for every prompt
    token after the first (a request asking for them does not reuse cached prefixes: their
    logits must be computed). allowed_token_ids: the only tokens that may be sampled (vLLM's;
    the others are masked before the logit bias, and a min_tokens ban that would leave none
    is lifted). truncate_prompt_tokens: a longer prompt keeps its last this many tokens (-1:
    max_seq_len's worth), as vLLM's. scaled_logprobs: logprobs of the logits divided by the
    temperature (SGLang's), not of the model's own distribution (greedy: temperature 1).
    bad_words: words the output may not contain (vLLM's): each
    is tokenized as it stands and after a space, and the last token of such a sequence is
    banned wherever the output ends with the rest of it; bad_words_token_ids: such sequences as
    token ids (the ``LLM`` adds bad_words' to them; without a tokenizer they are the only form).
    """

    max_tokens: int | None = 32
    min_tokens: int = 0
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    scaled_logprobs: bool = False
    guided_decoding: GuidedDecodingParams | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True
    end_id: int | None = None  # overrides the tokenizer's EOS when set
    stop_strings: list[str] = field(init=False, repr=False, default_factory=list)

    def __post_init__(self) -> None:
        if self.stop_token_ids is not None:
            _check(isinstance(self.stop_token_ids, (list, tuple)), "stop_token_ids", "must be a list of token ids",
                   self.stop_token_ids)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None:
            self.logit_bias = _bias_map(self.logit_bias)
        if isinstance(self.guided_decoding, dict):
            self.guided_decoding = GuidedDecodingParams(**self.guided_decoding)
        self.validate()

    # -- derived -------------------------------------------------------------------------
    @property
    def effective_temperature(self) -> float:
        """0.0 means greedy."""
        if self.temperature is not None:
            return float(self.temperature)
        sampling = (self.top_k not in (None, 0, -1)) or self.top_p is not None or self.min_p is not None
        return 1.0 if sampling else 0.0

    @property
    def is_greedy(self) -> bool:
        return self.effective_temperature == 0.0 or self.top_k == 1

    @property
    def needs_history(self) -> bool:
        """Whether sampling reads earlier output tokens' values (penalties, a bad word of several
        tokens): a row whose previous token is still in flight waits for it."""
        return self.needs_penalties or any(len(w) > 1 for w in self.bad_words_token_ids or ())

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    # -- checks --------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ValueError naming the first field whose type or value is out of range. Derived
        fields (``stop_strings``) are made again here, and set once all checks pass: a field may
        have changed since construction."""
        if isinstance(self.stop, str):
            stop_strings = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            stop_strings = list(self.stop)
        else:
            _check(self.stop is None, "stop", "must be a string or a list of strings", self.stop)
            stop_strings = []
        _int(self.max_tokens, "max_tokens", 1, INT32_MAX, optional=True)
        _int(self.min_tokens, "min_tokens", 0, INT32_MAX)
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens,
               "min_tokens", f"must be <= max_tokens ({self.max_tokens})", self.min_tokens)
        _real(self.temperature, "temperature", 0.0, 100.0, optional=True)
        _int(self.top_k, "top_k", -1, INT32_MAX, optional=True, rule="must be -1, 0 (off) or in [1, 2**31 - 1]")
        _real(self.top_p, "top_p", 0.0, 1.0, optional=True, open_low=True)
        _real(self.min_p, "min_p", 0.0, 1.0, optional=True)
        _int(self.seed, "seed", INT64_MIN, INT64_MAX, optional=True, rule="must be a 64-bit signed integer")
        _int(self.n, "n", 1, MAX_N)
        _real(self.presence_penalty, "presence_penalty", -2.0, 2.0)
        _real(self.frequency_penalty, "frequency_penalty", -2.0, 2.0)
        _real(self.repetition_penalty, "repetition_penalty", 0.0, 10.0, open_low=True)
        _int(self.logprobs, "logprobs", 0, MAX_LOGPROBS, optional=True)
        _int(self.prompt_logprobs, "prompt_logprobs", 0, MAX_LOGPROBS, optional=True)
        _int(self.end_id, "end_id", 0, INT32_MAX, optional=True)
        if self.bad_words is not None:
            _check(isinstance(self.bad_words, (list, tuple)) and len(self.bad_words) <= MAX_BAD_WORDS, "bad_words",
                   f"must be a list of at most {MAX_BAD_WORDS} strings", self.bad_words)
            for w in self.bad_words:
                _check(isinstance(w, str) and len(w.strip()) > 0 and len(w) <= MAX_STOP_STRING_LEN, "bad_words",
                       f"each must be a string of 1 to {MAX_STOP_STRING_LEN} characters, not only blanks", w)
        if self.bad_words_token_ids is not None:
            seqs = self.bad_words_token_ids
            _check(isinstance(seqs, (list, tuple)) and len(seqs) <= MAX_BAD_WORD_SEQUENCES, "bad_words_token_ids",
                   f"must be a list of at most {MAX_BAD_WORD_SEQUENCES} token-id lists", seqs)
            for seq in seqs:
                _check(isinstance(seq, (list, tuple)) and 0 < len(seq) <= MAX_BAD_WORD_TOKENS, "bad_words_token_ids",
                       f"each must be a list of 1 to {MAX_BAD_WORD_TOKENS} token ids", seq)
                for t in seq:
                    _int(t, "bad_words_token_ids", 0, INT32_MAX, rule="must hold token ids (integers >= 0)")
        _int(self.truncate_prompt_tokens, "truncate_prompt_tokens", -1, INT32_MAX, optional=True,
             rule="must be -1 (max_seq_len) or at least 1")
        _check(self.truncate_prompt_tokens != 0, "truncate_prompt_tokens", "must be -1 (max_seq_len) or at least 1",
               self.truncate_prompt_tokens)
        _check(self.guided_decoding is None or isinstance(self.guided_decoding, GuidedDecodingParams),
               "guided_decoding", "must be a GuidedDecodingParams", type(self.guided_decoding).__name__)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "detokenize",
                     "scaled_logprobs"):
            _check(isinstance(getattr(self, name), bool), name, "must be true or false", getattr(self, name))
        _check(len(stop_strings) <= MAX_STOP_STRINGS, "stop",
               f"at most {MAX_STOP_STRINGS} strings", len(stop_strings))
        for s in stop_strings:
            _check(isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_LEN, "stop",
                   f"each must be a non-empty string of at most {MAX_STOP_STRING_LEN} characters", s)
        _check(self.detokenize or not stop_strings, "stop",
               "needs detokenize=True: stop strings are matched in the output's text (stop_token_ids need no text)",
               stop_strings)
        _check(self.stop_token_ids is None or isinstance(self.stop_token_ids, (list, tuple)), "stop_token_ids",
               "must be a list of token ids", self.stop_token_ids)
        _check(self.logit_bias is None or isinstance(self.logit_bias, dict), "logit_bias",
               "must be a dict of token id -> bias", self.logit_bias)
        _check(len(self.stop_token_ids or []) <= MAX_STOP_TOKEN_IDS, "stop_token_ids",
               f"at most {MAX_STOP_TOKEN_IDS} ids", len(self.stop_token_ids or []))
        for t in self.stop_token_ids or []:
            _int(t, "stop_token_ids", 0, INT32_MAX, rule="must be token ids (integers >= 0)")
        _check(len(self.logit_bias or {}) <= MAX_LOGIT_BIAS, "logit_bias",
               f"at most {MAX_LOGIT_BIAS} entries", len(self.logit_bias or {}))
        for t, v in (self.logit_bias or {}).items():
            _int(t, "logit_bias", 0, INT32_MAX, rule="keys must be token ids (integers >= 0)")
            _real(v, "logit_bias", -100.0, 100.0, rule="values must be numbers in [-100, 100]")
        if self.allowed_token_ids is not None:
            allowed = self.allowed_token_ids
            _check(isinstance(allowed, (list, tuple)) and 0 < len(allowed) <= MAX_ALLOWED_TOKEN_IDS,
                   "allowed_token_ids", f"must be a non-empty list of at most {MAX_ALLOWED_TOKEN_IDS} token ids",
                   type(allowed).__name__ if not isinstance(allowed, (list, tuple)) else len(allowed))
            for t in allowed:
                _int(t, "allowed_token_ids", 0, INT32_MAX, rule="must be token ids (integers >= 0)")
            _check(self.guided_decoding is None, "allowed_token_ids",
                   "cannot be combined with guided_decoding (the grammar may allow none of them)", allowed)
            self._check_something_allowed()      # (both lists checked by now)
        self.stop_strings = stop_strings   # only once every check has passed

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids named by the params must exist in the vocabulary."""
        for t in self.stop_token_ids or []:
            _check(t < vocab_size, "stop_token_ids", f"must be < vocab size {vocab_size}", t)
        for t in (self.logit_bias or {}):
            _check(0 <= t < vocab_size, "logit_bias", f"token ids must be in [0, {vocab_size})", t)
        for t in self.allowed_token_ids or []:
            _check(t < vocab_size, "allowed_token_ids", f"must be < vocab size {vocab_size}", t)
        for seq in self.bad_words_token_ids or []:
            _check(max(seq) < vocab_size, "bad_words_token_ids", f"must hold ids < vocab size {vocab_size}", seq)
        _check(self.end_id is None or self.end_id < vocab_size, "end_id", f"must be < vocab size {vocab_size}",
               self.end_id)

    def add_bad_word_ids(self, sequences: Sequence[Sequence[int]]) -> None:
        """Add ``bad_words``' token sequences (``bad_word_sequences``) to ``bad_words_token_ids``,
        none twice, and check what they leave to draw."""
        seqs = [list(s) for s in self.bad_words_token_ids or []]
        seen = set(map(tuple, seqs))
        for seq in sequences:
            if tuple(seq) not in seen:
                seen.add(tuple(seq))
                seqs.append(list(seq))
        _check(len(seqs) <= MAX_BAD_WORD_SEQUENCES, "bad_words",
               f"give at most {MAX_BAD_WORD_SEQUENCES} token sequences with bad_words_token_ids", len(seqs))
        self.bad_words_token_ids = seqs
        self._check_something_allowed()

    def _check_something_allowed(self) -> None:
        """allowed_token_ids that one-token bad words ban altogether leave no token to draw."""
        if self.allowed_token_ids and self.bad_words_token_ids:
            singles = {seq[0] for seq in self.bad_words_token_ids if len(seq) == 1}
            _check(not set(self.allowed_token_ids) <= singles, "allowed_token_ids",
                   "are all bad words (a one-token bad word is never drawn): no token is left", self.allowed_token_ids)

    # -- wire form -----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The wire form: the fields that differ from their defaults (``from_dict`` fills in the
        rest). A request sets a few; unpacking all twenty-two on the rank cost ~9 µs a request
        (msgpack makes every key a new string), which a burst of hundreds pays in one iteration."""
        d = {}
        for name, default in _WIRE_DEFAULTS.items():
            v = getattr(self, name)
            if not (type(v) is type(default) and v == default):
                d[name] = v
        if d.get("stop_token_ids") == []:      # what construction makes of None
            del d["stop_token_ids"]
        if d.get("logit_bias"):
            d["logit_bias"] = [[k, v] for k, v in d["logit_bias"].items()]
        if d.get("guided_decoding") is not None:
            d["guided_decoding"] = d["guided_decoding"].to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        d = dict(d)
        bias = d.get("logit_bias")
        if bias:
            _check(isinstance(bias, list) and all(isinstance(p, list) and len(p) == 2 for p in bias),
                   "logit_bias", "must be a list of [token id, bias] pairs on the wire", type(bias).__name__)
            d["logit_bias"] = dict(bias)
        return cls(**d)


_WIRE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SamplingParams) if f.init}


def bad_word_sequences(words: Sequence[str], encode: Callable[[str], list[int]]) -> list[list[int]]:
    """``bad_words``' token sequences, as vLLM reads them: each word as it stands (leading
    blanks dropped), and after a space where that tokenizes to as many tokens and starts with
    another one (the word met inside a text). Raises ValueError for a word too long."""
    seqs: list[list[int]] = []
    for word in words:
        bare = encode(word.lstrip())
        spaced = encode(" " + word.lstrip())
        for seq in (bare, spaced) if (len(spaced) == len(bare) and spaced[:1] != bare[:1]) else (bare,):
            _check(len(seq) <= MAX_BAD_WORD_TOKENS, "bad_words", f"must each be at most {MAX_BAD_WORD_TOKENS} tokens",
                   word)
            if seq and seq not in seqs:
                seqs.append(seq)
    return seqs


def plain_token_ids(ids: Sequence[int], limit: int | None = None) -> bool:
    """Whether a non-empty list holds only ints (not bools) in [0, limit): the common case,
    checked in C loops (a 2k-id prompt: ~57 µs; a set of types, min and max took ~90). False
    says only that the caller must look element by element."""
    n = len(ids)
    if not n or list(map(type, ids)).count(int) != n:   # exactly int: no bool, float, numpy scalar
        return False
    try:
        struct.pack(f"<{n}Q", *ids)    # every id in [0, 2**64), without comparing each one to 0
    except struct.error:               # a negative id, or one past 64 bits
        return min(ids) >= 0 and (limit is None or max(ids) < limit)
    return limit is None or max(ids) < limit


def check_prompt(ids: Sequence[int], vocab_size: int, max_seq_len: int) -> None:
    """Raise ValueError (naming the field and the limit) for a prompt no engine can run.

    Checked in the user process before sending and again on the ranks (requests may come
    from any client of the socket), where ids that crossed as uint32 (an array("I"),
    ``messages.ids_from_wire``) need only the vocabulary's bound."""
    if isinstance(ids, bytes | bytearray):   # what ``messages.ids_from_wire`` could not read
        raise ValueError(f"prompt_token_ids: {len(ids)} bytes are not a sequence of uint32 token ids")
    if not ids:
        raise ValueError("prompt must contain at least one token")
    if isinstance(ids, array) and ids.typecode == "I":   # from the wire: unsigned ints by construction
        import numpy as np  # on the ranks, where it is loaded already (this module stays light)
        if int(np.frombuffer(ids, np.uint32).max()) >= vocab_size:   # ~2 µs at 2k ids; max() ~45
            bad = next(t for t in ids if t >= vocab_size)
            raise ValueError(f"prompt_token_ids: token id {bad} is outside the vocabulary [0, {vocab_size})")
    elif not plain_token_ids(ids, vocab_size):
        bad = next((t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt_token_ids: token id {bad} is outside the vocabulary [0, {vocab_size})")
    if len(ids) >= max_seq_len:
        raise ValueError(f"prompt has {len(ids)} tokens but max_seq_len is {max_seq_len} "
                         f"(at most {max_seq_len - 1} prompt tokens leave room for output)")


def child_seed(seed: int | None, index: int) -> int | None:
    """The seed of the ``index``-th of n sequences: ``seed + index``, wrapped into 64 bits."""
    if seed is None:
        return None
    return (seed + index - INT64_MIN) % 2**64 + INT64_MIN


def _bias_map(bias: Any) -> dict[int, float]:
    """logit_bias as {token id: bias}; keys may be ints or decimal strings (JSON objects)."""
    _check(isinstance(bias, dict), "logit_bias", "must be a mapping of token id to bias", type(bias).__name__)
    out: dict[int, float] = {}
    for k, v in bias.items():
        if isinstance(k, str):
            _check(_TOKEN_ID_KEY.fullmatch(k) is not None and len(k) <= 12, "logit_bias",
                   "keys must be token ids written as decimal integers", k)
            k = int(k)
        out[k] = v
    return out


def _check(ok: bool, name: str, rule: str, value: Any) -> None:
    if not ok:
        shown = repr(value)
        raise ValueError(f"{name} {rule}, got {shown if len(shown) <= 80 else shown[:77] + '...'}")


def _int(value: Any, name: str, low: int, high: int, optional: bool = False, rule: str | None = None) -> None:
    if value is None and optional:
        return
    if not (isinstance(value, int) and not isinstance(value, bool) and low <= value <= high):   # the message
        _check(False, name, rule or f"must be an integer in [{low}, {high}]", value)           # only if it fails


def _real(value: Any, name: str, low: float, high: float, optional: bool = False, open_low: bool = False,
          rule: str | None = None) -> None:
    if value is None and optional:
        return
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and (low < value if open_low else low <= value) and value <= high):
        _check(False, name, rule or f"must be a number in {'(' if open_low else '['}{low:g}, {high:g}]", value)
