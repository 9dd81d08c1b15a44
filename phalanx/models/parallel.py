"""The tensor-parallel group a model shard belongs to, and how heads are split across it.

A group's all-reduce takes the custom one-host all-reduce (phalanx/distributed) where it was set
up and fits the tensor, else NCCL (gloo on a CPU). A row-parallel projection's partial sums are
reduced by the norm that follows them (``all_reduce_add_rms_norm``): with the custom all-reduce
that is one kernel — all-reduce, residual add and RMSNorm — instead of two."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class TPGroup:
    """Rank ``rank`` of ``size`` ranks; ``group`` is a torch.distributed group (None at size 1);
    ``custom``: the custom all-reduce (a ``CustomAllReduce``), set once at build time, or None."""

    rank: int = 0
    size: int = 1
    group: Any = None
    custom: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the group (use the returned tensor: x may or may not hold it)."""
        if self.size == 1:
            return x
        if self.custom is not None and self.custom.supports(x):
            return self.custom.all_reduce(x)
        torch.distributed.all_reduce(x, group=self.group)
        return x

    def all_reduce_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """residual + all-reduce(x), and its RMSNorm: (normed, new residual)."""
        if self.fuses_norm(x, residual, weight):
            assert self.custom is not None
            return self.custom.all_reduce_add_rms_norm(x, residual, weight, eps)
        from phalanx.kernels import ops
        return ops.fused_add_rms_norm(self.all_reduce(x), residual, weight, eps)

    def fuses_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether ``all_reduce_add_rms_norm`` runs as one kernel (the custom all-reduce's)."""
        return self.custom is not None and self.custom.supports_norm(x, residual, weight)

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``x`` along the last dimension (rank order)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        torch.distributed.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one rank owns.

    Query heads ``[q_start, q_start + num_heads)`` and KV heads ``[kv_start, kv_start +
    num_kv_heads)``; ``kv_of_q[i]`` is the local KV head serving local query head i. When the
    head counts do not divide by the TP size, query heads are split as evenly as contiguous
    ranges allow and each rank keeps every KV head its query heads use (a KV head on a
    boundary is held by both neighbours).
    """

    q_start: int
    num_heads: int
    kv_start: int
    num_kv_heads: int
    kv_of_q: tuple[int, ...]

    @property
    def uniform_groups(self) -> bool:
        """Every local KV head serves the same number of consecutive query heads."""
        g = self.num_heads // self.num_kv_heads
        return self.num_heads % self.num_kv_heads == 0 and all(
            k == i // g for i, k in enumerate(self.kv_of_q))


def shard_heads(num_heads: int, num_kv_heads: int, rank: int, size: int) -> HeadShard:
    """Split ``num_heads`` query heads (GQA over ``num_kv_heads``) for ``rank`` of ``size``."""
    if size > num_heads:
        raise ValueError(f"tensor_parallel_size {size} exceeds the {num_heads} attention heads")
    group = num_heads // num_kv_heads
    q0, q1 = rank * num_heads // size, (rank + 1) * num_heads // size
    kv0, kv1 = q0 // group, (q1 - 1) // group + 1
    kv_of_q = tuple(q // group - kv0 for q in range(q0, q1))
    return HeadShard(q0, q1 - q0, kv0, kv1 - kv0, kv_of_q)


def split_range(total: int, rank: int, size: int) -> tuple[int, int]:
    """The contiguous ``[start, end)`` of ``total`` items owned by ``rank`` (even split required)."""
    if total % size:
        raise ValueError(f"{total} does not divide by tensor_parallel_size {size}")
    per = total // size
    return rank * per, (rank + 1) * per
