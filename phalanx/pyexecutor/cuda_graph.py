"""CUDA graphs for decode steps and for small prefill / extend steps.

At start-up one graph per batch size in ``cuda_graph_config`` is captured over persistent input
buffers (token ids, positions, slots, sequence lengths, block tables). A decode step of n
requests copies its inputs into the first n rows, pads up to the next captured size (padding
rows attend to one token of a scratch block no request owns) and replays the graph.

Steps that are not decode-only (a prompt, a prompt's chunk, new tokens after a cached prefix,
mixed with decodes) replay an *extend* graph when they have at most ``extend_max_seqs``
sequences and at most the largest of ``extend_sizes`` tokens: one graph per token count T, each
over ``extend_max_seqs + 1`` sequence rows. The step's tokens fill the first rows; the padding up
to T forms one more sequence of its own, over the scratch block only, and the rows left over
are empty sequences, which the extend attention kernel skips (its grid covers T queries of
every row; a row's programs beyond its query length return at once). Only the rows that sample
are turned into logits. Such steps are short on the device, so eagerly their ~300 kernel
launches (host-bound) would cost more than the kernels themselves.

Larger steps — more sequences than an extend graph holds (a prompt's chunk among decoding
requests), or more tokens — replay *piecewise* graphs (``PiecewiseGraphs``) when they have at
most the largest of ``piecewise_sizes`` tokens: everything but attention is captured, one graph
per stretch between two attention calls, and attention runs eagerly between the replays with
the step's own metadata (whatever its rows). Anything else — steps with prompt logprobs or
speculative rows, mixture-of-experts models — runs eagerly.

An extend step's inputs do not pass through tensors of their own: ``ModelRunner.prepare`` writes
them, already padded as the graph reads them, into pinned host memory laid out as the graphs'
input buffer, and one copy brings them over (``GraphInputs``) — not a copy or a fill per tensor,
a dozen small device calls on the host's path to a prefix hit's first token.
"""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from phalanx.kernels.metadata import AttentionMetadata

if TYPE_CHECKING:
    from phalanx.models.llama import CausalLM

logger = logging.getLogger("phalanx")
# graphs are captured again on wake_up inside a running process (the in-process engine shares it
# with the user's threads): only this thread's calls must keep off the device during a capture
CAPTURE_MODE = "thread_local"


class GraphInputs:
    """A graph's static inputs as views of one device buffer, written through pinned host
    memory of the same layout: a step writes its inputs, padded as the graph reads them, into
    ``host()`` and ``send()`` brings the whole buffer over in one copy.

    Two host copies take turns; one is written again only once its last copy is done (an
    event), so the host prepares a step while the device may still be copying the one before.
    Each step writes every element its graph reads; what it does not write (block-table
    columns past a row's blocks) keeps an older step's values and is never read."""

    def __init__(self, fields: list[tuple[str, tuple[int, ...], torch.dtype]], device: torch.device) -> None:
        layout, total = [], 0
        for name, shape, dtype in sorted(fields, key=lambda f: -f[2].itemsize):   # widest first: aligned
            nbytes = math.prod(shape) * dtype.itemsize
            layout.append((name, shape, dtype, total, nbytes))
            total += nbytes
        self.buffer = torch.zeros(total, dtype=torch.uint8, device=device)
        self.views = {name: self.buffer[o:o + n].view(dtype).view(shape) for name, shape, dtype, o, n in layout}
        cuda = device.type == "cuda"
        self._host: list[tuple[torch.Tensor, dict[str, np.ndarray], torch.cuda.Event | None]] = []
        for _ in range(2):
            host = torch.zeros(total, dtype=torch.uint8, pin_memory=cuda)
            raw = host.numpy()
            arrays = {name: raw[o:o + n].view(_NP_DTYPES[dtype]).reshape(shape) for name, shape, dtype, o, n in layout}
            self._host.append((host, arrays, torch.cuda.Event() if cuda else None))
        self._turn = 0

    def mirror(self) -> None:
        """Both host copies take the device buffer's contents (after the buffer's views were
        given their first values on the device)."""
        for host, _, _ in self._host:
            host.copy_(self.buffer)

    def host(self) -> dict[str, np.ndarray]:
        """The host copy this step writes (by field name), once its last copy is done."""
        _, arrays, done = self._host[self._turn]
        if done is not None:
            done.synchronize()
        return arrays

    def send(self) -> None:
        """Queue the copy of what ``host()`` gave to the device buffer (current stream)."""
        host, _, done = self._host[self._turn]
        self.buffer.copy_(host, non_blocking=True)
        if done is not None:
            done.record()
        self._turn ^= 1


_NP_DTYPES = {torch.int64: np.int64, torch.int32: np.int32}


class CudaGraphRunner:
    def __init__(self, model: CausalLM, kv_tensor: torch.Tensor, sizes: list[int], max_blocks_per_seq: int,
                 tokens_per_block: int, max_seq_len: int, scratch_block: int, enable_padding: bool,
                 device: torch.device, extend_sizes: list[int] | None = None, extend_max_seqs: int = 8,
                 logits_per_seq: int = 1, piecewise_sizes: list[int] | None = None) -> None:
        self.model, self.kv_tensor, self.device = model, kv_tensor, device
        self.sizes = sorted(set(sizes))
        self.enable_padding = enable_padding
        self.scratch_block = scratch_block
        self.tokens_per_block = tokens_per_block
        n = self.max_size = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), scratch_block * tokens_per_block, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.query_start = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.full((n, max_blocks_per_seq), scratch_block, dtype=torch.int32, device=device)
        self.max_seq_len = max_seq_len
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.metas: dict[int, AttentionMetadata] = {}
        self.capture_seconds = 0.0
        # extend graphs: T tokens over extend_max_seqs + 1 sequence rows (the last for padding)
        self.extend_sizes = sorted({t for t in extend_sizes or [] if 1 < t <= max_seq_len})
        self.extend_max_seqs = extend_max_seqs
        # rows of logits an extend graph returns: one a sequence, k + 1 for speculative verify rows
        self.extend_max_logits = extend_max_seqs * logits_per_seq if self.extend_sizes else 0
        if self.extend_sizes:
            tmax, rows = self.extend_sizes[-1], extend_max_seqs + 1
            self.e_inputs = GraphInputs([("ids", (tmax,), torch.long), ("positions", (tmax,), torch.long),
                                         ("slots", (tmax,), torch.long),
                                         ("logits_indices", (self.extend_max_logits,), torch.long),
                                         ("sample_slots", (self.extend_max_logits,), torch.long),
                                         ("query_start", (rows + 1,), torch.int32), ("seq_lens", (rows,), torch.int32),
                                         ("block_tables", (rows, max_blocks_per_seq), torch.int32)], device)
            v = self.e_inputs.views
            self.e_ids, self.e_positions, self.e_slots = v["ids"], v["positions"], v["slots"]
            self.e_query_start, self.e_seq_lens = v["query_start"], v["seq_lens"]
            self.e_block_tables = v["block_tables"]
            self.e_logits_indices = v["logits_indices"]
            # not a graph input: the sampling rows' request slots ride along in the same copy for the
            # sampler queued right after the replay (``ModelRunner.prepare`` says when they may)
            self.e_sample_slots = v["sample_slots"]
            # the padding sequence's tokens: positions 0.. in the scratch block
            self.e_pad_positions = np.arange(tmax, dtype=np.int64)
            self.e_pad_slots = scratch_block * tokens_per_block + self.e_pad_positions % tokens_per_block
            self.e_positions.copy_(torch.from_numpy(self.e_pad_positions))
            self.e_slots.copy_(torch.from_numpy(self.e_pad_slots))
            self.e_block_tables.fill_(scratch_block)
            self.e_inputs.mirror()
        self.extend_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.extend_outputs: dict[int, torch.Tensor] = {}
        self.piecewise = (PiecewiseGraphs(model, kv_tensor, piecewise_sizes, scratch_block * tokens_per_block,
                                          tokens_per_block, device) if piecewise_sizes else None)

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(slot_mapping=self.slot_mapping[:bs], query_start=self.query_start[:bs + 1],
                                 seq_lens=self.seq_lens[:bs], block_tables=self.block_tables[:bs],
                                 max_query_len=1, max_seq_len=self.max_seq_len, tokens_per_block=self.tokens_per_block,
                                 is_decode_only=True)

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.monotonic()
        pool = None
        stream = torch.cuda.Stream(self.device)
        lora = getattr(self.model, "lora", None)
        if lora is not None:   # the warm-up steps below read the LoRA step buffers: none may name a token past them
            lora.reset_tokens()
        for bs in reversed(self.sizes):          # largest first: smaller graphs reuse its memory
            meta = self.metas[bs] = self._meta(bs)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream), self.model.padded_step(bs):
                for _ in range(2):               # compile kernels and settle the allocator outside the graph
                    self._forward(bs, meta)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode=CAPTURE_MODE), \
                    self.model.padded_step(bs):
                self.outputs[bs] = self._forward(bs, meta)
            pool = graph.pool()
            self.graphs[bs] = graph
        pool = None          # the extend graphs' own pool: nothing of theirs aliases a decode graph's
        empty = np.zeros(0, np.int64)
        for t in reversed(self.extend_sizes):
            meta = self._extend_meta(t)
            # every token in the padding row: a valid step
            self.stage_extend(t, empty, empty, empty, np.zeros(1, np.int32), empty, np.zeros((0, 0), np.int32), empty)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._extend_forward(t, meta)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode=CAPTURE_MODE):
                self.extend_outputs[t] = self._extend_forward(t, meta)
            pool = graph.pool()
            self.extend_graphs[t] = graph
        if self.piecewise is not None:
            self.piecewise.capture(stream)
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.monotonic() - t0
        logger.info("captured %d CUDA graphs (batch sizes %s; extend token counts %s; piecewise token counts %s) "
                    "in %.1fs", len(self.graphs) + len(self.extend_graphs), self.sizes, self.extend_sizes,
                    self.piecewise.sizes if self.piecewise is not None else [], self.capture_seconds)

    def release(self) -> None:
        """Drop the graphs and their memory pool (``capture`` makes them again; the engine's
        sleep does this, since the weights and the KV cache come back at other addresses)."""
        for graph in [*self.graphs.values(), *self.extend_graphs.values()]:
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()
        self.metas.clear()
        self.extend_graphs.clear()
        self.extend_outputs.clear()
        if self.piecewise is not None:
            self.piecewise.release()

    def _forward(self, bs: int, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.model(self.input_ids[:bs], self.positions[:bs], meta, self.kv_tensor)
        return self.model.compute_logits(hidden)

    def _extend_meta(self, t: int) -> AttentionMetadata:
        # most rows are empty: attention plans for one sequence with tokens
        return AttentionMetadata(slot_mapping=self.e_slots[:t], query_start=self.e_query_start,
                                 seq_lens=self.e_seq_lens, block_tables=self.e_block_tables, max_query_len=t,
                                 max_seq_len=self.max_seq_len, tokens_per_block=self.tokens_per_block,
                                 plan_num_seqs=1)

    def _extend_forward(self, t: int, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.model(self.e_ids[:t], self.e_positions[:t], meta, self.kv_tensor)
        return self.model.compute_logits(hidden[self.e_logits_indices])

    def stage_extend(self, t: int, ids: np.ndarray, positions: np.ndarray, slots: np.ndarray, query_start: np.ndarray,
                     seq_lens: np.ndarray, block_tables: np.ndarray, logits_indices: np.ndarray,
                     sample_slots: np.ndarray | None = None) -> None:
        """Queue a step's inputs (n sequences, ``len(ids)`` tokens: the host arrays
        ``ModelRunner.prepare`` builds) into the extend graphs' buffers, padded to ``t`` tokens:
        tokens ``len(ids)..t`` form sequence n over the scratch block, and the rows after it are
        empty. One copy; the replay (``run_extend``) reads them. ``sample_slots`` ride along
        (``e_sample_slots``) until the next step's copy."""
        h = self.e_inputs.host()
        n, tokens, k = len(seq_lens), len(ids), len(logits_indices)
        pad = t - tokens
        h["ids"][:tokens] = ids
        h["ids"][tokens:t] = 0
        h["positions"][:tokens] = positions
        h["positions"][tokens:t] = self.e_pad_positions[:pad]
        h["slots"][:tokens] = slots
        h["slots"][tokens:t] = self.e_pad_slots[:pad]
        h["query_start"][:n + 1] = query_start
        h["query_start"][n + 1:] = t
        h["seq_lens"][:n] = seq_lens
        h["seq_lens"][n] = pad
        h["seq_lens"][n + 1:] = 0
        h["block_tables"][:n, :block_tables.shape[1]] = block_tables
        h["block_tables"][n] = self.scratch_block
        h["logits_indices"][:k] = logits_indices
        h["logits_indices"][k:] = 0   # rows of earlier steps may lie past a smaller graph's tokens
        if sample_slots is not None:
            h["sample_slots"][:len(sample_slots)] = sample_slots
        self.e_inputs.send()

    def extend_size(self, num_tokens: int, num_seqs: int) -> int | None:
        """The extend graph a step of ``num_tokens`` tokens over ``num_seqs`` sequences replays, or None."""
        if num_seqs > self.extend_max_seqs:
            return None
        for t in self.extend_sizes:
            if t >= num_tokens and t in self.extend_graphs:
                return t
        return None

    def run_extend(self, t: int, num_logits: int) -> torch.Tensor:
        """Replay the extend graph of ``t`` tokens over the inputs ``stage_extend`` queued;
        logits [num_logits, V]."""
        self.extend_graphs[t].replay()
        return self.extend_outputs[t][:num_logits]

    def graph_size(self, n: int) -> int | None:
        """The captured size a decode batch of n runs in, or None (eager)."""
        for bs in self.sizes:
            if bs in self.graphs and (bs == n or (self.enable_padding and bs > n)):
                return bs
        return None

    def run_padding(self, bs: int) -> None:
        """Replay the graph of size ``bs`` with padding rows only (an attention-DP rank with
        nothing to decode while the others replay theirs: the MoE collectives must line up)."""
        self.slot_mapping[:bs].fill_(self.scratch_block * self.tokens_per_block)
        self.seq_lens[:bs].fill_(1)
        self.block_tables[:bs, 0].fill_(self.scratch_block)
        self.positions[:bs].zero_()
        self.input_ids[:bs].zero_()
        self.graphs[bs].replay()

    def run(self, n: int, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            bs: int | None = None) -> torch.Tensor:
        """Copy a decode step's inputs into the buffers and replay the graph of size ``bs`` (by
        default the smallest that holds n); logits [n, V]."""
        bs = bs or self.graph_size(n)
        assert bs is not None and bs >= n
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        w = meta.block_tables.shape[1]
        self.block_tables[:n, :w].copy_(meta.block_tables)
        if bs > n:  # padding rows: one token in the scratch block
            self.slot_mapping[n:bs].fill_(self.scratch_block * self.tokens_per_block)
            self.seq_lens[n:bs].fill_(1)
            self.block_tables[n:bs, 0].fill_(self.scratch_block)
            self.positions[n:bs].zero_()
            self.input_ids[n:bs].zero_()
        self.graphs[bs].replay()
        return self.outputs[bs][:n]


class PiecewiseGraphs:
    """Everything of a step but attention, from graphs: for each token count T of ``sizes``, L + 1
    graphs (L layers) — the embedding and the first layer up to its rotated q; then for each
    layer the o projection of the previous layer's attention output, its MLP, and this layer's
    norm, q/k/v, rotary and K/V write; then the last MLP and the final norm. Attention runs
    eagerly between the replays over the step's real rows and metadata, from the q buffer into
    the output buffer the next graph reads (both static, outside the graphs' pool).

    A step of n ≤ T tokens fills the first n rows of the inputs; the padding rows write their
    K/V into the scratch block and are never read. The graphs of all sizes share one memory
    pool: a graph's intermediates may take the memory of an earlier graph's, which is safe
    because a step replays its size's graphs in the order they were captured (each graph's
    inputs were alive while it was captured, so nothing inside it overwrites them). The final
    hidden states go to a static buffer too, valid until the next step replays."""

    def __init__(self, model: CausalLM, kv_tensor: torch.Tensor, sizes: list[int], scratch_slot: int,
                 tokens_per_block: int, device: torch.device) -> None:
        self.device = device
        self.decoder = model.model
        self.layers = model.model.decoder_layers
        self.kv_tensor = kv_tensor
        self.kv = [(kv_tensor[i, 0], kv_tensor[i, -1]) for i in range(len(self.layers))]   # (one plane: both)
        self.sizes = sorted(set(sizes))
        self.tokens_per_block = tokens_per_block
        tmax = self.sizes[-1]
        attn = self.layers[0].self_attn
        heads, head_dim = attn.heads.num_heads, attn.head_dim
        self.ids = torch.zeros(tmax, dtype=torch.long, device=device)
        self.positions = torch.zeros(tmax, dtype=torch.long, device=device)
        self.pad_slots = scratch_slot + torch.arange(tmax, device=device) % tokens_per_block
        self.slots = self.pad_slots.clone()
        self.q = torch.zeros(tmax, heads, head_dim, dtype=model.activation_dtype, device=device)
        self.o = torch.zeros_like(self.q)
        self.hidden = torch.zeros(tmax, model.config.hidden_size, dtype=model.activation_dtype, device=device)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}

    def _meta(self, t: int) -> AttentionMetadata:
        # the graphs run no attention: only the K/V write reads the metadata (its slots)
        empty = torch.zeros(1, dtype=torch.int32, device=self.device)
        return AttentionMetadata(slot_mapping=self.slots[:t], query_start=empty, seq_lens=empty,
                                 block_tables=empty[None], max_query_len=t, max_seq_len=t,
                                 tokens_per_block=self.tokens_per_block)

    def _piece(self, i: int, t: int, residual: torch.Tensor | None, meta: AttentionMetadata) -> torch.Tensor:
        """Graph i of size t (``DecoderModel.piece``): reads the previous attention output from
        ``self.o``, leaves layer i's rotated q in ``self.q``; returns the residual stream (after
        the last layer: the final hidden states, in ``self.hidden``)."""
        out, q = self.decoder.piece(i, self.ids[:t], self.positions[:t], meta, self.kv_tensor, residual, self.o[:t])
        if q is None:   # the final hidden states into a static buffer: nothing in the pool outlives a step
            return self.hidden[:t].copy_(out)
        self.q[:t].copy_(q)
        return out

    def capture(self, stream: torch.cuda.Stream) -> None:
        pool = None
        current = torch.cuda.current_stream(self.device)
        for t in reversed(self.sizes):   # largest first: smaller sizes reuse its memory
            meta = self._meta(t)
            self.ids.zero_()
            self.positions.zero_()
            self.slots.copy_(self.pad_slots)
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                carry = None             # compile the kernels outside the graphs
                for i in range(len(self.layers) + 1):
                    carry = self._piece(i, t, carry, meta)
                graphs = []
                carry = None
                for i in range(len(self.layers) + 1):
                    graph = torch.cuda.CUDAGraph()
                    graph.capture_begin(pool=pool, capture_error_mode=CAPTURE_MODE)
                    try:
                        out = self._piece(i, t, carry, meta)
                    finally:
                        graph.capture_end()
                    pool = graph.pool()
                    graphs.append(graph)
                    carry = out          # the previous graph's output is released only now
            current.wait_stream(stream)
            self.graphs[t] = graphs

    def release(self) -> None:
        for graphs in self.graphs.values():
            for graph in graphs:
                graph.reset()
        self.graphs.clear()

    def size(self, num_tokens: int) -> int | None:
        """The token count a step of ``num_tokens`` replays, or None (eager)."""
        for t in self.sizes:
            if t >= num_tokens and t in self.graphs:
                return t
        return None

    def run(self, t: int, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """A step's tokens through the graphs of size ``t`` with attention between them -> the
        final hidden states of its n tokens [n, hidden]."""
        n = input_ids.shape[0]
        self.ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(meta.slot_mapping)
        if t > n:
            self.slots[n:t].copy_(self.pad_slots[n:t])
        graphs, q, o = self.graphs[t], self.q[:n], self.o[:n]
        for graph, layer, kv in zip(graphs, self.layers, self.kv, strict=False):
            graph.replay()
            layer.self_attn.attend(q, meta, *kv, out=o)
        graphs[-1].replay()
        return self.hidden[:n]
