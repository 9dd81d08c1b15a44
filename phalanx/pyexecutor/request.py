"""The rank-side state of one request. Pure Python: no torch.

Counters, in the vocabulary of the glossary::

    token_ids            prompt tokens, then output tokens
    num_prompt_tokens    len(prompt)
    num_computed_tokens  positions whose KV is written or scheduled to be (advanced when a step
                         is scheduled; prefix hits included)
    num_cached_tokens    positions reused from the prefix cache at the first admission
    num_output_tokens    tokens sampled so far (known on the host)
    num_inflight_tokens  tokens scheduled to be sampled but not read yet (at most 2: the
                         overlap loop schedules step n+1 before step n's token is known)
    num_prompt_logprobs  prompt positions whose next-token log-probabilities were sent (only
                         for requests that ask for prompt logprobs)

A step schedules ``num_scheduled_tokens`` positions starting at ``num_computed_tokens``; when
computed catches up with ``num_total_tokens`` the step also samples one token. Prefill,
chunked prefill and decode are all this one rule.

Speculative decoding (``spec_len`` k > 0): once a request has scheduled its first sampling
step (``spec_ready``), each step verifies its last token and k drafts, k + 1 positions, and
appends 1 .. k + 1 tokens. Their positions start where the tokens accepted on the device end,
which the host learns only when it reads the step; so while a verify step is in flight
``num_computed_tokens`` is an upper bound (the step's k + 1 positions counted whole) and
``update`` takes back the positions of the rejected drafts.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from phalanx.kv_manager.radix_tree import DEFAULT_PRIORITY
from phalanx.llmapi.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    FINISHED_STOPPED = 2
    FINISHED_LENGTH = 3
    FINISHED_ABORTED = 4
    FINISHED_ERROR = 5

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False)
class Request:
    request_id: int
    prompt_token_ids: list[int]
    sampling: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    max_total_tokens: int = 0        # finish by length at this many tokens (prompt + output)
    extra_key: bytes = b""           # cache_salt / LoRA id: isolates prefix reuse
    lora_id: int = 0                 # its LoRA adapter (lora_int_id; 0: none)
    priority: int = DEFAULT_PRIORITY  # KV retention priority of its blocks
    grammar: Any = None              # its compiled grammar (guided decoding), opaque here
    arrival_time: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    num_inflight_tokens: int = 0
    num_prompt_logprobs: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | None = None   # the stop token id that ended it, if any
    error: str | None = None
    admitted: bool = False           # has been admitted at least once (cached count is final)
    first_scheduled_time: float = 0.0  # monotonic clock (system-wide on Linux) at first admission
    spec_len: int = 0                # drafts verified per step (0: no speculation for this request)
    spec_ready: bool = False         # its device state (length, next inputs) is set: steps verify
    spec_history: int = 0            # positions of its tokens written into the device history (NGram)
    # its sampler settings, built once (opaque here): [once min_tokens is reached, while it bans tokens]
    row_settings: list[Any] = field(default_factory=lambda: [None, None], repr=False)
    allowed_index: Any = field(default=None, repr=False)   # its allowed_token_ids on the sampler's device, once

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        if self.max_total_tokens <= 0:
            raise ValueError("max_total_tokens must be set")

    @property
    def reuses_prefix(self) -> bool:
        """Whether cached KV may stand in for its prompt (not when prompt logprobs are asked:
        every prompt position's logits must then be computed)."""
        return self.sampling.prompt_logprobs is None

    @property
    def kv_limit(self) -> int:
        """Positions its KV may need: its length limit, plus, with speculation, the drafts a
        verify step and the draft model write past the accepted tokens."""
        return self.max_total_tokens + 2 * self.spec_len

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_total_tokens(self) -> int:
        """Known tokens plus placeholders for tokens still in flight."""
        return len(self.token_ids) + self.num_inflight_tokens

    @property
    def awaiting_last_token(self) -> bool:
        """Its final token (by length) is in flight: nothing more to schedule."""
        return self.num_total_tokens >= self.max_total_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def append_token(self, token_id: int) -> None:
        # (Scheduler.update's path for a row's one sampled token appends to token_ids itself)
        self.token_ids.append(token_id)

    def check_stop(self) -> RequestStatus | None:
        """After a token was appended: the finished status it causes, or None."""
        tokens = self.token_ids   # (lengths read directly: called for every row every step)
        last = tokens[-1]
        if len(tokens) - len(self.prompt_token_ids) > self.sampling.min_tokens:
            if last in (self.sampling.stop_token_ids or ()):
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
            if not self.sampling.ignore_eos and last in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if len(tokens) >= self.max_total_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
