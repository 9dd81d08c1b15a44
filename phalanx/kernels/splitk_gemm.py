"""A Triton GEMM for decode steps of 65–256 rows, split over K so that its grid fills the GPU.

Between the skinny kernels (up to 64 rows, kernels/gemv.py) and the prompt steps' GEMMs, a
decode step's projections still stream their weights from memory: 128 rows of bf16 do 128
FLOP a weight byte, under the ~200 at which an H200 turns compute-bound. What they need is the
whole GPU reading. cuBLAS and the CUTLASS tiles give a 4,096 × 4,096 projection at 128 rows
(M, N) tiles of 64–128 × 128: 32–64 programs on 132 SMs, so most of the memory system idles
(docs/results/gpu27_gemm_forms.txt: the o projection at 128 rows 14.3 µs in bf16, 2.3 TB/s;
11.5 µs in FP8, 1.5 TB/s).

``SplitTile`` names BLOCK_M × BLOCK_N output tiles, BLOCK_K, warps, pipeline stages and K slices.
Program (m, n, s) multiplies K slice s of its tile on the tensor cores; with more than one slice
each writes a float32 partial and the slice that finishes last (a counter per output tile,
reset by it) sums the partials in slice order and stores the result — no second kernel, and
the same sum whichever slice finishes last. The M tiles of one weight tile are neighbours in
the grid, so the weight is read from memory once and from L2 by the others.

A kernel takes the calling form of the many-row GEMMs (``fp8.RowsGemm``, the CUTLASS tiles'):
FP8 ``gemm(q_rows, rows_scale [M, 1], q [N, K], scale [N])`` with the activation rows quantized per
row, both scales applied in the epilogue; bf16 ``gemm(x, None, w, None)``. The tuner times it
against cuBLAS(Lt) and the CUTLASS tiles at the buckets of up to ``UP_TO`` rows
(``gemv_tuner.tune_many``) and a projection takes it where it measured faster. The reference is
the float32 product of the same operands (tests/kernels/test_splitk_gemm.py).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from phalanx.kernels import pdl as _pdl
from phalanx.kernels.pdl import prologue

UP_TO = 256     # the largest bucket of rows the tuner offers these tiles at: above it the GEMMs turn compute-bound


class SplitTile(NamedTuple):
    """BLOCK_M × BLOCK_N output tiles over BLOCK_K steps (elements; FP8 tiles take twice the
    elements of a bf16 one for the same bytes), warps, pipeline stages, K slices."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int
    splits: int = 1
    dtype: str = "bf16"


# (BLOCK_M, BLOCK_N, warps, stages): each tried whole and split over K (``tiles``)
SHAPES = ((64, 128, 4, 4), (128, 64, 4, 4), (128, 128, 8, 3))
K_BYTES = 128     # a K step of 128 bytes: 64 bf16 or 128 FP8 elements


def tiles(dtype: str, N: int, K: int, rows: int, num_sms: int) -> list[SplitTile]:
    """The candidates for a weight [N, K] at ``rows`` rows: each shape whole and, where its grid
    leaves SMs idle, split over K into about one program per SM (at least 4 K steps a slice)."""
    bk = K_BYTES // (1 if dtype == "fp8" else 2)
    out = []
    for bm, bn, warps, stages in SHAPES:
        grid = triton.cdiv(rows, bm) * triton.cdiv(N, bn)
        splits = max(1, min(num_sms // grid, K // (4 * bk)))
        out += [SplitTile(bm, bn, bk, warps, stages, s, dtype) for s in sorted({1, splits})]
    return out


@triton.jit(do_not_specialize=["M"])   # one form for any row count
def _kernel(a_ptr, w_ptr, as_ptr, ws_ptr, y_ptr, part_ptr, count_ptr, M, N, K, k_per_split, s_am, s_wn, s_ym,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP8: tl.constexpr,
            SPLIT: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr):
    """y[m, n] = a[m] · w[n] (times a_scale[m] · w_scale[n] with FP8) for one BLOCK_M × BLOCK_N
    tile over K slice program_id(2); SPLIT: partials summed by the slice that finishes last."""
    prologue(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    sk = tl.program_id(2)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mm = m < M
    nm = n < N
    k_lo = sk * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        km = k < k_hi
        a = tl.load(a_ptr + m[:, None] * s_am + k[None, :], mask=mm[:, None] & km[None, :], other=0.0)
        w = tl.load(w_ptr + n[:, None] * s_wn + k[None, :], mask=nm[:, None] & km[None, :], other=0.0,
                    eviction_policy="evict_first")
        acc += tl.dot(a, tl.trans(w), input_precision=PREC)
    tile = m[:, None] * N + n[None, :]
    both = mm[:, None] & nm[None, :]
    if SPLIT:
        splits = tl.num_programs(2)
        tl.store(part_ptr + sk * M * N + tile, acc, mask=both)
        tl.debug_barrier()                      # every thread's partial is written before the count
        counter = count_ptr + pid_m * tl.num_programs(1) + pid_n
        done = tl.atomic_add(counter, 1, sem="acq_rel")
        if done == splits - 1:
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for j in range(0, splits):          # L2 only (".cg"): the partials of other SMs
                acc += tl.load(part_ptr + j * M * N + tile, mask=both, other=0.0, cache_modifier=".cg")
            tl.store(counter, 0)
            _store(y_ptr, as_ptr, ws_ptr, s_ym, m, mm, n, nm, acc, FP8)
    else:
        _store(y_ptr, as_ptr, ws_ptr, s_ym, m, mm, n, nm, acc, FP8)


@triton.jit
def _store(y_ptr, as_ptr, ws_ptr, s_ym, m, mm, n, nm, acc, FP8: tl.constexpr):
    if FP8:   # the rows' and the weight rows' scales
        acc *= tl.load(as_ptr + m, mask=mm, other=0.0)[:, None] * tl.load(ws_ptr + n, mask=nm, other=0.0)[None, :]
    tl.store(y_ptr + m[:, None] * s_ym + n[None, :], acc.to(y_ptr.dtype.element_ty), mask=mm[:, None] & nm[None, :])


_COUNTS: dict[torch.device, torch.Tensor] = {}
MAX_TILES = 1 << 16


def _counts(device: torch.device) -> torch.Tensor:
    """The split-K counters of a device (zero between kernels: the last slice resets its own),
    made on first use — the tuner's timing, before any CUDA graph is captured."""
    if device not in _COUNTS:
        _COUNTS[device] = torch.zeros(MAX_TILES, dtype=torch.int32, device=device)
    return _COUNTS[device]


class Kernel:
    """One tile's GEMM in the many-row form: FP8 ``kernel(q_rows, rows_scale, q, scale)``, bf16
    ``kernel(x, None, w, None)`` -> bf16 [M, N] (the activations' dtype for bf16)."""

    def __init__(self, tile: SplitTile):
        self.tile = tile

    def __call__(self, a: torch.Tensor, a_scale: torch.Tensor | None, w: torch.Tensor,
                 w_scale: torch.Tensor | None) -> torch.Tensor:
        t = self.tile
        fp8 = t.dtype == "fp8"
        if fp8 != (a_scale is not None and w_scale is not None) or a.dtype != w.dtype or a.shape[1] != w.shape[1]:
            raise ValueError(f"split-K GEMM {t}: needs a and w of one dtype and K{' and both scales' if fp8 else ''},"
                             f" got {a.dtype} {tuple(a.shape)}, {w.dtype} {tuple(w.shape)}")
        M, K = a.shape
        N = w.shape[0]
        if a.stride(-1) != 1:
            a = a.contiguous()
        y = torch.empty(M, N, dtype=torch.bfloat16 if fp8 else a.dtype, device=a.device)
        grid_m, grid_n = triton.cdiv(M, t.block_m), triton.cdiv(N, t.block_n)
        k_per = triton.cdiv(triton.cdiv(K, t.splits), t.block_k) * t.block_k
        splits = triton.cdiv(K, k_per)
        if grid_m * grid_n > MAX_TILES:
            splits, k_per = 1, K
        part = torch.empty(splits, M, N, dtype=torch.float32, device=a.device) if splits > 1 else y
        counts = _counts(a.device) if splits > 1 else y
        _kernel[(grid_m, grid_n, splits)](
            a, w, a_scale if fp8 else a, w_scale if fp8 else a, y, part, counts, M, N, K, k_per,
            a.stride(0), w.stride(0), y.stride(0), BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
            FP8=fp8, SPLIT=splits > 1, PREC="ieee" if a.dtype == torch.float32 else "tf32", num_warps=t.warps,
            num_stages=t.stages, **_pdl.launch(a))
        return y


@functools.cache
def kernel(tile: SplitTile) -> Kernel:
    return Kernel(tile)
