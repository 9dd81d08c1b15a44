"""All-reduce for tensor parallelism inside one host: Triton kernels that read and write the other
ranks' memory over NVLink, for the small and mid-sized messages of decode, where NCCL's latency
dominates. NCCL stays the path above ``max_bytes`` and wherever ``supports`` says no.

Every rank cudaMallocs one buffer and shares it through a CUDA IPC handle (64 bytes, passed around
by a caller-supplied ``exchange(bytes) -> list[bytes]``, an allgather in rank order; nothing is
pickled). Kernels get the ranks' base addresses as a device int64 tensor and bitcast them to typed
pointers. They stage the input into the rank's own buffer themselves, so no tensor of the caller
needs registering. Every rank's buffer (bytes; F flag bytes and M = max_bytes, rounded up to 256):

    [0, F)              flags, int64 [2 barriers][max_programs][world]: flags[b][j][p] is the last
                        epoch in which rank p's program j passed barrier b (written by rank p)
    F + 2sM + [0, M)    slot s = epoch % 2, staging: this rank's input
    F + 2sM + [M, 2M)   slot s, gather: the reduced slices of the other ranks (two-shot)

Kinds (cut-overs in ``AllReduceConfig``):

- one-shot: each program stages its chunks, passes barrier 0, sums those chunks over every rank's
  staging area and writes them out. One barrier a call; each rank reads (N-1) messages remotely.
- two-shot: stage; barrier 0; rank r sums slice r (1/N of the message) over every rank and writes it
  into its output and every peer's gather area; barrier 1; copy the other slices out of the gather
  area. Two barriers; each rank moves 2(N-1)/N messages remotely.
- one-shot fused with the residual add and RMSNorm that follow in the decoder, a program per row.

Epochs. The local counter (int64 [2]: calls done, programs arrived) gives every program of a call
the epoch calls done + 1; the last program to arrive stores the epoch back and zeroes the arrival
count, so the next call, which the stream starts after this one has ended, sees epoch + 1. The host
passes the same arguments on every call: a captured CUDA graph replays as it is, the counter
advancing on the device.

Barrier b of program j at epoch e: a CTA barrier (every thread's stores issued), then e is stored
into flags[b][j][rank] of every peer (atomic exchange, release, system scope); then acquire loads of
flags[b][j][p] in the own buffer spin until each peer's is >= e; a CTA barrier. ">=": a peer runs at
most one call ahead (it cannot pass barrier 0 of call k+1 before this rank sends its flag, which it
does after finishing call k) and may already have replaced e by e + 1.

One barrier a call is enough with two slots. Rank r writes staging slot s in call k; the peers read
it in call k only. Before r's call k+2 writes slot s again, r's call k+1 has ended, and each of its
programs has seen every peer's flag of call k+1, stored after that peer's call k had ended, all its
reads of slot s included. The same holds for the gather areas: peers write r's in call k after
barrier 0 of call k (so after r's call k-1 ended), and r reads it before its call k ends.

Determinism. Every output element is a float32 sum in rank order 0, 1, ..., N-1 cast once (in
two-shot by the slice's owner, whose bits every rank copies): every rank gets the same bits, equal to
``all_reduce_ref``, so that the ranks sample the same tokens.

Contract, as with NCCL: every rank makes the same calls (kind, shape, dtype) in the same order, or
replays the same graphs in the same order; a call ends only after every rank has launched it. A call
runs at most ``max_programs`` programs (fewer than the SMs), so all can be resident at once and none
waits for a peer program that cannot be scheduled. Only loads, stores and atomics reach the peers:
no multicast objects, no multimem instructions.

On CPU tensors (tests) the kernels run in the Triton interpreter on host buffers whose host
addresses fill the pointer tensor; the interpreter follows the same int64-to-pointer bitcasts.
"""

from __future__ import annotations

import logging
import os
import struct
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from phalanx.kernels.reference import fused_add_rms_norm_ref

logger = logging.getLogger("phalanx")

ENV_SWITCH = "PHALANX_CUSTOM_ALLREDUCE"      # "0" turns the custom path off
# the environment that keeps NVLink multicast off in NCCL, torch symmetric memory and NVSHMEM
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_NORM_WIDTH = 8192                        # the fused kernel holds a row in registers
ONE_SHOT, TWO_SHOT = "one_shot", "two_shot"
_HANDLE_BYTES = 64
_ALIGN = 256

Exchange = Callable[[bytes], list[bytes]]


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


# -- configuration and layout ----------------------------------------------------------------------
@dataclass(frozen=True)
class AllReduceConfig:
    """Sizes and switches. The cut-overs are measured with tools/bench_allreduce.py; re-measure them
    on other machines and rank counts.

    One-shot has one barrier and reads (N-1) messages over NVLink per rank; two-shot has two and
    moves 2(N-1)/N. On two H200s (bf16, 20 calls in a CUDA graph, µs per call), one-shot beat both
    two-shot and NCCL at every size from 8 KB (5.4 against 8.0 and 11.9) to 8 MB (35 against 41 and
    50): at 2 ranks one-shot runs up to ``max_bytes``. With more ranks its reads grow with N while
    two-shot's do not; until measured there, one-shot stops at 512 KiB up to 4 ranks and 256 KiB
    above. ``max_bytes`` (8 MiB) also sizes the buffer, 4 × max_bytes a rank; NCCL above it.
    128 programs moved 8 MB 25% faster than 64; 8 KB chunks were 5% faster than 4 KB above 512 KB.
    """

    max_bytes: int = 8 << 20                  # custom path up to here, NCCL above
    one_shot_max_bytes: int | None = None     # None: all at 2 ranks, 512 KiB up to 4, 256 KiB above
    chunk_bytes: int = 4096                   # what a program moves per step (a power of two)
    max_programs: int = 128                   # programs per call; below the SM count
    enabled: bool = True                      # False (or PHALANX_CUSTOM_ALLREDUCE=0): NCCL only

    def __post_init__(self) -> None:
        if self.chunk_bytes < 16 or self.chunk_bytes & (self.chunk_bytes - 1):
            raise ValueError(f"chunk_bytes must be a power of two >= 16, got {self.chunk_bytes}")
        if self.max_programs < 1 or self.max_bytes < 1:
            raise ValueError("max_programs and max_bytes must be positive")

    def one_shot_limit(self, world: int) -> int:
        if self.one_shot_max_bytes is not None:
            return min(self.one_shot_max_bytes, self.max_bytes)
        if world == 2:
            return self.max_bytes
        return min(self.max_bytes, (512 << 10) if world <= 4 else (256 << 10))


@dataclass(frozen=True)
class Layout:
    """Byte offsets inside every rank's buffer (the table in the module docstring)."""

    world: int
    max_programs: int
    max_bytes: int

    @property
    def flag_bytes(self) -> int:
        return _round_up(2 * self.max_programs * self.world * 8, _ALIGN)

    @property
    def slot_bytes(self) -> int:
        return _round_up(self.max_bytes, _ALIGN)

    @property
    def total_bytes(self) -> int:
        return self.flag_bytes + 4 * self.slot_bytes

    def flag(self, barrier: int, program: int, src: int) -> int:
        return ((barrier * self.max_programs + program) * self.world + src) * 8

    def staging(self, epoch: int) -> int:
        return self.flag_bytes + (epoch % 2) * 2 * self.slot_bytes

    def gather(self, epoch: int) -> int:
        return self.staging(epoch) + self.slot_bytes


@dataclass(frozen=True)
class Peers:
    """What a launch needs: every rank's buffer address (int64 [world], rank order, on the kernels'
    device), this rank's counter (int64 [2]: calls done, programs arrived), the rank, the layout."""

    ptrs: torch.Tensor
    counter: torch.Tensor
    rank: int
    layout: Layout


# -- references ------------------------------------------------------------------------------------
def all_reduce_ref(xs: list[torch.Tensor]) -> torch.Tensor:
    """Every rank's x [...] -> their sum [...], in float32 in rank order (rank 0 first), cast once."""
    acc = xs[0].float()
    for x in xs[1:]:
        acc = acc + x.float()
    return acc.to(xs[0].dtype)


def all_reduce_add_rms_norm_ref(xs: list[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor,
                                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """residual = all-reduce(xs) + residual; returns (rms_norm(residual) * weight, residual)."""
    return fused_add_rms_norm_ref(all_reduce_ref(xs), residual, weight, eps)


# -- kernel pieces ---------------------------------------------------------------------------------
@triton.jit
def _area(ptrs_ptr, rank, offset, DT: tl.constexpr):
    """A DT pointer to byte ``offset`` (a multiple of 256) of ``rank``'s buffer. The alignment hint
    sits on the pointer itself: the compiler's alignment analysis does not look through the
    int-to-pointer cast, and without it the loads and stores are not vectorized."""
    ptr = (tl.load(ptrs_ptr + rank) + offset).to(tl.pointer_type(DT), bitcast=True)
    return tl.multiple_of(ptr, 16)


@triton.jit
def _flag(ptrs_ptr, rank, offset):
    return (tl.load(ptrs_ptr + rank) + offset).to(tl.pointer_type(tl.int64), bitcast=True)


@triton.jit
def _start(ctr_ptr, FLAG_BYTES: tl.constexpr, SLOT_BYTES: tl.constexpr):
    """This call's epoch and the byte offset of its staging area."""
    epoch = tl.load(ctr_ptr, volatile=True) + 1
    return epoch, FLAG_BYTES + (epoch % 2) * (2 * SLOT_BYTES)


@triton.jit
def _finish(ctr_ptr, epoch):
    """The last program of the call to arrive publishes the epoch for the next call."""
    arrived = tl.atomic_add(ctr_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) - 1:
        tl.atomic_xchg(ctr_ptr + 1, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(ctr_ptr, epoch, sem="relaxed", scope="gpu")


@triton.jit
def _barrier(ptrs_ptr, rank, row, epoch, WORLD: tl.constexpr):
    """Tell every peer that this program reached the barrier whose flags start at byte ``row``
    (flags[b][j][:]) in ``epoch``; wait until every peer has told this rank the same."""
    tl.debug_barrier()                                   # every thread's stores are issued
    for p in tl.static_range(WORLD):
        if p != rank:
            tl.atomic_xchg(_flag(ptrs_ptr, p, row + rank * 8), epoch, sem="release", scope="sys")
    for p in tl.static_range(WORLD):
        if p != rank:
            flag = _flag(ptrs_ptr, rank, row + p * 8)
            seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
            while seen < epoch:
                seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
    tl.debug_barrier()                                   # no thread reads before the flags are seen


@triton.jit
def _sum_ranks(ptrs_ptr, area, offs, mask, DT: tl.constexpr, WORLD: tl.constexpr):
    """Elements ``offs`` of byte ``area`` of every rank's buffer, summed in float32 in rank order.
    ``.cg``: past L1, which does not see the peers' writes."""
    acc = tl.load(_area(ptrs_ptr, 0, area, DT) + offs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    for p in tl.static_range(1, WORLD):
        acc += tl.load(_area(ptrs_ptr, p, area, DT) + offs, mask=mask, other=0.0,
                       cache_modifier=".cg").to(tl.float32)
    return acc


@triton.jit
def _slice(q, c, per, n, BLOCK: tl.constexpr):
    """Offsets and mask of block c of rank q's slice [q * per, (q + 1) * per) of [0, n)."""
    i = c * BLOCK + tl.arange(0, BLOCK)
    offs = q * per + i
    return offs, (i < per) & (offs < n)


# -- kernels ---------------------------------------------------------------------------------------
@triton.jit
def _one_shot_kernel(x_ptr, out_ptr, ptrs_ptr, ctr_ptr, rank, n, WORLD: tl.constexpr, BLOCK: tl.constexpr,
                     FLAG_BYTES: tl.constexpr, SLOT_BYTES: tl.constexpr):
    """x, out [n]; program j owns blocks j, j + G, ... of BLOCK elements."""
    DT = x_ptr.dtype.element_ty
    j, G = tl.program_id(0), tl.num_programs(0)
    epoch, stage = _start(ctr_ptr, FLAG_BYTES, SLOT_BYTES)
    own = _area(ptrs_ptr, rank, stage, DT)
    for c in range(j, tl.cdiv(n, BLOCK), G):
        offs = c * BLOCK + tl.arange(0, BLOCK)
        tl.store(own + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)
    _barrier(ptrs_ptr, rank, j * (WORLD * 8), epoch, WORLD)
    for c in range(j, tl.cdiv(n, BLOCK), G):
        offs = c * BLOCK + tl.arange(0, BLOCK)
        acc = _sum_ranks(ptrs_ptr, stage, offs, offs < n, DT, WORLD)
        tl.store(out_ptr + offs, acc.to(DT), mask=offs < n)
    _finish(ctr_ptr, epoch)


@triton.jit
def _two_shot_kernel(x_ptr, out_ptr, ptrs_ptr, ctr_ptr, rank, n, per, WORLD: tl.constexpr, BLOCK: tl.constexpr,
                     MAX_PROGRAMS: tl.constexpr, FLAG_BYTES: tl.constexpr, SLOT_BYTES: tl.constexpr):
    """x, out [n], cut into WORLD slices of ``per``; program j owns blocks j, j + G, ... of every slice."""
    DT = x_ptr.dtype.element_ty
    j, G = tl.program_id(0), tl.num_programs(0)
    epoch, stage = _start(ctr_ptr, FLAG_BYTES, SLOT_BYTES)
    gather = stage + SLOT_BYTES
    own = _area(ptrs_ptr, rank, stage, DT)
    for c in range(j, tl.cdiv(per, BLOCK), G):
        for q in tl.static_range(WORLD):
            offs, m = _slice(q, c, per, n, BLOCK)
            tl.store(own + offs, tl.load(x_ptr + offs, mask=m), mask=m)
    _barrier(ptrs_ptr, rank, j * (WORLD * 8), epoch, WORLD)
    for c in range(j, tl.cdiv(per, BLOCK), G):                  # reduce this rank's slice, scatter it
        offs, m = _slice(rank, c, per, n, BLOCK)
        y = _sum_ranks(ptrs_ptr, stage, offs, m, DT, WORLD).to(DT)
        tl.store(out_ptr + offs, y, mask=m)
        for p in tl.static_range(WORLD):
            if p != rank:
                tl.store(_area(ptrs_ptr, p, gather, DT) + offs, y, mask=m)
    _barrier(ptrs_ptr, rank, (MAX_PROGRAMS + j) * (WORLD * 8), epoch, WORLD)
    own_gather = _area(ptrs_ptr, rank, gather, DT)
    for c in range(j, tl.cdiv(per, BLOCK), G):                  # the peers' slices
        for q in tl.static_range(WORLD):
            if q != rank:
                offs, m = _slice(q, c, per, n, BLOCK)
                tl.store(out_ptr + offs, tl.load(own_gather + offs, mask=m, cache_modifier=".cg"), mask=m)
    _finish(ctr_ptr, epoch)


@triton.jit
def _one_shot_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, ptrs_ptr, ctr_ptr, rank, T, H, eps,
                          WORLD: tl.constexpr, BLOCK: tl.constexpr, FLAG_BYTES: tl.constexpr,
                          SLOT_BYTES: tl.constexpr):
    """x, residual, out, res_out [T, H]; program j owns rows j, j + G, ... Roundings as
    fused_add_rms_norm_ref: the sum cast once, the add in float32 cast once, the norm scaled in float32
    and cast, times the weight cast once."""
    DT = x_ptr.dtype.element_ty
    j, G = tl.program_id(0), tl.num_programs(0)
    epoch, stage = _start(ctr_ptr, FLAG_BYTES, SLOT_BYTES)
    own = _area(ptrs_ptr, rank, stage, DT)
    cols = tl.arange(0, BLOCK)
    m = cols < H
    for t in range(j, T, G):
        tl.store(own + t * H + cols, tl.load(x_ptr + t * H + cols, mask=m), mask=m)
    _barrier(ptrs_ptr, rank, j * (WORLD * 8), epoch, WORLD)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    for t in range(j, T, G):
        offs = t * H + cols
        s = _sum_ranks(ptrs_ptr, stage, offs, m, DT, WORLD).to(DT)
        r = (s.to(tl.float32) + tl.load(res_ptr + offs, mask=m, other=0.0).to(tl.float32)).to(DT)
        tl.store(res_out_ptr + offs, r, mask=m)
        rf = r.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(rf * rf, axis=0) / H + eps)
        tl.store(out_ptr + offs, ((rf * rstd).to(DT).to(tl.float32) * w).to(DT), mask=m)
    _finish(ctr_ptr, epoch)


# -- launches --------------------------------------------------------------------------------------
def _consts(peers: Peers, block: int) -> dict:
    L = peers.layout
    return {"WORLD": L.world, "BLOCK": block, "FLAG_BYTES": L.flag_bytes, "SLOT_BYTES": L.slot_bytes,
            "num_warps": min(16, max(4, block // 256))}


def _grid(units: int, peers: Peers) -> tuple[int]:
    return (max(1, min(units, peers.layout.max_programs)),)


def two_shot_slice(n: int, world: int) -> int:
    """Elements of each rank's slice in two-shot (a multiple of 64, so slices stay aligned)."""
    return _round_up(-(-n // world), 64)


def one_shot(x: torch.Tensor, peers: Peers, chunk_bytes: int = 4096,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """x [...] contiguous -> the sum over the ranks [...], into ``out`` (may be x) or a new tensor."""
    out = torch.empty_like(x) if out is None else out
    n, block = x.numel(), chunk_bytes // x.element_size()
    _one_shot_kernel[_grid(triton.cdiv(n, block), peers)](x, out, peers.ptrs, peers.counter, peers.rank, n,
                                                          **_consts(peers, block))
    return out


def two_shot(x: torch.Tensor, peers: Peers, chunk_bytes: int = 4096,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """x [...] contiguous -> the sum over the ranks [...], into ``out`` (may be x) or a new tensor."""
    out = torch.empty_like(x) if out is None else out
    n, block = x.numel(), chunk_bytes // x.element_size()
    per = two_shot_slice(n, peers.layout.world)
    _two_shot_kernel[_grid(triton.cdiv(per, block), peers)](x, out, peers.ptrs, peers.counter, peers.rank, n, per,
                                                            MAX_PROGRAMS=peers.layout.max_programs,
                                                            **_consts(peers, block))
    return out


def one_shot_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                          peers: Peers) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [..., H] contiguous, weight [H] -> (rms_norm(sum + residual) * weight, sum + residual)."""
    H = x.shape[-1]
    T = x.numel() // H
    out, res_out = torch.empty_like(x), torch.empty_like(x)
    _one_shot_norm_kernel[_grid(T, peers)](x, residual, weight, out, res_out, peers.ptrs, peers.counter,
                                           peers.rank, T, H, eps, **_consts(peers, triton.next_power_of_2(H)))
    return out, res_out


# -- CUDA IPC --------------------------------------------------------------------------------------
def _cudart() -> Any:
    try:
        from cuda.bindings import runtime
    except ImportError:                      # cuda-python before the cuda.bindings namespace
        from cuda import cudart as runtime
    return runtime


def _check(result: tuple) -> Any:
    """cuda-python returns (error, *values): raise on an error, else the value (or None)."""
    err, *values = result
    if int(err) != 0:
        raise RuntimeError(f"CUDA runtime call failed: {err!r}")
    return values[0] if values else None


def _handle_bytes(handle: Any) -> bytes:
    return bytes(b % 256 for b in handle.reserved)      # bytes, or a list of (signed) chars


def _handle_from(rt: Any, data: bytes) -> Any:
    handle = rt.cudaIpcMemHandle_t()
    try:
        handle.reserved = data
    except (TypeError, ValueError):
        handle.reserved = list(data)
    return handle


class _IpcBuffers:
    """This rank's buffer (cudaMalloc, zeroed) and the peers' buffers opened from their IPC handles;
    ``addresses`` in rank order. Every rank checks every payload, so a layout mismatch fails on all."""

    def __init__(self, rank: int, device_index: int, nbytes: int, exchange: Exchange):
        self.device_index = device_index
        self.local = 0
        self.opened: list[int] = []
        self.addresses: list[int] = []
        try:
            self._open(rank, nbytes, exchange)
        except BaseException:
            self.release()
            raise

    def _open(self, rank: int, nbytes: int, exchange: Exchange) -> None:
        rt = _cudart()
        _check(rt.cudaSetDevice(self.device_index))
        self.local = int(_check(rt.cudaMalloc(nbytes)))
        _check(rt.cudaMemset(self.local, 0, nbytes))
        _check(rt.cudaDeviceSynchronize())          # flags are zero before any peer may write them
        payloads = exchange(_handle_bytes(_check(rt.cudaIpcGetMemHandle(self.local))) + struct.pack("<Q", nbytes))
        for r, p in enumerate(payloads):
            if len(p) != _HANDLE_BYTES + 8 or struct.unpack_from("<Q", p, _HANDLE_BYTES)[0] != nbytes:
                raise RuntimeError(f"rank {r}'s all-reduce buffer has another layout (config differs across ranks)")
        for r, p in enumerate(payloads):
            if r == rank:
                self.addresses.append(self.local)
                continue
            ptr = int(_check(rt.cudaIpcOpenMemHandle(_handle_from(rt, p[:_HANDLE_BYTES]),
                                                     rt.cudaIpcMemLazyEnablePeerAccess)))
            self.opened.append(ptr)
            self.addresses.append(ptr)

    def release(self) -> None:
        """Close the peers' buffers and free this one, once; errors (a tearing-down runtime) are ignored."""
        try:
            rt = _cudart()
            rt.cudaSetDevice(self.device_index)
            rt.cudaDeviceSynchronize()
            for ptr in self.opened:
                rt.cudaIpcCloseMemHandle(ptr)
            if self.local:
                rt.cudaFree(self.local)
        except Exception:
            pass
        self.opened, self.local, self.addresses = [], 0, []


def exchange_over(group: Any = None, max_len: int = 256) -> Exchange:
    """An ``exchange`` over a torch.distributed group: an allgather of one fixed-size uint8 row a rank
    (a 4-byte length, then the payload), on the CPU for gloo, on the current CUDA device for NCCL."""
    dist = torch.distributed

    def exchange(payload: bytes) -> list[bytes]:
        if len(payload) > max_len:
            raise ValueError(f"payload of {len(payload)} bytes exceeds {max_len}")
        dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
        row = torch.zeros(4 + max_len, dtype=torch.uint8)
        data = struct.pack("<I", len(payload)) + payload
        row[:len(data)] = torch.tensor(list(data), dtype=torch.uint8)
        rows = torch.empty(dist.get_world_size(group) * row.numel(), dtype=torch.uint8, device=dev)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(rows, row.to(dev), group=group)
        out = [bytes(r.tolist()) for r in rows.cpu().view(-1, row.numel())]
        return [b[4:4 + struct.unpack_from("<I", b)[0]] for b in out]

    return exchange


# -- the all-reduce --------------------------------------------------------------------------------
class CustomAllReduce:
    """The custom all-reduce of one rank. Construction is collective (it calls ``exchange`` once);
    so is every all-reduce (module docstring: same calls, same order, on every rank).

    Off when ``config.enabled`` is False, PHALANX_CUSTOM_ALLREDUCE=0 or world_size is 1 (nothing is
    allocated, ``exchange`` is not called, ``supports`` says False): every rank must agree on that too.
    """

    def __init__(self, rank: int, world_size: int, device: torch.device | str, exchange: Exchange,
                 config: AllReduceConfig | None = None):
        self.rank, self.world_size = rank, world_size
        self.config = config or AllReduceConfig()
        self.device = torch.device(device)
        self.layout = Layout(world_size, self.config.max_programs, self.config.max_bytes)
        self.peers: Peers | None = None
        self._release: weakref.finalize | None = None
        if self.config.enabled and os.environ.get(ENV_SWITCH, "1") != "0" and world_size > 1:
            self._open(exchange)

    def _open(self, exchange: Exchange) -> None:
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)
        with torch.cuda.device(index):
            buffers = _IpcBuffers(self.rank, index, self.layout.total_bytes, exchange)
        self._release = weakref.finalize(self, buffers.release)
        self._release.atexit = False         # at exit the driver reclaims it: no CUDA calls in teardown
        ptrs = torch.tensor(buffers.addresses, dtype=torch.int64, device=self.device)
        counter = torch.zeros(2, dtype=torch.int64, device=self.device)
        self.peers = Peers(ptrs, counter, self.rank, self.layout)

    @property
    def enabled(self) -> bool:
        return self.peers is not None

    def supports(self, x: torch.Tensor) -> bool:
        """Whether ``all_reduce(x)`` may run: on, dtype fp32/bf16/fp16, contiguous, this device, at
        most max_bytes (and not empty)."""
        return (self.enabled and x.dtype in DTYPES and x.is_contiguous() and x.device == self.device
                and 0 < x.numel() * x.element_size() <= self.config.max_bytes)

    def kind(self, x: torch.Tensor) -> str:
        """Which kernel ``all_reduce(x)`` runs, by size."""
        small = x.numel() * x.element_size() <= self.config.one_shot_limit(self.world_size)
        return ONE_SHOT if small else TWO_SHOT

    def all_reduce(self, x: torch.Tensor, out: torch.Tensor | None = None, kind: str | None = None) -> torch.Tensor:
        """The sum of x over the ranks, into ``out`` (may be x itself) or a new tensor; x is not
        changed unless it is ``out``. Needs ``supports(x)``. ``kind`` forces one kernel (benchmarks)."""
        assert self.peers is not None, "custom all-reduce is off"
        fn = one_shot if (kind or self.kind(x)) == ONE_SHOT else two_shot
        return fn(x, self.peers, self.config.chunk_bytes, out)

    def supports_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether ``all_reduce_add_rms_norm`` may run: ``supports(x)``, residual like x, weight [H] of x's dtype."""
        return (self.supports(x) and residual.shape == x.shape and residual.dtype == x.dtype
                and residual.is_contiguous() and residual.device == x.device and weight.dtype == x.dtype
                and weight.shape == x.shape[-1:] and weight.is_contiguous())

    def all_reduce_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """residual = all-reduce(x) + residual; returns (rms_norm(residual) * weight, residual), new
        tensors, as ``fused_add_rms_norm``. One fused kernel for one-shot sizes and H <= 8192; else the
        all-reduce, then the separate norm. Needs ``supports_norm``."""
        assert self.peers is not None, "custom all-reduce is off"
        if self.kind(x) == ONE_SHOT and x.shape[-1] <= MAX_NORM_WIDTH:
            return one_shot_add_rms_norm(x, residual, weight, eps, self.peers)
        from phalanx.kernels import ops
        return ops.fused_add_rms_norm(self.all_reduce(x), residual, weight, eps)

    def close(self) -> None:
        """Synchronize the device, close the peers' buffers and free this rank's. Call it on every rank
        once every rank's last all-reduce has finished (e.g. after a barrier): a peer may still read."""
        if self._release is not None:
            self._release()
        self.peers = None


def all_reduce(x: torch.Tensor, car: CustomAllReduce | None, group: Any = None) -> torch.Tensor:
    """The all-reduce for the model: custom where ``car`` supports x, else NCCL in place. Use the
    returned tensor; x may or may not hold the sum."""
    if car is not None and car.supports(x):
        return car.all_reduce(x)
    torch.distributed.all_reduce(x, group=group)
    return x


def all_reduce_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                            car: CustomAllReduce | None, group: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(all-reduce(x) + residual) * weight, all-reduce(x) + residual), by whichever path fits."""
    if car is not None and car.supports_norm(x, residual, weight):
        return car.all_reduce_add_rms_norm(x, residual, weight, eps)
    from phalanx.kernels import ops
    return ops.fused_add_rms_norm(all_reduce(x, car, group), residual, weight, eps)


def build_for_group(rank: int, world_size: int, device: torch.device, group: Any, same_host: bool,
                    config: AllReduceConfig | None = None) -> CustomAllReduce | None:
    """The custom all-reduce of a tensor-parallel group, or None where it cannot run. Collective:
    every rank first says whether it can (one host, CUDA, cuda-python, peer access to every GPU of
    the group), and only if all can is the buffer exchange made, so no rank waits for another that
    gave up."""
    exchange = exchange_over(group)
    ok, why = _can_run(device, world_size, same_host)
    verdicts = exchange(b"1" if ok else why.encode()[:200])
    refusals = [f"rank {r}: {v.decode()}" for r, v in enumerate(verdicts) if v != b"1"]
    if refusals:
        logger.warning("custom all-reduce off, NCCL only: %s", "; ".join(refusals))
        return None
    car = CustomAllReduce(rank, world_size, device, exchange, config)
    return car if car.enabled else None


def _can_run(device: torch.device, world_size: int, same_host: bool) -> tuple[bool, str]:
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return False, f"{ENV_SWITCH}=0"
    if not same_host:
        return False, "the group spans hosts"
    if device.type != "cuda":
        return False, "not on a GPU"
    try:
        _cudart()
    except ImportError as e:
        return False, f"cuda-python is missing ({e})"
    here = device.index if device.index is not None else torch.cuda.current_device()
    peers = [d for d in range(min(world_size, torch.cuda.device_count())) if d != here]
    if any(not torch.cuda.can_device_access_peer(here, d) for d in peers):
        return False, "no peer access between the GPUs"
    return True, ""
