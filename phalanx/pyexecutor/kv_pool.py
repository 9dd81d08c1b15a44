"""The KV pool tensor (kept apart from the pure kv_manager) and how many blocks it gets.

One tensor for all layers: [num_layers, 2 (K, V), num_blocks, tokens_per_block, Hkv, D], where
Hkv is this rank's KV heads. Block ids from the KVCacheManager index dimension 2. An FP8 pool's
values fill each block key-minor, as [Hkv, D, tokens_per_block]
(``attention_ref.values_key_minor``); the tensor is zeroed when allocated, which that layout needs.
"""

from __future__ import annotations

import logging

import torch

from phalanx.kernels import ops

logger = logging.getLogger("phalanx")

CPU_DEFAULT_KV_BYTES = 1 << 30


def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, tokens_per_block: int,
                    dtype: torch.dtype) -> int:
    return 2 * num_layers * tokens_per_block * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8


def num_blocks_for_budget(budget_bytes: int, block_bytes: int, tokens_per_block: int,
                          max_tokens: int | None) -> int:
    """Blocks that fit ``budget_bytes``, capped by ``max_tokens`` when given."""
    n = budget_bytes // block_bytes
    if max_tokens is not None:
        n = min(n, -(-max_tokens // tokens_per_block))
    return max(int(n), 1)


class KVPool:
    """The KV tensor plus the partial-reuse copies that run before each forward."""

    def __init__(self, num_layers: int, num_blocks: int, tokens_per_block: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.num_blocks, self.tokens_per_block = num_blocks, tokens_per_block
        self.tensor = torch.zeros(num_layers, 2, num_blocks, tokens_per_block, num_kv_heads, head_dim,
                                  dtype=dtype, device=device)
        logger.info("KV pool: %d blocks × %d tokens = %d tokens, %.1f MiB", num_blocks, tokens_per_block,
                    num_blocks * tokens_per_block, self.tensor.numel() * self.tensor.element_size() / 2**20)

    def copy_blocks(self, ops_list) -> None:
        """Run ``CopyOp``s (src block rows [0, n) -> dst block; whole blocks of an FP8 pool)."""
        if ops_list:
            ops.copy_blocks(self.tensor, [o.src for o in ops_list], [o.dst for o in ops_list],
                            [o.num_tokens for o in ops_list])
