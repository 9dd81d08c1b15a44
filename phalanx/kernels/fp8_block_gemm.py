"""The GEMM of many rows against a block-scaled FP8 weight (``fp8.Fp8BlockWeight``: a scale per
rows x cols block of W, as DeepSeek's and Qwen3's FP8 checkpoints ship), on the tensor cores.

cuBLASLt's row-wise FP8 GEMM takes one scale per row of W, so a block-scaled weight cannot go
there as it is. This kernel multiplies the activation rows quantized per row (``fp8.Fp8Rows``,
from the kernel in front as for the row-scaled weights) by the weight's e4m3 tiles in FP8, one
block of columns per K step, and scales each step's [BLOCK_M, BLOCK_N] dot by the scales of its
block column before it adds it up (W8A8; the activation rows' scales once at the end):

    y[m, n] = xs[m] · Σ_kb ws[n // rows, kb] · Σ_{k in block kb} xq[m, k] · wq[n, k]

Programs walk the output in groups of ``GROUP_M`` row tiles per column tile, so a column tile's
weight is read from L2 by the row tiles that share it. The tile (``BlockGemmTile``) is chosen
per bucket of rows by the tuner (kernels/gemv_tuner.py ``tune_many``). The reference is the
projection of the dequantized weight (``fp8.reference``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from phalanx.kernels.fp8 import Block, RowsGemm
from phalanx.kernels.linear_plan import BLOCK_GEMM_TILE, BlockGemmTile

GROUP_M = 8
# the tiles the tuner tries for each bucket of many rows (the untuned plan's first) ...
TILES = (BLOCK_GEMM_TILE, BlockGemmTile(128, 128, 8, 3), BlockGemmTile(128, 64, 4, 4),
         BlockGemmTile(64, 64, 4, 4), BlockGemmTile(128, 256, 8, 3))
# ... and for the buckets of up to 16 and 64 rows beside the skinny kernels: narrow column tiles, so
# that a weight read once spreads over every SM
FEW_ROW_TILES = (BlockGemmTile(16, 64, 4, 4), BlockGemmTile(32, 64, 4, 4), BlockGemmTile(64, 64, 4, 4),
                 BlockGemmTile(64, 32, 4, 4))
DEFAULT_TILE = BLOCK_GEMM_TILE


@triton.jit(do_not_specialize=["M"])   # one form for any row count: a step's rows vary
def _block_gemm_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, M, N, K, s_am, s_wn, s_sn, s_ym,
                       HAS_BIAS: tl.constexpr, SBN: tl.constexpr, SBK: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, GROUP: tl.constexpr):
    pid = tl.program_id(0)
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
    ws_rows = ws_ptr + (n // SBN) * s_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, SBK):
        k = k0 + tl.arange(0, SBK)
        km = k < K
        a = tl.load(a_ptr + m[:, None] * s_am + k[None, :], mask=mm[:, None] & km[None, :], other=0.0)
        w = tl.load(w_ptr + n[:, None] * s_wn + k[None, :], mask=nm[:, None] & km[None, :], other=0.0)
        ws = tl.load(ws_rows + k0 // SBK, mask=nm, other=0.0)
        acc += tl.dot(a, tl.trans(w)) * ws[None, :]
    acc *= tl.load(as_ptr + m, mask=mm, other=0.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=nm, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + m[:, None] * s_ym + n[None, :], acc.to(y_ptr.dtype.element_ty), mask=mm[:, None] & nm[None, :])


def gemm(rows_q: torch.Tensor, rows_scale: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block: Block,
         tile: BlockGemmTile = DEFAULT_TILE, bias: torch.Tensor | None = None,
         out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """rows (q [M, K] e4m3, scale [M, 1] float32) times a block-scaled weight (q [N, K] e4m3,
    scale [⌈N / rows⌉, ⌈K / cols⌉] float32) -> [M, N] in ``out_dtype`` (+ ``bias``)."""
    M, K = rows_q.shape
    N = q.shape[0]
    if rows_q.stride(-1) != 1:
        rows_q = rows_q.contiguous()
    rows_scale = rows_scale.reshape(-1).contiguous()
    y = torch.empty(M, N, dtype=out_dtype, device=rows_q.device)
    bm, bn, warps, stages = tile
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
    _block_gemm_kernel[grid](rows_q, rows_scale, q, scale, bias if bias is not None else y, y, M, N, K,
                             rows_q.stride(0), q.stride(0), scale.stride(0), y.stride(0), HAS_BIAS=bias is not None,
                             SBN=block[0], SBK=block[1], BLOCK_M=bm, BLOCK_N=bn, GROUP=GROUP_M, num_warps=warps,
                             num_stages=stages)
    return y


def rows_gemm(tile: BlockGemmTile, block: Block) -> RowsGemm:
    """``gemm`` with its tile and blocks bound, in the form of ``fp8.RowsGemm``."""
    def run(rows_q: torch.Tensor, rows_scale: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return gemm(rows_q, rows_scale, q, scale, block, tile)
    return run
