"""The KV pool tensor (kept apart from the pure kv_manager) and how many blocks it gets.

One tensor for all layers: [num_layers, 2 (K, V), num_blocks, tokens_per_block, Hkv, D], where
Hkv is this rank's KV heads. Block ids from the KVCacheManager index dimension 2. An FP8 pool's
values fill each block key-minor, as [Hkv, D, tokens_per_block]
(``attention_ref.values_key_minor``); the tensor is zeroed when allocated, which that layout needs.

The host tier (``kv_cache_config.host_cache_size``) is a second tensor in host memory, pinned
on a GPU, block-major: [num_host_blocks, num_layers, 2, tokens_per_block, Hkv, D], so that a
block is one contiguous copy each way. On a GPU the device's side of every host copy stays on
the step's stream, and the PCIe transfers run on a copy stream of their own, through two
device staging buffers of ``STAGE_BYTES``::

    offload   step's stream: gather the blocks into a staging buffer  → copy stream: D2H
    onboard   copy stream: H2D into a staging buffer  → step's stream: scatter into the pool

An offload reads its device blocks in stream order, after the steps that wrote them and before
the step that writes them again, and the step's stream never waits for its PCIe transfer; an
onboard's transfer is waited for by the scatter alone. Host blocks are only touched by the
copy stream, in the list's order. A staging buffer is written again only once its last reader,
on either stream, is done (an event each). Nothing waits on the host.
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
        self._stage_blocks = max(1, min(STAGE_BYTES // block_bytes, num_host_blocks))
        self._copy_stream: torch.cuda.Stream | None = None
        if self.host is not None and device.type == "cuda":
            self._copy_stream = torch.cuda.Stream(device)
            shape = (self._stage_blocks, *self.host.shape[1:])
            self._stages = [torch.empty(shape, dtype=self._bytes(self.host).dtype, device=device) for _ in range(2)]
            self._last_use: list[tuple[torch.cuda.Event, torch.cuda.Stream] | None] = [None, None]
            self._next_stage = 0

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
        step = self._stage_blocks
        for lo in range(0, len(run), step):
            (self._offload if kind == OFFLOAD else self._onboard)(src[lo:lo + step], dst[lo:lo + step])

    def _offload(self, blocks: list[int], host_ids: list[int]) -> None:
        assert self.host is not None
        pool, host = self._bytes(self.tensor), self._bytes(self.host)
        gathered = pool.index_select(2, self._index(blocks)).permute(2, 0, 1, 3, 4, 5)   # block-major
        cs = self._copy_stream
        if cs is None:   # the CPU: one copy per run of host ids, as they come
            for a, b, first in _runs(host_ids):
                host[first:first + b - a].copy_(gathered[a:b])
            return
        step = torch.cuda.current_stream(pool.device)
        i = self._claim(step)
        stage = self._stages[i][:len(blocks)]
        stage.copy_(gathered)
        ready = torch.cuda.Event()
        ready.record(step)
        cs.wait_event(ready)
        with torch.cuda.stream(cs):
            for a, b, first in _runs(host_ids):
                host[first:first + b - a].copy_(stage[a:b], non_blocking=True)
        self._release(i, cs)

    def _onboard(self, host_ids: list[int], blocks: list[int]) -> None:
        assert self.host is not None
        pool, host = self._bytes(self.tensor), self._bytes(self.host)
        cs = self._copy_stream
        if cs is None:
            stage = torch.empty((len(host_ids), *host.shape[1:]), dtype=host.dtype)
            for a, b, first in _runs(host_ids):
                stage[a:b].copy_(host[first:first + b - a])
        else:
            step = torch.cuda.current_stream(pool.device)
            i = self._claim(cs)
            stage = self._stages[i][:len(host_ids)]
            with torch.cuda.stream(cs):
                for a, b, first in _runs(host_ids):
                    stage[a:b].copy_(host[first:first + b - a], non_blocking=True)
            landed = torch.cuda.Event()
            landed.record(cs)
            step.wait_event(landed)
        pool.index_copy_(2, self._index(blocks), stage.permute(1, 2, 0, 3, 4, 5))
        if cs is not None:
            self._release(i, step)

    def _claim(self, stream: torch.cuda.Stream) -> int:
        """The next staging buffer, for ``stream`` to write: it waits for the buffer's last
        reader where that ran on the other stream."""
        i = self._next_stage
        self._next_stage ^= 1
        last = self._last_use[i]
        if last is not None and last[1] != stream:
            stream.wait_event(last[0])
        return i

    def _release(self, i: int, stream: torch.cuda.Stream) -> None:
        """``stream`` has queued its last read of staging buffer ``i``."""
        done = torch.cuda.Event()
        done.record(stream)
        self._last_use[i] = (done, stream)

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
