"""The KV pool tensor (kept apart from the pure kv_manager) and how many blocks it gets.

One tensor for all layers: [num_layers, 2 (K, V), num_blocks, tokens_per_block, Hkv, D], where
Hkv is this rank's KV heads. Block ids from the KVCacheManager index dimension 2. An FP8 pool's
values fill each block key-minor, as [Hkv, D, tokens_per_block]
(``attention_ref.values_key_minor``); the tensor is zeroed when allocated, which that layout needs.

The host tier (``kv_cache_config.host_cache_size``) is a second tensor in host memory, pinned
on a GPU, block-major: [num_host_blocks, num_layers, 2, tokens_per_block, Hkv, D], so that a
block is one contiguous copy each way. Its copies are queued on the current stream like every
other op of a step (no wait on the host): an offload reads a device block after the steps that
wrote it and before the step that writes it again, an onboard lands before the step that reads it.
"""

from __future__ import annotations

import logging

import torch

from phalanx.kernels import ops
from phalanx.kv_manager.manager import COPY, OFFLOAD, ONBOARD

logger = logging.getLogger("phalanx")

CPU_DEFAULT_KV_BYTES = 1 << 30
STAGE_BYTES = 64 << 20   # the device staging of one batch of host copies (a step's larger batches go in parts)


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
    """The KV tensor, its host tier's tensor, and the copies that run before each forward."""

    def __init__(self, num_layers: int, num_blocks: int, tokens_per_block: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device, num_host_blocks: int = 0) -> None:
        self.num_blocks, self.tokens_per_block = num_blocks, tokens_per_block
        self.tensor = torch.zeros(num_layers, 2, num_blocks, tokens_per_block, num_kv_heads, head_dim,
                                  dtype=dtype, device=device)
        logger.info("KV pool: %d blocks × %d tokens = %d tokens, %.1f MiB", num_blocks, tokens_per_block,
                    num_blocks * tokens_per_block, self.tensor.numel() * self.tensor.element_size() / 2**20)
        self.host: torch.Tensor | None = None
        if num_host_blocks:
            self.host = torch.empty(num_host_blocks, num_layers, 2, tokens_per_block, num_kv_heads, head_dim,
                                    dtype=dtype, pin_memory=device.type == "cuda")
            logger.info("KV host tier: %d blocks = %d tokens, %.1f MiB of host memory%s", num_host_blocks,
                        num_host_blocks * tokens_per_block, self.host.numel() * self.host.element_size() / 2**20,
                        " (pinned)" if device.type == "cuda" else "")
        block_bytes = self.tensor[:, :, 0].numel() * self.tensor.element_size()
        self._stage_blocks = max(1, STAGE_BYTES // block_bytes)

    def copy_blocks(self, ops_list) -> None:
        """Run ``CopyOp``s in order: partial-reuse copies (src block rows [0, n) -> dst block;
        whole blocks of an FP8 pool), offloads to the host tier and onboards from it. Each run
        of one kind goes as a batch."""
        if not ops_list:
            return
        start = 0
        for i in range(1, len(ops_list) + 1):
            if i == len(ops_list) or ops_list[i].kind != ops_list[start].kind:
                self._run(ops_list[start:i])
                start = i

    def _run(self, run) -> None:
        kind, src, dst = run[0].kind, [o.src for o in run], [o.dst for o in run]
        if kind == COPY:
            ops.copy_blocks(self.tensor, src, dst, [o.num_tokens for o in run])
            return
        assert self.host is not None and kind in (OFFLOAD, ONBOARD)
        pool, host = self._bytes(self.tensor), self._bytes(self.host)
        step = self._stage_blocks
        for lo in range(0, len(run), step):
            s, d = src[lo:lo + step], dst[lo:lo + step]
            if kind == OFFLOAD:   # gather the device blocks block-major, then one copy per run of host ids
                stage = pool.index_select(2, self._index(s)).permute(2, 0, 1, 3, 4, 5).contiguous()
                for a, b, first in _runs(d):
                    host[first:first + b - a].copy_(stage[a:b], non_blocking=True)
            else:                 # one copy per run of host ids into a staging tensor, then a scatter
                stage = torch.empty((len(s), *host.shape[1:]), dtype=host.dtype, device=pool.device)
                for a, b, first in _runs(s):
                    stage[a:b].copy_(host[first:first + b - a], non_blocking=True)
                pool.index_copy_(2, self._index(d), stage.permute(1, 2, 0, 3, 4, 5))

    def _index(self, ids: list[int]) -> torch.Tensor:
        """Block ids as a device tensor, through pinned memory on a GPU (a pageable copy would
        wait for the stream)."""
        dev = self.tensor.device
        if dev.type != "cuda":
            return torch.tensor(ids, dtype=torch.long)
        return torch.tensor(ids, dtype=torch.long, pin_memory=True).to(dev, non_blocking=True)

    @staticmethod
    def _bytes(t: torch.Tensor) -> torch.Tensor:
        """A one-byte dtype (FP8) as uint8, which every copy and index op takes."""
        return t.view(torch.uint8) if t.element_size() == 1 else t


def _runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """(a, b, ids[a]) for each stretch ids[a:b] of consecutive ids."""
    out, a = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[i - 1] + 1:
            out.append((a, i, ids[a]))
            a = i
    return out
