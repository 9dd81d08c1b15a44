"""ModelRunner: a ScheduledBatch in, sampled token ids out. The one boundary to the device.

It never calls the scheduler. Per step it packs the scheduled positions of every request into
flat tensors (no padding), runs the partial-reuse copies, the forward and the sampler.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from phalanx.executor.kv_pool import KVPool
from phalanx.executor.sampler import Sampler
from phalanx.executor.scheduler import ScheduledBatch
from phalanx.kernels.metadata import AttentionMetadata
from phalanx.models.parallel import TPGroup


@dataclass
class StepInputs:
    input_ids: torch.Tensor        # [T]
    positions: torch.Tensor        # [T]
    meta: AttentionMetadata
    logits_indices: torch.Tensor   # [S_sample] packed row of each sampling row's last token
    sample_rows: list[int]         # batch rows that sample


@dataclass
class StepResult:
    """Per batch row: the sampled token (None if the row did not sample) and its logprobs."""

    token_ids: list[int | None]
    logprobs: list | None = None


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_pool: KVPool, sampler: Sampler, device: torch.device,
                 tp: TPGroup | None = None) -> None:
        self.model, self.kv_pool, self.sampler, self.device = model, kv_pool, sampler, device
        self.tp = tp or TPGroup()
        self.tokens_per_block = kv_pool.tokens_per_block

    # -- packing ---------------------------------------------------------------------------------
    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        """Host lists -> device tensors for one step."""
        B = self.tokens_per_block
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        sample_rows: list[int] = []
        for row, (req, start, n, table) in enumerate(zip(
                batch.requests, batch.num_computed_tokens, batch.num_scheduled_tokens, batch.block_tables)):
            end = start + n
            ids.extend(req.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // B] * B + p % B for p in range(start, end))
            query_start.append(query_start[-1] + n)
            seq_lens.append(end)
            if end >= req.num_tokens:
                logits_indices.append(query_start[-1] - 1)
                sample_rows.append(row)
        max_blocks = max(len(t) for t in batch.block_tables)
        tables = [t + [0] * (max_blocks - len(t)) for t in batch.block_tables]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=_tensor(slots, dev),
            query_start=_tensor(query_start, dev, torch.int32),
            seq_lens=_tensor(seq_lens, dev, torch.int32),
            block_tables=_tensor(tables, dev, torch.int32),
            max_query_len=max(batch.num_scheduled_tokens),
            max_seq_len=max(seq_lens),
            tokens_per_block=B,
            is_decode_only=len(ids) == len(seq_lens),
        )
        return StepInputs(_tensor(ids, dev), _tensor(positions, dev), meta,
                          _tensor(logits_indices, dev), sample_rows)

    # -- running ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch, inputs: StepInputs) -> torch.Tensor:
        """Copies, forward, logits of the sampling rows: [S_sample, V] float32."""
        self.kv_pool.copy_blocks(batch.copy_ops)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta, self.kv_pool.tensor)
        return self.model.compute_logits(hidden[inputs.logits_indices])

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepResult:
        """Run one step synchronously and return host-side results."""
        inputs = self.prepare(batch)
        logits = self.forward(batch, inputs)
        rows = inputs.sample_rows
        tokens: list[int | None] = [None] * len(batch)
        logprobs = None
        if rows:
            out = self.sampler.sample(logits, [batch.requests[i] for i in rows])
            if self.tp.size > 1:  # every rank must append the same tokens: rank 0's win
                torch.distributed.broadcast(out.token_ids, src=0, group=self.tp.group)
            for i, t in zip(rows, out.token_ids.tolist()):
                tokens[i] = t
            if out.logprobs is not None:
                logprobs = [None] * len(batch)
                for i, lp in zip(rows, out.logprobs):
                    logprobs[i] = lp
        return StepResult(tokens, logprobs)


def _tensor(values: list, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    t = torch.tensor(values, dtype=dtype)
    return t.to(device, non_blocking=True) if device.type != "cpu" else t
