"""PyExecutor: the loop every rank runs — fetch new requests, schedule, execute, update, respond.

The loop is the same on every rank; only rank 0 talks to the user process (``respond``). The
request source (``RequestQueue``) hides whether requests come from a local queue or from rank
0's broadcast. A request's failure (bad input, a request that can never fit) fails that request
only; an exception in the forward fails the requests of that step and the loop goes on.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections.abc import Callable

from phalanx.executor.messages import GenerationRequest, IterationInput, Response
from phalanx.executor.model_runner import ModelRunner, StepResult
from phalanx.executor.request import Request, RequestStatus
from phalanx.executor.scheduler import ScheduledBatch, Scheduler, StepOutcome
from phalanx.llmapi.sampling_params import SamplingParams

logger = logging.getLogger("phalanx")


class RequestQueue:
    """In-process request source: the user thread puts, the executor loop fetches."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._pending = IterationInput()

    def put_request(self, req: GenerationRequest) -> None:
        with self._cond:
            self._pending.new.append(req)
            self._cond.notify()

    def put_cancel(self, request_id: int) -> None:
        with self._cond:
            self._pending.cancel.append(request_id)
            self._cond.notify()

    def put_shutdown(self) -> None:
        with self._cond:
            self._pending.shutdown = True
            self._cond.notify()

    def fetch(self, idle: bool, timeout: float = 0.1) -> IterationInput:
        """Everything queued since the last fetch; waits up to ``timeout`` only when idle."""
        with self._cond:
            if idle and not self._pending:
                self._cond.wait(timeout)
            out, self._pending = self._pending, IterationInput()
            return out


Responder = Callable[[list[Response]], None]


class PyExecutor:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, queue: RequestQueue,
                 respond: Responder, vocab_size: int, max_seq_len: int) -> None:
        self.scheduler, self.runner, self.queue, self.respond = scheduler, runner, queue, respond
        self.vocab_size, self.max_seq_len = vocab_size, max_seq_len
        self.shutdown_requested = False
        self.iteration = 0
        self.on_idle: Callable[[], None] | None = None   # debug hook (e.g. KV integrity check)

    # -- the loops ---------------------------------------------------------------------------------
    def run(self) -> None:
        """Run until a shutdown arrives and (after aborting what is left) return."""
        while not self.shutdown_requested:
            self._fetch()
            if self.scheduler.has_work and not self.shutdown_requested:
                self._step_sync()
            elif self.on_idle is not None:
                self.on_idle()
        self._abort_all("shutdown")

    def _step_sync(self) -> None:
        batch = self.scheduler.schedule()
        self.iteration += 1
        if not batch.requests:
            return
        try:
            result = self.runner.execute(batch)
        except Exception:
            self._fail_batch(batch, traceback.format_exc())
            return
        outcome = self.scheduler.update(batch, result.token_ids)
        self._respond_step(batch, result, outcome)

    # -- intake ----------------------------------------------------------------------------------
    def _fetch(self) -> None:
        inp = self.queue.fetch(idle=not self.scheduler.has_work)
        for req in inp.new:
            self._add(req)
        for rid in inp.cancel:
            req = self.scheduler.finish(rid, RequestStatus.FINISHED_ABORTED)
            if req is not None:
                self._finished(req)
                self.respond([Response(rid, finish_reason="abort", num_cached_tokens=req.num_cached_tokens,
                                       num_prompt_tokens=req.num_prompt_tokens)])
        if inp.shutdown:
            self.shutdown_requested = True

    def _add(self, msg: GenerationRequest) -> None:
        try:
            req = self._make_request(msg)
            error = self.scheduler.add_request(req)
        except (ValueError, TypeError) as e:
            error = str(e)
        if error is not None:
            self.respond([Response(msg.request_id, finish_reason="error", error=error,
                                   num_prompt_tokens=len(msg.prompt_token_ids))])

    def _make_request(self, msg: GenerationRequest) -> Request:
        ids = msg.prompt_token_ids
        if not ids:
            raise ValueError("prompt must contain at least one token")
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt_token_ids: token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        if len(ids) >= self.max_seq_len:
            raise ValueError(f"prompt has {len(ids)} tokens; max_seq_len {self.max_seq_len} allows at most "
                             f"{self.max_seq_len - 1} prompt tokens")
        params = SamplingParams.from_dict(msg.sampling_params)
        params.check_vocab(self.vocab_size)
        limit = self.max_seq_len if params.max_tokens is None else min(self.max_seq_len, len(ids) + params.max_tokens)
        if msg.max_total_tokens:
            limit = min(limit, msg.max_total_tokens)
        salt = (msg.cache_salt or "").encode()
        return Request(msg.request_id, list(ids), params, tuple(msg.eos_token_ids), limit,
                       extra_key=salt, priority=msg.priority)

    # -- output ----------------------------------------------------------------------------------
    def _respond_step(self, batch: ScheduledBatch, result: StepResult, outcome: StepOutcome) -> None:
        finished = {r.request_id for r in outcome.finished}
        out = []
        for row, req in enumerate(batch.requests):
            token = outcome.new_tokens.get(req.request_id)
            if token is None:
                continue
            lp = result.logprobs[row] if result.logprobs is not None else None
            done = req.request_id in finished
            out.append(Response(req.request_id, [token], [list(lp)] if lp is not None else None,
                                req.finish_reason if done else None, req.stop_reason,
                                req.num_cached_tokens, req.num_prompt_tokens))
            if done:
                self._finished(req)
        if out:
            self.respond(out)

    def _finished(self, req: Request) -> None:
        self.runner.sampler.release(req.request_id)

    def _fail_batch(self, batch: ScheduledBatch, tb: str) -> None:
        logger.error("forward failed; failing %d requests:\n%s", len(batch), tb)
        out = []
        for req in batch.requests:
            if self.scheduler.finish(req.request_id, RequestStatus.FINISHED_ERROR) is not None:
                self._finished(req)
                out.append(Response(req.request_id, finish_reason="error",
                                    error=f"forward failed: {tb.strip().splitlines()[-1]}"))
        self.respond(out)

    def _abort_all(self, why: str) -> None:
        out = []
        for req in list(self.scheduler.requests.values()):
            self.scheduler.finish(req.request_id, RequestStatus.FINISHED_ABORTED)
            self._finished(req)
            out.append(Response(req.request_id, finish_reason="abort", error=None))
        if out:
            self.respond(out)
        logger.debug("executor stopped (%s) after %d iterations", why, self.iteration)


def now() -> float:
    return time.monotonic()
