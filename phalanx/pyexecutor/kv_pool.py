"""The KV pool tensor (kept apart from the pure kv_manager) and how many blocks it gets.

One tensor for all layers: [num_layers, 2 (K, V), num_blocks, tokens_per_block, Hkv, D], where
Hkv is this rank's KV heads. Block ids from the KVCacheManager index dimension 2. An FP8 pool's
values fill each block key-minor, as [Hkv, D, tokens_per_block]
(``attention_ref.values_key_minor``); the tensor is zeroed when allocated, which that layout needs.

The host tier (``kv_cache_config.host_cache_size``) is a second tensor in host memory, pinned
on a GPU, block-major: [num_host_blocks, num_layers, 2, tokens_per_block, Hkv, D], so that a
block is one contiguous copy each way. On a GPU the device's side of every host copy stays on
the step's stream, and the PCIe transfers run on two copy streams of their own, one a
direction (the link is full duplex: a prefix onboarded while the blocks its admission evicted
go out), each through a ring of device staging buffers of ``STAGE_BYTES`` (``OUT_STAGES`` and
``IN_STAGES`` of them; the memory is set aside before the pool is sized, ``staging_bytes``)::

    offload   step's stream: gather the blocks into a staging buffer  → out stream: D2H
    onboard   in stream: H2D into a staging buffer  → step's stream: scatter into the pool

An offload reads its device blocks in stream order, after the steps that wrote them and before
the step that writes them again; the step's stream waits for an offload's PCIe transfer only
when the out ring comes round to a buffer whose transfer still runs (each run of offloads takes
a buffer of its own; the ring holds the 64 blocks of a 2k-token prefix of an 8B model); an
onboard's transfer is waited for by the scatter alone. (A gather's temporary, up to a buffer's
size, comes from torch's allocator.) A host block's copies follow the list's
order through an event each: an onboard waits for the offload that last wrote its host block,
an offload for the onboard that last read its host block. A staging buffer is written again
only once its last reader, on either stream, is done. Nothing waits on the host.
"""

from __future__ import annotations

import logging
import weakref

import torch

from phalanx.kernels import ops
from phalanx.kv_manager.manager import COPY, OFFLOAD, ONBOARD

logger = logging.getLogger("phalanx")

CPU_DEFAULT_KV_BYTES = 1 << 30
STAGE_BYTES = 32 << 20   # the device staging of one batch of host copies (a step's larger batches go in parts)
OUT_STAGES, IN_STAGES = 8, 2   # staging buffers of the offloads' ring and the onboards'


def stage_blocks(block_bytes: int, num_host_blocks: int) -> int:
    """Blocks one staging buffer holds."""
    return max(1, min(STAGE_BYTES // block_bytes, num_host_blocks))


def staging_bytes(block_bytes: int, num_host_blocks: int) -> int:
    """The device memory a pool of ``block_bytes`` blocks with a host tier keeps for staging."""
    if not num_host_blocks:
        return 0
    return (OUT_STAGES + IN_STAGES) * stage_blocks(block_bytes, num_host_blocks) * block_bytes



def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, tokens_per_block: int,
                    dtype: torch.dtype, planes: int = 2) -> int:
    return planes * num_layers * tokens_per_block * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8


def num_blocks_for_budget(budget_bytes: int, block_bytes: int, tokens_per_block: int,
                          max_tokens: int | None) -> int:
    """Blocks that fit ``budget_bytes``, capped by ``max_tokens`` when given."""
    n = budget_bytes // block_bytes
    if max_tokens is not None:
        n = min(n, -(-max_tokens // tokens_per_block))
    return max(int(n), 1)


class KVPool:
    """The KV tensor, its host tier's tensor, and the copies that run before each forward.
    ``planes``: K and V (2), or one plane that is both (DeepSeek's latents, ``ModelConfig.kv_planes``:
    a layer's keys are ``tensor[i, 0]`` and its values ``tensor[i, -1]``)."""

    def __init__(self, num_layers: int, num_blocks: int, tokens_per_block: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device, num_host_blocks: int = 0,
                 planes: int = 2) -> None:
        self.num_blocks, self.tokens_per_block = num_blocks, tokens_per_block
        self.tensor = torch.zeros(num_layers, planes, num_blocks, tokens_per_block, num_kv_heads, head_dim,
                                  dtype=dtype, device=device)
        logger.info("KV pool: %d blocks × %d tokens = %d tokens, %.1f MiB", num_blocks, tokens_per_block,
                    num_blocks * tokens_per_block, self.tensor.numel() * self.tensor.element_size() / 2**20)
        self.host: torch.Tensor | None = None
        if num_host_blocks:
            shape = (num_host_blocks, num_layers, planes, tokens_per_block, num_kv_heads, head_dim)
            self.host = _pinned(shape, dtype) if device.type == "cuda" else torch.empty(shape, dtype=dtype)
            logger.info("KV host tier: %d blocks = %d tokens, %.1f MiB of host memory%s", num_host_blocks,
                        num_host_blocks * tokens_per_block, self.host.numel() * self.host.element_size() / 2**20,
                        " (pinned)" if device.type == "cuda" else "")
        block_bytes = self.tensor[:, :, 0].numel() * self.tensor.element_size()
        self._stage_blocks = stage_blocks(block_bytes, num_host_blocks)
        self._lanes: tuple[_Lane, _Lane] | None = None   # (out: offloads, in: onboards), on a GPU
        if self.host is not None and device.type == "cuda":
            shape, dtype = (self._stage_blocks, *self.host.shape[1:]), self._bytes(self.host).dtype
            self._lanes = (_Lane(shape, dtype, device, OUT_STAGES), _Lane(shape, dtype, device, IN_STAGES))
            self._written: list[torch.cuda.Event | None] = [None] * num_host_blocks   # its last offload's D2H
            self._read: list[torch.cuda.Event | None] = [None] * num_host_blocks      # its last onboard's H2D

    def release_staging(self) -> None:
        """Give the host tier's device staging back (sleep mode; the pool's own memory goes
        beside it). ``restore_staging`` takes it again."""
        for lane in self._lanes or ():
            for stage in lane.stages:
                stage.untyped_storage().resize_(0)
            lane.last_use = [None] * len(lane.stages)

    def restore_staging(self) -> None:
        for lane in self._lanes or ():
            for stage in lane.stages:
                stage.untyped_storage().resize_(stage.numel() * stage.element_size())

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
        if self._lanes is None:   # the CPU: one copy per run of host ids, as they come
            for a, b, first in _runs(host_ids):
                host[first:first + b - a].copy_(gathered[a:b])
            return
        lane, step = self._lanes[0], torch.cuda.current_stream(pool.device)
        stage = lane.claim(step)[:len(blocks)]
        stage.copy_(gathered)
        lane.stream.wait_event(_recorded(step))
        _wait_all(lane.stream, (self._read[h] for h in host_ids))   # an onboard still reading a host block
        with torch.cuda.stream(lane.stream):
            for a, b, first in _runs(host_ids):
                host[first:first + b - a].copy_(stage[a:b], non_blocking=True)
        done = lane.release(lane.stream)
        for h in host_ids:
            self._written[h] = done

    def _onboard(self, host_ids: list[int], blocks: list[int]) -> None:
        assert self.host is not None
        pool, host = self._bytes(self.tensor), self._bytes(self.host)
        if self._lanes is None:
            stage = torch.empty((len(host_ids), *host.shape[1:]), dtype=host.dtype)
            for a, b, first in _runs(host_ids):
                stage[a:b].copy_(host[first:first + b - a])
            pool.index_copy_(2, self._index(blocks), stage.permute(1, 2, 0, 3, 4, 5))
            return
        lane, step = self._lanes[1], torch.cuda.current_stream(pool.device)
        stage = lane.claim(lane.stream)[:len(host_ids)]
        _wait_all(lane.stream, (self._written[h] for h in host_ids))   # the offloads that wrote them
        with torch.cuda.stream(lane.stream):
            for a, b, first in _runs(host_ids):
                stage[a:b].copy_(host[first:first + b - a], non_blocking=True)
        landed = _recorded(lane.stream)
        for h in host_ids:
            self._read[h] = landed
        step.wait_event(landed)
        pool.index_copy_(2, self._index(blocks), stage.permute(1, 2, 0, 3, 4, 5))
        lane.release(step)

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


class _Lane:
    """One direction of the host copies: its stream and a ring of staging buffers, used in turn."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, n: int) -> None:
        self.stream = torch.cuda.Stream(device)
        self.stages = [torch.empty(shape, dtype=dtype, device=device) for _ in range(n)]
        self.last_use: list[tuple[torch.cuda.Event, torch.cuda.Stream] | None] = [None] * n
        self.next = 0

    def claim(self, writer: torch.cuda.Stream) -> torch.Tensor:
        """The next staging buffer, for ``writer`` to fill: it waits for the buffer's last
        reader where that ran on another stream."""
        last = self.last_use[self.next]
        if last is not None and last[1] != writer:
            writer.wait_event(last[0])
        return self.stages[self.next]

    def release(self, reader: torch.cuda.Stream) -> torch.cuda.Event:
        """``reader`` has queued its last read of the buffer ``claim`` gave; the next turns."""
        done = _recorded(reader)
        self.last_use[self.next] = (done, reader)
        self.next = (self.next + 1) % len(self.stages)
        return done


def _pinned(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Host memory of exactly this size, page-locked (``cudaHostRegister``; torch's pinned
    allocator rounds a request up to a power of two: 40 GiB would lock 64), unregistered when
    the tensor goes. A torch without the binding takes its pinned allocator; a registration
    that fails is refused (CUDA would keep its error for the next call to find)."""
    t = torch.empty(shape, dtype=dtype)
    ptr, size = t.data_ptr(), t.numel() * t.element_size()
    try:
        cudart = torch.cuda.cudart()
        register, unregister = cudart.cudaHostRegister, cudart.cudaHostUnregister
    except (AttributeError, RuntimeError):
        logger.warning("KV host tier: no cudaHostRegister in this torch; pinned through its allocator instead")
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    error = register(ptr, size, 0)
    code = int(getattr(error, "value", error))
    if code:
        raise RuntimeError(f"kv_cache_config.host_cache_size: locking {size} bytes of host memory failed "
                           f"(cudaHostRegister error {code}); lower it, or raise the locked-memory limit")
    weakref.finalize(t, unregister, ptr)
    return t


def _recorded(stream: torch.cuda.Stream) -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record(stream)
    return event


def _wait_all(stream: torch.cuda.Stream, events) -> None:
    for event in {id(e): e for e in events if e is not None}.values():
        stream.wait_event(event)


def _runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """(a, b, ids[a]) for each stretch ids[a:b] of consecutive ids."""
    out, a = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[i - 1] + 1:
            out.append((a, i, ids[a]))
            a = i
    return out
