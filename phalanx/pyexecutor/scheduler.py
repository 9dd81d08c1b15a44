"""Token-budget scheduler. Pure Python: no torch.

Each step gives every scheduled request a number of positions to compute
(``num_scheduled_tokens``) under three budgets: ``max_batch_size`` requests,
``max_num_tokens`` positions, ``max_seq_len`` per request. There are no prefill/decode
branches: a request computes until ``num_computed_tokens`` catches up with ``num_tokens`` and
then samples one token per step. Order within a step: decoding requests, then running prefills
(chunked), then waiting requests, first come first served (the first that does not fit stops
admission: no head-of-line skipping). With LoRA adapters, the running requests use at most
``max_loras`` of them, so every step fits the model's adapter slots: a waiting request whose
adapter would be one more waits, and every LoRA request behind it with it (so that the adapters
running drain and it gets a slot), while requests without an adapter behind it are admitted.

Capacity policies:
  GUARANTEED_NO_EVICT  admit only if every running request can still reach its last token
                       (blocks to completion are reserved by counting); never preempts.
  MAX_UTILIZATION      allocate for the next step only; when blocks run out, preempt the most
                       recently started request (its blocks are freed, committed ones stay
                       cached) and recompute it later.
"""

from __future__ import annotations

import hashlib
import math
import struct
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from phalanx.kv_manager import CopyOp, KVCacheManager, PrefixMatch
from phalanx.pyexecutor.request import Request, RequestStatus

GUARANTEED_NO_EVICT = "GUARANTEED_NO_EVICT"
MAX_UTILIZATION = "MAX_UTILIZATION"
HOST_PLACED = -1    # ScheduledBatch.num_drafts of a row whose positions the host knows


class SpecPolicy:
    """How many drafts a step's speculative rows verify: k, or 0 (one token, no drafts — a
    decode step that replays a CUDA graph). Pure Python, the same on every rank.

    A verify step over b rows costs r(b) decode steps: a fixed part (the sampling and
    bookkeeping of k + 1 positions a row, an extend step instead of a decode graph) and the
    b·(k + 1) positions, which cost more than reading the weights once the batch leaves the
    weights-bound regime. With m the recent mean accepted length (tokens a verify row
    brings, 1 .. k + 1; weight 1/2 for the latest verify step, starting at k + 1)::

        r(b) = 1 + OVERHEAD + b·(k + 1) / TOKENS_FREE
        speculate  iff  b <= max_concurrency (when set)  and  m >= r(b)

    OVERHEAD and TOKENS_FREE fit the Llama-3.1-8B shape on an H200 at k = 4: a verify step
    took 1.36 decode steps at batch 1 and 4.35 at batch 64 (docs/results/gpu9_spec_decode.json).
    While off, one step in ceil((r(b) − 1) / PROBE_COST) (at least 8) verifies anyway — about
    PROBE_COST of the time — so m follows the text (a request that starts copying turns drafts
    back on). ``adaptive=False``: drafts on every step (within max_concurrency).
    """

    OVERHEAD = 0.35
    TOKENS_FREE = 110
    PROBE_COST = 0.03

    def __init__(self, k: int, max_concurrency: int | None = None, adaptive: bool = True) -> None:
        self.k, self.max_concurrency, self.adaptive = k, max_concurrency, adaptive
        self.mean_accepted = float(k + 1)
        self.steps_off = 0
        self.last = 0            # the previous step's draft length

    def most_sampled_rows(self, max_batch_size: int, max_num_tokens: int) -> int:
        """The most rows one step can sample: one a request, k + 1 a request that verifies, and
        ``draft_len`` lets at most max_concurrency rows verify, with their drafts at most half of
        the step's tokens."""
        verifying = min(max_batch_size, max_num_tokens // (2 * (self.k + 1)))
        if self.max_concurrency is not None:
            verifying = min(verifying, self.max_concurrency)
        return min(max_num_tokens, max_batch_size + self.k * verifying)

    def cost(self, rows: int) -> float:
        """r(b): a verify step over ``rows`` rows, in decode steps."""
        return 1 + self.OVERHEAD + rows * (self.k + 1) / self.TOKENS_FREE

    def probe_every(self, rows: int) -> int:
        return max(8, math.ceil((self.cost(rows) - 1) / self.PROBE_COST))

    def draft_len(self, rows: int, token_budget: int) -> int:
        """The step's draft length for ``rows`` speculative decode rows; drafts never take more
        than half of the step's ``token_budget`` (max_num_tokens), the rest being left to prompts."""
        if rows == 0:               # no speculative decode rows: prompts finishing get their first drafts
            self.propose = True
            return 0
        probe = self.probe_every(rows)
        if ((self.max_concurrency is not None and rows > self.max_concurrency)
                or 2 * rows * (self.k + 1) > token_budget):
            k = 0
        elif not self.adaptive or self.mean_accepted >= self.cost(rows) or self.steps_off >= probe:
            self.steps_off = 0
            k = self.k
        else:
            self.steps_off += 1
            k = 0
        self.last, previous = k, self.last
        self.propose = k > 0 or previous > 0 or self.steps_off >= probe - 1
        return k

    propose = True
    """Whether the step just decided proposes drafts for the next: when it verifies, when the
    one before did (its acceptance, read before the next step is decided, may turn drafts on),
    and before a probe; otherwise the proposer is skipped (a later verify of stale drafts is
    still exact, just rejected)."""

    def observe(self, accepted_lengths: list[int]) -> None:
        """A verify step's rows were read: their accepted lengths."""
        if accepted_lengths:
            self.mean_accepted = 0.5 * self.mean_accepted + 0.5 * sum(accepted_lengths) / len(accepted_lengths)


@dataclass(frozen=True)
class SchedulerLimits:
    max_batch_size: int
    max_num_tokens: int
    max_seq_len: int
    policy: str = GUARANTEED_NO_EVICT
    enable_chunked_prefill: bool = True
    max_prefill_tokens_while_decoding: int | None = None   # None: max_num_tokens
    max_loras: int = 0         # LoRA adapters a step may run (0: no adapters served)

    def prefill_budget(self, budget: int, decode_rows: int) -> int:
        """The positions prompts may take of what is left of a step's ``budget`` once its
        ``decode_rows`` are in: capped while any row decodes (chunked prefill only: without it a
        prompt longer than the cap could never start)."""
        cap = self.max_prefill_tokens_while_decoding
        if cap is None or not decode_rows or not self.enable_chunked_prefill:
            return budget
        return min(budget, cap)


@dataclass
class ScheduledBatch:
    """One step's decision. Integers only, identical on every rank.

    Row i: request ``requests[i]`` computes positions
    ``[num_computed_tokens[i], num_computed_tokens[i] + num_scheduled_tokens[i])`` with KV
    blocks ``block_tables[i]``; it samples a token when that range reaches its last token.
    A speculative row (``num_drafts[i]`` = k >= 0, not HOST_PLACED) computes k + 1 positions
    from where its accepted tokens end on the device (at most ``num_computed_tokens[i]``) and
    samples 1 .. k + 1 tokens; all of a step's speculative rows verify the same k.
    ``copy_ops`` (partial prefix reuse, the KV host tier's moves) run before the forward.
    """

    step: int
    requests: list[Request] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    samples: list[bool] = field(default_factory=list)
    propose: bool = True          # speculative rows that sample get drafts for the next step
    num_drafts: list[int] = field(default_factory=list)   # HOST_PLACED, or a speculative row's drafts (0 .. k)
    copy_ops: list[CopyOp] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def is_decode_only(self) -> bool:
        return all(n == 1 for n in self.num_scheduled_tokens) and all(self.samples)

    def add(self, req: Request, num_tokens: int, block_table: list[int], num_drafts: int = HOST_PLACED) -> None:
        self.requests.append(req)
        self.num_scheduled_tokens.append(num_tokens)
        self.num_computed_tokens.append(req.num_computed_tokens)
        self.block_tables.append(list(block_table))
        self.samples.append(num_drafts != HOST_PLACED
                            or req.num_computed_tokens + num_tokens >= len(req.token_ids) + req.num_inflight_tokens)
        self.num_drafts.append(num_drafts)

    def without(self, rows: Iterable[int]) -> ScheduledBatch:
        """The same decision minus some rows (requests that failed before the forward)."""
        drop = set(rows)
        out = ScheduledBatch(self.step, copy_ops=self.copy_ops, preempted=self.preempted, propose=self.propose)
        for i, req in enumerate(self.requests):
            if i not in drop:
                out.requests.append(req)
                out.num_scheduled_tokens.append(self.num_scheduled_tokens[i])
                out.num_computed_tokens.append(self.num_computed_tokens[i])
                out.block_tables.append(self.block_tables[i])
                out.samples.append(self.samples[i])
                out.num_drafts.append(self.num_drafts[i])
        return out

    def digest(self) -> bytes:
        """A short hash of the decision, compared across ranks to detect divergence."""
        h = hashlib.blake2b(digest_size=16)
        h.update(struct.pack("<qq", self.step, self.propose))
        for r, n, c, d, bt in zip(self.requests, self.num_scheduled_tokens, self.num_computed_tokens,
                                  self.num_drafts, self.block_tables, strict=True):
            h.update(struct.pack(f"<qqqq{len(bt)}q", r.request_id, n, c, d, *bt))
        for op in self.copy_ops:
            h.update(struct.pack("<qqqq", op.src, op.dst, op.num_tokens, op.kind))
        return h.digest()


@dataclass
class StepOutcome:
    """What one step did to requests: tokens appended, and who finished."""

    new_tokens: dict[int, list[int]] = field(default_factory=dict)  # request id -> tokens appended
    finished: list[Request] = field(default_factory=list)


class Scheduler:
    """Owns the waiting queue and the running list; mutates requests and the KV manager."""

    def __init__(self, limits: SchedulerLimits, kv: KVCacheManager, spec: SpecPolicy | None = None) -> None:
        if limits.policy not in (GUARANTEED_NO_EVICT, MAX_UTILIZATION):
            raise ValueError(f"capacity_scheduler_policy must be {GUARANTEED_NO_EVICT} or "
                             f"{MAX_UTILIZATION}, got {limits.policy!r}")
        self.limits = limits
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[int, Request] = {}
        self.step = 0
        self.num_preemptions = 0
        self.num_held = 0   # waiting LoRA requests at the front held behind an adapter with no slot (last step)
        self.spec = spec
        self.num_verify_rows = 0        # speculative decoding: verify rows read,
        self.num_draft_tokens = 0       # drafts they carried,
        self.num_accepted_drafts = 0    # and drafts accepted

    # -- intake --------------------------------------------------------------------------
    def add_request(self, req: Request) -> str | None:
        """Queue a request. Returns an error message (and queues nothing) if it can never run."""
        if req.request_id in self.requests:
            return f"request id {req.request_id} is already in use"
        if not self.limits.enable_chunked_prefill and req.num_tokens > self.limits.max_num_tokens:
            return (f"the prompt has {req.num_tokens} tokens, more than max_num_tokens "
                    f"({self.limits.max_num_tokens}) with chunked prefill off")
        need = self.kv.num_blocks_for(req.kv_limit)
        if need > self.kv.num_blocks:
            return (f"the request needs {need} KV blocks for prompt + max_tokens "
                    f"({req.kv_limit} tokens) but the KV pool has {self.kv.num_blocks}; "
                    f"lower max_tokens or raise kv_cache_config.max_tokens")
        self.requests[req.request_id] = req
        self.waiting.append(req)
        return None

    def finish(self, request_id: int, status: RequestStatus) -> Request | None:
        """End a request now (abort, error): free its blocks and forget it."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self.kv.free(request_id)
        req.status = status
        return req

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step --------------------------------------------------------------------------
    def schedule(self, admit: bool = True) -> ScheduledBatch:
        """Decide this step. Mutates the KV manager (blocks for the scheduled positions) and
        the running/waiting lists (admissions, preemptions); request counters are advanced
        later by ``update``. ``admit=False``: no waiting request starts (a paused engine
        letting its running requests finish)."""
        self.kv.release_copy_sources()
        batch = ScheduledBatch(self.step)
        self.step += 1
        budget = self._schedule_running(batch, self.limits.max_num_tokens)
        if not batch.preempted and admit:
            self._schedule_waiting(batch, budget)
        batch.copy_ops = self.kv.take_copy_ops()
        for req, n, samples, d in zip(batch.requests, batch.num_scheduled_tokens, batch.samples, batch.num_drafts,
                                      strict=True):
            req.num_computed_tokens += n          # scheduled = will be computed by this step
            if d == HOST_PLACED:                  # a placeholder until update() reads the token
                req.num_inflight_tokens += samples
        return batch

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        """Decoding rows, then the running prompts' next chunks within the prompts' budget
        (``SchedulerLimits.prefill_budget``). Returns what is left of it for new prompts."""
        # decoding: one position a step (or a speculative row's k + 1); a preempted request
        # recomputing its output tokens is prompt work, like a prompt
        decoding: list[Request] = []
        prefilling: list[Request] = []
        for r in self.running:   # (num_prompt_tokens, num_total_tokens: lengths read directly, once a row a step)
            c = r.num_computed_tokens
            one = c >= len(r.prompt_token_ids) and (
                r.spec_ready or len(r.token_ids) + r.num_inflight_tokens - c <= 1)
            (decoding if one else prefilling).append(r)
        scheduled: set[int] = set()
        ready = sum(1 for r in decoding if r.spec_ready)
        k_step = 0
        if self.spec is not None:
            k_step = self.spec.draft_len(min(ready, self.limits.max_batch_size), self.limits.max_num_tokens)
            batch.propose = self.spec.propose
        budget = self._running_rows(batch, decoding, budget, k_step, scheduled)
        return self._running_rows(batch, prefilling, self.limits.prefill_budget(budget, len(batch)), k_step,
                                  scheduled)

    def _running_rows(self, batch: ScheduledBatch, requests: list[Request], budget: int, k_step: int,
                      scheduled: set[int]) -> int:
        # runs for every running request every step: the limits are locals, each request's
        # total (``num_total_tokens``) is computed once
        max_rows, running = self.limits.max_batch_size, RequestStatus.RUNNING
        for req in requests:
            if req.status != running:
                continue  # preempted earlier in this step
            if len(batch) >= max_rows or budget <= 0:
                break
            if req.spec_ready:   # the last token and k drafts; room for the draft model's drafts
                k = min(k_step, req.spec_len)
                n = k + 1
                if n > budget:
                    break
                grow_to = min(req.num_computed_tokens + n + req.spec_len, req.kv_limit)
            else:
                k = HOST_PLACED
                total = len(req.token_ids) + req.num_inflight_tokens
                if total >= req.max_total_tokens:
                    continue   # its last token is in flight (``awaiting_last_token``)
                n = min(total - req.num_computed_tokens, budget)
                grow_to = req.num_computed_tokens + n
                if req.spec_len:
                    grow_to += self._first_drafts(req, grow_to)
            if not self._grow_or_preempt(req, grow_to, batch, scheduled):
                continue
            self._add_row(batch, req, n, k)
            scheduled.add(req.request_id)
            budget -= n
        return budget

    @staticmethod
    def _first_drafts(req: Request, end: int) -> int:
        """Positions past ``end`` a row that completes a speculative request's prompt needs: the
        proposer writes the first token and k − 1 drafts there before the first verify step."""
        if not req.spec_len or end < req.num_total_tokens:
            return 0
        return max(0, min(end + req.spec_len, req.kv_limit) - end)

    def _add_row(self, batch: ScheduledBatch, req: Request, n: int, num_drafts: int = HOST_PLACED) -> None:
        batch.add(req, n, self.kv.block_table(req.request_id), num_drafts)
        if req.spec_len and batch.samples[-1]:
            req.spec_ready = True      # the step that samples sets its device state: verify from now on

    def _grow_or_preempt(self, req: Request, num_slots: int, batch: ScheduledBatch, scheduled: set[int]) -> bool:
        grow = self.kv.grow
        while not grow(req.request_id, num_slots):
            if self.limits.policy == GUARANTEED_NO_EVICT:
                raise RuntimeError("KV reservation broken: a running request cannot grow")
            victims = [r for r in self.running if r.request_id not in scheduled]
            victim = victims[-1]  # the most recently started; may be req itself
            self._preempt(victim, batch)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request, batch: ScheduledBatch) -> None:
        self.running.remove(req)
        self.kv.free(req.request_id)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_inflight_tokens = 0   # an in-flight token of a preempted request is dropped
        req.spec_ready = False        # recomputed from its tokens; its first sampling step sets the device state
        req.spec_history = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        batch.preempted.append(req)

    def _schedule_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        if not self.waiting or budget <= 0 or len(batch) >= self.limits.max_batch_size:
            return   # (before the reservation count: a pass over every running request)
        reserved = self._reserved_blocks() if self.limits.policy == GUARANTEED_NO_EVICT else 0
        adapters: set[int] | None = None
        held: list[Request] = []    # LoRA requests set aside (in order) behind one whose adapter has no slot
        while self.waiting and budget > 0 and len(batch) < self.limits.max_batch_size:
            req = self.waiting[0]
            if req.lora_id:   # a step runs the adapters of at most max_loras (the running requests' first)
                if adapters is None:
                    adapters = {r.lora_id for r in self.running if r.lora_id}
                if held or req.lora_id not in adapters and len(adapters) >= self.limits.max_loras:
                    held.append(self.waiting.popleft())
                    continue
                adapters.add(req.lora_id)
            match = self.kv.match(req.token_ids, req.extra_key, req.reuses_prefix)
            fit = self._fit(req, match, budget, reserved)
            if fit is None and match.tree_match.partial_node is not None:
                match = self.kv.whole_blocks(match)     # the partial block's copy source did not fit
                fit = self._fit(req, match, budget, reserved)
            if fit is None:
                break
            n, slots, reserved = fit
            self._admit(req, match, slots)
            self._add_row(batch, req, n)
            budget -= n
        self.waiting.extendleft(reversed(held))
        self.num_held = len(held)

    def _fit(self, req: Request, match: PrefixMatch, budget: int, reserved: int) -> tuple[int, int, int] | None:
        """Whether a waiting request is admitted now with ``match``: (its tokens this step, the
        slots it takes, the blocks reserved for the running requests after it), or None."""
        n = req.num_tokens - match.num_tokens
        if n > budget:
            if not self.limits.enable_chunked_prefill:
                return None
            n = budget
        slots = match.num_tokens + n
        slots += self._first_drafts(req, slots)
        need = self.kv.num_blocks_to_admit(match, slots)
        if self.limits.policy == GUARANTEED_NO_EVICT:
            future = self.kv.num_blocks_to_admit(match, req.kv_limit)
            if future + reserved > self.kv.num_available_blocks:
                return None
            return n, slots, reserved + future - need
        if need > self.kv.num_available_blocks:
            return None
        return n, slots, reserved

    def _admit(self, req: Request, match: PrefixMatch, slots: int) -> None:
        cached = self.kv.admit(req.request_id, match, slots, req.extra_key, req.priority)
        if not req.admitted:
            req.num_cached_tokens = cached
            req.admitted = True
            req.first_scheduled_time = time.monotonic()
            self.kv.record_query(req.num_prompt_tokens, cached)
        req.num_computed_tokens = cached
        req.status = RequestStatus.RUNNING
        self.waiting.popleft()
        self.running.append(req)

    def _reserved_blocks(self) -> int:
        """Blocks the running requests may still need to reach their last token."""
        kv = self.kv
        return sum(max(0, kv.num_blocks_for(r.kv_limit) - kv.num_held_blocks(r.request_id))
                   for r in self.running)

    # -- after the forward --------------------------------------------------------------------
    def update(self, batch: ScheduledBatch, sampled: Iterable[int | list[int] | None],
               stops_at: Callable[[Request, int], bool] | None = None) -> StepOutcome:
        """The step has run: commit its full blocks, append sampled tokens, finish requests.

        ``sampled[i]`` is the token of row i (None for rows that do not sample), or a verify
        row's accepted tokens (1 .. k + 1: accepted drafts, then the target's own token). Rows
        of requests that ended meanwhile (aborted, preempted, or finished by the step before —
        the stray step of the overlap loop) are skipped: their tokens are discarded. Tokens are
        appended one at a time and the first that ends a request drops the rest.
        ``stops_at(request, token)``, called for every appended token, may end a request there
        too (a grammar that is complete).
        """
        out = StepOutcome()
        accepted: list[int] = []
        running, requests, commit = RequestStatus.RUNNING, self.requests, self.kv.commit
        for req, start, n, k, token in zip(batch.requests, batch.num_computed_tokens, batch.num_scheduled_tokens,
                                           batch.num_drafts, sampled, strict=True):
            if req.status != running or req.request_id not in requests:
                continue
            tokens: list[int]
            placed = k != HOST_PLACED
            if not placed and type(token) is int and stops_at is None:
                # the common row: one sampled token, no grammar (what the loop below does for it)
                commit(req.request_id, req.token_ids, start + n)
                req.num_inflight_tokens -= 1
                req.token_ids.append(token)
                out.new_tokens[req.request_id] = [token]
                status = req.check_stop()
                if status is not None:
                    self.finish(req.request_id, status)
                    out.finished.append(req)
                continue
            if placed:
                tokens = token if isinstance(token, list) else [] if token is None else [token]
                req.num_computed_tokens -= n - len(tokens)   # the rejected drafts' positions are free again
                if k:
                    self.num_verify_rows += 1
                    self.num_draft_tokens += k
                    self.num_accepted_drafts += len(tokens) - 1
                    accepted.append(len(tokens))
            else:
                commit(req.request_id, req.token_ids, start + n)
                if token is None:
                    continue
                req.num_inflight_tokens -= 1
                tokens = [token] if isinstance(token, int) else token
            appended: list[int] = []
            status = None
            for t in tokens:
                req.append_token(t)
                appended.append(t)
                status = req.check_stop()
                if stops_at is not None and stops_at(req, t) and status is None:
                    status = RequestStatus.FINISHED_STOPPED
                if status is not None:
                    break
            if placed:   # the accepted tokens' KV is written, all but the last one's
                self.kv.commit(req.request_id, req.token_ids, req.num_tokens - 1)
            out.new_tokens[req.request_id] = appended
            if status is not None:
                self.finish(req.request_id, status)
                out.finished.append(req)
        if self.spec is not None:
            self.spec.observe(accepted)
        return out
