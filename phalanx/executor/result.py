"""GenerationResult: the user-side state of one submitted request (its n sequences).

Responses from rank 0 are applied here by the dispatching thread: incremental detokenization,
stop strings (a hit cuts the text exactly and aborts the sequence on the ranks), logprobs,
timings. Readers take consistent snapshots under the lock; waiters (threads or asyncio tasks)
are woken after every change.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

from phalanx.executor.messages import Response
from phalanx.llmapi.outputs import Logprob
from phalanx.llmapi.sampling_params import SamplingParams
from phalanx.llmapi.tokenizer import IncrementalDetokenizer, Tokenizer


class _Sequence:
    """One of the n output sequences: tokens, text, stop strings, logprobs."""

    def __init__(self, index: int, params: SamplingParams, tokenizer: Tokenizer | None,
                 prompt_token_ids: list[int]) -> None:
        self.index, self.params = index, params
        self.detok = (IncrementalDetokenizer(tokenizer, params.skip_special_tokens, prompt_token_ids)
                      if tokenizer is not None and params.detokenize else None)
        self.tokenizer = tokenizer
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

    def add(self, resp: Response) -> bool:
        """Apply a response; True if a stop string ended the sequence here."""
        if resp.token_ids and resp.weight_version and (
                not self.weight_versions or self.weight_versions[-1][1] != resp.weight_version):
            self.weight_versions.append((len(self.token_ids), resp.weight_version))
        hit = False
        if self.detok is not None and self.params.stop_strings and len(resp.token_ids) > 1:
            # several tokens at once (a speculative step): the tokens after a stop string's are dropped
            for tok in resp.token_ids:
                self.token_ids.append(tok)
                before = len(self.text)
                self.text += self.detok.add([tok])
                if self._check_stop_strings(before):
                    hit = True
                    break
        else:
            self.token_ids.extend(resp.token_ids)
            if self.logprobs is not None and resp.logprobs:
                for tok, (chosen, top) in zip(resp.token_ids, resp.logprobs, strict=True):
                    self.logprobs.append(_logprob_entry(tok, (chosen, top)))
                    self.cumulative_logprob += float(chosen)
            if self.detok is not None and resp.token_ids:
                before = len(self.text)
                self.text += self.detok.add(resp.token_ids)
                hit = self._check_stop_strings(before)
        if resp.finish_reason is not None and not self.finished:
            if self.detok is not None:
                before = len(self.text)
                self.text += self.detok.flush()
                hit = self._check_stop_strings(before) or hit
            if not self.finished:
                self.finish_reason, self.stop_reason = resp.finish_reason, resp.stop_reason
        return hit

    def _check_stop_strings(self, before: int) -> bool:
        if not self.params.stop_strings or self.finished:
            return False
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
                 abort: Callable[[int], None]) -> None:
        self.request_id, self.child_ids = request_id, child_ids
        self.prompt, self.prompt_token_ids, self.params = prompt, prompt_token_ids, params
        self.n = len(child_ids)
        self._index = {cid: i for i, cid in enumerate(child_ids)}
        self._seqs = [_Sequence(i, params, tokenizer, prompt_token_ids) for i in range(self.n)]
        self._abort = abort
        self._lock = threading.Condition()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
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
        self.token_times: list[float] = []

    @property
    def is_done(self) -> bool:
        return self.error is not None or all(s.finished for s in self._seqs)

    # -- writer side -------------------------------------------------------------------------------
    def handle(self, resp: Response) -> bool:
        """Apply one response (dispatch thread). Returns True once every sequence is done."""
        stopped: list[int] = []
        with self._lock:
            seq = self._seqs[self._index[resp.request_id]]
            if seq.finished or self.error is not None:
                return self.is_done
            if resp.error is not None:
                self.error = resp.error
            if resp.prompt_logprobs and self.prompt_logprobs is not None:
                start = resp.prompt_logprobs_start + 1       # the chunk's entries are for these tokens
                targets = self.prompt_token_ids[start:start + len(resp.prompt_logprobs)]
                self.prompt_logprobs.extend(_logprob_entry(tok, lp) for tok, lp in zip(
                    targets, resp.prompt_logprobs, strict=True))
            now = time.monotonic()
            if resp.token_ids:
                self.first_token_time = self.first_token_time or now
                self.last_token_time = now
                self.token_times.append(now)
            self.cached_tokens = max(self.cached_tokens, resp.num_cached_tokens)
            if resp.first_scheduled_time and self.first_scheduled_time is None:
                self.first_scheduled_time = resp.first_scheduled_time
            if resp.rank >= 0:
                self.rank = resp.rank
            if resp.token_ids and resp.weight_version:
                self.weight_version = resp.weight_version
            if seq.add(resp) and resp.finish_reason is None:
                stopped.append(resp.request_id)
            done = self.is_done
            if done:
                self.finish_time = now
            self._changed()
        for cid in stopped:  # outside the lock: aborting may call back into the executor
            self._abort(cid)
        return done

    def fail(self, error: str) -> None:
        """The engine is gone: fail whatever is still running."""
        with self._lock:
            if self.is_done:
                return
            self.error = error
            self.finish_time = time.monotonic()
            self._changed()

    def abort(self) -> None:
        """Cancel every unfinished sequence (the final 'abort' responses arrive later)."""
        for seq, cid in zip(self._seqs, self.child_ids, strict=True):
            if not seq.finished:
                self._abort(cid)

    def _changed(self) -> None:
        self.version += 1
        self._lock.notify_all()
        waiters, self._waiters = self._waiters, []
        for loop, fut in waiters:
            loop.call_soon_threadsafe(_set_if_pending, fut)

    # -- reader side -------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "version": self.version, "finished": self.is_done, "error": self.error,
                "weight_version": self.weight_version,
                "cached_tokens": self.cached_tokens, "metrics": self.metrics(),
                "prompt_logprobs": list(self.prompt_logprobs) if self.prompt_logprobs is not None else None,
                "seqs": [{"text": s.visible_text(), "token_ids": list(s.token_ids),
                          "finish_reason": s.finish_reason, "stop_reason": s.stop_reason,
                          "logprobs": list(s.logprobs) if s.logprobs is not None else None,
                          "weight_versions": list(s.weight_versions),
                          "cumulative_logprob": s.cumulative_logprob if s.logprobs is not None else None}
                         for s in self._seqs],
            }

    def metrics(self) -> dict[str, float]:
        m: dict[str, float] = {"arrival_time": self.arrival_time, "rank": self.rank}
        if self.first_token_time is not None:
            m["ttft"] = self.first_token_time - self.arrival_time
        if self.finish_time is not None:
            m["e2e"] = self.finish_time - self.arrival_time
        return m

    def wait_done(self, timeout: float | None = None) -> bool:
        with self._lock:
            return self._lock.wait_for(lambda: self.is_done, timeout)

    def wait_change(self, version: int) -> None:
        with self._lock:
            self._lock.wait_for(lambda: self.version != version)

    async def await_change(self, version: int) -> None:
        while True:
            with self._lock:
                if self.version != version:
                    return
                loop = asyncio.get_running_loop()
                fut = loop.create_future()
                self._waiters.append((loop, fut))
            await fut

    async def await_done(self) -> None:
        while True:
            with self._lock:
                if self.is_done:
                    return
                version = self.version
            await self.await_change(version)


def _logprob_entry(token_id: int, wire: Any) -> dict[int, Logprob]:
    """{token id: Logprob} from the wire's [chosen logprob, [[id, logprob], ...]]: the top
    alternatives ranked from 1, and the token itself (rank None unless it is among them)."""
    chosen, top = wire
    entry = {int(t): Logprob(float(lp), rank + 1) for rank, (t, lp) in enumerate(top)}
    entry.setdefault(int(token_id), Logprob(float(chosen), None))
    return entry


def _set_if_pending(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)
