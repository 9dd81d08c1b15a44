"""The GEMM of FP8 rows against an FP8 weight on the tensor cores (W8A8): many rows against a
block-scaled weight (``fp8.Fp8BlockWeight``: a scale per rows x cols block of W, as DeepSeek's and
Qwen3's FP8 checkpoints ship), and 2–64 rows against either a block-scaled weight or one scaled
per row.

cuBLASLt's row-wise FP8 GEMM takes one scale per row of W, so a block-scaled weight cannot go
there as it is. This kernel multiplies the activation rows quantized per row (``fp8.Fp8Rows``,
from the kernel in front as for the row-scaled weights) by the weight's e4m3 tiles in FP8, one
block of columns per K step, and scales each step's [BLOCK_M, BLOCK_N] dot by the scales of its
block column before it adds it up (the activation rows' scales once at the end):

    y[m, n] = xs[m] · Σ_kb ws[n // rows, kb] · Σ_{k in block kb} xq[m, k] · wq[n, k]

A weight scaled per row takes its scale with the rows' at the end. Programs walk the output in
groups of ``GROUP_M`` row tiles per column tile, so a column tile's weight is read from L2 by the
row tiles that share it. With few rows a weight's column tiles alone give fewer programs than
two per SM (a 4,096-row weight in tiles of 64 gives 64), and a weight read at a few bytes in
flight per SM reads slowly: a tile may split K over ``BlockGemmTile.splits`` slices (summed as
the padded rows of kernels/gemv.py sum theirs). The tile is chosen per bucket of rows by the
tuner (kernels/gemv_tuner.py ``tune_many`` for many rows, ``candidates`` for up to 64). The
reference is the projection of the dequantized weight (``fp8.reference``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from phalanx.kernels.fp8 import Block, RowsGemm
from phalanx.kernels.gemv import slices_for, split_k
from phalanx.kernels.linear_plan import BLOCK_GEMM_TILE, BlockGemmTile

GROUP_M = 8
ROW_K_STEP = 128   # a K step of a weight scaled per row (a block-scaled one steps one block's columns)
# the tiles the tuner tries for each bucket of many rows (the untuned plan's first) ...
TILES = (BLOCK_GEMM_TILE, BlockGemmTile(128, 128, 8, 3), BlockGemmTile(128, 64, 4, 4),
         BlockGemmTile(64, 64, 4, 4), BlockGemmTile(128, 256, 8, 3))
# ... and for the buckets of up to 16 and 64 rows beside the skinny kernels: narrow column tiles, so
# that a weight read once spreads over every SM, each tried whole and split over K (``auto_splits``)
FEW_ROW_TILES = (BlockGemmTile(16, 64, 4, 4), BlockGemmTile(32, 64, 4, 4), BlockGemmTile(64, 64, 4, 4),
                 BlockGemmTile(64, 32, 4, 4))
DEFAULT_TILE = BLOCK_GEMM_TILE


@triton.jit(do_not_specialize=["M"])   # one form for any row count: a step's rows vary
def _block_gemm_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, part_ptr, count_ptr, M, N, K, k_per_split,
                       s_am, s_wn, s_sn, s_ym, HAS_BIAS: tl.constexpr, SBN: tl.constexpr, SBK: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
                       SPLIT: tl.constexpr):
    """Program (t, s) multiplies output tile t over K-slice s. SBK > 0: a scale per SBN x SBK
    block of W (BLOCK_K = SBK), each step's dot scaled by its block column's; SBK = 0: a scale per
    row of W, applied once at the end with the rows'. SPLIT: as the padded rows of kernels/gemv.py
    (each slice's partial to part[s], the slice that finishes last sums them in slice order)."""
    pid = tl.program_id(0)
    sk = tl.program_id(1)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP * tiles_n
    first_m = (pid // per_group) * GROUP
    group_rows = tl.minimum(tiles_m - first_m, GROUP)
    pm = first_m + (pid % per_group) % group_rows
    pn = (pid % per_group) // group_rows
    m = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    mm = m < M
    nm = n < N
    k_lo = sk * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        km = k < k_hi
        a = tl.load(a_ptr + m[:, None] * s_am + k[None, :], mask=mm[:, None] & km[None, :], other=0.0)
        w = tl.load(w_ptr + n[:, None] * s_wn + k[None, :], mask=nm[:, None] & km[None, :], other=0.0)
        if SBK > 0:
            ws = tl.load(ws_ptr + (n // SBN) * s_sn + k0 // SBK, mask=nm, other=0.0)
            acc += tl.dot(a, tl.trans(w)) * ws[None, :]
        else:
            acc = tl.dot(a, tl.trans(w), acc)
    if SPLIT:
        tile = m[:, None] * N + n[None, :]
        both = mm[:, None] & nm[None, :]
        tl.store(part_ptr + sk * M * N + tile, acc, mask=both)
        tl.debug_barrier()                      # every thread's partial is written before the count
        done = tl.atomic_add(count_ptr + pid, 1, sem="acq_rel")
        if done == tl.num_programs(1) - 1:
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for j in range(0, tl.num_programs(1)):   # L2 only (".cg"): the partials of other SMs
                acc += tl.load(part_ptr + j * M * N + tile, mask=both, other=0.0, cache_modifier=".cg")
            tl.store(count_ptr + pid, 0)
            _store(as_ptr, ws_ptr, b_ptr, y_ptr, s_ym, m, mm, n, nm, acc, HAS_BIAS, SBK)
    else:
        _store(as_ptr, ws_ptr, b_ptr, y_ptr, s_ym, m, mm, n, nm, acc, HAS_BIAS, SBK)


@triton.jit
def _store(as_ptr, ws_ptr, b_ptr, y_ptr, s_ym, m, mm, n, nm, acc, HAS_BIAS: tl.constexpr, SBK: tl.constexpr):
    """The rows' scales (and with a scale per row of W, its), the bias, the store."""
    acc *= tl.load(as_ptr + m, mask=mm, other=0.0)[:, None]
    if SBK == 0:
        acc *= tl.load(ws_ptr + n, mask=nm, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=nm, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + m[:, None] * s_ym + n[None, :], acc.to(y_ptr.dtype.element_ty), mask=mm[:, None] & nm[None, :])


def _k_step(block: Block | None) -> int:
    return block[1] if block is not None else ROW_K_STEP


def auto_splits(M: int, N: int, K: int, tile: BlockGemmTile, block: Block | None, num_sms: int) -> int:
    """K slices that give about two programs per SM for a tile (at least 4 K steps each)."""
    return slices_for(triton.cdiv(M, tile.block_m) * triton.cdiv(N, tile.block_n), K, _k_step(block), num_sms)


def gemm(rows_q: torch.Tensor, rows_scale: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block: Block | None,
         tile: BlockGemmTile = DEFAULT_TILE, bias: torch.Tensor | None = None,
         out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """rows (q [M, K] e4m3, scale [M, 1] float32) times an FP8 weight (q [N, K] e4m3) scaled per
    ``block`` (scale [⌈N / rows⌉, ⌈K / cols⌉] float32) or, with ``block`` None, per row (scale
    [N]) -> [M, N] in ``out_dtype`` (+ ``bias``), over ``tile.splits`` slices of K."""
    M, K = rows_q.shape
    N = q.shape[0]
    if scale.dim() != (1 if block is None else 2):
        raise ValueError(f"a {scale.dim()}-D scale with blocks {block}: one a row is 1-D, one a block 2-D")
    if rows_q.stride(-1) != 1:
        rows_q = rows_q.contiguous()
    rows_scale = rows_scale.reshape(-1).contiguous()
    y = torch.empty(M, N, dtype=out_dtype, device=rows_q.device)
    step = _k_step(block)
    tiles = triton.cdiv(M, tile.block_m) * triton.cdiv(N, tile.block_n)
    splits, k_per, counts, part = split_k(y, K, tile.splits, step, tiles)
    _block_gemm_kernel[(tiles, splits)](
        rows_q, rows_scale, q, scale, bias if bias is not None else y, y, part, counts if counts is not None else y,
        M, N, K, k_per, rows_q.stride(0), q.stride(0), scale.stride(0), y.stride(0), HAS_BIAS=bias is not None,
        SBN=block[0] if block is not None else 1, SBK=block[1] if block is not None else 0, BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n, BLOCK_K=step, GROUP=GROUP_M, SPLIT=splits > 1, num_warps=tile.warps,
        num_stages=tile.stages)
    return y


def rows_gemm(tile: BlockGemmTile, block: Block | None) -> RowsGemm:
    """``gemm`` with its tile and blocks bound, in the form of ``fp8.RowsGemm``."""
    def run(rows_q: torch.Tensor, rows_scale: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return gemm(rows_q, rows_scale, q, scale, block, tile)
    return run
