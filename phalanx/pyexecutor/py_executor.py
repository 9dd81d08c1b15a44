"""PyExecutor: the loop every rank runs — fetch new requests, schedule, execute, update, respond.

The loop is the same on every rank; only rank 0 talks to the user process (``sender``). The
request source hides whether requests come from a local queue (one rank) or from rank 0's
per-iteration broadcast. With several ranks, each iteration's scheduling digest is compared
across ranks and a mismatch is fatal.

Errors: a bad request fails that request only. An exception in the forward fails the requests
of that step when there is one rank; with several ranks it is fatal (the collectives of the
other ranks can no longer line up) and propagates to the worker, which reports the rank.
"""

from __future__ import annotations

import gc
import itertools
import json
import logging
import threading
import time
import traceback
from array import array
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

from phalanx.executor.messages import (
    HEARTBEAT_INTERVAL,
    Control,
    ControlResult,
    Finished,
    FirstToken,
    GenerationRequest,
    Heartbeat,
    IterationInput,
    Response,
    TokenBatch,
    pack,
    unpack,
)
from phalanx.kernels import compiles
from phalanx.llmapi.sampling_params import SamplingParams, check_prompt
from phalanx.pyexecutor.host_clock import IDLE_COLLECT, GcPauses, HostClock
from phalanx.pyexecutor.model_runner import InFlightStep, ModelRunner, RequestFailures, StepResult
from phalanx.pyexecutor.request import Request, RequestStatus
from phalanx.pyexecutor.rollout import Rollout
from phalanx.pyexecutor.scheduler import ScheduledBatch, Scheduler, StepOutcome
from phalanx.pyexecutor.speculative import speculates

logger = logging.getLogger("phalanx")

INTAKE_STEPS = 2   # arrivals are taken in while the waiting queue holds less than this many steps' prompts


class Sender(Protocol):
    """Rank 0's way back to the user process."""

    def send_responses(self, responses: list[Response]) -> None: ...

    def send(self, obj: Any) -> None: ...


class RequestQueue:
    """The local request source: producers put, the executor loop fetches once per iteration."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._pending = IterationInput()

    def put_request(self, req: GenerationRequest) -> None:
        self._put(lambda p: p.new.append(req))

    def put_cancel(self, request_id: int) -> None:
        self._put(lambda p: p.cancel.append(request_id))

    def put_control(self, ctl: Control) -> None:
        self._put(lambda p: p.control.append(ctl))

    def put_shutdown(self) -> None:
        self._put(lambda p: setattr(p, "shutdown", True))

    def _put(self, fn) -> None:
        with self._cond:
            fn(self._pending)
            self._cond.notify()

    def fetch(self, idle: bool, timeout: float = 0.05) -> IterationInput:
        """Everything queued since the last fetch; waits up to ``timeout`` only when idle."""
        with self._cond:
            if idle and not self._pending:
                self._cond.wait(timeout)
            out, self._pending = self._pending, IterationInput()
            return out


class RequestSource(Protocol):
    """Where rank 0's loop takes its input from: a ``RequestQueue`` in the user's process, or
    the user's IPC socket read by the loop itself (``worker.Rank0Link``)."""

    def fetch(self, idle: bool, timeout: float = 0.05) -> IterationInput: ...


class BroadcastRequestQueue:
    """Rank 0 fetches locally and broadcasts the iteration's input; other ranks receive it. A
    job of one rank only fetches: nothing to broadcast, so no pack and unpack of each request."""

    def __init__(self, dist: Any, local: RequestSource | None) -> None:
        self.dist, self.local = dist, local
        self.fetch: Callable[[bool], IterationInput] = (
            local.fetch if local is not None and dist.size == 1 else self._broadcast)

    def _broadcast(self, idle: bool) -> IterationInput:
        if self.local is None:
            return unpack(self.dist.bcast_bytes(None, idle))
        # rank 0 keeps its own input (~13 µs a request it need not unpack again): its source hands
        # over messages unpacked once (worker.Rank0Link), which unpack again to themselves
        # (messages.ids_from_wire), so every rank holds the same requests
        inp = self.local.fetch(idle)
        self.dist.bcast_bytes(pack(inp), idle)
        return inp


class PyExecutor:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, queue: RequestQueue | BroadcastRequestQueue,
                 sender: Sender | None, vocab_size: int, max_seq_len: int, dist: Any = None,
                 disable_overlap: bool = False) -> None:
        self.scheduler, self.runner, self.queue, self.sender = scheduler, runner, queue, sender
        self.vocab_size, self.max_seq_len = vocab_size, max_seq_len
        self.dist = dist
        self.rank = dist.rank if dist is not None else 0
        self.multi_rank = dist is not None and dist.size > 1
        if self.multi_rank and runner.lora is not None:   # a LoRA adapter is read, or refused, on every rank
            runner.lora.agree = lambda error: [e.decode() for e in dist.allgather_bytes(error.encode())]
        self.check_digests = True   # identical schedulers on every rank (not so under attention DP)
        self.disable_overlap = disable_overlap
        self.shutdown_requested = False
        self.iteration = 0
        self._fail_next_forward = False   # set by the "fail_next_forward" control (fault injection)
        self._compiles_before = compiles.count()   # Triton compiles before "timing:on"
        self._last_beat = 0.0
        self._profiler: Any = None
        self._host_profiler: Any = None
        self._profiled_from = 0
        self._allocs_before: dict[str, int] = {}
        self.clock = runner.clock = HostClock()   # the runner marks its own phases of a launch
        self.gc_pauses = GcPauses()
        # arrived, made into Requests as steps need them, in arrival order (by id: a cancel finds one at once)
        self.intake: OrderedDict[int, GenerationRequest] = OrderedDict()
        self.rollout = Rollout(self)   # pause, sleep, weight updates and versions (RL trainers)

    # -- the loops: one switch, two short functions -----------------------------------------------------
    def run(self) -> None:
        """Run until a shutdown arrives and (after aborting what is left) return."""
        with self.gc_pauses:
            (self._loop_sync if self.disable_overlap else self._loop_overlap)()
            self.abort_all()

    def _loop_sync(self) -> None:
        """Schedule, run and read each step before scheduling the next."""
        while not self.shutdown_requested:
            self._fetch(idle=not self._has_steps)
            self.clock.mark("fetch")
            batch = self._schedule()
            self.clock.mark("schedule")
            if batch is not None:
                step = self._launch(batch)
                self.clock.mark("launch")
                self._process(step)

    def _loop_overlap(self) -> None:
        """Launch step n+1 before reading step n: the host's work for step n (tokens, stop
        checks, responses, frees) runs while the device computes step n+1."""
        prev, clock = None, self.clock
        while not self.shutdown_requested or prev is not None:
            self._fetch(idle=prev is None and not self._has_steps)
            clock.mark("fetch")
            batch = self._schedule()
            clock.mark("schedule")
            if batch is not None and prev is not None and _needs_known_history(batch):
                self._process(prev)          # penalties need the in-flight tokens' values
                prev = None
            # grammar rows sample only once step n's tokens are read: ``_process`` fills their
            # bitmask and queues their sampling while step n+1's forward runs
            step = self._launch(batch, defer_sampling=True) if batch is not None else None
            clock.mark("launch")
            if prev is not None:
                self._process(prev, ahead=step)
            if step is not None:
                self.runner.finish_sampling(step)
            clock.mark("sample")
            prev = step

    # -- one step ----------------------------------------------------------------------------------
    @property
    def _has_steps(self) -> bool:
        """Whether a step could run now (work, not paused or asleep)."""
        s = self.scheduler
        return not self.rollout.holds and bool(s.running or ((s.waiting or self.intake) and self.rollout.admits))

    def _schedule(self) -> ScheduledBatch | None:
        if self.shutdown_requested or not self._has_steps:
            return None
        batch = self.scheduler.schedule(admit=self.rollout.admits)
        self.iteration += 1
        self.clock.iteration = self.iteration
        if self.multi_rank and self.check_digests:
            self.dist.check_digest(batch.digest(), self.iteration)
        if not batch.requests and batch.copy_ops:   # (none today: only a row's grow or admission queues them)
            self.runner.run_copies(batch)
        return batch if batch.requests else None

    def _launch(self, batch: ScheduledBatch, graph_size: int | None = None,
                defer_sampling: bool = False) -> InFlightStep | None:
        """Launch a step (``graph_size``, ``defer_sampling`` as ModelRunner.launch's); None if it failed."""
        try:
            if self._fail_next_forward:
                self._fail_next_forward = False
                raise RuntimeError(f"injected forward failure on rank {self.rank}")
            step = self.runner.launch(batch, graph_size, defer_sampling)
            step.weight_version = self.rollout.weight_version
            return step
        except RequestFailures as e:   # found before the device ran anything: fail those alone
            self._fail_rows(batch, e.errors)
            rest = batch.without(e.errors)
            return self._launch(rest, graph_size, defer_sampling) if rest.requests else None
        except Exception:
            if self.multi_rank:
                raise
            self._fail_batch(batch, traceback.format_exc())
            self._keep_cache_whole(batch)
            return None

    def _keep_cache_whole(self, batch: ScheduledBatch) -> None:
        """A failed step's KV copies still run (the tree moved those blocks when it scheduled
        them); where they cannot, nothing cached may match again."""
        try:
            self.runner.run_copies(batch)
        except Exception:
            logger.exception("a failed step's KV copies failed too: the prefix cache is dropped")
            self.rollout.new_epoch()

    def _process(self, step: InFlightStep | None, ahead: InFlightStep | None = None) -> None:
        """Read a launched step's tokens, update requests, respond. ``ahead``: the step launched
        after it, whose sampling (deferred for its grammar rows) is queued as soon as the grammars
        have these tokens, before the responses."""
        if step is None:
            return
        clock = self.clock
        try:
            result = self.runner.collect(step)
        except Exception:
            if self.multi_rank:
                raise
            self._fail_batch(step.batch, traceback.format_exc())
            return
        clock.mark("wait")
        if result.prompt_logprobs:
            self._respond_prompt_logprobs(step.batch, result.prompt_logprobs)
        guided = self.runner.guided
        outcome = self.scheduler.update(step.batch, result.token_ids,
                                        guided.accept if guided is not None and guided.matchers else None)
        clock.mark("update")
        if ahead is not None:
            self.runner.finish_sampling(ahead)
            clock.mark("sample")
        self._respond_step(step.batch, result, outcome, step.weight_version)
        clock.mark("respond")

    # -- intake ----------------------------------------------------------------------------------
    def _fetch(self, idle: bool) -> None:
        self._beat()
        inp = self.queue.fetch(idle)
        self.clock.mark("receive")
        for req in inp.new:
            self._add(req)
        for rid in inp.cancel:
            if isinstance(rid, int):   # (from a client of the socket: anything; an id is an int)
                self._cancel(rid)
        self._take_intake()
        for ctl in inp.control:
            self._control(ctl)
        if inp.shutdown:
            self.shutdown_requested = True
        elif idle and not (inp.new or inp.cancel or inp.control):
            self.clock.mark("fetch")
            if self.gc_pauses.idle():   # an idle wait brought nothing: the deferred full collection, if due
                self.clock.mark(IDLE_COLLECT)
            return
        self.gc_pauses.busy()

    def _cancel(self, request_id: int) -> None:
        req = self.scheduler.finish(request_id, RequestStatus.FINISHED_ABORTED)
        if req is not None:
            self._finished(req)
            self._send([Response(request_id, finish_reason="abort", num_cached_tokens=req.num_cached_tokens,
                                 num_prompt_tokens=req.num_prompt_tokens, weight_version=self.rollout.weight_version)])
            return
        msg = self.intake.pop(request_id, None)   # not taken in yet
        if msg is not None:
            self._send([Response(request_id, finish_reason="abort", num_prompt_tokens=prompt_len(msg),
                                 weight_version=self.rollout.weight_version)])

    def _add(self, msg: GenerationRequest) -> None:
        rid = msg.request_id
        error = _id_error(rid)
        if error is None and rid in self.intake:
            error = f"request id {rid} is already in use"   # as the scheduler refuses an id it holds
        if error is not None:
            self._send([Response(rid, finish_reason="error", num_prompt_tokens=prompt_len(msg), error=error)])
            return
        self.intake[rid] = msg

    def _take_intake(self) -> None:
        """Make arrived requests into the scheduler's, first come first served, until its waiting
        queue holds what the next INTAKE_STEPS steps can admit (prompt tokens for their token
        budgets, or a batch of rows). Making a request costs ~0.1 ms of host time (unpacked
        params checked, its Request built): hundreds arriving at once took tens of milliseconds
        in one iteration while the device went idle; they now come in as steps admit them.
        The same on every rank: every rank holds the same arrivals and the same queue."""
        if not self.intake:
            return
        limits = self.scheduler.limits
        need_tokens, need_rows = INTAKE_STEPS * limits.max_num_tokens, limits.max_batch_size
        tokens = rows = 0
        for req in itertools.islice(self.scheduler.waiting, self.scheduler.num_held, None):   # (held: not admissible)
            tokens += req.num_tokens - req.num_computed_tokens
            rows += 1
            if tokens >= need_tokens or rows >= need_rows:
                return
        while self.intake and tokens < need_tokens and rows < need_rows:
            taken = self._take(self.intake.popitem(last=False)[1])
            if taken is not None:
                tokens += taken.num_tokens
                rows += 1

    def _take(self, msg: GenerationRequest) -> Request | None:
        """One arrival into the scheduler (None, and an error response, if it cannot run)."""
        req = None
        try:
            req = self._make_request(msg)
            error = self._enqueue(req)
        except (ValueError, TypeError) as e:
            error = str(e)
        if error is None:
            return req
        if req is not None and req.lora_id and self.runner.lora is not None:   # its own hold on its adapter
            self.runner.lora.release(msg.request_id)
        self._send([Response(msg.request_id, finish_reason="error", error=error, num_prompt_tokens=prompt_len(msg))])
        return None

    def _make_request(self, msg: GenerationRequest) -> Request:
        error = _id_error(msg.request_id)   # (attention DP's arrivals come here unchecked)
        if error is not None:
            raise TypeError(error)
        ids = msg.prompt_token_ids
        check_prompt(ids, self.vocab_size, self.max_seq_len)
        params = SamplingParams.from_dict(msg.sampling_params)
        params.check_vocab(self.vocab_size)
        limit = self.max_seq_len if params.max_tokens is None else min(self.max_seq_len, len(ids) + params.max_tokens)
        if msg.max_total_tokens:
            limit = min(limit, msg.max_total_tokens)
        grammar = None
        if params.guided_decoding is not None:   # refuse a grammar that does not compile, here
            if self.runner.guided is None:
                raise ValueError("guided_decoding is not available on this engine")
            grammar = self.runner.guided.compile(params.guided_decoding)
        if msg.cache_salt is not None and not isinstance(msg.cache_salt, str):
            raise TypeError(f"cache_salt must be a string, got {type(msg.cache_salt).__name__}")
        salt = (msg.cache_salt or "").encode()
        if msg.lora is not None and self.runner.lora is None:
            raise ValueError("lora_request: this engine serves no LoRA adapters (start it with lora_config "
                             "or enable_lora)")
        spec = self.runner.spec
        req = Request(msg.request_id, ids.tolist() if isinstance(ids, array) else list(ids), params,
                      tuple(msg.eos_token_ids), limit,
                      extra_key=salt, priority=msg.priority, grammar=grammar,
                      spec_len=spec.k if spec is not None and speculates(params) else 0)
        if msg.lora is not None and self.runner.lora is not None:   # last: nothing after it refuses the request
            req.lora_id = self.runner.lora.register(msg.request_id, msg.lora)
            req.extra_key = self.runner.lora.cache_key(req.lora_id) + salt   # its KV is the adapter's
        return req

    def _beat(self) -> None:
        """Tell the user process this loop is alive (once per HEARTBEAT_INTERVAL at most)."""
        now = time.monotonic()
        if now - self._last_beat >= HEARTBEAT_INTERVAL:
            self._last_beat = now
            self._emit(Heartbeat(self.rank, self.iteration, self.stats()))

    def _enqueue(self, req: Request) -> str | None:
        """Give a request to this rank's scheduler and, once it is in, follow its grammar;
        the scheduler's refusal, or None."""
        error = self.scheduler.add_request(req)
        if error is None and req.grammar is not None and self.runner.guided is not None:
            self.runner.guided.add(req)
        return error

    # -- inspection ------------------------------------------------------------------------------
    def _control(self, ctl: Control) -> None:
        try:
            result = self._run_control(ctl.op, ctl.args or {})
        except Exception as e:  # an inspection failure is reported, never fatal
            result = f"error: {type(e).__name__}: {e}"
        per_rank = ([r.decode() for r in self.dist.allgather_bytes(result.encode())]
                    if self.multi_rank else [result])
        ok = all(not r.startswith("error") for r in per_rank)
        if self.sender is not None:
            self.sender.send(ControlResult(ctl.control_id, ok, per_rank))

    def _run_control(self, op: str, args: dict[str, Any]) -> str:
        if op in Rollout.OPS:
            if not isinstance(args, dict):
                raise ValueError("control args must be a mapping")
            return self.rollout.run(op, args)
        if op in ("add_lora", "remove_lora", "list_loras"):   # LLM.add_lora / remove_lora / list_loras
            if self.runner.lora is None:
                raise ValueError(f"{op}: this engine serves no LoRA adapters (start it with lora_config or "
                                 "enable_lora)")
            if not isinstance(args, dict):
                raise ValueError("control args must be a mapping")
            lora = self.runner.lora
            if op != "list_loras":   # requests sent before the op hold their adapter first (FCFS, not throttled)
                while self.intake:
                    self._take(self.intake.popitem(last=False)[1])
            if op == "add_lora":
                return lora.add(args.get("lora_name"), args.get("lora_int_id"),  # type: ignore[arg-type]
                                args.get("lora_path") or "", args.get("peft_config"), args.get("specs"))
            return lora.remove(args.get("lora_int_id")) if op == "remove_lora" else lora.listing()  # type: ignore[arg-type]
        if op == "check_integrity":
            self.scheduler.kv.check_integrity()
            return "ok"
        if op == "stats":
            return json.dumps(self.stats())
        if op.startswith("fail_next_forward:"):   # fault injection: that rank's next forward raises
            self._fail_next_forward = int(op.split(":", 1)[1]) == self.rank
            return "ok"
        if op in ("timing:on", "timing:off"):      # CUDA events around each step (idle share of the GPU)
            self.runner.record_timing = op == "timing:on"
            if self.runner.record_timing:
                self.runner.timings.clear()
                self.runner.timing_shapes.clear()
                self._compiles_before = compiles.count()
                self.clock.start(self.iteration)
                self.gc_pauses.reset()
                self._allocs_before = self.runner.allocator_counts()
            else:
                self.clock.stop(self.iteration)
            return "ok"
        if op == "trace:on":     # every mark of the loop from now on, stamped (HostClock)
            self.clock.start_trace()
            return "ok"
        if op == "trace:off":
            return json.dumps(self.clock.stop_trace())
        if op == "timing":   # + the host's milliseconds per step in each phase of the loop
            out = self.runner.idle_fraction() if self.runner.timings else {}
            return json.dumps({**out, "host_ms_per_step": self.clock.per_step_ms(self.iteration),
                               "gc": self.gc_pauses.summary(), "gc_frozen": gc.get_freeze_count(),
                               "gc_thresholds": list(gc.get_threshold()),
                               "allocator": {k: v - self._allocs_before.get(k, 0)
                                             for k, v in self.runner.allocator_counts().items()},
                               "compiled": compiles.since(self._compiles_before)})
        if op == "profile:start":                # the torch profiler around the steps that follow
            from torch.profiler import ProfilerActivity, profile
            # gpu_only: CUDA activity alone (recording host ops slows the loop); a CPU engine records its host ops
            gpu_only = bool(args.get("gpu_only")) and self.runner.device.type == "cuda"
            self._profiler = profile(activities=[ProfilerActivity.CUDA] + ([] if gpu_only else [ProfilerActivity.CPU]))
            self._profiler.__enter__()
            self._profiled_from = self.iteration
            return json.dumps(self.runner.align_marker()) if args.get("align") else "ok"
        if op == "profile:stop":                 # this rank's kernels per step, slowest first
            prof, self._profiler = self._profiler, None
            if prof is None:
                raise ValueError("profile:stop without profile:start")
            prof.__exit__(None, None, None)
            trace = args.get("trace")
            if isinstance(trace, str) and trace:
                prof.export_chrome_trace(f"{trace}.rank{self.rank}.json" if self.multi_rank else trace)
            return json.dumps(kernel_table(prof, max(1, self.iteration - self._profiled_from)))
        if op == "hostprofile:start":            # cProfile of this loop's thread: its host time by function
            import cProfile
            self._host_profiler = cProfile.Profile()
            self._host_profiler.enable()
            return "ok"
        if op == "hostprofile:stop":             # the functions by cumulative time (args: ``top``, ``sort``)
            import io
            import pstats
            host, self._host_profiler = self._host_profiler, None
            if host is None:
                raise ValueError("hostprofile:stop without hostprofile:start")
            host.disable()
            buf = io.StringIO()
            pstats.Stats(host, stream=buf).sort_stats(str(args.get("sort", "cumulative"))).print_stats(
                int(args.get("top", 60)))
            return buf.getvalue()
        if op.startswith("skew_scheduler:"):      # fault injection: that rank's decisions drift
            if int(op.split(":", 1)[1]) == self.rank:
                self.scheduler.step += 1
            return "ok"
        raise ValueError(f"unknown control op {op!r}")

    def stats(self) -> dict[str, Any]:
        s, kv = self.scheduler, self.scheduler.kv
        return {"rank": self.rank, "iteration": self.iteration, "num_running": len(s.running),
                "num_waiting": len(s.waiting) + len(self.intake), "kv_usage": kv.usage, "num_blocks": kv.num_blocks,
                "num_available_blocks": kv.num_available_blocks, "prefix_queried_tokens": kv.num_queried_tokens,
                "prefix_hit_tokens": kv.num_hit_tokens, "num_preemptions": s.num_preemptions,
                "kv_host_blocks": kv.num_host_blocks, "kv_host_cached_blocks": len(kv.tree.host_nodes),
                "kv_offloaded_blocks": kv.tree.num_offloaded, "kv_onboarded_blocks": kv.tree.num_onboarded,
                "num_graph_steps": self.runner.num_graph_steps,
                "spec_verify_rows": s.num_verify_rows, "spec_draft_tokens": s.num_draft_tokens,
                "spec_accepted_drafts": s.num_accepted_drafts,
                "num_extend_graph_steps": self.runner.num_extend_graph_steps,
                "num_piecewise_steps": self.runner.num_piecewise_steps,
                "weight_version": self.rollout.weight_version,
                "paused": self.rollout.pause_mode, "asleep": sorted(self.rollout.asleep),
                **(self.runner.guided.stats() if self.runner.guided is not None else {}),
                **(self.runner.lora.stats() if self.runner.lora is not None else {}),
                "weight_bytes_per_step": self._weight_bytes()}

    def _weight_bytes(self) -> int:
        """Bytes of weights a one-token decode step reads on this rank (embedding tables excluded:
        one row; of a mixture of experts' layers, the top_k of the E experts a token is routed to,
        wherever they lie: each rank's share of its experts' bytes × top_k / E)."""
        if not hasattr(self, "_wbytes"):
            from phalanx.models.moe import SparseMoE
            model = self.runner.model
            experts = {id(p): m.top_k / m.cfg.num_experts for m in model.modules() if isinstance(m, SparseMoE)
                       for p in (m.w13, m.w2, m.w13_scale, m.w2_scale) if p is not None}
            self._wbytes = int(sum(p.numel() * p.element_size() * experts.get(id(p), 1.0)
                                   for n, p in model.named_parameters() if "embed_tokens" not in n))
        return self._wbytes

    # -- output ----------------------------------------------------------------------------------
    def _send(self, responses: list[Response]) -> None:
        if responses:
            self._emit(responses)

    def _emit(self, obj: Any) -> None:
        """Hand a message for the user process to rank 0's sender (other ranks drop it)."""
        if self.sender is not None:
            self.sender.send(obj)

    def _respond_step(self, batch: ScheduledBatch, result: StepResult, outcome: StepOutcome,
                      weight_version: str) -> None:
        finished = {r.request_id for r in outcome.finished}
        msg = TokenBatch(logprobs=[] if result.logprobs is not None else None, weight_version=weight_version)
        for row, req in enumerate(batch.requests):
            tokens = outcome.new_tokens.get(req.request_id)
            if not tokens:
                continue
            msg.request_ids.append(req.request_id)
            msg.token_ids.append(tokens[0] if len(tokens) == 1 else tokens)
            if msg.logprobs is not None and result.logprobs is not None:
                lp = result.logprobs[row]
                msg.logprobs.append(list(lp) if lp is not None else None)
            if req.num_output_tokens == len(tokens):
                msg.first.append(FirstToken(req.request_id, req.num_cached_tokens, req.num_prompt_tokens,
                                            req.first_scheduled_time, self.rank))
            if req.request_id in finished:
                msg.finished.append(Finished(req.request_id, req.finish_reason or "stop", req.stop_reason))
                self._finished(req)
        if msg.request_ids:
            self._emit(msg)

    def _respond_prompt_logprobs(self, batch: ScheduledBatch, rows: dict[int, tuple[int, list]]) -> None:
        """Send each request's new prompt log-probabilities (before the step's tokens)."""
        out = []
        for row, (first, entries) in rows.items():
            req = batch.requests[row]
            if req.status != RequestStatus.RUNNING or first != req.num_prompt_logprobs:
                continue   # ended or preempted meanwhile: the positions are computed again
            req.num_prompt_logprobs = first + len(entries)
            out.append(Response(req.request_id, prompt_logprobs=entries, prompt_logprobs_start=first))
        self._send(out)

    def _finished(self, req: Request) -> None:
        self.runner.release(req.request_id)

    def _fail_rows(self, batch: ScheduledBatch, errors: dict[int, str]) -> None:
        """Fail the requests of some rows (their own inputs broke); the others go on."""
        out = []
        for row, error in errors.items():
            req = batch.requests[row]
            logger.warning("request %d failed alone: %s", req.request_id, error)
            if self.scheduler.finish(req.request_id, RequestStatus.FINISHED_ERROR) is not None:
                self._finished(req)
                out.append(Response(req.request_id, finish_reason="error", error=error,
                                    num_prompt_tokens=req.num_prompt_tokens))
        self._send(out)

    def _fail_batch(self, batch: ScheduledBatch, tb: str) -> None:
        logger.error("forward failed; failing %d requests:\n%s", len(batch), tb)
        out = []
        for req in batch.requests:
            if self.scheduler.finish(req.request_id, RequestStatus.FINISHED_ERROR) is not None:
                self._finished(req)
                out.append(Response(req.request_id, finish_reason="error",
                                    error=f"forward failed: {tb.strip().splitlines()[-1]}"))
        self._send(out)

    def num_unfinished(self) -> int:
        """Requests not finished on any rank (the same on every rank), taken in or not."""
        return len(self.scheduler.requests) + len(self.intake)

    def abort_all(self) -> None:
        """End every unfinished request now (finish reason "abort": each keeps its tokens)."""
        version = self.rollout.weight_version   # an abort's answer says which weights were serving
        out = [Response(rid, finish_reason="abort", num_prompt_tokens=prompt_len(m), weight_version=version)
               for rid, m in self.intake.items()]
        self.intake.clear()
        for req in list(self.scheduler.requests.values()):
            self.scheduler.finish(req.request_id, RequestStatus.FINISHED_ABORTED)
            self._finished(req)
            out.append(Response(req.request_id, finish_reason="abort", weight_version=version))
        self._send(out)


def kernel_table(prof: Any, steps: int, top: int = 40) -> list[dict[str, Any]]:
    """GPU kernels of a torch profile: name, calls and microseconds per step, slowest first."""
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t and e.count and getattr(e, "device_type", None) is not None and "CUDA" in str(e.device_type):
            rows.append({"kernel": e.key[:90], "calls_per_step": e.count / steps, "us_per_step": t / steps})
    rows.sort(key=lambda r: -r["us_per_step"])
    return rows[:top]


def _id_error(request_id: Any) -> str | None:
    """Why a request id that came off the socket cannot be one (anything may), or None."""
    return None if isinstance(request_id, int) else f"request_id must be an integer, got {type(request_id).__name__}"


def prompt_len(msg: GenerationRequest) -> int:
    """A request's prompt length as it arrived (which may be anything a client of the socket sent)."""
    ids = msg.prompt_token_ids
    return len(ids) if isinstance(ids, list | tuple | array) else 0


def _needs_known_history(batch: ScheduledBatch) -> bool:
    """Penalties and bad words of several tokens read the values of earlier tokens; a row whose
    previous token is still in flight cannot be sampled before that token is read."""
    return any(r.num_inflight_tokens > 1 and r.sampling.needs_history for r in batch.requests)
