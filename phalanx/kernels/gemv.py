"""Skinny matmul kernels y = x Wᵀ (+ b) for decode batches of a few rows, and their launchers.

At batch 1 a decode step is a stream of weight reads; the one-row kernel walks W in [BLOCK_N,
BLOCK_K] tiles with wide loads and a pipelined K loop, multiplies in float32 and sums once at the
end (FP8 tiles first fold each step's products into a narrower accumulator:
``OneRowTile.fold``). Up to 64 rows are padded to 16 or 64 for ``tl.dot`` (tensor cores in
bf16/fp16); where there are too few column tiles to fill the GPU, K is split over programs and
the last slice of each tile adds the partials up in slice order (split-K with no second kernel,
deterministic).
SiLU-and-mul on the input of the down projection rides along so that it costs no launch of its
own. For one token, two epilogues fuse more: the q/k/v projection with rotary and the K/V write
(``qkv_rope``), and gate ‖ up with silu(gate) * up (``gate_up_silu``).

Launchers take plain tiles (``linear_plan.OneRowTile`` / ``RowsTile``); which tile, PDL and
preload a projection runs with is decided once by the tuner (``gemv_tuner``) and held by the
layer as its plan (``linear_plan``). The reference is ``torch.nn.functional.linear`` after the
references of the neighbours.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from phalanx.kernels import pdl as _pdl
from phalanx.kernels.attention_ref import UNIT_KV_SCALE, KvScale, inverse_kv_scale
from phalanx.kernels.fp8 import Block
from phalanx.kernels.linear_plan import OneRowTile, QkvRopePlan, RowsTile, bucket
from phalanx.kernels.pdl import prologue, release, wait
from phalanx.kernels.triton_ops import key_to_pool, silu_mul, value_block, value_offsets, value_to_pool

# the tiles the tuner tries: one row (BLOCK_N, BLOCK_K, warps, stages[, fold]) ...
ONE_ROW_TILES = [OneRowTile(8, 512, 4, 4), OneRowTile(16, 512, 4, 3), OneRowTile(16, 1024, 8, 2),
                 OneRowTile(32, 256, 4, 4), OneRowTile(8, 1024, 4, 3)]
# FP8 weights (one byte each): wider K tiles keep as many bytes in flight, and products folded 16
# at a time keep the accumulator of twice the elements per byte small (docs/gpu_notes.md)
ONE_ROW_TILES_FP8 = [OneRowTile(8, 2048, 4, 3, 16), OneRowTile(4, 2048, 4, 4, 16), OneRowTile(4, 4096, 4, 3, 16),
                     OneRowTile(8, 1024, 4, 4, 16), OneRowTile(16, 2048, 8, 3, 16), OneRowTile(4, 1024, 4, 6, 16)]
# ... and more rows (padded to 16 or 64 for tl.dot), each tried whole and split over K (``auto_splits``);
# each is a compile at start-up
ROWS_TILES = [RowsTile(32, 256, 4, 4), RowsTile(64, 128, 4, 3)]
SMEM_BYTES = 200 << 10


def _fit_stages(stages: int, bytes_per_stage: int) -> int:
    """Fewer pipeline stages where the tiles would not fit in shared memory (fp32, wide K tiles,
    the padded rows of the dot path)."""
    while stages > 1 and stages * bytes_per_stage > SMEM_BYTES:
        stages -= 1
    return stages


@triton.jit
def _w_tile(w_ptr, s_wn, n, nm, k, km):
    """A [BLOCK_N, BLOCK_K] tile of W, loaded evict-first: each weight is read once per step, so
    it should not push anything else out of L2."""
    return tl.load(w_ptr + n[:, None] * s_wn + k[None, :], mask=nm[:, None] & km[None, :], other=0.0,
                   eviction_policy="evict_first")


@triton.jit
def _store_one_row(y_ptr, b_ptr, s_ptr, n, nm, y, HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr):
    """One row: scale the [BLOCK_N] sums by their weight rows' FP8 scales (HAS_SCALE), add the
    bias, store."""
    if HAS_SCALE:
        y *= tl.load(s_ptr + n, mask=nm, other=0.0)
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=nm, other=0.0).to(tl.float32)
    tl.store(y_ptr + n, y.to(y_ptr.dtype.element_ty), mask=nm)


@triton.jit
def _store_padded_rows(y_ptr, b_ptr, s_ptr, s_ym, n, nm, m, mm, acc, HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr):
    """Padded rows: scale the [BLOCK_M, BLOCK_N] dot result by the weight rows' FP8 scales
    (HAS_SCALE), add the bias, store the real rows."""
    if HAS_SCALE:
        acc *= tl.load(s_ptr + n, mask=nm, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=nm, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + m[:, None] * s_ym + n[None, :], acc.to(y_ptr.dtype.element_ty), mask=mm[:, None] & nm[None, :])


@triton.jit
def _row_product(x_ptr, w_ptr, s_wn, n, nm, K, sb_ptr, s_sn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 FOLD: tl.constexpr, SILU: tl.constexpr, PRE: tl.constexpr, PDL: tl.constexpr,
                 SBN: tl.constexpr, SBK: tl.constexpr):
    """x · W[n] for one row x ([1, K], or gate ‖ up [1, 2K] with SILU) over the weight rows n:
    float32 products, each K step's folded FOLD at a time into a [BLOCK_N, BLOCK_K // FOLD]
    accumulator (``OneRowTile.fold``), summed once at the end -> [BLOCK_N] float32.

    SBK > 0: the weight is FP8 with a scale per SBN x SBK block (``fp8.Fp8BlockWeight``, the
    scales at sb_ptr, s_sn apart by block row): each folded lane is multiplied by its block's
    scale before it is added (FOLD divides SBK, so a lane never spans two blocks). A program's
    rows lie in at most two block rows (its first and last: rows of a tile no taller than a
    block, gate and up rows, the two halves of a rotary pair), so each K step loads the scales
    of those two for its lanes ([BLOCK_K // FOLD] each) and picks one a row.

    PRE: the first weight tile is loaded before the PDL wait (a weight: nothing in the chain writes
    it), so that it streams while the kernel in front finishes. That pays where the kernel in
    front is short (a norm, the attention) and leaves most of the GPU idle
    (``linear_plan.PRELOAD_BEHIND``); behind a long kernel the early programs would hold
    registers and slots its later waves need (docs/gpu_notes.md has the measurements)."""
    release(PDL)
    k = tl.arange(0, BLOCK_K)
    km = k < K
    bn = tl.where(nm, n, tl.min(n)) // SBN     # block-scaled weights (SBK > 0): each row's block row,
    lo = tl.min(bn)                            # the program's first and last
    sb_lo = sb_ptr + lo * s_sn
    sb_hi = sb_ptr + tl.max(bn) * s_sn
    first = bn == lo
    if PRE:
        w0 = _w_tile(w_ptr, s_wn, n, nm, k, km)
    wait(PDL)
    acc1 = tl.zeros([BLOCK_N, BLOCK_K // FOLD], tl.float32)
    if PRE:
        acc1 = _fma_tile(acc1, w0, x_ptr, k, km, K, first, sb_lo, sb_hi, 0, BLOCK_K, FOLD, SILU, SBK)
    for k0 in range(BLOCK_K * PRE, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        km = k < K
        acc1 = _fma_tile(acc1, _w_tile(w_ptr, s_wn, n, nm, k, km), x_ptr, k, km, K, first, sb_lo, sb_hi, k0, BLOCK_K,
                         FOLD, SILU, SBK)
    return tl.sum(acc1, 1)


@triton.jit
def _fma_tile(acc1, w, x_ptr, k, km, K, first, sb_lo, sb_hi, k0, BLOCK_K: tl.constexpr, FOLD: tl.constexpr,
              SILU: tl.constexpr, SBK: tl.constexpr):
    """acc1 + a weight tile times the matching tile of x (silu(gate) * up of it with SILU), the
    products summed FOLD neighbours at a time (and with SBK > 0 each sum scaled by its block's
    scale: from the block row at ``sb_lo`` for the rows ``first``, else at ``sb_hi``)."""
    x = tl.load(x_ptr + k, mask=km, other=0.0)
    if SILU:
        x = silu_mul(x, tl.load(x_ptr + K + k, mask=km, other=0.0))
    p = w.to(tl.float32) * x.to(tl.float32)[None, :]
    if FOLD > 1:
        p = tl.sum(tl.reshape(p, [p.shape[0], p.shape[1] // FOLD, FOLD]), 2)
    if SBK > 0:
        kf = k0 + tl.arange(0, BLOCK_K // FOLD) * FOLD
        kb = kf // SBK
        s_lo = tl.load(sb_lo + kb, mask=kf < K, other=0.0)
        s_hi = tl.load(sb_hi + kb, mask=kf < K, other=0.0)
        p *= tl.where(first[:, None], s_lo[None, :], s_hi[None, :])
    return acc1 + p


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, s_ptr, y_ptr, N, K, s_wn, s_sn,
                 HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 FOLD: tl.constexpr, SILU: tl.constexpr, PRE: tl.constexpr, PDL: tl.constexpr,
                 SBN: tl.constexpr, SBK: tl.constexpr):
    """One row: y[n] = x · W[n] (+ b) for BLOCK_N rows n of W per program. SILU: x holds
    gate ‖ up ([1, 2K]) and the kernel multiplies silu(gate) * up on the fly. HAS_SCALE: a scale
    per row at s_ptr; SBK > 0: a scale per SBN x SBK block there instead."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < N
    y = _row_product(x_ptr, w_ptr, s_wn, n, nm, K, s_ptr, s_sn, BLOCK_N, BLOCK_K, FOLD, SILU, PRE, PDL, SBN, SBK)
    _store_one_row(y_ptr, b_ptr, s_ptr, n, nm, y, HAS_BIAS, HAS_SCALE)


@triton.jit
def _qkv_rope_kernel(x_ptr, w_ptr, b_ptr, sc_ptr, pos_ptr, cs_ptr, slot_ptr, q_ptr, kc_ptr, vc_ptr, K, s_wn, s_qh,
                     s_cs, s_ch, H, Hkv, k_inv, v_inv, s_sn, HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr,
                     D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FOLD: tl.constexpr,
                     PRE: tl.constexpr, VB: tl.constexpr, PDL: tl.constexpr, SBN: tl.constexpr, SBK: tl.constexpr):
    """The q/k/v projection of one token with rotary and the K/V write as its epilogue. A
    program of the q or k heads takes BLOCK_N // 2 rotary pairs (rows j and j + D/2 of a head,
    interleaved), so it can rotate what it computed; a program of v takes BLOCK_N rows. Each
    output is rounded to the model's dtype before it is rotated, as when the projection and
    ``rope_and_write_kv`` run apart, so the two paths give the same bits."""
    col0 = tl.program_id(0) * BLOCK_N
    head = col0 // D
    r = tl.arange(0, BLOCK_N)
    rotated = head < H + Hkv
    j0 = (col0 % D) // 2
    n = tl.where(rotated, head * D + j0 + r // 2 + (r % 2) * (D // 2), col0 + r)
    nm = n < (H + 2 * Hkv) * D
    pos = tl.load(pos_ptr)                      # metadata: read before the wait
    slot = tl.load(slot_ptr).to(tl.int64)
    j = j0 + tl.arange(0, BLOCK_N // 2)
    cos = tl.load(cs_ptr + pos * D + j)
    sin = tl.load(cs_ptr + pos * D + D // 2 + j)
    y = _row_product(x_ptr, w_ptr, s_wn, n, nm, K, sc_ptr, s_sn, BLOCK_N, BLOCK_K, FOLD, False, PRE, PDL, SBN, SBK)
    if HAS_SCALE:   # FP8 weights, a scale per row
        y *= tl.load(sc_ptr + n, mask=nm, other=0.0)
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=nm, other=0.0).to(tl.float32)
    y = y.to(q_ptr.dtype.element_ty)
    if rotated:
        x1, x2 = tl.split(tl.reshape(y, [BLOCK_N // 2, 2]))
        x1 = x1.to(tl.float32)
        x2 = x2.to(tl.float32)
        r1 = x1 * cos - x2 * sin
        r2 = x2 * cos + x1 * sin
        if head < H:   # stored apart: the pool's dtype may differ from q's (an FP8 pool)
            tl.store(q_ptr + head * s_qh + j, r1.to(q_ptr.dtype.element_ty))
            tl.store(q_ptr + head * s_qh + D // 2 + j, r2.to(q_ptr.dtype.element_ty))
        else:
            kd = kc_ptr + slot * s_cs + (head - H) * s_ch
            tl.store(kd + j, key_to_pool(r1, kc_ptr.dtype.element_ty, VB, k_inv))
            tl.store(kd + D // 2 + j, key_to_pool(r2, kc_ptr.dtype.element_ty, VB, k_inv))
    else:
        vh = head - H - Hkv
        tl.store(vc_ptr + value_offsets(slot, vh, s_cs, s_ch, col0 % D + r, VB),
                 value_to_pool(y, vc_ptr.dtype.element_ty, VB, v_inv))


@triton.jit
def _gate_up_silu_kernel(x_ptr, w_ptr, b_ptr, sc_ptr, a_ptr, I, K, s_wn, s_sn,  # noqa: E741 (I: intermediate size)
                         HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, FOLD: tl.constexpr, PRE: tl.constexpr, PDL: tl.constexpr,
                         SBN: tl.constexpr, SBK: tl.constexpr):
    """The gate ‖ up projection of one token with SiLU-and-mul as its epilogue: a program takes
    BLOCK_N // 2 pairs of rows (gate j and up j, interleaved) and writes silu(gate) * up for
    them, so the down projection reads I values instead of 2I and computes no SiLU. Outputs are
    rounded to the model's dtype before the SiLU, as when the two run apart: the same bits."""
    r = tl.arange(0, BLOCK_N)
    j0 = tl.program_id(0) * (BLOCK_N // 2)
    n = j0 + r // 2 + (r % 2) * I
    nm = j0 + r // 2 < I
    y = _row_product(x_ptr, w_ptr, s_wn, n, nm, K, sc_ptr, s_sn, BLOCK_N, BLOCK_K, FOLD, False, PRE, PDL, SBN, SBK)
    if HAS_SCALE:   # FP8 weights, a scale per row
        y *= tl.load(sc_ptr + n, mask=nm, other=0.0)
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=nm, other=0.0).to(tl.float32)
    gate, up = tl.split(tl.reshape(y.to(a_ptr.dtype.element_ty), [BLOCK_N // 2, 2]))
    j = j0 + tl.arange(0, BLOCK_N // 2)
    tl.store(a_ptr + j, silu_mul(gate, up), mask=j < I)


@triton.jit(do_not_specialize=["M"])   # one form for any row count: a step's sampled rows vary
def _rows_kernel(x_ptr, w_ptr, b_ptr, s_ptr, y_ptr, part_ptr, count_ptr, M, N, K, k_per_split, s_xm, s_wn, s_ym,
                 s_sn, HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, PREC: tl.constexpr, SILU: tl.constexpr, SPLIT: tl.constexpr,
                 PDL: tl.constexpr, SBN: tl.constexpr, SBK: tl.constexpr):
    """Up to BLOCK_M rows, padded for tensor-core dots; program (n, s) multiplies K-slice s.
    SBK > 0: a block-scaled FP8 weight (BLOCK_K divides SBK): each step's dot is scaled by the
    scales of its block column before it is added.
    SPLIT: each slice's [M, BLOCK_N] partial goes to part[s], and the slice that finishes last
    (a counter per column tile, reset by it) sums the partials in slice order and stores the
    result — no reduce kernel, and the same sum whichever slice finishes last."""
    prologue(PDL)
    pid = tl.program_id(0)
    sk = tl.program_id(1)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < N
    m = tl.arange(0, BLOCK_M)
    mm = m < M
    k_lo = sk * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        km = k < k_hi
        w = _w_tile(w_ptr, s_wn, n, nm, k, km)
        xm = mm[:, None] & km[None, :]
        x = tl.load(x_ptr + m[:, None] * s_xm + k[None, :], mask=xm, other=0.0)
        if SILU:
            x = silu_mul(x, tl.load(x_ptr + m[:, None] * s_xm + K + k[None, :], mask=xm, other=0.0))
        if SBK > 0:
            sb = tl.load(s_ptr + (n // SBN) * s_sn + k0 // SBK, mask=nm, other=0.0)
            acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=PREC) * sb[None, :]
        elif HAS_SCALE:   # FP8 weights: widened to the activations' dtype for the dot
            acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=PREC)
        else:
            acc += tl.dot(x.to(w.dtype), tl.trans(w), input_precision=PREC)
    if SPLIT:
        splits = tl.num_programs(1)
        tile = m[:, None] * N + n[None, :]
        tl.store(part_ptr + sk * M * N + tile, acc, mask=mm[:, None] & nm[None, :])
        tl.debug_barrier()                      # every thread's partial is written before the count
        done = tl.atomic_add(count_ptr + pid, 1, sem="acq_rel")
        if done == splits - 1:
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for j in range(0, splits):          # L2 only (".cg"): the partials of other SMs
                acc += tl.load(part_ptr + j * M * N + tile, mask=mm[:, None] & nm[None, :], other=0.0,
                               cache_modifier=".cg")
            tl.store(count_ptr + pid, 0)
            _store_padded_rows(y_ptr, b_ptr, s_ptr, s_ym, n, nm, m, mm, acc, HAS_BIAS, HAS_SCALE)
    else:
        _store_padded_rows(y_ptr, b_ptr, s_ptr, s_ym, n, nm, m, mm, acc, HAS_BIAS, HAS_SCALE)


_COUNTS: dict[torch.device, torch.Tensor] = {}


def split_counts(device: torch.device, tiles: int) -> torch.Tensor | None:
    """The split-K counters of a device (zero between kernels: the last slice resets its own),
    made on first use — the tuner's warm-up, before any CUDA graph is captured. None when a
    weight has more column tiles than there are counters."""
    if device not in _COUNTS:
        _COUNTS[device] = torch.zeros(1 << 16, dtype=torch.int32, device=device)
    return _COUNTS[device] if tiles <= _COUNTS[device].numel() else None


def _one_row_launch(tile: OneRowTile, x: torch.Tensor, w: torch.Tensor, silu: bool = False) -> dict:
    """The launch arguments of a one-row tile for input x (gate ‖ up with silu) and weight w (FP8
    weights take half the bytes): BLOCK_N, BLOCK_K, FOLD, warps, and the stages cut to what fits
    in shared memory."""
    bn, bk, warps, stages, fold = tile
    stages = _fit_stages(stages, bn * bk * w.element_size() + bk * (2 if silu else 1) * x.element_size())
    return {"BLOCK_N": bn, "BLOCK_K": bk, "FOLD": fold, "num_warps": warps, "num_stages": stages}


def _padded_rows_launch(tile: RowsTile) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, stages, K slices) of a tile for more than one row: a tensor-core
    dot needs 16 columns."""
    bn, bk, warps, stages, splits = tile
    return max(bn, 16), bk, warps, stages, splits


def slices_for(tiles: int, K: int, k_step: int, num_sms: int) -> int:
    """K slices that give about two programs per SM for ``tiles`` output tiles (at least 4 K
    steps of ``k_step`` each): the rule of both split-K products (this file's and fp8_block_gemm's)."""
    return max(1, min(triton.cdiv(2 * num_sms, tiles), K // (4 * k_step)))


def auto_splits(N: int, K: int, tile: RowsTile, num_sms: int) -> int:
    """K slices for a padded-rows tile (``slices_for``)."""
    bn, bk = _padded_rows_launch(tile)[:2]
    return slices_for(triton.cdiv(N, bn), K, bk, num_sms)


def split_k(y: torch.Tensor, K: int, splits: int, k_step: int,
            tiles: int) -> tuple[int, int, torch.Tensor | None, torch.Tensor]:
    """(slices, K per slice, counters, partials) of a product into y [M, N] over ``splits``
    slices of K in whole steps of ``k_step``: one slice over all of K (counters None, partials y
    itself) where one is asked or there are fewer counters than ``tiles``."""
    k_per = triton.cdiv(triton.cdiv(K, splits), k_step) * k_step
    splits = triton.cdiv(K, k_per)
    counts = split_counts(y.device, tiles) if splits > 1 else None
    if counts is None:
        return 1, K, None, y
    return splits, k_per, counts, torch.empty(splits, *y.shape, dtype=torch.float32, device=y.device)


def _scales(scale: torch.Tensor | None, block: Block | None, run: int = 0) -> dict:
    """The scale arguments of a launch: none, a scale per row (HAS_SCALE), or per ``block`` of an
    FP8 weight (SBN x SBK, the scales' row stride). ``run``: the longest run of consecutive rows
    a program of the one-row kernels takes (aligned to its length); no longer than a block, so
    that a program's rows lie in at most two block rows (``_row_product``)."""
    if scale is not None and scale.dim() != (1 if block is None else 2):
        raise ValueError(f"a {scale.dim()}-D scale with blocks {block}: one a row is 1-D, one a block 2-D")
    if scale is None or block is None:
        return {"HAS_SCALE": scale is not None, "SBN": 1, "SBK": 0, "s_sn": 0}
    if run > block[0]:
        raise ValueError(f"a program's run of {run} rows spans more than a block of {block[0]} rows")
    return {"HAS_SCALE": False, "SBN": block[0], "SBK": block[1], "s_sn": scale.stride(0)}


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tile: OneRowTile | RowsTile,
         silu: bool = False, pdl: bool = False, preload: bool = False,
         scale: torch.Tensor | None = None, block: Block | None = None) -> torch.Tensor:
    """x [M, K] (M <= 64), weight [N, K] -> [M, N]. With ``silu``, x is [M, 2K] = gate ‖ up and the
    product is silu(gate) * up times Wᵀ. ``tile``: a OneRowTile for one row, a RowsTile for more.
    ``pdl``: launched with programmatic dependent launch where the GPU has it; ``preload``: one
    row loads its first weight tile before the PDL wait. ``scale`` [N] float32: the weight is FP8
    (kernels/fp8.py) and row n of the product is multiplied by scale[n]; with ``block`` = (rows,
    cols), scale [⌈N / rows⌉, ⌈K / cols⌉] holds one per block (``fp8.Fp8BlockWeight``; the padded
    rows' K steps are cut to one block's columns where the tile's are wider)."""
    M = x.shape[0]
    N, K = weight.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    bias_arg = bias if bias is not None else weight
    scale_arg = scale if scale is not None else weight
    if M == 1 and isinstance(tile, OneRowTile):
        # a program's block_n rows, aligned: in at most two block rows where no taller than two
        # blocks, the condition ``_scales`` checks as a run of half of them
        scales = _scales(scale, block, tile.block_n // 2)
        _gemv_kernel[(triton.cdiv(N, tile.block_n),)](
            x, weight, bias_arg, scale_arg, y, N, K, weight.stride(0), HAS_BIAS=bias is not None,
            SILU=silu, PRE=preload, **scales, **_one_row_launch(tile, x, weight, silu), **_pdl.launch(x, pdl))
        return y
    scales = _scales(scale, block)
    rows_tile = tile if isinstance(tile, RowsTile) else RowsTile(*tile[:4])
    bn, bk, warps, stages, splits = _padded_rows_launch(rows_tile)
    if scales["SBK"]:
        bk = min(bk, scales["SBK"])
    bm = max(16, bucket(M))                            # the rows the plan was tuned at: one compile each
    tiles = triton.cdiv(N, bn)
    splits, k_per, counts, part = split_k(y, K, splits, bk, tiles)
    stages = _fit_stages(stages, (bn * bk + bm * bk * (2 if silu else 1)) * x.element_size())
    _rows_kernel[(tiles, splits)](
        x, weight, bias_arg, scale_arg, y, part, counts if counts is not None else y, M, N, K, k_per,
        x.stride(0), weight.stride(0), y.stride(0), HAS_BIAS=bias is not None, **scales,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        PREC="ieee" if x.dtype == torch.float32 else "tf32", SILU=silu, SPLIT=splits > 1, num_warps=warps,
        num_stages=stages, **_pdl.launch(x, pdl))
    return y


def qkv_rope(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, positions: torch.Tensor,
             cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
             num_heads: int, num_kv_heads: int, head_dim: int, tile: OneRowTile, pdl: bool,
             scale: torch.Tensor | None = None, block: Block | None = None,
             kv_scale: KvScale = UNIT_KV_SCALE) -> torch.Tensor:
    """One token behind its norm: the q/k/v projection, rotary and the K/V write in one kernel
    (``_qkv_rope_kernel``); returns the rotated q [1, H, D]. The tile must hold whole rotary pairs
    of one head (``QkvRopePlan.fits``). ``scale``: the weight is FP8, a scale per row (per
    ``block`` where given); ``kv_scale``: an FP8 pool's K and V scales, as ``rope_and_write_kv``."""
    D = head_dim
    if x.shape[0] != 1 or not QkvRopePlan.fits(tile, D):
        raise ValueError(f"qkv_rope takes one row and a tile within a head of {D}, got {x.shape[0]} rows, {tile}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    H, Hkv = num_heads, num_kv_heads
    q = torch.empty(1, H, D, dtype=x.dtype, device=x.device)
    kc, vc = k_cache.view(-1, Hkv, D), v_cache.view(-1, Hkv, D)
    _qkv_rope_kernel[((H + 2 * Hkv) * D // tile.block_n,)](
        x, weight, bias if bias is not None else weight, scale if scale is not None else weight, positions, cos_sin,
        slot_mapping, q, kc, vc, x.shape[1], weight.stride(0), q.stride(1), kc.stride(0), kc.stride(1), H, Hkv,
        *inverse_kv_scale(kv_scale), HAS_BIAS=bias is not None, **_scales(scale, block, tile.block_n // 2), D=D,
        PRE=True, VB=value_block(v_cache), **_one_row_launch(tile, x, weight), **_pdl.launch(x, pdl))
    return q


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tile: OneRowTile,
                 pdl: bool, scale: torch.Tensor | None = None, block: Block | None = None) -> torch.Tensor:
    """One token behind its norm: silu(gate) * up [1, I] straight from the gate ‖ up projection
    (``_gate_up_silu_kernel``). ``scale``: the weight is FP8, a scale per row (per ``block``
    where given)."""
    if x.shape[0] != 1:
        raise ValueError(f"gate_up_silu takes one row, got {x.shape[0]}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    I = weight.shape[0] // 2  # noqa: E741 (the intermediate size, as everywhere in the MLP code)
    if block is not None and I % (tile.block_n // 2):
        raise ValueError(f"the up rows of a program must start on a run of {tile.block_n // 2}: I = {I}")
    act = torch.empty(1, I, dtype=x.dtype, device=x.device)
    _gate_up_silu_kernel[(triton.cdiv(I, tile.block_n // 2),)](
        x, weight, bias if bias is not None else weight, scale if scale is not None else weight, act, I, x.shape[1],
        weight.stride(0), HAS_BIAS=bias is not None, **_scales(scale, block, tile.block_n // 2), PRE=True,
        **_one_row_launch(tile, x, weight), **_pdl.launch(x, pdl))
    return act
