"""SamplingParams: how one request is decoded. Pure Python (it crosses process boundaries).

Defaults follow TensorRT-LLM: ``temperature``, ``top_k`` and ``top_p`` unset means greedy
decoding; setting any sampling knob without a temperature samples at temperature 1.0.
Invalid values raise ``ValueError`` naming the field and the allowed range.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

MAX_LOGPROBS = 20
MAX_N = 128
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_LEN = 1024
MAX_LOGIT_BIAS = 1024


@dataclass
class SamplingParams:
    """Decoding settings of one request (names as TensorRT-LLM's ``SamplingParams``).

    max_tokens: tokens to generate (None: up to max_seq_len). min_tokens: EOS and
    stop_token_ids are suppressed until this many tokens exist. temperature 0 is greedy.
    top_k 0/None/-1 disables; top_p in (0, 1]; min_p in [0, 1]. seed makes sampling
    reproducible for this request whatever else is in the batch. n > 1 returns n sequences.
    stop: strings that end the output (cut from the text unless include_stop_str_in_output).
    logprobs: return the log-probability of each token and this many top alternatives.
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
    logprobs: int | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True
    end_id: int | None = None  # overrides the tokenizer's EOS when set
    stop_strings: list[str] = field(init=False, repr=False, default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        else:
            self.stop_strings = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
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
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    # -- checks --------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ValueError naming the first field out of range."""
        _check(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
               "max_tokens", "must be an integer >= 1", self.max_tokens)
        _check(self.min_tokens >= 0, "min_tokens", "must be >= 0", self.min_tokens)
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens,
               "min_tokens", f"must be <= max_tokens ({self.max_tokens})", self.min_tokens)
        _check(self.temperature is None or 0.0 <= self.temperature <= 100.0,
               "temperature", "must be in [0, 100]", self.temperature)
        _check(self.top_k is None or self.top_k >= -1, "top_k", "must be -1, 0 (off) or >= 1", self.top_k)
        _check(self.top_p is None or 0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]", self.top_p)
        _check(self.min_p is None or 0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]", self.min_p)
        _check(1 <= self.n <= MAX_N, "n", f"must be in [1, {MAX_N}]", self.n)
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]",
               self.presence_penalty)
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]",
               self.frequency_penalty)
        _check(0.0 < self.repetition_penalty <= 10.0, "repetition_penalty", "must be in (0, 10]",
               self.repetition_penalty)
        _check(self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs",
               f"must be in [0, {MAX_LOGPROBS}]", self.logprobs)
        _check(len(self.stop_strings) <= MAX_STOP_STRINGS, "stop",
               f"at most {MAX_STOP_STRINGS} strings", len(self.stop_strings))
        for s in self.stop_strings:
            _check(isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_LEN, "stop",
                   f"each must be a non-empty string of at most {MAX_STOP_STRING_LEN} characters", s)
        _check(len(self.logit_bias or {}) <= MAX_LOGIT_BIAS, "logit_bias",
               f"at most {MAX_LOGIT_BIAS} entries", len(self.logit_bias or {}))
        for v in (self.logit_bias or {}).values():
            _check(-100.0 <= v <= 100.0, "logit_bias", "values must be in [-100, 100]", v)
        for t in self.stop_token_ids or []:
            _check(isinstance(t, int) and t >= 0, "stop_token_ids", "must be non-negative integers", t)
        _check(self.seed is None or isinstance(self.seed, int), "seed", "must be an integer", self.seed)

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids named by the params must exist in the vocabulary."""
        for t in self.stop_token_ids or []:
            _check(t < vocab_size, "stop_token_ids", f"must be < vocab size {vocab_size}", t)
        for t in (self.logit_bias or {}):
            _check(0 <= t < vocab_size, "logit_bias", f"token ids must be in [0, {vocab_size})", t)

    # -- wire form -----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        if d["logit_bias"]:
            d["logit_bias"] = [[k, v] for k, v in d["logit_bias"].items()]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        d = dict(d)
        if d.get("logit_bias"):
            d["logit_bias"] = {int(k): float(v) for k, v in d["logit_bias"]}
        return cls(**d)


def _check(ok: bool, name: str, rule: str, value: Any) -> None:
    if not ok:
        raise ValueError(f"{name} {rule}, got {value!r}")
