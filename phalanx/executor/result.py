"""GenerationResult: the user-side state of one submitted request (its n sequences).

Responses from rank 0 are applied here by the dispatching thread: incremental detokenization,
stop strings (a hit cuts the text exactly and aborts the sequence on the ranks), logprobs,
timings. Readers take consistent snapshots under the lock, of what is new to them; waiters (threads or asyncio tasks)
are woken after every change. A step's tokens for hundreds of requests arrive together: the
dispatcher collects the asyncio waiters of all of them (``Wakeups``) and wakes each event loop
once for the lot, not once a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from phalanx.executor.messages import Finished, FirstToken, Response
from phalanx.llmapi.outputs import Logprob
from phalanx.llmapi.sampling_params import SamplingParams
from phalanx.llmapi.tokenizer import IncrementalDetokenizer, Tokenizer


class Wakeups:
    """asyncio futures to set, collected over one dispatched batch, then set with one
    ``call_soon_threadsafe`` per event loop (each call writes to the loop's wake-up pipe)."""

    __slots__ = ("_by_loop",)

    def __init__(self) -> None:
        self._by_loop: dict[asyncio.AbstractEventLoop, list[asyncio.Future]] = {}

    def add(self, waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]]) -> None:
        for loop, fut in waiters:
            self._by_loop.setdefault(loop, []).append(fut)

    def fire(self) -> None:
        by_loop, self._by_loop = self._by_loop, {}
        for loop, futs in by_loop.items():
            with contextlib.suppress(RuntimeError):   # that loop was closed: nobody waits there any more
                loop.call_soon_threadsafe(_set_all_pending, futs)


class SeqSnapshot(NamedTuple):
    """One sequence as ``snapshot`` saw it: its text whole (a string is shared, not copied), its
    tokens and their logprobs from the reader's count on (new lists)."""

    text: str
    new_token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None
    new_logprobs: list[dict[int, Logprob]] | None
    weight_versions: list[tuple[int, str]]
    cumulative_logprob: float | None


class Snapshot(NamedTuple):
    """A request's state as ``snapshot`` saw it."""

    version: int
    finished: bool
    error: str | None
    weight_version: str
    cached_tokens: int
    metrics: dict[str, float]
    new_prompt_logprobs: list[dict[int, Logprob] | None] | None   # from the reader's count on
    seqs: tuple[SeqSnapshot, ...]


class _Sequence:
    """One of the n output sequences: tokens, text, stop strings, logprobs."""

    def __init__(self, index: int, params: SamplingParams, tokenizer: Tokenizer | None,
                 prompt_token_ids: list[int], eos_token_ids: tuple[int, ...] = ()) -> None:
        self.index, self.params = index, params
        self.eos_token_ids = frozenset(eos_token_ids)   # what the engine ends this request on
        self.detok = (IncrementalDetokenizer(tokenizer, params.skip_special_tokens, prompt_token_ids)
                      if tokenizer is not None and params.detokenize else None)
        self.tokenizer = tokenizer
        self.named = tokenizer if params.detokenize else None   # logprob entries get their tokens' text
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.weight_versions: list[tuple[int, str]] = []   # (index of the first token, version) per span
        self.max_stop_len = max((len(s) for s in params.stop_strings), default=0)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, token_ids: list[int], logprobs: list[Any] | None, finish_reason: str | None,
            stop_reason: int | None, weight_version: str) -> bool:
        """Apply one step's tokens (a response's fields); True if a stop string ended the sequence here."""
        if token_ids and weight_version and (
                not self.weight_versions or self.weight_versions[-1][1] != weight_version):
            self.weight_versions.append((len(self.token_ids), weight_version))
        hit = False
        # the token that ended the sequence (EOS, or one of stop_token_ids) stays in token_ids and
        # its logprobs, not in the text (as vLLM), unless include_stop_str_in_output
        text_ids = token_ids[:-1] if token_ids and self._ends_on_stop_token(token_ids[-1], finish_reason,
                                                                              stop_reason) else token_ids
        if self.detok is not None and self.params.stop_strings and len(token_ids) > 1:
            # several tokens at once (a speculative step): the tokens after a stop string's are dropped
            for i, tok in enumerate(token_ids):
                self.token_ids.append(tok)
                if self.logprobs is not None and logprobs:
                    self.logprobs.append(_logprob_entry(tok, logprobs[i], self.named))
                    self.cumulative_logprob += float(logprobs[i][0])
                before = len(self.text)
                if i < len(text_ids):
                    self.text += self.detok.add([tok])
                if self._check_stop_strings(before):
                    hit = True
                    break
        else:
            self.token_ids.extend(token_ids)
            if self.logprobs is not None and logprobs:
                for tok, wire in zip(token_ids, logprobs, strict=True):
                    self.logprobs.append(_logprob_entry(tok, wire, self.named))
                    self.cumulative_logprob += float(wire[0])
            if self.detok is not None and text_ids:
                before = len(self.text)
                self.text += self.detok.add(text_ids)
                hit = self._check_stop_strings(before)
        if finish_reason is not None and not self.finished:
            if self.detok is not None:
                before = len(self.text)
                self.text += self.detok.flush()
                hit = self._check_stop_strings(before) or hit
            if not self.finished:
                self.finish_reason, self.stop_reason = finish_reason, stop_reason
        return hit

    def _ends_on_stop_token(self, last: int, finish_reason: str | None, stop_reason: int | None) -> bool:
        """Whether ``last``, the step's last token, is a stop token that ended the sequence: one of
        stop_token_ids (the engine names it in ``stop_reason``) or an EOS the request was sent
        with (no reason; ``end_id`` where set; a complete grammar ends on EOS too)."""
        if finish_reason != "stop" or self.params.include_stop_str_in_output or self.finished:
            return False
        if stop_reason is not None:
            return stop_reason == last
        return last in self.eos_token_ids

    def _check_stop_strings(self, before: int) -> bool:
        if not self.params.stop_strings or self.finished or len(self.token_ids) < self.params.min_tokens:
            return False   # (as EOS is suppressed until min_tokens, so are stop strings: vLLM does the same)
        start = max(0, before - self.max_stop_len + 1)
        best: tuple[int, str] | None = None
        for s in self.params.stop_strings:
            pos = self.text.find(s, start)
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, s)
        if best is None:
            return False
        pos, s = best
        self.text = self.text[:pos + len(s)] if self.params.include_stop_str_in_output else self.text[:pos]
        self.finish_reason, self.stop_reason = "stop", s
        return True

    def visible_text(self) -> str:
        """The text safe to show now: while running, a tail that may start a stop string is held."""
        if self.finished or not self.max_stop_len:
            return self.text
        hold = 0
        for s in self.params.stop_strings:
            for k in range(min(len(s) - 1, len(self.text)), 0, -1):
                if self.text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        return self.text[:len(self.text) - hold] if hold else self.text


class GenerationResult:
    """State shared by the dispatching thread (writer) and the caller (reader, waiter)."""

    def __init__(self, request_id: int, child_ids: list[int], prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, tokenizer: Tokenizer | None,
                 abort: Callable[[int], None], eos_token_ids: tuple[int, ...] = ()) -> None:
        self.request_id, self.child_ids = request_id, child_ids
        self.prompt, self.prompt_token_ids, self.params = prompt, prompt_token_ids, params
        self.n = len(child_ids)
        self._index = {cid: i for i, cid in enumerate(child_ids)}
        self._seqs = [_Sequence(i, params, tokenizer, prompt_token_ids, eos_token_ids) for i in range(self.n)]
        self._named = tokenizer if params.detokenize else None
        self._abort = abort
        # writes and reads hold the mutex; threads that block for a change wait on the condition
        # (over the same mutex: ``with self._mutex`` is a C call, ``with`` the condition a Python one)
        self._mutex = threading.RLock()
        self._lock = threading.Condition(self._mutex)
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._done = False                  # the error is set or every sequence finished
        self._blocked = 0                   # threads waiting on the condition (wait_done, wait_change)
        self._metrics: dict[str, float] | None = None   # metrics() until one of its inputs changes
        self.version = 0
        self.error: str | None = None
        self.cached_tokens = 0
        # position i: the log-probabilities of prompt token i (None for the first token)
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = (
            [None] if params.prompt_logprobs is not None else None)
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self.first_scheduled_time: float | None = None
        self.rank = -1                      # the rank that served it
        self.weight_version = ""            # of the latest token
        self.last_token_time: float | None = None
        self.finish_time: float | None = None
        # when each sequence's chunks of tokens arrived (one entry a chunk: a verify step's
        # accepted tokens come together), per sequence: inter-token latency is within a sequence
        self.token_times: list[list[float]] = [[] for _ in range(self.n)]

    @property
    def is_done(self) -> bool:
        return self._done

    # -- writer side -------------------------------------------------------------------------------
    def handle(self, resp: Response, wakeups: Wakeups | None = None) -> bool:
        """Apply one response (dispatch thread). Returns True once every sequence is done.
        ``wakeups``: collect the asyncio waiters there (the caller fires them) instead of waking
        their loops now."""
        with self._mutex:
            if self._seqs[self._index[resp.request_id]].finish_reason is not None or self.error is not None:
                return self._done
            if resp.error is not None:
                self.error = resp.error
            if resp.prompt_logprobs and self.prompt_logprobs is not None:
                start = resp.prompt_logprobs_start + 1       # the chunk's entries are for these tokens
                targets = self.prompt_token_ids[start:start + len(resp.prompt_logprobs)]
                self.prompt_logprobs.extend(_logprob_entry(tok, lp, self._named) for tok, lp in zip(
                    targets, resp.prompt_logprobs, strict=True))
            self._started(resp.num_cached_tokens, resp.first_scheduled_time, resp.rank)
            done, stopped = self._add(resp.request_id, resp.token_ids, resp.logprobs, resp.finish_reason,
                                      resp.stop_reason, resp.weight_version, wakeups)
        if stopped:  # outside the lock: aborting may call back into the executor
            self._abort(resp.request_id)
        return done

    def handle_row(self, request_id: int, token_ids: list[int], logprobs: list[Any] | None,
                   finished: Finished | None, first: FirstToken | None, weight_version: str,
                   wakeups: Wakeups | None = None) -> bool:
        """Apply one ``TokenBatch`` row (``TokenBatch.rows``) as ``handle`` applies its Response,
        without making one (hundreds of rows a step)."""
        with self._mutex:
            if self._seqs[self._index[request_id]].finish_reason is not None or self.error is not None:
                return self._done
            if first is not None:
                self._started(first.num_cached_tokens, first.first_scheduled_time, first.rank)
            finish, stop = (finished.finish_reason, finished.stop_reason) if finished is not None else (None, None)
            done, stopped = self._add(request_id, token_ids, logprobs, finish, stop, weight_version, wakeups)
        if stopped:  # outside the lock: aborting may call back into the executor
            self._abort(request_id)
        return done

    def _started(self, num_cached_tokens: int, first_scheduled_time: float, rank: int) -> None:
        if num_cached_tokens > self.cached_tokens:
            self.cached_tokens = num_cached_tokens
        if first_scheduled_time and self.first_scheduled_time is None:
            self.first_scheduled_time = first_scheduled_time
        if rank >= 0 and rank != self.rank:
            self.rank = rank
            self._metrics = None

    def _add(self, request_id: int, token_ids: list[int], logprobs: list[Any] | None, finish_reason: str | None,
             stop_reason: int | None, weight_version: str, wakeups: Wakeups | None) -> tuple[bool, bool]:
        """Under the lock: one sequence's new tokens and finish. (done, a stop string ended it here)."""
        seq = self._seqs[self._index[request_id]]
        now = time.monotonic()
        if token_ids:
            if self.first_token_time is None:
                self.first_token_time = now
                self._metrics = None
            self.last_token_time = now
            self.token_times[self._index[request_id]].append(now)
            if weight_version:
                self.weight_version = weight_version
        elif weight_version and not self.weight_version:   # ended before a token: the weights serving then
            self.weight_version = weight_version
        stopped = seq.add(token_ids, logprobs, finish_reason, stop_reason, weight_version) and finish_reason is None
        if seq.finish_reason is not None or self.error is not None:
            self._done = self.error is not None or all(s.finished for s in self._seqs)
            if self._done:
                self.finish_time = now
                self._metrics = None
        self._changed(wakeups)
        return self._done, stopped

    def fail(self, error: str) -> None:
        """The engine is gone: fail whatever is still running."""
        with self._mutex:
            if self.is_done:
                return
            self.error = error
            self._done = True
            self.finish_time = time.monotonic()
            self._metrics = None
            self._changed()

    def abort(self) -> None:
        """Cancel every unfinished sequence (the final 'abort' responses arrive later)."""
        for seq, cid in zip(self._seqs, self.child_ids, strict=True):
            if not seq.finished:
                self._abort(cid)

    def _changed(self, wakeups: Wakeups | None = None) -> None:
        self.version += 1
        if self._blocked:
            self._lock.notify_all()
        waiters, self._waiters = self._waiters, []
        if wakeups is not None:
            wakeups.add(waiters)
            return
        for loop, fut in waiters:
            with contextlib.suppress(RuntimeError):   # that loop was closed: nobody waits there any more
                loop.call_soon_threadsafe(_set_if_pending, fut)

    # -- reader side -------------------------------------------------------------------------------
    def snapshot(self, seen_tokens: Sequence[int] = (), seen_logprobs: Sequence[int] = (),
                 seen_prompt_logprobs: int = 0) -> Snapshot:
        """A consistent copy of what the reader sees. Tokens, logprobs and prompt logprobs only
        grow, so only what comes after the reader's counts is copied (``seen_tokens[i]`` and
        ``seen_logprobs[i]`` of sequence i, 0 where missing): a stream's pulls cost what is new,
        not the whole output."""
        with self._mutex:
            pl = self.prompt_logprobs
            return Snapshot(
                self.version, self._done, self.error, self.weight_version, self.cached_tokens, self.metrics(),
                pl[seen_prompt_logprobs:] if pl is not None else None,
                tuple(_seq_snapshot(s, seen_tokens[i] if i < len(seen_tokens) else 0,
                                    seen_logprobs[i] if i < len(seen_logprobs) else 0)
                      for i, s in enumerate(self._seqs)))

    def metrics(self) -> dict[str, float]:
        """Arrival, rank, and TTFT and end-to-end latency once known (a copy: the caller's to change)."""
        m = self._metrics
        if m is None:
            m = {"arrival_time": self.arrival_time, "rank": self.rank}
            if self.first_token_time is not None:
                m["ttft"] = self.first_token_time - self.arrival_time
            if self.finish_time is not None:
                m["e2e"] = self.finish_time - self.arrival_time
            self._metrics = m
        return dict(m)

    def wait_done(self, timeout: float | None = None) -> bool:
        with self._lock:
            self._blocked += 1
            try:
                return self._lock.wait_for(lambda: self._done, timeout)
            finally:
                self._blocked -= 1

    def wait_change(self, version: int) -> None:
        with self._lock:
            self._blocked += 1
            try:
                self._lock.wait_for(lambda: self.version != version)
            finally:
                self._blocked -= 1

    async def await_change(self, version: int) -> None:
        while True:
            if self.version != version:   # read without the lock: an int, written under it
                return
            with self._mutex:
                if self.version != version:
                    return
                loop = asyncio.get_running_loop()
                fut = loop.create_future()
                self._waiters.append((loop, fut))
            await fut

    async def await_done(self) -> None:
        while True:
            with self._mutex:
                if self.is_done:
                    return
                version = self.version
            await self.await_change(version)


def _seq_snapshot(s: _Sequence, seen: int, seen_logprobs: int) -> SeqSnapshot:
    return SeqSnapshot(s.visible_text(), s.token_ids[seen:], s.finish_reason, s.stop_reason,
                       s.logprobs[seen_logprobs:] if s.logprobs is not None else None, list(s.weight_versions),
                       s.cumulative_logprob if s.logprobs is not None else None)


def _logprob_entry(token_id: int, wire: Any, named: Tokenizer | None = None) -> dict[int, Logprob]:
    """{token id: Logprob} from the wire's [chosen logprob, its rank, [[id, logprob], ...]]: the
    top alternatives ranked from 1, and the token itself with its rank in the vocabulary; with
    ``named``, each with its token's text (``decoded_token``)."""
    chosen, rank, top = wire
    text = named.token_text if named is not None else _no_text
    entry = {int(t): Logprob(float(lp), i + 1, text(int(t))) for i, (t, lp) in enumerate(top)}
    if token_id not in entry:
        entry[int(token_id)] = Logprob(float(chosen), int(rank), text(int(token_id)))
    return entry


def _no_text(token_id: int) -> None:
    return None


def _set_if_pending(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def _set_all_pending(futs: list[asyncio.Future]) -> None:
    for fut in futs:
        if not fut.done():
            fut.set_result(None)
