"""GenerationExecutor: the user side's client of the ranks — submit, abort, dispatch results.

Subclasses say how messages travel: ``InProcessExecutor`` runs the rank loop in a thread of
this process; the proxy (executor/proxy.py) talks to an MPI job over ZMQ.
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
import time
import traceback
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from phalanx.executor.messages import Control, ControlResult, GenerationRequest, Heartbeat, Response, TokenBatch
from phalanx.executor.result import GenerationResult, Wakeups
from phalanx.kv_manager.radix_tree import DEFAULT_PRIORITY
from phalanx.llmapi.sampling_params import SamplingParams, child_seed
from phalanx.llmapi.tokenizer import Tokenizer

logger = logging.getLogger("phalanx")


class EngineDeadError(RuntimeError):
    """The engine stopped; no request can be served."""


class GenerationExecutor(ABC):
    # whether the ranks run in a private network namespace (nothing outside the host's loopback
    # reaches them, nor they it); the MPI proxy sets it from what it started
    private_network = False

    def __init__(self) -> None:
        self._results: dict[int, GenerationResult] = {}  # child request id -> its result
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.dead_error: str | None = None
        self._controls: dict[int, tuple[threading.Event, list]] = {}
        self._control_ids = itertools.count(1)
        self._stopping = False
        self._last_beat = time.monotonic()
        self._beats: dict[int, Heartbeat] = {}        # rank -> its latest heartbeat
        self.rank_processes: list[tuple[str, int]] = []   # (host, pid) of every rank, when known

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
               max_total_tokens: int = 0, priority: int = DEFAULT_PRIORITY,
               lora: list | None = None) -> GenerationResult:
        """Send a request (n sequences = n rank requests) and return its result handle. ``lora``:
        its adapter as [lora_name, lora_int_id, lora_path]."""
        if self.dead_error is not None:
            raise EngineDeadError(self.dead_error)
        with self._lock:
            child_ids = [next(self._ids) for _ in range(params.n)]
        result = GenerationResult(child_ids[0], child_ids, prompt, list(prompt_token_ids), params,
                                  tokenizer, self.abort, tuple(eos_token_ids))
        wire = params.to_dict()
        msgs = []
        for i, cid in enumerate(child_ids):
            child = {k: v for k, v in wire.items() if k not in ("n", "seed")}   # each is one sequence
            seed = child_seed(params.seed, i)
            if seed is not None:
                child["seed"] = seed
            if i > 0:
                child.pop("prompt_logprobs", None)   # one sequence reports the shared prompt's
            msgs.append(GenerationRequest(cid, list(prompt_token_ids), child, list(eos_token_ids),
                                          max_total_tokens, cache_salt, priority, result.arrival_time, lora))
        with self._lock:
            for cid in child_ids:
                self._results[cid] = result
        for m in msgs:
            self._send_request(m)
        return result

    def abort(self, request_id: int) -> None:
        if self.dead_error is None and request_id in self._results:
            self._send_cancel(request_id)

    def control(self, op: str, timeout: float = 30.0, args: dict | None = None) -> ControlResult:
        """Run an op on every rank between the same two iterations ("check_integrity", "stats",
        the rollout ops of pyexecutor/rollout.py with their ``args``)."""
        if self.dead_error is not None:
            raise EngineDeadError(self.dead_error)
        cid = next(self._control_ids)
        done: tuple[threading.Event, list] = (threading.Event(), [])
        self._controls[cid] = done
        self._send_control(Control(op, cid, dict(args or {})))
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

    def latest_stats(self) -> list[dict]:
        """Every rank's counters from its latest heartbeat (at most a heartbeat interval old);
        answers at once, also while the engine is busy or stalled."""
        return [self._beats[r].stats for r in sorted(self._beats)]

    @property
    def num_pending(self) -> int:
        return len(self._results)

    # -- liveness -------------------------------------------------------------------------------------
    def _start_watchdog(self, timeout: float) -> None:
        """Declare the engine dead after ``timeout`` seconds without a heartbeat (0: never)."""
        self._last_beat = time.monotonic()
        if timeout > 0:
            threading.Thread(target=self._watch, args=(timeout,), name="phalanx-watchdog", daemon=True).start()

    def _watch(self, timeout: float) -> None:
        while self.dead_error is None and not self._stopping:
            time.sleep(min(0.5, timeout / 4))
            silent = time.monotonic() - self._last_beat
            if self._controls:   # a rank loop busy with a control op answers it (each has its own timeout)
                continue
            if silent > timeout and self.dead_error is None and not self._stopping:
                reason = f"the engine stalled: {self._stall_reason(silent)}"
                logger.error("%s; failing every pending request", reason)
                self._fail_all(reason)
                self._stop_stalled_engine()
                return

    def _stall_reason(self, silent: float) -> str:
        """Name the rank that holds the others up, when a local process state shows it."""
        import psutil
        here = socket.gethostname()
        for rank, (host, pid) in enumerate(self.rank_processes):
            if host != here:
                continue
            try:
                status = psutil.Process(pid).status()
            except psutil.NoSuchProcess:
                return f"rank {rank} (pid {pid}) is gone"
            if status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP, psutil.STATUS_ZOMBIE,
                          psutil.STATUS_DEAD):
                return f"rank {rank} (pid {pid}) is {status}; no progress for {silent:.1f}s"
        last = self._beats.get(0)
        at = f" after iteration {last.iteration}" if last is not None else ""
        return f"no heartbeat from rank 0's loop for {silent:.1f}s{at} (a rank is stuck in a collective or a kernel)"

    def _stop_stalled_engine(self) -> None:  # noqa: B027 (a hook: only the proxy has a job to kill)
        """After a stall: release what the engine holds, if this side can (the proxy kills the job)."""

    # -- results --------------------------------------------------------------------------------------
    def _dispatch(self, responses: list[Response]) -> None:
        wakeups = Wakeups()   # one wake-up per event loop for the whole batch
        try:
            for resp in responses:
                result = self._results.get(resp.request_id)
                if result is not None:   # None: already finished on this side (stop string), or aborted
                    self._apply(result, resp.request_id, resp.finish_reason is not None or resp.error is not None,
                                result.handle, resp, wakeups)
        finally:
            wakeups.fire()

    def _dispatch_batch(self, batch: TokenBatch) -> None:
        """A step's tokens, row by row (``GenerationResult.handle_row``: no Response a row)."""
        wakeups = Wakeups()
        version = batch.weight_version
        try:
            for rid, toks, lps, fin, fst in batch.rows():
                result = self._results.get(rid)
                if result is not None:
                    self._apply(result, rid, fin is not None, result.handle_row, rid, toks, lps, fin, fst, version,
                                wakeups)
        finally:
            wakeups.fire()

    def _apply(self, result: GenerationResult, request_id: int, final: bool, handle: Callable[..., bool],
               *args: Any) -> None:
        """``handle(*args)`` for one request; a failure there fails that request alone."""
        try:
            handle(*args)
        except Exception:  # a bug in output handling must not stop the dispatcher
            logger.error("output handling failed for request %d:\n%s", request_id, traceback.format_exc())
            result.fail("output handling failed")
        if final:
            with self._lock:
                self._results.pop(request_id, None)

    def _dispatch_other(self, obj: object) -> None:
        if isinstance(obj, list):
            self._dispatch([r for r in obj if isinstance(r, Response)])
        elif isinstance(obj, TokenBatch):
            self._dispatch_batch(obj)
        elif isinstance(obj, Heartbeat):
            self._beats[obj.rank] = obj
            self._last_beat = time.monotonic()
        elif isinstance(obj, ControlResult):
            self._last_beat = time.monotonic()
            waiter = self._controls.pop(obj.control_id, None)
            if waiter is not None:
                waiter[1].append(obj)
                waiter[0].set()

    def _fail_all(self, error: str) -> None:
        """The engine died: every pending request fails once; new submits fail fast. The
        first cause stays the engine's ``dead_error``."""
        if self.dead_error is None:
            self.dead_error = error
        with self._lock:
            pending, self._results = set(self._results.values()), {}
        for result in pending:
            result.fail(self.dead_error)
        for event, _ in list(self._controls.values()):
            event.set()
