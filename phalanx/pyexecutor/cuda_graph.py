"""CUDA graphs for decode-only steps.

At start-up one graph per batch size in ``cuda_graph_config`` is captured over persistent input
buffers (token ids, positions, slots, sequence lengths, block tables). A decode step of n
requests copies its inputs into the first n rows, pads up to the next captured size (padding
rows attend to one token of a scratch block no request owns) and replays the graph. Anything
else — prefill, mixed batches, a batch larger than the largest graph — runs eagerly.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from phalanx.kernels.metadata import AttentionMetadata

if TYPE_CHECKING:
    from phalanx.models.llama import CausalLM

logger = logging.getLogger("phalanx")


class CudaGraphRunner:
    def __init__(self, model: CausalLM, kv_tensor: torch.Tensor, sizes: list[int], max_blocks_per_seq: int,
                 tokens_per_block: int, max_seq_len: int, scratch_block: int, enable_padding: bool,
                 device: torch.device) -> None:
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
        for bs in reversed(self.sizes):          # largest first: smaller graphs reuse its memory
            meta = self.metas[bs] = self._meta(bs)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream), self.model.padded_step(bs):
                for _ in range(2):               # compile kernels and settle the allocator outside the graph
                    self._forward(bs, meta)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream), self.model.padded_step(bs):
                self.outputs[bs] = self._forward(bs, meta)
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.monotonic() - t0
        logger.info("captured %d CUDA graphs (batch sizes %s) in %.1fs", len(self.graphs), self.sizes,
                    self.capture_seconds)

    def release(self) -> None:
        """Drop the graphs and their memory pool (``capture`` makes them again; the engine's
        sleep does this, since the weights and the KV cache come back at other addresses)."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()
        self.metas.clear()

    def _forward(self, bs: int, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.model(self.input_ids[:bs], self.positions[:bs], meta, self.kv_tensor)
        return self.model.compute_logits(hidden)

    def graph_size(self, n: int) -> int | None:
        """The captured size a decode batch of n runs in, or None (eager)."""
        for bs in self.sizes:
            if bs == n or (self.enable_padding and bs > n):
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
