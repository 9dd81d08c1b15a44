"""GenerationExecutor: the user side's client of the ranks — submit, abort, dispatch results.

Subclasses say how messages travel: ``InProcessExecutor`` runs the rank loop in a thread of
this process; the proxy (executor/proxy.py) talks to an MPI job over ZMQ.
"""

from __future__ import annotations

import itertools
import logging
import threading
import traceback
from abc import ABC, abstractmethod

from phalanx.executor.messages import Control, ControlResult, GenerationRequest, Response, TokenBatch
from phalanx.executor.result import GenerationResult
from phalanx.llmapi.sampling_params import SamplingParams
from phalanx.llmapi.tokenizer import Tokenizer

logger = logging.getLogger("phalanx")


class EngineDeadError(RuntimeError):
    """The engine stopped; no request can be served."""


class GenerationExecutor(ABC):
    def __init__(self) -> None:
        self._results: dict[int, GenerationResult] = {}  # child request id -> its result
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.dead_error: str | None = None
        self._controls: dict[int, tuple[threading.Event, list]] = {}
        self._control_ids = itertools.count(1)

    # -- transport (subclasses) ----------------------------------------------------------------------
    @abstractmethod
    def _send_request(self, msg: GenerationRequest) -> None: ...

    @abstractmethod
    def _send_cancel(self, request_id: int) -> None: ...

    @abstractmethod
    def _send_control(self, ctl: Control) -> None: ...

    @abstractmethod
    def shutdown(self) -> None: ...

    # -- API ------------------------------------------------------------------------------------------
    def submit(self, prompt_token_ids: list[int], params: SamplingParams, tokenizer: Tokenizer | None,
               prompt: str | None = None, eos_token_ids: tuple[int, ...] = (), cache_salt: str | None = None,
               max_total_tokens: int = 0, priority: int = 35) -> GenerationResult:
        """Send a request (n sequences = n rank requests) and return its result handle."""
        if self.dead_error is not None:
            raise EngineDeadError(self.dead_error)
        with self._lock:
            child_ids = [next(self._ids) for _ in range(params.n)]
        result = GenerationResult(child_ids[0], child_ids, prompt, list(prompt_token_ids), params,
                                  tokenizer, self.abort)
        wire = params.to_dict()
        msgs = []
        for i, cid in enumerate(child_ids):
            child = dict(wire, n=1, seed=None if params.seed is None else params.seed + i)
            msgs.append(GenerationRequest(cid, list(prompt_token_ids), child, list(eos_token_ids),
                                          max_total_tokens, cache_salt, priority, result.arrival_time))
        with self._lock:
            for cid in child_ids:
                self._results[cid] = result
        for m in msgs:
            self._send_request(m)
        return result

    def abort(self, request_id: int) -> None:
        if self.dead_error is None and request_id in self._results:
            self._send_cancel(request_id)

    def control(self, op: str, timeout: float = 30.0) -> ControlResult:
        """Run an inspection op on every rank between iterations ("check_integrity", "stats")."""
        if self.dead_error is not None:
            raise EngineDeadError(self.dead_error)
        cid = next(self._control_ids)
        done: tuple[threading.Event, list] = (threading.Event(), [])
        self._controls[cid] = done
        self._send_control(Control(op, cid))
        if not done[0].wait(timeout):
            self._controls.pop(cid, None)
            raise TimeoutError(f"control {op!r} got no answer within {timeout}s")
        if not done[1]:
            raise EngineDeadError(self.dead_error or "the engine stopped")
        return done[1][0]

    def check_integrity(self) -> list[str]:
        """KV-cache integrity on every rank; raises AssertionError naming failing ranks."""
        res = self.control("check_integrity")
        if not res.ok:
            raise AssertionError(f"KV integrity failed: {res.per_rank}")
        return res.per_rank

    def stats(self) -> list[dict]:
        import json
        return [json.loads(r) for r in self.control("stats").per_rank]

    @property
    def num_pending(self) -> int:
        return len(self._results)

    # -- results --------------------------------------------------------------------------------------
    def _dispatch(self, responses: list[Response]) -> None:
        for resp in responses:
            result = self._results.get(resp.request_id)
            if result is None:
                continue  # already finished on this side (stop string), or aborted
            try:
                result.handle(resp)
            except Exception:  # a bug in output handling must not stop the dispatcher
                logger.error("output handling failed for request %d:\n%s", resp.request_id, traceback.format_exc())
                result.fail("output handling failed")
            if resp.finish_reason is not None or resp.error is not None:
                with self._lock:
                    self._results.pop(resp.request_id, None)

    def _dispatch_other(self, obj: object) -> None:
        if isinstance(obj, list):
            self._dispatch([r for r in obj if isinstance(r, Response)])
        elif isinstance(obj, TokenBatch):
            self._dispatch(obj.responses())
        elif isinstance(obj, ControlResult):
            waiter = self._controls.pop(obj.control_id, None)
            if waiter is not None:
                waiter[1].append(obj)
                waiter[0].set()

    def _fail_all(self, error: str) -> None:
        """The engine died: every pending request fails once; new submits fail fast."""
        self.dead_error = error
        with self._lock:
            pending, self._results = set(self._results.values()), {}
        for result in pending:
            result.fail(error)
        for event, _ in list(self._controls.values()):
            event.set()
