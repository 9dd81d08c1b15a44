"""ModelRunner: a ScheduledBatch in, sampled token ids out. The one boundary to the device.

It never calls the scheduler. ``launch`` packs the scheduled positions of every request into
flat tensors (no padding), queues the partial-reuse copies, the forward and the sampler, and
starts an asynchronous copy of the sampled ids to the host; ``collect`` waits for that copy.
The sync loop calls them back to back; the overlap loop calls ``launch(n+1)`` before
``collect(n)``.

Sampled ids also land in a persistent per-slot device buffer (one slot per running request).
When a request's input token is still in flight (sampled by the step before, not read yet),
the next step gathers it from that buffer on the device; its position comes from counts.
"""

from __future__ import annotations

import contextlib
import time
from bisect import bisect_left
from dataclasses import dataclass, field
from itertools import accumulate, chain, pairwise
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from phalanx.kernels import compiles
from phalanx.kernels.metadata import AttentionMetadata
from phalanx.models.parallel import TPGroup
from phalanx.pyexecutor.host_clock import HostClock
from phalanx.pyexecutor.kv_pool import KVPool
from phalanx.pyexecutor.sampler import RowSettings, SampleOutput, Sampler, logprob_ranks
from phalanx.pyexecutor.scheduler import HOST_PLACED, ScheduledBatch

if TYPE_CHECKING:
    from phalanx.models.llama import CausalLM
    from phalanx.pyexecutor.cuda_graph import CudaGraphRunner
    from phalanx.pyexecutor.guided_decoder import GuidedDecoder
    from phalanx.pyexecutor.lora import LoraManager
    from phalanx.pyexecutor.request import Request
    from phalanx.pyexecutor.speculative import Eagle3Proposer, SampledRows, SpecDecoder, SpecStep


class RequestFailures(Exception):
    """Per-request host work for a step failed for some rows (nothing reached the device).

    ``errors`` maps batch row -> message. The caller fails those requests alone and launches
    the step again without them."""

    def __init__(self, errors: dict[int, str]) -> None:
        super().__init__(f"{len(errors)} request(s) failed while preparing a step")
        self.errors = errors


@dataclass
class PromptLogprobRows:
    """Prompt positions whose next-token log-probabilities a step computes.

    Position p of a request yields the log-probability of prompt token p + 1. Each entry of
    ``spans`` is (batch row, first position, count, top-k); the device tensors list the packed
    row of every such position and its target token, span after span."""

    spans: list[tuple[int, int, int, int]]
    indices: torch.Tensor          # [N] packed rows
    targets: torch.Tensor          # [N] the prompt token each position predicts


@dataclass
class StepInputs:
    input_ids: torch.Tensor        # [T] (0 where the token is gathered on the device)
    positions: torch.Tensor        # [T]
    meta: AttentionMetadata
    logits_indices: torch.Tensor   # [S_sample] packed row of each sampling row's last token
    sample_rows: list[int]         # batch rows that sample
    sampling: list[RowSettings]    # one per sampling row
    sample_slots: torch.Tensor     # [S_sample] each sampling row's request slot
    gather_dst: torch.Tensor | None = None    # [G] packed rows whose token is in flight
    gather_slot: torch.Tensor | None = None   # [G] their request slots
    prompt_logprobs: PromptLogprobRows | None = None
    spec: SpecStep | None = None              # speculative rows (verify, first tokens, prompts)
    extend_graph: int | None = None           # the extend graph whose buffers hold these inputs
    lora_slots: torch.Tensor | None = None    # [T] each token's LoRA adapter slot (-1: none), when set this step
    lora_groups: torch.Tensor | None = None   # their ``LoraState.groups``, where the grouped kernels may run
    lora_clear: bool = True                   # no token of the step has an adapter
    tails: torch.Tensor | None = None         # [S] the token after each row's last input, where known (EAGLE-3)
    draft_hidden: torch.Tensor | None = None  # [T, H] the target's h of every row (EAGLE-3: after the forward)


@dataclass
class PromptLogprobs:
    """Device tensors of one step's prompt log-probabilities (see ``PromptLogprobRows``)."""

    spans: list[tuple[int, int, int, int]]
    chosen: torch.Tensor           # [N]
    ranks: torch.Tensor            # [N] the chosen token's rank in the vocabulary
    top_ids: torch.Tensor          # [N, k]
    top_logprobs: torch.Tensor     # [N, k]

    def host(self) -> dict[int, tuple[int, list]]:
        """{batch row: (first position, [[chosen, rank, [[id, logprob], ...]], ...])}. Synchronizes."""
        chosen, ranks = self.chosen.tolist(), self.ranks.tolist()
        ids, vals = self.top_ids.tolist(), self.top_logprobs.tolist()
        out, j = {}, 0
        for row, first, count, k in self.spans:
            out[row] = (first, [[chosen[i], ranks[i], [list(p) for p in zip(ids[i][:k], vals[i][:k], strict=True)]]
                                for i in range(j, j + count)])
            j += count
        return out


@dataclass
class StepResult:
    """Per batch row: the sampled token (None if the row did not sample; a verify row's
    accepted tokens as a list) and its logprobs; prompt log-probabilities by row for the rows
    that asked."""

    token_ids: list[int | list[int] | None]
    logprobs: list | None = None
    prompt_logprobs: dict[int, tuple[int, list]] | None = None


@dataclass
class InFlightStep:
    """A launched step: device results and the event that says they reached the host. While
    ``pending`` holds the step's logits and sampling settings, its sampling is not queued yet
    (``ModelRunner.finish_sampling``)."""

    batch: ScheduledBatch
    sample_rows: list[int]
    sampled: SampleOutput | None
    host_tokens: torch.Tensor | None
    ready: torch.cuda.Event | None = None
    prompt_logprobs: PromptLogprobs | None = None
    pending: tuple[torch.Tensor, list[RowSettings], torch.Tensor] | None = None   # + the rows' slots
    start: torch.cuda.Event | None = None
    weight_version: str = ""            # the weights the step's forward read (set by the loop)
    spec: SpecStep | None = None
    head_rows: SampledRows | None = None   # an EAGLE-3 head's entries of the plain sampling rows


def padded_rows(n: int, sizes: list[int]) -> int:
    """The smallest of the ascending ``sizes`` that holds ``n`` rows; ``n`` itself past the last."""
    i = bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else n


def step_shape(batch: ScheduledBatch) -> tuple[int, int, int]:
    """(decode rows, prompt tokens, decode context) of a step: the rows past their prompts (a
    speculative row with its drafts included), the tokens of the rows still computing their prompts
    (a chunk, a prefix hit's rest, a preempted request's recompute), and the keys the decode rows'
    attention reads (each row's context after the step)."""
    rows = prompt = context = 0
    for r, n, c in zip(batch.requests, batch.num_scheduled_tokens, batch.num_computed_tokens, strict=True):
        if c < r.num_prompt_tokens:
            prompt += n
        else:
            rows += 1
            context += c + n
    return rows, prompt, context


class ModelRunner:
    def __init__(self, model: CausalLM, kv_pool: KVPool, sampler: Sampler, device: torch.device,
                 tp: TPGroup | None = None, max_slots: int = 256) -> None:
        self.model, self.kv_pool, self.sampler, self.device = model, kv_pool, sampler, device
        self.tp = tp or TPGroup()
        self.tokens_per_block = kv_pool.tokens_per_block
        self.token_buffer = torch.zeros(max_slots, dtype=torch.long, device=device)
        self._slots: dict[int, int] = {}
        self._free_slots = list(range(max_slots - 1, -1, -1))
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        if device.type == "cuda":
            compiles.install()      # the step timing lists the kernels compiled while it ran
        self.graphs: CudaGraphRunner | None = None   # decode-only steps (GPU)
        self.logits_rows: list[int] = []               # row counts an eager output layer is padded to (``_logits``)
        self._dummy: tuple[torch.Tensor, AttentionMetadata] | None = None   # dummy_step's inputs, made once
        self._zero_rows = torch.zeros(0, dtype=torch.long, device=device)
        self.guided: GuidedDecoder | None = None      # grammar state (guided decoding)
        self.spec: SpecDecoder | None = None          # speculative decoding (device state, proposer)
        self.lora: LoraManager | None = None          # LoRA adapters (their slots in the model)
        self._lora_mask_clear = True                  # no token of the last step had an adapter
        self.num_graph_steps = 0                     # steps that replayed a graph
        self.num_extend_graph_steps = 0              # prefill / extend / mixed steps that replayed one
        self.num_piecewise_steps = 0                 # larger steps: piecewise graphs, attention eager
        self.record_timing = False           # CUDA events around each step (idle-time measurement)
        self.last_prompt_logprobs: PromptLogprobs | None = None   # of the last forward
        self.timings: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.timing_shapes: list[tuple[int, int, int]] = []   # each timed step's step_shape
        self.clock = HostClock()   # the executor's, once it has one (marks its launch phases)
        self.stage = Staging(device)   # a step's host arrays to the device
        self._copied: list | None = None    # the copy list last run (``run_copies``: once a step)
        self._copying: list | None = None   # one that raised before it was done

    # -- request slots -----------------------------------------------------------------------------
    def slot_of(self, request_id: int) -> int:
        slot = self._slots.get(request_id)
        if slot is None:
            if not self._free_slots:
                self._grow_slots()
            slot = self._slots[request_id] = self._free_slots.pop()
            if self.spec is not None:
                self.spec.ensure_rows(slot + 1)
        return slot

    def release(self, request_id: int) -> None:
        """A request ended: free its slot, its grammar and its hold on its LoRA adapter."""
        slot = self._slots.pop(request_id, None)
        if slot is not None:
            self._free_slots.append(slot)
        if self.guided is not None:
            self.guided.release(request_id)
        if self.lora is not None:
            self.lora.release(request_id)

    def _grow_slots(self) -> None:
        old = self.token_buffer.shape[0]
        self.token_buffer = torch.cat([self.token_buffer, torch.zeros_like(self.token_buffer)])
        self._free_slots = list(range(2 * old - 1, old - 1, -1))

    # -- packing ---------------------------------------------------------------------------------
    def prepare(self, batch: ScheduledBatch, graph_size: int | None = None) -> StepInputs:
        """Host lists -> device tensors for one step (numpy on the host side). ``graph_size``:
        as ``forward``'s. A step that replays an extend graph has its inputs written straight
        into that graph's buffers (``CudaGraphRunner.stage_extend``).

        Per-request work (packing a row, its sampling settings, its prompt-logprob positions)
        runs row by row; rows that fail are reported together by ``RequestFailures`` before
        anything is sent to the device."""
        B = self.tokens_per_block
        S = len(batch)
        starts = np.fromiter(batch.num_computed_tokens, np.int64, S)
        counts = np.fromiter(batch.num_scheduled_tokens, np.int64, S)
        ends = starts + counts
        row_starts = list(accumulate(batch.num_scheduled_tokens, initial=0))   # Python ints for the row loop
        query_start = np.array(row_starts, np.int32)
        T = row_starts[-1]
        ids = np.zeros(T, np.int64)
        slots = np.empty(T, np.int64)
        gather_dst: list[int] = []
        gather_slot: list[int] = []
        prompt_spans: list[tuple[int, int, int, int]] = []
        failed: dict[int, str] = {}
        spec = _SpecRows() if self.spec is not None else None
        # a head reading the target's hidden states (EAGLE-3) takes, for each row's last input, the
        # token after it where the host knows it (a prompt chunk's next prompt token), else 0
        tails = np.zeros(S, np.int64) if self.spec is not None and self.spec.proposer.reads_hidden else None
        for row, (req, start, n, table) in enumerate(zip(batch.requests, batch.num_computed_tokens,
                                                          batch.num_scheduled_tokens, batch.block_tables, strict=True)):
            q0 = row_starts[row]
            if tails is not None and start + n < len(req.token_ids):
                tails[row] = req.token_ids[start + n]
            try:
                if spec is not None and req.spec_len:
                    slot = self.slot_of(req.request_id)
                    if batch.num_drafts[row] != HOST_PLACED:   # inputs, positions, slots: from the device state
                        spec.verify.append((row, q0, slot))
                        spec.k = batch.num_drafts[row]
                        slots[q0:q0 + n] = 0
                        continue
                    if self.spec is not None and self.spec.keep_history:   # NGram: the tokens go into the history
                        if req.spec_history < start:   # prompt tokens found in the prefix cache
                            spec.cached.append((req.token_ids[req.spec_history:start], req.spec_history, slot))
                        req.spec_history = start + n
                        spec.prompt.append((q0, n, start, slot))
                    if batch.samples[row]:
                        spec.first.append((row, start + n + 1, req.max_total_tokens, slot, q0 + n - 1))
                if n == 1:   # a decode row: scalars, no slices (hundreds of rows a step)
                    if start < len(req.token_ids):
                        ids[q0] = req.token_ids[start]
                    else:    # its input token is still in flight: gathered on the device
                        gather_dst.append(q0)
                        gather_slot.append(self.slot_of(req.request_id))
                    slots[q0] = table[start // B] * B + start % B
                else:
                    known = req.token_ids[start:start + n]
                    ids[q0:q0 + len(known)] = known
                    if len(known) < n:   # the last input token is still in flight: gather it on the device
                        gather_dst.append(q0 + len(known))
                        gather_slot.append(self.slot_of(req.request_id))
                    pos = np.arange(start, start + n)
                    slots[q0:q0 + n] = np.asarray(table, np.int64)[pos // B] * B + pos % B
                if req.sampling.prompt_logprobs is not None:
                    span = _prompt_logprob_span(req, start, n)
                    if span is not None:
                        prompt_spans.append((row, *span))
            except (ValueError, TypeError, OverflowError, IndexError) as e:
                failed[row] = f"preparing the step: {type(e).__name__}: {e}"
        sample_rows = [i for i, (x, d) in enumerate(zip(batch.samples, batch.num_drafts, strict=True))
                       if x and d == HOST_PLACED]
        settings, bad = self.sampler.plan([batch.requests[i] for i in sample_rows])
        failed.update({sample_rows[j]: msg for j, msg in bad.items()})
        if spec is not None and spec.verify:
            spec.settings, bad = self.sampler.plan([batch.requests[row] for row, _, _ in spec.verify])
            failed.update({spec.verify[j][0]: msg for j, msg in bad.items()})
        if failed:
            raise RequestFailures(failed)
        self.clock.mark("pack")
        positions = np.repeat(starts - query_start[:-1], counts) + np.arange(T)   # start_i + offset in row i
        logits_indices = query_start[1:][sample_rows] - 1 if sample_rows else np.zeros(0, np.int64)
        if spec is not None and spec.verify:   # every position of a verify row: k + 1 logits rows
            verify_idx = (np.asarray([q0 for _, q0, _ in spec.verify], np.int64)[:, None]
                          + np.arange(spec.k + 1)).ravel()
            logits_indices = np.concatenate([np.asarray(logits_indices, np.int64), verify_idx])
        widths = [len(t) for t in batch.block_tables]
        width = max(widths)
        if min(widths) == width:   # no padding (one row, or rows of one length): the ids, row after row
            tables = np.fromiter(chain.from_iterable(batch.block_tables), np.int32, S * width).reshape(S, width)
        else:
            # padding: the scratch block no request owns (only positions inside a row's table are read);
            # the rows' ids filled in row-major order in one assignment
            tables = np.full((S, width), self.kv_pool.num_blocks - 1, np.int32)
            tables[np.arange(width) < np.asarray(widths)[:, None]] = np.fromiter(
                chain.from_iterable(batch.block_tables), np.int32, sum(widths))
        sample_slots = np.fromiter((self.slot_of(batch.requests[i].request_id) for i in sample_rows), np.int64,
                                   len(sample_rows))
        seq_lens, positions = ends.astype(np.int32), positions.astype(np.int64)
        logits_indices = np.asarray(logits_indices, np.int64)
        # staged in this order: slots, query starts, lengths, tables, ids, positions, logits rows, sample slots
        arrays: list[np.ndarray] = [slots, query_start, seq_lens, tables, ids, positions, logits_indices, sample_slots]
        staged: list[torch.Tensor] = []
        extend_graph = self._extend_graph(T, S, len(logits_indices), bool(prompt_spans), graph_size)
        if extend_graph is not None:   # into the graph's buffers; their views stand for the step's tensors
            g = self.graphs
            assert g is not None
            # the sample slots ride in the same copy unless the step's sampling may be deferred past
            # the next step's copy (grammar rows: ``launch``'s defer_sampling)
            ride = self.guided is None or not self.guided.has_grammar([batch.requests[i] for i in sample_rows])
            g.stage_extend(extend_graph, ids, positions, slots, query_start, seq_lens, tables, logits_indices,
                           sample_slots if ride else None)
            staged = [g.e_slots[:T], g.e_query_start[:S + 1], g.e_seq_lens[:S], g.e_block_tables[:S, :tables.shape[1]],
                      g.e_ids[:T], g.e_positions[:T], g.e_logits_indices[:len(logits_indices)]]
            if ride:
                staged.append(g.e_sample_slots[:len(sample_slots)])
            arrays = arrays[len(staged):]
        if gather_dst:
            arrays += [np.asarray(gather_dst, np.int64), np.asarray(gather_slot, np.int64)]
        if tails is not None:
            arrays.append(tails)
        lora = self._lora_slots(batch, counts)
        if lora is not None:
            arrays += lora[0]
        if arrays:
            staged += self.stage(arrays)
        self.clock.mark("stage")
        meta = AttentionMetadata(
            slot_mapping=staged[0],
            query_start=staged[1],
            seq_lens=staged[2],
            block_tables=staged[3],
            max_query_len=max(batch.num_scheduled_tokens),
            max_seq_len=int(ends.max()),
            tokens_per_block=B,
            is_decode_only=T == S,
            num_decode_rows=0 if T == S else _leading_decode_rows(counts),
        )
        inputs = StepInputs(staged[4], staged[5], meta, staged[6], sample_rows, settings, staged[7],
                            extend_graph=extend_graph)
        if gather_dst:
            inputs.gather_dst, inputs.gather_slot = staged[8], staged[9]
        if tails is not None:
            inputs.tails = staged[10 if gather_dst else 8]
        if lora is not None:
            inputs.lora_slots, inputs.lora_clear = staged[len(staged) - len(lora[0])], lora[1]
            inputs.lora_groups = staged[-1] if len(lora[0]) == 2 else None
        if prompt_spans:
            inputs.prompt_logprobs = self._prompt_rows(batch, prompt_spans, query_start)
        if spec is not None and (spec.verify or spec.first or spec.prompt or spec.cached):
            assert self.spec is not None
            inputs.spec = spec.build(self.spec, sample_rows, int(ends.max()), meta.block_tables, batch.propose,
                                     self.stage)
        return inputs

    def _lora_slots(self, batch: ScheduledBatch, counts: np.ndarray) -> tuple[list[np.ndarray], bool] | None:
        """([each token's adapter slot (-1: none), and their grouped kernels' metadata where those
        may run the step], whether no token has an adapter), the step's adapters written into
        slots; None where neither this step nor the last step that wrote the mask has a token
        with an adapter (the mask stays zero)."""
        if self.lora is None or self.model.lora is None:
            return None
        ids = [r.lora_id for r in batch.requests]
        clear = not any(ids)
        if clear and self._lora_mask_clear:
            return None
        slots = np.repeat(np.asarray(self.lora.slots(ids), np.int64), counts)
        groups = self.model.lora.groups(slots)
        return ([slots] if groups is None else [slots, groups]), clear

    def _prompt_rows(self, batch: ScheduledBatch, spans: list[tuple[int, int, int, int]],
                     query_start: np.ndarray) -> PromptLogprobRows:
        indices, targets = [], []
        for row, first, count, _ in spans:
            req, start = batch.requests[row], batch.num_computed_tokens[row]
            q = int(query_start[row]) + first - start
            indices.append(np.arange(q, q + count, dtype=np.int64))
            targets.append(np.asarray(req.prompt_token_ids[first + 1:first + 1 + count], np.int64))
        return PromptLogprobRows(spans, _tensor(np.concatenate(indices), self.device),
                                 _tensor(np.concatenate(targets), self.device))

    def _extend_graph(self, num_tokens: int, num_seqs: int, num_logits: int, prompt_logprobs: bool,
                      graph_size: int | None) -> int | None:
        """The extend graph a step replays (its token count), or None: not when the caller chose
        (``graph_size``), a decode graph holds the step, or it wants prompt logprobs or more
        logits rows than the graphs give."""
        g = self.graphs
        if g is None or graph_size is not None or prompt_logprobs or num_logits > g.extend_max_logits:
            return None
        if self._decode_graph(num_seqs, num_tokens == num_seqs, prompt_logprobs) is not None:
            return None
        return g.extend_size(num_tokens, num_seqs)

    def _decode_graph(self, num_seqs: int, decode_only: bool, prompt_logprobs: bool) -> int | None:
        """The decode graph a step replays unless the caller chose (its batch size), or None."""
        if self.graphs is None or not decode_only or prompt_logprobs:
            return None
        return self.graphs.graph_size(num_seqs)

    # -- running ---------------------------------------------------------------------------------
    def graphable(self, batch: ScheduledBatch) -> bool:
        """Whether a step could replay a CUDA graph: decode only (one token a row, every row
        sampling, no prompt logprobs) and a graph holds it."""
        return (self.graphs is not None and batch.is_decode_only and self.graphs.graph_size(len(batch)) is not None
                and all(r.sampling.prompt_logprobs is None for r in batch.requests))

    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch, inputs: StepInputs, graph_size: int | None = None) -> torch.Tensor:
        """Copies, forward, logits of the sampling rows: [S_sample, V] float32. Prompt
        log-probabilities, when the step has any, are left in ``self.last_prompt_logprobs``.
        ``graph_size``: replay that graph (attention DP, where every rank must replay the same
        size) or run eagerly (0); by default decided here."""
        if inputs.gather_dst is not None:
            inputs.input_ids[inputs.gather_dst] = self.token_buffer[inputs.gather_slot]
        if inputs.lora_slots is not None and self.model.lora is not None:
            self.model.lora.set_tokens(inputs.lora_slots, inputs.lora_groups, inputs.lora_clear)
            self._lora_mask_clear = inputs.lora_clear   # (once written: a step that failed before wrote nothing)
        if inputs.spec is not None and self.spec is not None:
            self.spec.place(inputs.spec, inputs.input_ids, inputs.positions, inputs.meta)
        self.run_copies(batch)
        self.last_prompt_logprobs = None
        logits = self._target_forward(batch, inputs, graph_size)
        if self.spec is not None:   # a draft's KV follows every target forward
            hidden = self.spec.proposer.after_forward(inputs.input_ids, inputs.positions, inputs.meta, inputs.tails)
            inputs.draft_hidden = hidden
            if inputs.spec is not None:
                inputs.spec.draft_hidden = hidden
        return logits

    def _target_forward(self, batch: ScheduledBatch, inputs: StepInputs, graph_size: int | None) -> torch.Tensor:
        if graph_size is None:
            graph_size = self._decode_graph(len(batch), inputs.meta.is_decode_only, inputs.prompt_logprobs is not None)
        if graph_size and self.graphs is not None:
            self.num_graph_steps += 1
            logits = self.graphs.run(len(batch), inputs.input_ids, inputs.positions, inputs.meta, graph_size)
            # rows in batch order; speculative rows sample after the others
            return logits[inputs.logits_indices] if inputs.spec is not None and inputs.sample_rows else logits
        if graph_size is None and inputs.extend_graph is not None and self.graphs is not None:   # inputs in place
            self.num_extend_graph_steps += 1
            return self.graphs.run_extend(inputs.extend_graph, inputs.logits_indices.shape[0])
        pieces = self.graphs.piecewise if self.graphs is not None and graph_size is None else None
        if pieces is not None and inputs.prompt_logprobs is None and inputs.spec is None:
            t = pieces.size(inputs.input_ids.shape[0])
            if t is not None:
                self.num_piecewise_steps += 1
                hidden = pieces.run(t, inputs.input_ids, inputs.positions, inputs.meta)
                return self._logits(hidden, inputs.logits_indices)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta, self.kv_pool.tensor)
        if inputs.prompt_logprobs is not None:
            self.last_prompt_logprobs = self._prompt_logprobs(hidden, inputs.prompt_logprobs)
        return self._logits(hidden, inputs.logits_indices)

    def pad_logits_to(self, sizes: list[int]) -> None:
        """Set once at build time: the row counts an eager step's output layer is padded to."""
        self.logits_rows = sorted(set(sizes))
        self._zero_rows = torch.zeros(self.logits_rows[-1] if self.logits_rows else 0, dtype=torch.long,
                                      device=self.device)

    def _logits(self, hidden: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """The output layer over the rows ``indices`` picks, outside a graph. Its row count is
        padded (with row 0, its logits then dropped) to the next of ``logits_rows``: the batch
        sizes the graphs were captured at, whose products the start-up ran eagerly. A product
        of a row count never seen may take a kernel not loaded yet, and loading one waits until
        the device has run everything queued (CUDA's lazy loading): the host then stops running
        ahead of an eager step, and the device idles for the host's next step."""
        n = indices.shape[0]
        size = padded_rows(n, self.logits_rows)
        if 0 < n < size:   # (a step that samples nothing keeps its empty product)
            indices = torch.cat([indices, self._zero_rows[:size - n]])
        return self.model.compute_logits(hidden[indices])[:n]

    def _prompt_logprobs(self, hidden: torch.Tensor, rows: PromptLogprobRows) -> PromptLogprobs:
        """Log-softmax over the prompt positions' logits, a slice of rows at a time (a long
        prompt's [N, V] float32 logits would not fit at once)."""
        k = max(span[3] for span in rows.spans)
        chosen, ranks, top_ids, top_vals = [], [], [], []
        for lo in range(0, rows.indices.shape[0], PROMPT_LOGPROB_ROWS):
            idx = rows.indices[lo:lo + PROMPT_LOGPROB_ROWS]
            lp = self.model.compute_logits(hidden[idx])[:, :self.sampler.vocab_size].log_softmax(dim=-1)
            chosen.append(lp.gather(1, rows.targets[lo:lo + PROMPT_LOGPROB_ROWS, None]).squeeze(1))
            ranks.append(logprob_ranks(lp, chosen[-1]))
            vals, ids = lp.topk(min(k, lp.shape[1]), dim=-1)
            top_ids.append(ids)
            top_vals.append(vals)
        return PromptLogprobs(rows.spans, torch.cat(chosen), torch.cat(ranks), torch.cat(top_ids),
                              torch.cat(top_vals))

    def _on_stream(self) -> contextlib.AbstractContextManager:
        if self.stream is None:
            return contextlib.nullcontext()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self.stream)

    @torch.inference_mode()
    def run_copies(self, batch: ScheduledBatch) -> None:
        """The step's KV block copies (partial reuse, the host tier's moves), once, whatever
        becomes of its rows: the tree moved those blocks when the step was scheduled, so a step
        whose rows all fail before the forward still runs them (``batch.without`` keeps the list)."""
        ops = batch.copy_ops
        if not ops or ops is self._copied:
            return
        if ops is self._copying:   # they failed part of the way: running them again could copy wrong rows
            raise RuntimeError("this step's KV block copies failed part of the way")
        self._copying = ops
        with self._on_stream():
            self.kv_pool.copy_blocks(ops)
            if self.spec is not None:
                self.spec.proposer.copy_blocks(ops)
        self._copied, self._copying = ops, None

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, graph_size: int | None = None,
               defer_sampling: bool = False) -> InFlightStep:
        """Queue one step on the device; returns without waiting for it. ``graph_size``: as
        ``forward``'s. With ``defer_sampling``, a step with grammar rows queues only its forward:
        its grammars cannot mask tokens before they have seen the previous step's, so the caller
        reads that step, then calls ``finish_sampling`` (the overlap loop)."""
        with self._on_stream():
            timing = self.stream is not None and self.record_timing
            start = _event(timing)
            self.run_copies(batch)   # (before ``prepare``, which may fail rows)
            inputs = self.prepare(batch, graph_size)
            self.clock.mark("prepare")
            logits = self.forward(batch, inputs, graph_size)
            self.clock.mark("forward")
            step = InFlightStep(batch, inputs.sample_rows, None, None, prompt_logprobs=self.last_prompt_logprobs,
                                pending=(logits, inputs.sampling, inputs.sample_slots), start=start, spec=inputs.spec,
                                head_rows=self._head_rows(inputs))
            waits = defer_sampling and self.guided is not None and self.guided.has_grammar(self._sampling(step))
            if not waits:
                self._sample(step)
            return step

    def _head_rows(self, inputs: StepInputs) -> SampledRows | None:
        """An EAGLE-3 head's entries of the step's plain sampling rows, taken now: once their token
        is sampled, each row's last entry takes it (``write_sampled``)."""
        if inputs.draft_hidden is None or not inputs.sample_rows:
            return None
        from phalanx.pyexecutor.speculative import SampledRows
        last = inputs.logits_indices[:len(inputs.sample_rows)]      # (plain rows first, then verify rows)
        return SampledRows(inputs.positions[last], inputs.draft_hidden[last], inputs.meta.slot_mapping[last])

    @torch.inference_mode()
    def finish_sampling(self, step: InFlightStep) -> None:
        """Queue the sampling of a step launched with its sampling deferred."""
        if step.pending is not None:
            with self._on_stream():
                self._sample(step)

    def _sampling(self, step: InFlightStep) -> list[Request]:
        return [step.batch.requests[i] for i in step.sample_rows]

    def _sample(self, step: InFlightStep) -> None:
        assert step.pending is not None
        (logits, settings, slots), step.pending = step.pending, None
        plain = len(step.sample_rows)
        if step.sample_rows:
            requests = self._sampling(step)
            bitmask = self.guided.bitmask(requests, logits.device) if self.guided is not None else None
            sampled = self.sampler.sample(logits[:plain], requests, settings, bitmask)
            if self.tp.size > 1:  # every rank must append the same tokens: rank 0's win
                torch.distributed.broadcast(sampled.token_ids, src=0, group=self.tp.group)
            self.token_buffer[slots] = sampled.token_ids
            step.sampled, step.host_tokens = sampled, _to_host(sampled.token_ids)
            if step.head_rows is not None:   # (set only with an EAGLE-3 head)
                assert self.spec is not None
                cast("Eagle3Proposer", self.spec.proposer).write_sampled(step.head_rows, sampled.token_ids)
        if step.spec is not None:
            self._verify_and_propose(step, logits[plain:])
        end = _event(step.start is not None)
        step.ready = _event(self.stream is not None)
        if step.start is not None and end is not None:
            self.timings.append((step.start, end))
            self.timing_shapes.append(step_shape(step.batch))

    def _verify_and_propose(self, step: InFlightStep, verify_logits: torch.Tensor) -> None:
        """Accept the verify rows' drafts, move every speculative row's device state on, and
        start copying the accepted tokens to the host."""
        spec, decoder = step.spec, self.spec
        assert spec is not None and decoder is not None
        if spec.verify_rows:
            assert spec.drafts is not None and spec.settings is not None
            tokens, accepted = decoder.verify(verify_logits, spec.drafts, spec.settings, self.sampler,
                                              spec.verify_slots)
            both = torch.cat([tokens, accepted[:, None]], dim=1)   # [Sv, k + 2]: one collective, one copy
            if self.tp.size > 1:   # every rank appends rank 0's tokens
                torch.distributed.broadcast(both, src=0, group=self.tp.group)
            spec.tokens, spec.accepted = both[:, :-1], both[:, -1]
            spec.host = _to_host(both)
        first = step.sampled.token_ids[spec.first_sample_idx] if spec.first_rows and step.sampled is not None else None
        decoder.advance(spec, first)

    def collect(self, step: InFlightStep) -> StepResult:
        """Wait for a launched step's tokens on the host (after the next step is launched)."""
        self.finish_sampling(step)
        tokens: list[int | list[int] | None] = [None] * len(step.batch)
        logprobs = None
        spec_host = step.spec.host if step.spec is not None else None
        if step.ready is not None and (step.sampled is not None or spec_host is not None):
            step.ready.synchronize()
        if spec_host is not None:
            assert step.spec is not None
            for row, values in zip(step.spec.verify_rows, spec_host.tolist(), strict=True):
                tokens[row] = values[:values[-1]]
        if step.sampled is not None:
            assert step.host_tokens is not None
            for i, t in zip(step.sample_rows, step.host_tokens.tolist(), strict=True):
                tokens[i] = t
            lp = step.sampled.host_logprobs()
            if lp is not None:
                logprobs = [None] * len(step.batch)
                for i, x in zip(step.sample_rows, lp, strict=True):
                    logprobs[i] = x
        prompt = step.prompt_logprobs.host() if step.prompt_logprobs is not None else None
        return StepResult(tokens, logprobs, prompt)

    @torch.inference_mode()
    def padding_step(self, graph_size: int) -> None:
        """An attention-DP rank with nothing to decode replays the others' graph size on padding."""
        assert self.graphs is not None
        self.num_graph_steps += 1
        if self.stream is None:
            return self.graphs.run_padding(graph_size)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self.graphs.run_padding(graph_size)

    @torch.inference_mode()
    def dummy_step(self) -> None:
        """A forward over one token in the scratch block no request owns (attention-DP ranks
        without work still have to join the MoE layers' collectives). Its inputs are made on the
        first call and kept: made anew from host lists, each would wait for the stream."""
        if self._dummy is None:
            dev, B = self.device, self.tokens_per_block
            scratch = self.kv_pool.num_blocks - 1
            i32 = torch.int32
            meta = AttentionMetadata(slot_mapping=torch.tensor([scratch * B], device=dev),
                                     query_start=torch.tensor([0, 1], dtype=i32, device=dev),
                                     seq_lens=torch.tensor([1], dtype=i32, device=dev),
                                     block_tables=torch.tensor([[scratch]], dtype=i32, device=dev), max_query_len=1,
                                     max_seq_len=1, tokens_per_block=B, is_decode_only=True)
            self._dummy = (torch.zeros(1, dtype=torch.long, device=dev), meta)
        zero, meta = self._dummy   # its attention plans (meta.cache) hold for every dummy step
        self.model(zero, zero, meta, self.kv_pool.tensor)

    def execute(self, batch: ScheduledBatch) -> StepResult:
        """Run one step synchronously and return host-side results."""
        return self.collect(self.launch(batch))

    def align_marker(self) -> dict[str, float]:
        """A kernel run on an idle device, and the host time (``time.monotonic``) at which the
        wait for its end returned: a profile started just before holds it as its last leading
        ``spin_kernel``, whose end then places the host's stamped marks (HostClock's trace) on
        the profile's clock to within the wait's wake-up (tools/profile_gaps.py). The end, not
        the start: the first launches under a new profile can start milliseconds late. One
        kernel goes first, so that the profiler's set-up is paid before the marker."""
        if self.device.type != "cuda":
            return {"monotonic": time.monotonic()}
        torch.cuda._sleep(1000)
        torch.cuda.synchronize(self.device)
        torch.cuda._sleep(1000)
        torch.cuda.synchronize(self.device)
        return {"monotonic": time.monotonic()}

    def allocator_counts(self) -> dict[str, int]:
        """The caching allocator's counters that mean a device call in a step: cudaMalloc
        and cudaFree calls, and retries (a failed cudaMalloc that freed the cache, which waits
        for the device)."""
        if self.device.type != "cuda":
            return {}
        st = torch.cuda.memory_stats(self.device)
        return {k: int(st.get(k, 0)) for k in ("num_alloc_retries", "num_device_alloc", "num_device_free")}

    def idle_fraction(self) -> dict[str, float]:
        """From the recorded CUDA events: busy time, gaps between consecutive steps, idle share."""
        if len(self.timings) < 2:
            return {"steps": len(self.timings), "idle_fraction": float("nan")}
        torch.cuda.synchronize(self.device)
        times = [s.elapsed_time(e) for s, e in self.timings]
        busy = sum(times)
        gaps = [max(0.0, e0.elapsed_time(s1)) for (_, e0), (s1, _) in pairwise(self.timings)]
        total = self.timings[0][0].elapsed_time(self.timings[-1][1])
        return {"steps": len(self.timings), "busy_ms": busy, "gap_ms": sum(gaps), "span_ms": total,
                "idle_fraction": sum(gaps) / total if total > 0 else float("nan"),
                "mean_gap_ms": sum(gaps) / len(gaps),
                "last_steps_ms": [round(t, 3) for t in times[-STEPS_REPORTED:]],
                "slowest_steps": [[i, round(times[i], 3), *self.timing_shapes[i]] for i in
                                  sorted(range(len(times)), key=times.__getitem__)[-SLOWEST_REPORTED:][::-1]],
                "by_kind": self._steps_by_kind(),
                "decode_by_rows": self._steps_by_kind(DECODE_ROWS_BIN)}

    def _steps_by_kind(self, rows_bin: int = 0) -> dict[str, dict[str, float]]:
        """The timed steps' GPU time split by what they carried (``step_shape``): ``decode``
        (rows past their prompts only) and ``prompt`` (some prompt tokens, with or without decode
        rows); per kind the steps, their GPU ms, decode rows, prompt tokens and the decode rows'
        context. With ``rows_bin`` the decode steps alone, by their rows: the key is the first
        row count of a bin of ``rows_bin`` (so a decode step's cost per row shows at each batch)."""
        out: dict[str, dict[str, float]] = {}
        for (s, e), (rows, tokens, context) in zip(self.timings, self.timing_shapes, strict=True):
            if rows_bin and tokens:
                continue
            key = str(rows // rows_bin * rows_bin) if rows_bin else "prompt" if tokens else "decode"
            k = out.setdefault(key, {"steps": 0, "gpu_ms": 0.0, "decode_rows": 0, "prompt_tokens": 0,
                                     "context_tokens": 0})
            k["steps"] += 1
            k["gpu_ms"] += s.elapsed_time(e)
            k["decode_rows"] += rows
            k["prompt_tokens"] += tokens
            k["context_tokens"] += context
        return out


PROMPT_LOGPROB_ROWS = 1024
STEPS_REPORTED = 256     # the last steps whose GPU time idle_fraction lists one by one
SLOWEST_REPORTED = 8     # and the slowest: [step, GPU ms, decode rows, prompt tokens, decode context]
DECODE_ROWS_BIN = 64     # decode steps grouped by their rows in bins this wide


@dataclass
class _SpecRows:
    """Speculative rows found while packing a step (host lists; ``build`` makes the SpecStep)."""

    verify: list[tuple[int, int, int]] = field(default_factory=list)        # (row, first packed row, slot)
    k: int = 0                                                              # the drafts each verifies
    settings: list[RowSettings] | None = None                               # the verify rows' sampling
    first: list[tuple[int, int, int, int, int]] = field(default_factory=list)   # (row, L after it, limit, slot,
    #                                                                               its last packed row)
    prompt: list[tuple[int, int, int, int]] = field(default_factory=list)   # (first packed row, n, position, slot)
    cached: list[tuple[list[int], int, int]] = field(default_factory=list)  # (tokens, first position, slot)

    def build(self, decoder: SpecDecoder, sample_rows: list[int], max_end: int, block_tables: torch.Tensor,
              propose: bool, stage: Staging) -> SpecStep:
        """The SpecStep, its integer columns sent to the device in one copy."""
        from phalanx.pyexecutor.speculative import SpecStep
        where = {row: j for j, row in enumerate(sample_rows)}
        verify_rows, first_rows = [r[0] for r in self.verify], [r[0] for r in self.first]
        cols: list[np.ndarray] = [
            np.asarray(verify_rows + first_rows, np.int64), np.asarray([r[1] for r in self.verify], np.int64),
            np.asarray([r[2] for r in self.verify], np.int64), np.asarray([where[r] for r in first_rows], np.int64),
            np.asarray([r[3] for r in self.first], np.int64), np.asarray([r[1] for r in self.first], np.int64),
            np.asarray([r[2] for r in self.first], np.int64), np.asarray([r[4] for r in self.first], np.int64)]
        history = bool(self.prompt)   # filled for NGram only
        if history:
            cols += [np.concatenate([np.arange(q0, q0 + n) for q0, n, _, _ in self.prompt]),
                     np.concatenate([np.full(n, s, np.int64) for _, n, _, s in self.prompt]),
                     np.concatenate([np.arange(p, p + n) for _, n, p, _ in self.prompt])]
        cached = bool(self.cached)
        if cached:    # tokens, slots, positions of the prefix-cache hits
            cols += [np.concatenate([np.asarray(t, np.int64) for t, _, _ in self.cached]),
                     np.concatenate([np.full(len(t), s, np.int64) for t, _, s in self.cached]),
                     np.concatenate([np.arange(p, p + len(t)) for t, p, _ in self.cached])]
        parts = stage([c.astype(np.int64) for c in cols])
        step = SpecStep(
            verify_rows=verify_rows, table_rows=parts[0], verify_q0=parts[1], verify_slots=parts[2],
            first_rows=first_rows, first_sample_idx=parts[3], first_slots=parts[4], first_length=parts[5],
            first_limit=parts[6], first_last_row=parts[7], max_length=max_end + decoder.k + 1,
            block_tables=block_tables, k=self.k, propose=propose, settings=self.settings)
        if history:
            step.prompt_src, step.prompt_slot, step.prompt_pos = parts[8], parts[9], parts[10]
        if cached:
            step.cached_tokens, step.cached_slot, step.cached_pos = parts[-3], parts[-2], parts[-1]
        return step


def _prompt_logprob_span(req, start: int, n: int) -> tuple[int, int, int] | None:
    """(first position, count, top-k) of the prompt positions in ``[start, start + n)`` whose
    log-probabilities the request still needs, or None. Position p predicts prompt token
    p + 1, so positions run up to the second-to-last prompt token; positions already reported
    (before a preemption, say) are not computed again."""
    k = req.sampling.prompt_logprobs
    if k is None:
        return None
    first = max(start, req.num_prompt_logprobs)
    last = min(start + n, req.num_prompt_tokens - 1)
    return (first, last - first, k) if last > first else None


def _leading_decode_rows(counts: np.ndarray) -> int:
    """How many leading rows of a mixed step compute one position each (its decode rows, which
    attention runs apart: AttentionMetadata.num_decode_rows); 0 unless some rows have more."""
    ones = counts == 1
    return 0 if ones.all() else int(ones.argmin())


def _event(enabled: bool) -> torch.cuda.Event | None:
    if not enabled:
        return None
    e = torch.cuda.Event(enable_timing=True)
    e.record()
    return e


def _to_host(t: torch.Tensor) -> torch.Tensor:
    if t.device.type == "cpu":
        return t
    return t.to("cpu", non_blocking=True)  # pinned by the caching host allocator


class Staging:
    """Host arrays -> device tensors of the same dtypes and shapes, through pinned host buffers
    and device buffers kept for the runner's life: one copy a call and nothing allocated (a fresh
    pinned buffer, a device buffer and three tensor ops per array would cost a step ~0.3 ms of
    host time on an H200's host).

    The buffers form a ring of SLOTS (host, device) pairs. A slot's host buffer is written again
    only once its last copy has finished (its event: with at most two steps in flight and two
    calls a step, an event long reached); its device buffer is overwritten by a copy queued on the
    same stream as every reader of the last contents, so after them. A call larger than its slot
    gets a larger pair (the old ones are freed when their copies and readers are done, as any
    tensor)."""

    SLOTS = 8
    MIN_BYTES = 64 << 10

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._slots: list[tuple[torch.Tensor, np.ndarray, torch.Tensor, torch.cuda.Event] | None] = [None] * self.SLOTS
        self._next = 0

    def __call__(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        if self.device.type == "cpu":
            return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
        # the arrays of each dtype back to back, widest first (each stays aligned): a view and a
        # split per dtype give them all, so a call costs a few tensor ops, not three per array
        groups: dict[np.dtype, list[int]] = {}
        for j in sorted(range(len(arrays)), key=lambda j: -arrays[j].itemsize):
            groups.setdefault(arrays[j].dtype, []).append(j)
        spans, total = [], 0
        for dtype, members in groups.items():
            nbytes = sum(arrays[j].nbytes for j in members)
            spans.append((dtype, members, total, nbytes))
            total += nbytes
        i, self._next = self._next, (self._next + 1) % self.SLOTS
        slot = self._slots[i]
        if slot is None or slot[0].numel() < total:
            size = max(self.MIN_BYTES, 1 << max(0, total - 1).bit_length())
            host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            slot = self._slots[i] = (host, host.numpy(), torch.empty(size, dtype=torch.uint8, device=self.device),
                                     torch.cuda.Event())
        else:
            slot[3].synchronize()
        host, raw, dev, done = slot
        o = 0
        for _, members, _, _ in spans:
            for j in members:
                a = arrays[j]
                raw[o:o + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
                o += a.nbytes
        dev[:total].copy_(host[:total], non_blocking=True)
        done.record()
        out: list[torch.Tensor] = [dev] * len(arrays)
        for dtype, members, offset, nbytes in spans:
            parts = dev[offset:offset + nbytes].view(_TORCH_DTYPES[dtype]).split([arrays[j].size for j in members])
            for j, t in zip(members, parts, strict=True):
                out[j] = t if arrays[j].ndim == 1 else t.view(arrays[j].shape)
        return out


_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}


def _tensor(values: np.ndarray | list, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    t = torch.from_numpy(values) if isinstance(values, np.ndarray) else torch.tensor(values, dtype=dtype or torch.long)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)
