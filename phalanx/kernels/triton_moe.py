"""Fused mixture-of-experts on the GPU: (token, expert) pairs placed by expert into blocks of
BLOCK_M rows, then two grouped GEMMs — gate‖up with SiLU-and-mul, and down scaled by the
routing weight — each block using its expert's weights; a token's k results are summed in a
fixed order. Checked against ``reference.experts_ref``.

The bookkeeping is two small kernels of fixed shape (no sort, no host synchronisation), so a
decode step with MoE layers can be captured in a CUDA graph::

    pairs P = T·k, local experts E, padded rows R ≤ P + E·(BLOCK_M − 1)
    _count_kernel    slot[p] = the pair's place among its expert's pairs (an atomic counter);
                     every row of sorted_pair set empty (P)
    _place_kernel    start[e] = Σ_{e' < e} ceil(count[e'] / BLOCK_M)·BLOCK_M (each program
                     recomputes it from the E counters); sorted_pair[start[e] + slot[p]] = p;
                     block_expert[b] = #{e : end[e] ≤ b·BLOCK_M} (E = empty block)

The order of pairs within an expert's rows depends on the atomics, but no result does: a row's
GEMM output depends only on that row, the down kernel writes each pair's row at its pair
index, and ``y.view(T, k, H).sum(1)`` adds a token's k rows in pair order.

A step of a few tokens (a decode step at small batch) has a few pairs, and that bookkeeping, the
blocks' padded rows and the sum after are most of its cost. Where the tuner timed it faster
(``MoePlan.rows``), such a step takes two launches instead: each pair's gate ‖ up as one row,
and each token's experts' down projections summed in the down kernel (``fused_moe_rows``).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from phalanx.kernels import fp8, pdl
from phalanx.kernels.gemv import _one_row_launch, _row_product
from phalanx.kernels.linear_plan import PAIR_BUCKETS, MoeOneRows, MoePlan, MoeTile, OneRowTile
from phalanx.kernels.pdl import prologue, release, wait

DEFAULT_PLAN = MoePlan()
# the tiles the tuner tries for each bucket of pairs (PAIR_BUCKETS, then larger)
CANDIDATES = (
    (MoeTile(16, 64, 64, 4, 3), MoeTile(16, 128, 64, 4, 3), MoeTile(16, 64, 128, 4, 3), MoeTile(16, 32, 128, 4, 4)),
    (MoeTile(16, 64, 64, 4, 3), MoeTile(16, 128, 64, 4, 3), MoeTile(32, 64, 64, 4, 3), MoeTile(32, 128, 64, 4, 3)),
    (MoeTile(32, 64, 64, 4, 3), MoeTile(64, 64, 64, 4, 3), MoeTile(64, 128, 64, 4, 3), MoeTile(64, 128, 64, 8, 3)),
    (MoeTile(64, 64, 64, 4, 3), MoeTile(64, 128, 64, 8, 3), MoeTile(128, 128, 64, 8, 3), MoeTile(64, 128, 128, 8, 2)),
)
# FP8 experts: K steps of twice the elements (the same bytes of weight a step as bf16's)
CANDIDATES_FP8 = (
    (MoeTile(16, 64, 128, 4, 3), MoeTile(16, 128, 128, 4, 3), MoeTile(16, 64, 256, 4, 3), MoeTile(16, 32, 256, 4, 4)),
    (MoeTile(16, 64, 128, 4, 3), MoeTile(16, 128, 128, 4, 3), MoeTile(32, 64, 128, 4, 3), MoeTile(32, 128, 128, 4, 3)),
    (MoeTile(32, 64, 128, 4, 3), MoeTile(64, 64, 128, 4, 3), MoeTile(64, 128, 128, 4, 3), MoeTile(64, 128, 128, 8, 3)),
    (MoeTile(64, 64, 128, 4, 3), MoeTile(64, 128, 128, 8, 3), MoeTile(128, 128, 128, 8, 3),
     MoeTile(64, 128, 256, 8, 2)),
)
# FP8 experts: steps of more (token, expert) pairs than the first bucket multiply in FP8 (W8A8),
# so that the tuner times every bucket the way it runs
A8_MIN_PAIRS = PAIR_BUCKETS[0]
_MEMO: dict[tuple, MoePlan] = {}


def candidates(weight_dtype: torch.dtype) -> tuple[tuple[MoeTile, ...], ...]:
    """The tiles the tuner tries for each bucket of pairs, for experts of ``weight_dtype``."""
    return CANDIDATES_FP8 if weight_dtype == fp8.FP8 else CANDIDATES


ALIGN_CHUNK = 256    # pairs (or blocks) per program of the bookkeeping kernels


@triton.jit
def _count_kernel(ids_ptr, cnt_ptr, slot_ptr, pair_ptr, P, first, E, R, CHUNK: tl.constexpr):
    i = tl.program_id(0)
    p = i * CHUNK + tl.arange(0, CHUNK)
    loc = tl.load(ids_ptr + p, mask=p < P, other=0).to(tl.int32) - first
    ok = (p < P) & (loc >= 0) & (loc < E)
    slot = tl.atomic_add(cnt_ptr + tl.where(ok, loc, 0), tl.full([CHUNK], 1, tl.int32), mask=ok)
    tl.store(slot_ptr + p, slot, mask=ok)
    for r0 in range(i * CHUNK, R, tl.num_programs(0) * CHUNK):   # every padded row starts empty
        r = r0 + tl.arange(0, CHUNK)
        tl.store(pair_ptr + r, tl.full([CHUNK], 0, tl.int64) + P, mask=r < R)


@triton.jit
def _place_kernel(ids_ptr, cnt_ptr, slot_ptr, pair_ptr, bexp_ptr, P, first, E, NB,
                  BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    i = tl.program_id(0)
    ex = tl.arange(0, E_PAD)
    counts = tl.load(cnt_ptr + ex, mask=ex < E, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    p = i * CHUNK + tl.arange(0, CHUNK)
    loc = tl.load(ids_ptr + p, mask=p < P, other=0).to(tl.int32) - first
    ok = (p < P) & (loc >= 0) & (loc < E)
    start = tl.sum(tl.where(loc[:, None] == ex[None, :], starts[None, :], 0), axis=1)
    slot = tl.load(slot_ptr + p, mask=ok, other=0)
    tl.store(pair_ptr + start + slot, p.to(tl.int64), mask=ok)
    b = i * CHUNK + tl.arange(0, CHUNK)
    row = (b * BLOCK_M).to(tl.int32)
    e = tl.sum(((ends[None, :] <= row[:, None]) & (ex < E)[None, :]).to(tl.int32), axis=1)
    tl.store(bexp_ptr + b, e.to(tl.int64), mask=b < NB)


def place_chunk(e_pad: int) -> int:
    """Pairs per program of ``_place_kernel``: it compares each pair (and block) with every
    expert, a [chunk, e_pad] tile kept to 4096 elements so it stays in registers."""
    return min(ALIGN_CHUNK, max(16, 4096 // e_pad))


def num_rows(pairs: int, num_local: int, block_m: int) -> int:
    """Padded rows of a step's pairs: every expert's run rounded up to whole blocks."""
    return triton.cdiv(pairs + num_local * (block_m - 1), block_m) * block_m


def align(ids: torch.Tensor, first: int, num_local: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pair [R], block_expert [R // block_m]) for the pairs of ``ids`` [T, k] that fall on
    this rank's experts ``first .. first + num_local``: each local expert's pairs in a run of
    whole blocks, in expert order; rows past a run hold P (empty)."""
    P = ids.numel()
    dev = ids.device
    R = num_rows(P, num_local, block_m)
    NB = R // block_m
    ids = ids.reshape(-1).contiguous()
    counts = torch.zeros(num_local, dtype=torch.int32, device=dev)
    slot = torch.empty(P, dtype=torch.int32, device=dev)
    sorted_pair = torch.empty(R, dtype=torch.long, device=dev)
    block_expert = torch.empty(NB, dtype=torch.long, device=dev)
    C = ALIGN_CHUNK
    _count_kernel[(triton.cdiv(P, C),)](ids, counts, slot, sorted_pair, P, first, num_local, R, CHUNK=C)
    e_pad = max(16, triton.next_power_of_2(num_local))
    c = place_chunk(e_pad)
    _place_kernel[(triton.cdiv(max(P, NB), c),)](ids, counts, slot, sorted_pair, block_expert, P, first, num_local,
                                                 NB, BLOCK_M=block_m, E_PAD=e_pad, CHUNK=c)
    return sorted_pair, block_expert


@triton.jit
def _moe_gate_up_kernel(x_ptr, xs_ptr, w_ptr, sc_ptr, pair_ptr, bexp_ptr, act_ptr, P, TOPK, H, I, E,  # noqa: E741 (I: intermediate size)
                        s_xt, s_we, s_wn, s_ar, s_se, s_sn,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr,
                        HAS_SCALE: tl.constexpr, A8: tl.constexpr, SBN: tl.constexpr, SBK: tl.constexpr):
    """HAS_SCALE: FP8 experts, gate and up rows scaled by sc[e, row]; widened for the dots, or
    with A8 multiplied in FP8 by x quantized per token (its scale xs[token]). SBK > 0: FP8
    experts with a scale per SBN x SBK block instead (sc[e, row // SBN, k // SBK], s_se and s_sn
    apart; BLOCK_K divides SBK): each step's dots scaled by their block column's scales."""
    b = tl.program_id(0)
    nb = tl.program_id(1)
    e = tl.load(bexp_ptr + b)
    if e < E:
        rows = b * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(pair_ptr + rows)
        rm = pair < P
        tok = pair // TOPK
        n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = n < I
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        wb = w_ptr + e.to(tl.int64) * s_we
        sg_rows = sc_ptr + e * s_se + (n // SBN) * s_sn          # SBK > 0: the block rows of gate ...
        su_rows = sc_ptr + e * s_se + ((I + n) // SBN) * s_sn    # ... and of up
        for k0 in range(0, H, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            km = k < H
            x = tl.load(x_ptr + tok[:, None] * s_xt + k[None, :], mask=rm[:, None] & km[None, :], other=0.0)
            wg = tl.load(wb + n[:, None] * s_wn + k[None, :], mask=nm[:, None] & km[None, :], other=0.0)
            wu = tl.load(wb + (I + n)[:, None] * s_wn + k[None, :], mask=nm[:, None] & km[None, :], other=0.0)
            if SBK > 0:   # each step's dots scaled by their block column's scales before they add up
                if A8:
                    dg = tl.dot(x, tl.trans(wg))
                    du = tl.dot(x, tl.trans(wu))
                else:
                    dg = tl.dot(x, tl.trans(wg.to(x.dtype)), input_precision=PREC)
                    du = tl.dot(x, tl.trans(wu.to(x.dtype)), input_precision=PREC)
                acc_g += dg * tl.load(sg_rows + k0 // SBK, mask=nm, other=0.0)[None, :]
                acc_u += du * tl.load(su_rows + k0 // SBK, mask=nm, other=0.0)[None, :]
            elif A8:   # (the sums go straight into the dots' accumulators: a form of its own)
                acc_g += tl.dot(x, tl.trans(wg))
                acc_u += tl.dot(x, tl.trans(wu))
            else:
                acc_g += tl.dot(x, tl.trans(wg.to(x.dtype)), input_precision=PREC)
                acc_u += tl.dot(x, tl.trans(wu.to(x.dtype)), input_precision=PREC)
        if HAS_SCALE:
            acc_g *= tl.load(sc_ptr + e * 2 * I + n, mask=nm, other=0.0)[None, :]
            acc_u *= tl.load(sc_ptr + e * 2 * I + I + n, mask=nm, other=0.0)[None, :]
        if A8:
            xs = tl.load(xs_ptr + tok, mask=rm, other=0.0)[:, None]
            acc_g *= xs
            acc_u *= xs
        act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        tl.store(act_ptr + rows[:, None] * s_ar + n[None, :], act.to(act_ptr.dtype.element_ty),
                 mask=rm[:, None] & nm[None, :])


@triton.jit
def _moe_down_kernel(act_ptr, as_ptr, w_ptr, sc_ptr, pair_ptr, bexp_ptr, rw_ptr, y_ptr, P, H, I, E,  # noqa: E741 (I: intermediate size)
                     s_ar, s_we, s_wn, s_yp, s_se, s_sn,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr,
                     HAS_SCALE: tl.constexpr, A8: tl.constexpr, SBN: tl.constexpr, SBK: tl.constexpr):
    """A8: the activation rows are FP8 with a scale each (as[row]), multiplied in FP8. SBK > 0:
    block-scaled FP8 experts, as in ``_moe_gate_up_kernel``."""
    b = tl.program_id(0)
    nb = tl.program_id(1)
    e = tl.load(bexp_ptr + b)
    if e < E:
        rows = b * BLOCK_M + tl.arange(0, BLOCK_M)
        n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = n < H
        pair = tl.load(pair_ptr + rows)
        rm = pair < P
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        wb = w_ptr + e.to(tl.int64) * s_we
        s_rows = sc_ptr + e * s_se + (n // SBN) * s_sn     # SBK > 0: the block rows of the weight
        for k0 in range(0, I, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            km = k < I
            a = tl.load(act_ptr + rows[:, None] * s_ar + k[None, :], mask=rm[:, None] & km[None, :], other=0.0)
            w = tl.load(wb + n[:, None] * s_wn + k[None, :], mask=nm[:, None] & km[None, :], other=0.0)
            if SBK > 0:
                if A8:  # noqa: SIM108 (constexpr branches, as in the gate ‖ up kernel)
                    d = tl.dot(a, tl.trans(w))
                else:
                    d = tl.dot(a, tl.trans(w.to(a.dtype)), input_precision=PREC)
                acc += d * tl.load(s_rows + k0 // SBK, mask=nm, other=0.0)[None, :]
            elif A8:
                acc += tl.dot(a, tl.trans(w))
            else:
                acc += tl.dot(a, tl.trans(w.to(a.dtype)), input_precision=PREC)
        if HAS_SCALE:
            acc *= tl.load(sc_ptr + e * H + n, mask=nm, other=0.0)[None, :]
        if A8:
            acc *= tl.load(as_ptr + rows, mask=rm, other=0.0)[:, None]
        rw = tl.load(rw_ptr + pair, mask=rm, other=0.0)
        acc = acc * rw[:, None]
        tl.store(y_ptr + pair[:, None] * s_yp + n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=rm[:, None] & nm[None, :])


def _block_scales(scale: torch.Tensor | None, block: fp8.Block | None) -> dict:
    """The scale arguments of an expert kernel: a scale per row (HAS_SCALE) or per ``block``."""
    if scale is not None and scale.dim() != (2 if block is None else 3):
        raise ValueError(f"experts' {scale.dim()}-D scales with blocks {block}: [E, rows] a row, [E, ...] a block")
    if scale is None or block is None:
        return {"HAS_SCALE": scale is not None, "SBN": 1, "SBK": 0, "s_se": 0, "s_sn": 0}
    return {"HAS_SCALE": False, "SBN": block[0], "SBK": block[1], "s_se": scale.stride(0), "s_sn": scale.stride(1)}


def fused_moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              first: int, plan: MoePlan = DEFAULT_PLAN, s13: torch.Tensor | None = None,
              s2: torch.Tensor | None = None, a8: bool | None = None, block: fp8.Block | None = None) -> torch.Tensor:
    """x [T, H]; ids/weights [T, k]; w13 [E, 2I, H]; w2 [E, H, I] (local experts from ``first``);
    the tiles from ``plan`` by the step's number of (token, expert) pairs. ``s13`` [E, 2I] and
    ``s2`` [E, H]: the experts are FP8 with a scale per output row (kernels/fp8.py); with
    ``block`` = (rows, cols), s13 [E, ⌈2I / rows⌉, ⌈H / cols⌉] and s2 [E, ⌈H / rows⌉, ⌈I / cols⌉]
    hold one per block (the tiles' K steps cut to a block's columns where wider). ``a8``: FP8
    experts multiply in FP8 — x and the SiLU-and-mul output quantized per row (W8A8) — instead of
    widening the weights (W8A16); by default where the step has more than ``A8_MIN_PAIRS`` pairs.
    A step of at most ``plan.rows.max_tokens`` tokens takes the few-token form (``fused_moe_rows``),
    unless FP8 products are asked for or its tiles do not fit these experts' scale blocks
    (``rows_take``; the tuner only picks tiles that fit)."""
    T, H = x.shape
    k = ids.shape[1]
    E, two_i, _ = w13.shape
    I = two_i // 2  # noqa: E741 (I: intermediate size)
    P = T * k
    if P == 0:
        return x.new_zeros(T, H)
    rows = plan.one_rows(T)
    if rows is not None and not a8 and rows_take(rows, I, block if s13 is not None else None):
        return fused_moe_rows(x, ids, weights, w13, w2, first, rows, s13, s2, block)
    bm, bn, bk, warps, stages = plan.tile(P)
    if block is not None and s13 is not None:
        bk = min(bk, block[1])
    sorted_pair, block_expert = align(ids, first, E, bm)
    R = sorted_pair.shape[0]
    x = x.contiguous()
    if a8 is None:
        a8 = P > A8_MIN_PAIRS
    a8 = a8 and s13 is not None and s2 is not None
    xq, xs, _ = fp8.quantize_rows(x) if a8 else (x, x, None)
    act = torch.empty(R, I, dtype=x.dtype, device=x.device)
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    launch = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "PREC": prec, "num_warps": warps, "num_stages": stages,
              "A8": a8}
    _moe_gate_up_kernel[(R // bm, triton.cdiv(I, bn))](
        xq, xs, w13, s13 if s13 is not None else w13, sorted_pair, block_expert, act, P, k, H, I, E, xq.stride(0),
        w13.stride(0), w13.stride(1), act.stride(0), **_block_scales(s13, block), **launch)
    aq, as_, _ = fp8.quantize_rows(act) if a8 else (act, act, None)
    y = torch.zeros(P, H, dtype=x.dtype, device=x.device)    # pairs of other ranks' experts stay 0
    _moe_down_kernel[(R // bm, triton.cdiv(H, bn))](
        aq, as_, w2, s2 if s2 is not None else w2, sorted_pair, block_expert, weights.reshape(-1).float().contiguous(),
        y, P, H, I, E, aq.stride(0), w2.stride(0), w2.stride(1), y.stride(0), **_block_scales(s2, block), **launch)
    return y.view(T, k, H).sum(1)


# -- a few tokens: each pair one row (``MoeOneRows``) --------------------------------------------
@triton.jit
def _moe_gate_up_rows_kernel(x_ptr, ids_ptr, w_ptr, sc_ptr, act_ptr, TOPK, first, E, I, H,  # noqa: E741 (I: intermediate size)
                             s_xt, s_we, s_wn, s_ar, s_se, s_sn,
                             HAS_SCALE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             FOLD: tl.constexpr, PDL: tl.constexpr, SBN: tl.constexpr, SBK: tl.constexpr):
    """Pair p = program_id(1), its expert's gate ‖ up rows as ``gemv._gate_up_silu_kernel``
    takes them (BLOCK_N // 2 gate rows and their up rows, interleaved) times its token's x:
    act[p] = silu(gate) * up, in float32 until the store, as ``_moe_gate_up_kernel``. A pair of
    another rank's expert writes nothing (the down kernel passes over it)."""
    prologue(PDL)    # the pairs' experts come from the routing just before: nothing is read ahead
    p = tl.program_id(1)
    e = tl.load(ids_ptr + p) - first
    if (e >= 0) & (e < E):
        r = tl.arange(0, BLOCK_N)
        j0 = tl.program_id(0) * (BLOCK_N // 2)
        n = j0 + r // 2 + (r % 2) * I
        nm = j0 + r // 2 < I
        e64 = e.to(tl.int64)
        y = _row_product(x_ptr + (p // TOPK) * s_xt, w_ptr + e64 * s_we, s_wn, n, nm, H, sc_ptr + e64 * s_se, s_sn,
                         BLOCK_N, BLOCK_K, FOLD, False, False, False, SBN, SBK)
        if HAS_SCALE:   # FP8 experts, a scale per row
            y *= tl.load(sc_ptr + e64 * s_se + n, mask=nm, other=0.0)
        gate, up = tl.split(tl.reshape(y, [BLOCK_N // 2, 2]))
        j = j0 + tl.arange(0, BLOCK_N // 2)
        tl.store(act_ptr + p * s_ar + j, (gate / (1.0 + tl.exp(-gate)) * up).to(act_ptr.dtype.element_ty),
                 mask=j < I)


@triton.jit
def _moe_down_rows_kernel(act_ptr, ids_ptr, rw_ptr, w_ptr, sc_ptr, y_ptr, TOPK, first, E, H, I,  # noqa: E741 (I: intermediate size)
                          s_ar, s_we, s_wn, s_yt, s_se, s_sn,
                          HAS_SCALE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          FOLD: tl.constexpr, PDL: tl.constexpr, SBN: tl.constexpr, SBK: tl.constexpr):
    """Token t = program_id(1), BLOCK_N output columns: Σ over its pairs on this rank's experts,
    in pair order, of the routing weight times act[p] · W2[e, n], summed in float32 and rounded
    once: no per-pair rows to add up after."""
    prologue(PDL)
    t = tl.program_id(1)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < H
    acc = tl.zeros([BLOCK_N], tl.float32)
    for j in range(TOPK):
        p = t * TOPK + j
        e = tl.load(ids_ptr + p) - first
        if (e >= 0) & (e < E):
            e64 = e.to(tl.int64)
            y = _row_product(act_ptr + p * s_ar, w_ptr + e64 * s_we, s_wn, n, nm, I, sc_ptr + e64 * s_se, s_sn,
                             BLOCK_N, BLOCK_K, FOLD, False, False, False, SBN, SBK)
            if HAS_SCALE:
                y *= tl.load(sc_ptr + e64 * s_se + n, mask=nm, other=0.0)
            acc += y * tl.load(rw_ptr + p).to(tl.float32)
    tl.store(y_ptr + t * s_yt + n, acc.to(y_ptr.dtype.element_ty), mask=nm)


def _gate_up_fits(tile: OneRowTile, I: int, block: fp8.Block | None) -> bool:  # noqa: E741 (I: intermediate size)
    """With a scale per block, a program's gate rows and its up rows each lie in one block row."""
    return block is None or (I % (tile.block_n // 2) == 0 and block[0] % (tile.block_n // 2) == 0)


def _down_fits(tile: OneRowTile, block: fp8.Block | None) -> bool:
    """With a scale per block, a program's rows lie in one block row."""
    return block is None or block[0] % tile.block_n == 0


def rows_take(rows: MoeOneRows, I: int, block: fp8.Block | None) -> bool:  # noqa: E741 (I: intermediate size)
    """Whether the few-token form's tiles fit experts of intermediate size ``I`` and their scale blocks."""
    return _gate_up_fits(rows.gate_up, I, block) and _down_fits(rows.down, block)


def _row_scales(scale: torch.Tensor | None, block: fp8.Block | None) -> dict:
    """The scale arguments of the few-token kernels (a row's scales at s_se per expert)."""
    if scale is None:
        return {"HAS_SCALE": False, "SBN": 1, "SBK": 0, "s_se": 0, "s_sn": 0}
    return {**_block_scales(scale, block), "s_se": scale.stride(0)}


def fused_moe_rows(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   first: int, rows: MoeOneRows, s13: torch.Tensor | None = None, s2: torch.Tensor | None = None,
                   block: fp8.Block | None = None) -> torch.Tensor:
    """``fused_moe`` for a few tokens, in two launches: each (token, expert) pair's gate ‖ up
    with SiLU-and-mul as one row (``_moe_gate_up_rows_kernel``), then each token's experts'
    down projections weighted and summed (``_moe_down_rows_kernel``). FP8 experts are widened
    (W8A16). A token's experts add up in float32 and round once, where the blocked form rounds
    each pair's row first: the last bits of a token's output depend on which form its step took
    (as they depend on the blocked form's tile of each bucket)."""
    T, H = x.shape
    k = ids.shape[1]
    E, two_i, _ = w13.shape
    I = two_i // 2  # noqa: E741 (I: intermediate size)
    if not rows_take(rows, I, block if s13 is not None else None):
        raise ValueError(f"the few-token MoE tiles {rows.gate_up}, {rows.down} do not fit experts of {I} rows "
                         f"scaled per block {block}")
    x = x.contiguous()
    ids = ids.reshape(-1).contiguous()
    P = ids.numel()
    act = torch.empty(P, I, dtype=x.dtype, device=x.device)
    y = torch.empty(T, H, dtype=x.dtype, device=x.device)
    if T == 0:
        return y
    on = pdl.launch(x)
    tile = rows.gate_up
    _moe_gate_up_rows_kernel[(triton.cdiv(I, tile.block_n // 2), P)](
        x, ids, w13, s13 if s13 is not None else w13, act, k, first, E, I, H, x.stride(0), w13.stride(0),
        w13.stride(1), act.stride(0), **_row_scales(s13, block if s13 is not None else None),
        **_one_row_launch(tile, x, w13), **on)
    tile = rows.down
    _moe_down_rows_kernel[(triton.cdiv(H, tile.block_n), T)](
        act, ids, weights.reshape(-1).contiguous(), w2, s2 if s2 is not None else w2, y, k, first, E, H, I,
        act.stride(0), w2.stride(0), w2.stride(1), y.stride(0), **_row_scales(s2, block if s2 is not None else None),
        **_one_row_launch(tile, act, w2), **on)
    return y


def _run_once(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              first: int, plan: MoePlan, s13: torch.Tensor | None, s2: torch.Tensor | None,
              block: fp8.Block | None, _copy: int) -> torch.Tensor:
    return fused_moe(x, ids, weights, w13, w2, first, plan, s13, s2, block=block)


def tune(w13: torch.Tensor, w2: torch.Tensor, top_k: int, num_experts: int, first: int,
         s13: torch.Tensor | None = None, s2: torch.Tensor | None = None,
         act_dtype: torch.dtype | None = None, block: fp8.Block | None = None) -> MoePlan:
    """The fastest tile of each bucket of pairs for this layer's shapes, timed in a CUDA graph
    at the bucket's bound with uniformly random routing over all ``num_experts`` experts (this
    rank holds ``first ..``); FP8 experts with their scales (per ``block`` where given). Then
    the few-token form's tiles and the steps it takes (``time_rows``: some twenty more timings).
    Memoised per shape and device."""
    from phalanx.kernels.gemv_tuner import time_graph
    act = act_dtype or w13.dtype
    key = (tuple(w13.shape), tuple(w2.shape), w13.dtype, act, top_k, num_experts, first, str(w13.device), block)
    if key in _MEMO:
        return _MEMO[key]
    H = w13.shape[2]
    tiles = []
    for i, tries in enumerate(candidates(w13.dtype)):
        pairs = PAIR_BUCKETS[i] if i < len(PAIR_BUCKETS) else 4 * PAIR_BUCKETS[-1]
        T = max(1, pairs // top_k)
        g = torch.Generator(device=w13.device).manual_seed(i)
        x = torch.randn(T, H, dtype=act, device=w13.device, generator=g)
        ids = torch.rand(T, num_experts, device=w13.device, generator=g).topk(top_k, dim=-1).indices
        weights = torch.rand(T, top_k, device=w13.device, generator=g)
        best, best_ms = DEFAULT_PLAN.tiles[i], float("inf")
        for tile in tries:
            plan = MoePlan(tuple(tile if j == i else DEFAULT_PLAN.tiles[j] for j in range(len(CANDIDATES))))
            run = functools.partial(_run_once, x, ids, weights, w13, w2, first, plan, s13, s2, block)
            try:
                ms = time_graph(run, 1, reps=8)
            except Exception:  # a tile the compiler rejects on this GPU
                continue
            if ms < best_ms:
                best, best_ms = tile, ms
        tiles.append(best)
    plan = MoePlan(tuple(tiles))
    _MEMO[key] = MoePlan(plan.tiles, _tune_rows(w13, w2, top_k, num_experts, first, plan, s13, s2, act, block))
    return _MEMO[key]


ROWS_TOKENS = (1, 2, 4, 8)   # the step sizes the tuner times the few-token form at, while it wins


def _tune_rows(w13: torch.Tensor, w2: torch.Tensor, top_k: int, num_experts: int, first: int, plan: MoePlan,
               s13: torch.Tensor | None, s2: torch.Tensor | None, act: torch.dtype,
               block: fp8.Block | None) -> MoeOneRows | None:
    """The few-token form for ``plan``'s layer, or None where it loses at one token
    (``time_rows``)."""
    rows, _ = time_rows(w13, w2, top_k, num_experts, first, plan, s13, s2, act, block)
    return rows if rows is not None and rows.max_tokens else None


def time_rows(w13: torch.Tensor, w2: torch.Tensor, top_k: int, num_experts: int, first: int, plan: MoePlan,
              s13: torch.Tensor | None, s2: torch.Tensor | None, act: torch.dtype, block: fp8.Block | None,
              sizes: tuple[int, ...] = ROWS_TOKENS, past_loss: bool = False
              ) -> tuple[MoeOneRows | None, list[tuple[int, float, float]]]:
    """The few-token form's tiles (the gate ‖ up kernel's timed with the down kernel's first
    fitting tile, then the down kernel's, at one token), and the largest of ``sizes`` up to which
    it beats the blocked form of ``plan`` (0 where it loses at the first; None: no tile fits); with the timings
    (tokens, few-token ms, blocked ms), of every size with ``past_loss``. Each timing replays
    eight routings over all ``num_experts`` experts, so that the experts' weights come from
    memory as a decode step's do, not from L2."""
    from phalanx.kernels.gemv import ONE_ROW_TILES, ONE_ROW_TILES_FP8
    from phalanx.kernels.gemv_tuner import time_graph
    I = w13.shape[1] // 2  # noqa: E741 (I: intermediate size)
    H = w13.shape[2]
    blk = block if s13 is not None else None
    tries = ONE_ROW_TILES_FP8 if w13.dtype == fp8.FP8 else ONE_ROW_TILES
    g = torch.Generator(device=w13.device).manual_seed(len(PAIR_BUCKETS) + 1)
    copies = 8

    def timed(T: int, rows: MoeOneRows | None) -> float:
        x = torch.randn(T, H, dtype=act, device=w13.device, generator=g)
        ids = [torch.rand(T, num_experts, device=w13.device, generator=g).topk(top_k, dim=-1).indices
               for _ in range(copies)]
        weights = torch.rand(T, top_k, device=w13.device, generator=g)
        if rows is None:
            def run(i: int) -> torch.Tensor:
                return fused_moe(x, ids[i], weights, w13, w2, first, plan, s13, s2, block=block)
        else:
            def run(i: int) -> torch.Tensor:
                return fused_moe_rows(x, ids[i], weights, w13, w2, first, rows, s13, s2, block)
        try:
            return time_graph(run, copies, reps=copies)
        except Exception:  # a tile the compiler rejects on this GPU
            return float("inf")

    gate_ups = [t for t in tries if _gate_up_fits(t, I, blk)]
    downs = [t for t in tries if _down_fits(t, blk)]
    if not gate_ups or not downs:
        return None, []
    gate_up = min(gate_ups, key=lambda t: timed(1, MoeOneRows(t, downs[0], 1)))
    down = min(downs, key=lambda t: timed(1, MoeOneRows(gate_up, t, 1)))
    best, times, lost = 0, [], False
    for T in sizes:
        times.append((T, timed(T, MoeOneRows(gate_up, down, T)), timed(T, None)))
        lost = lost or times[-1][1] >= times[-1][2]
        if not lost:
            best = T
        elif not past_loss:
            break
    return MoeOneRows(gate_up, down, best), times


# -- DeepSeek's routing (reference.grouped_topk_ref) ------------------------------------------------
@triton.jit
def _pick(c, e, em):
    """The index of the best of c over the experts em (the lowest index among equals)."""
    best = tl.max(tl.where(em, c, -float("inf")), 0)
    return tl.min(tl.where(em & (c == best), e, 1 << 30), 0)


@triton.jit
def _grouped_topk_kernel(logit_ptr, bias_ptr, w_ptr, id_ptr, s_lt, E, scaling,
                         BLOCK_E: tl.constexpr, K: tl.constexpr, SIGMOID: tl.constexpr, METHOD: tl.constexpr,
                         HAS_BIAS: tl.constexpr, NG: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr,
                         TOPK_GROUP: tl.constexpr, RENORM: tl.constexpr, PDL: tl.constexpr):
    """Token t's k experts and weights from its logits, in one program (``_route_token``)."""
    release(PDL)
    t = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    em = e < E
    bias = tl.zeros([BLOCK_E], tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + e, mask=em, other=0.0)     # a weight: read before the wait
    wait(PDL)
    x = tl.load(logit_ptr + t * s_lt + e, mask=em, other=-float("inf")).to(tl.float32)
    _route_token(x, bias, e, em, w_ptr + t * K, id_ptr + t * K, E, scaling, K, SIGMOID, METHOD, HAS_BIAS, NG,
                 BLOCK_K, BLOCK_G, TOPK_GROUP, RENORM)


@triton.jit
def _route_token(x, bias, e, em, w_ptr, id_ptr, E, scaling, K: tl.constexpr, SIGMOID: tl.constexpr,
                 METHOD: tl.constexpr, HAS_BIAS: tl.constexpr, NG: tl.constexpr, BLOCK_K: tl.constexpr,
                 BLOCK_G: tl.constexpr, TOPK_GROUP: tl.constexpr, RENORM: tl.constexpr):
    """One token's routing from its float32 logits x [BLOCK_E] (-inf past E): its k experts and
    weights stored at id_ptr / w_ptr. METHOD: 0 greedy, 1 group-limited greedy (a group's best
    score), 2 noaux_tc (a group's two best biased scores; the bias picks, the unbiased scores
    weigh). Experts are picked best first, as torch.topk orders them."""
    if SIGMOID:
        s = tl.sigmoid(x)
    else:
        z = tl.exp(x - tl.max(x, 0))
        s = z / tl.sum(tl.where(em, z, 0.0), 0)
    s = tl.where(em, s, 0.0)
    c = s
    if METHOD != 0:
        if HAS_BIAS:      # (the selection bias picks within groups only, as the reference)
            c = s + bias
        gs = E // NG
        grp = e // gs
        g = tl.arange(0, BLOCK_G)
        score = tl.full([BLOCK_G], -float("inf"), tl.float32)
        for i in tl.static_range(NG):
            mine = em & (grp == i)
            if METHOD == 2:
                first = _pick(c, e, mine)
                top = tl.max(tl.where(mine, c, -float("inf")), 0)
                second = tl.max(tl.where(mine & (e != first), c, -float("inf")), 0)
                score = tl.where(g == i, top + second, score)
            else:
                score = tl.where(g == i, tl.max(tl.where(mine, c, -float("inf")), 0), score)
        kept = tl.zeros(e.shape, tl.int1)
        for _ in tl.static_range(TOPK_GROUP):
            best = _pick(score, g, g < NG)
            kept = kept | (grp == best)
            score = tl.where(g == best, -float("inf"), score)
        c = tl.where(kept, c, -float("inf") if METHOD == 2 else 0.0)   # (constexpr: the dropped groups' fill)
    kk = tl.arange(0, BLOCK_K)
    picked = tl.zeros([BLOCK_K], tl.int64)
    weight = tl.zeros([BLOCK_K], tl.float32)
    for j in tl.static_range(K):
        pick = _pick(c, e, em)
        picked = tl.where(kk == j, pick.to(tl.int64), picked)
        weight = tl.where(kk == j, tl.sum(tl.where(e == pick, s, 0.0), 0), weight)
        c = tl.where(e == pick, -float("inf"), c)
    if RENORM:
        weight = weight / (tl.sum(weight, 0) + 1e-20)
    tl.store(id_ptr + kk, picked, mask=kk < K)
    tl.store(w_ptr + kk, weight * scaling, mask=kk < K)


@triton.jit
def _router_kernel(x_ptr, g_ptr, bias_ptr, logit_ptr, cnt_ptr, w_ptr, id_ptr, s_xt, H, E, scaling,
                   BLOCK_E: tl.constexpr, TILE_E: tl.constexpr, BLOCK_H: tl.constexpr, K: tl.constexpr,
                   SIGMOID: tl.constexpr, METHOD: tl.constexpr, HAS_BIAS: tl.constexpr, NG: tl.constexpr,
                   BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr, TOPK_GROUP: tl.constexpr, RENORM: tl.constexpr,
                   PDL: tl.constexpr):
    """The router's product and the routing in one launch, for a few tokens: program (t, b)
    computes token t's logits of experts b·TILE_E .. (the router weight's rows, float32 sums of
    x · g rounded to the weight's dtype as ``F.linear`` of x in that dtype gives them) into
    logit[t]; the last of the token's programs to count itself in (cnt[t], reset by it) reads
    them all and routes the token (``_route_token``). The counters must be zero at launch: one
    launch over a layer's counters at a time, on one stream (each MoE layer holds its own)."""
    release(PDL)
    t = tl.program_id(0)
    b = tl.program_id(1)
    r = b * TILE_E + tl.arange(0, TILE_E)
    rm = r < E
    wait(PDL)
    acc = tl.zeros([TILE_E, BLOCK_H], tl.float32)
    for h0 in range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        hm = h < H
        x = tl.load(x_ptr + t * s_xt + h, mask=hm, other=0.0).to(g_ptr.dtype.element_ty).to(tl.float32)
        g = tl.load(g_ptr + r[:, None] * H + h[None, :], mask=rm[:, None] & hm[None, :], other=0.0)
        acc += g.to(tl.float32) * x[None, :]
    logit = tl.sum(acc, 1).to(g_ptr.dtype.element_ty).to(tl.float32)
    tl.store(logit_ptr + t * E + r, logit, mask=rm)
    tl.debug_barrier()                       # every thread's logits are written before the count
    done = tl.atomic_add(cnt_ptr + t, 1, sem="acq_rel")
    if done == tl.num_programs(1) - 1:
        e = tl.arange(0, BLOCK_E)
        em = e < E
        bias = tl.zeros([BLOCK_E], tl.float32)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + e, mask=em, other=0.0)
        z = tl.load(logit_ptr + t * E + e, mask=em, other=-float("inf"), cache_modifier=".cg")  # L2: other SMs'
        tl.store(cnt_ptr + t, 0)
        _route_token(z, bias, e, em, w_ptr + t * K, id_ptr + t * K, E, scaling, K, SIGMOID, METHOD, HAS_BIAS, NG,
                     BLOCK_K, BLOCK_G, TOPK_GROUP, RENORM)


ROUTER_TILE_BYTES = 16 << 10   # router weight bytes a program of ``_router_kernel`` reads (at least two rows)


def route(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor | None, counts: torch.Tensor, top_k: int,
          sigmoid: bool, method: str, n_group: int, topk_group: int, renormalize: bool,
          scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] through the router ``gate`` [E, H] and routed (``reference.grouped_topk_ref`` of
    ``F.linear(x.to(gate.dtype), gate)``) in one launch; ``counts`` [≥ T] int32 zeros, the
    tokens' counters (left zero). (weights [T, k] float32, ids [T, k])."""
    T, H = x.shape
    E = gate.shape[0]
    if counts.numel() < T:
        raise ValueError(f"{T} tokens for {counts.numel()} router counters")
    weights = torch.empty(T, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(T, top_k, dtype=torch.long, device=x.device)
    logits = torch.empty(T, E, dtype=torch.float32, device=x.device)
    tile_e = max(2, min(triton.next_power_of_2(E), ROUTER_TILE_BYTES // (H * gate.element_size())))
    tile_e = 1 << (tile_e.bit_length() - 1)   # (a power of two)
    if T:
        _router_kernel[(T, triton.cdiv(E, tile_e))](
            x, gate, bias if bias is not None else gate, logits, counts, weights, ids, x.stride(0), H, E, scaling,
            BLOCK_E=triton.next_power_of_2(E), TILE_E=tile_e, BLOCK_H=max(16, min(512, 8192 // tile_e)), K=top_k,
            BLOCK_K=triton.next_power_of_2(top_k), SIGMOID=sigmoid, METHOD=GROUPED_TOPK_METHODS[method],
            HAS_BIAS=bias is not None, NG=n_group, BLOCK_G=max(2, triton.next_power_of_2(n_group)),
            TOPK_GROUP=topk_group, RENORM=renormalize, **pdl.launch(x))
    return weights, ids


GROUPED_TOPK_METHODS = {"greedy": 0, "group_limited_greedy": 1, "noaux_tc": 2}


def grouped_topk(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, sigmoid: bool, method: str,
                 n_group: int, topk_group: int, renormalize: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.grouped_topk_ref`` in one launch (a program a token)."""
    T, E = logits.shape
    weights = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, top_k, dtype=torch.long, device=logits.device)
    if T:
        _grouped_topk_kernel[(T,)](
            logits, bias if bias is not None else logits, weights, ids, logits.stride(0), E, scaling,
            BLOCK_E=triton.next_power_of_2(E), K=top_k, BLOCK_K=triton.next_power_of_2(top_k), SIGMOID=sigmoid,
            METHOD=GROUPED_TOPK_METHODS[method],
            HAS_BIAS=bias is not None, NG=n_group, BLOCK_G=max(2, triton.next_power_of_2(n_group)),
            TOPK_GROUP=topk_group, RENORM=renormalize, **pdl.launch(logits))
    return weights, ids
