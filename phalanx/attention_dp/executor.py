"""AdpExecutor: attention data parallelism. Each rank owns its requests, KV pool and
scheduler; the MoE layers exchange tokens every step, so all ranks step together.

Per iteration, on every rank: receive rank 0's broadcast; place new requests, as many as the
next steps can admit, with the router (allgather of each rank's prefix-match lengths and load;
every rank computes the same placement and keeps its share); schedule its own step; tell the
others what it scheduled (one allgather: nothing to do, a step that cannot replay a graph, or a
decode batch of n); run the step; gather every rank's outputs to rank 0, which sends them to the
user process.

When every rank's step is a decode batch (or nothing), all ranks replay the CUDA graph of the
size that holds the largest: each pads its batch to that size, and a rank with nothing replays
it on padding rows only, so the MoE layers' token exchange has fixed sizes inside the graph.
Otherwise the step runs eagerly (counts exchanged once per forward) and a rank with nothing to
run takes a one-token dummy step. Runs the sync loop (no overlap).
"""

from __future__ import annotations

import logging
from typing import Any

from phalanx.attention_dp.router import PlacementProbe, RouterConfig, place
from phalanx.executor.messages import GenerationRequest, Response, pack, unpack
from phalanx.pyexecutor.py_executor import INTAKE_STEPS, PyExecutor, prompt_len
from phalanx.pyexecutor.request import RequestStatus
from phalanx.pyexecutor.scheduler import ScheduledBatch

logger = logging.getLogger("phalanx")

NO_WORK, EAGER_STEP = -2, -1     # a rank's step, as told to the others (else: decode rows)


class AdpExecutor(PyExecutor):
    def __init__(self, *args: Any, adp_config: Any = None, capacity: int = 2048, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        from phalanx.config import AttentionDpConfig
        self.check_digests = False      # each rank schedules its own requests
        self.adp = adp_config or AttentionDpConfig()
        self.router = RouterConfig(self.adp.load_balance_weight, self.adp.routing == "load",
                                   self.adp.balance_threshold)
        self.capacity = capacity
        self.pending: list[GenerationRequest] = []
        self.waited = 0
        self.outbox: list[Any] = []
        self.num_dummy_steps = 0
        self.num_padding_steps = 0
        self.num_placed = [0] * self.dist.size
        self.num_placements = 0    # iterations that took pending requests to place (a burst: several)

    # -- the loop --------------------------------------------------------------------------------
    def run(self) -> None:
        with self.gc_pauses:
            self._run()

    def _run(self) -> None:
        any_work = False
        while not self.shutdown_requested:
            self._fetch(idle=not any_work and not self.pending)
            self._place(any_work)
            batch = self._schedule()
            steps = self._exchange_steps(batch)
            any_work = any(s != NO_WORK for s in steps)
            if any_work:
                self._step(batch, self._common_graph_size(steps))
            self._flush()
        self.abort_all()
        self._flush()

    def _step(self, batch: ScheduledBatch | None, graph_size: int | None) -> None:
        step = self._launch(batch, graph_size or 0) if batch is not None else None
        if step is None:   # nothing to run here (or every row failed first): join the collectives
            self._idle_step(graph_size)
        self._process(step)

    def _idle_step(self, graph_size: int | None) -> None:
        if graph_size:
            self.runner.padding_step(graph_size)
            self.num_padding_steps += 1
        else:
            self.runner.dummy_step()
            self.num_dummy_steps += 1

    def _exchange_steps(self, batch: ScheduledBatch | None) -> list[int]:
        """Every rank's step this iteration: NO_WORK, EAGER_STEP, or the rows of a decode batch
        that a CUDA graph can hold (0: work waiting, nothing scheduled)."""
        if not self._has_steps:    # no requests, or paused / asleep (the same on every rank)
            mine = NO_WORK
        elif batch is None:
            mine = 0
        else:
            mine = len(batch) if self.runner.graphable(batch) else EAGER_STEP
        return [int(b) for b in self.dist.allgather_bytes(str(mine).encode())]

    def _common_graph_size(self, steps: list[int]) -> int | None:
        """The graph every rank replays this step, or None (eager): only when no rank runs an
        eager step and some rank decodes."""
        graphs = self.runner.graphs
        if graphs is None or EAGER_STEP in steps or max(steps) <= 0:
            return None
        return graphs.graph_size(max(steps))

    # -- intake: new requests wait for placement --------------------------------------------------
    def _add(self, msg: GenerationRequest) -> None:
        self.pending.append(msg)

    def _place(self, any_work: bool) -> None:
        if not self.pending:
            return
        world = self.dist.size
        wait = min(self.adp.batching_wait_iters, self.adp.timeout_iters)
        if self.adp.enable_balance and any_work and len(self.pending) < world and self.waited < wait:
            self.waited += 1
            return
        n = self._num_to_place()
        batch, self.pending = self.pending[:n], self.pending[n:]
        self.waited = wait if self.pending else 0   # the rest of a burst does not wait for company
        self.num_placements += 1
        valid, reqs = [], []
        for msg in batch:
            try:
                reqs.append(self._make_request(msg))
                valid.append(msg)
            except (ValueError, TypeError) as e:
                if self.rank == 0:
                    self._emit([Response(msg.request_id, finish_reason="error", error=str(e))])
        if not reqs:
            return
        kv = self.scheduler.kv
        mine = PlacementProbe([kv.match(r.token_ids, r.extra_key, r.reuses_prefix).num_tokens for r in reqs],
                              len(self.scheduler.requests), self.capacity)
        per_rank = [PlacementProbe(*unpack(b)) for b in self.dist.allgather_bytes(pack(mine))]
        ranks = place([r.num_prompt_tokens for r in reqs], [p.matches for p in per_rank], [p.load for p in per_rank],
                      [p.capacity for p in per_rank], self.router)
        for req, r in zip(reqs, ranks, strict=True):
            self.num_placed[r] += 1
            if r != self.rank:
                continue
            error = self._enqueue(req)
            if error is not None:
                self._emit([Response(req.request_id, finish_reason="error", error=error)])

    def _num_to_place(self) -> int:
        """How many of the pending requests to place this iteration, first come first served: at
        most INTAKE_STEPS steps' prompt tokens of every rank's token budget, and at most a batch of
        rows a rank; at least one. A cap per iteration (what ranks already hold waiting is not
        counted: that would take another exchange). Every rank makes a Request of each one placed
        (~0.1 ms of host time) before it keeps its share: a burst of hundreds placed at once held
        every rank for tens of milliseconds in one iteration. The same on every rank."""
        limits, world = self.scheduler.limits, self.dist.size
        need_tokens, need_rows = INTAKE_STEPS * limits.max_num_tokens * world, limits.max_batch_size * world
        tokens = 0
        for i, msg in enumerate(self.pending):
            if i >= need_rows or tokens >= need_tokens:
                return i
            tokens += prompt_len(msg)
        return len(self.pending)

    # -- cancels: a request not placed yet is dropped everywhere (rank 0 answers) ----------------------
    def _cancel(self, request_id: int) -> None:
        for i, msg in enumerate(self.pending):
            if msg.request_id == request_id:
                del self.pending[i]
                if self.rank == 0:
                    self._emit([Response(request_id, finish_reason="abort")])
                return
        req = self.scheduler.finish(request_id, RequestStatus.FINISHED_ABORTED)
        if req is not None:   # only the owner has it
            self._finished(req)
            self._emit([Response(request_id, finish_reason="abort", num_cached_tokens=req.num_cached_tokens,
                                 num_prompt_tokens=req.num_prompt_tokens)])

    def num_unfinished(self) -> int:
        """Requests unfinished on all ranks together (placed or not): the same on every rank."""
        counts = self.dist.allgather_bytes(str(len(self.scheduler.requests)).encode())
        return sum(int(c) for c in counts) + len(self.pending)

    def abort_all(self) -> None:
        if self.rank == 0:   # not placed yet: rank 0 answers for them
            self._emit([Response(m.request_id, finish_reason="abort") for m in self.pending])
        self.pending = []
        super().abort_all()

    # -- outputs: every rank's messages reach the user through rank 0 ---------------------------------
    def _emit(self, obj: Any) -> None:
        self.outbox.append(obj)

    def _flush(self) -> None:
        gathered = self.dist.allgather_bytes(pack(self.outbox))
        self.outbox = []
        if self.sender is None:
            return
        for data in gathered:
            for obj in unpack(data):
                self.sender.send(obj) if not isinstance(obj, list) else self.sender.send_responses(obj)

    def stats(self) -> dict[str, Any]:
        s = super().stats()
        s.update({"num_dummy_steps": self.num_dummy_steps, "num_padding_steps": self.num_padding_steps,
                  "num_placed": list(self.num_placed), "num_placements": self.num_placements,
                  "num_owned": len(self.scheduler.requests)})
        ep = getattr(self.runner.model, "ep", None)
        if ep is not None:
            s.update({"moe_forwards": ep.num_forwards, "moe_count_exchanges": ep.num_count_exchanges})
        return s
