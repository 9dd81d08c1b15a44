"""Skinny matmul y = x Wᵀ (+ b) for decode batches of a few rows, and the per-shape choice
between it and cuBLAS.

At batch 1 a decode step is a stream of weight reads; the kernel walks W in [BLOCK_N, BLOCK_K]
tiles with wide loads and a pipelined K loop. One row is multiplied with float32 FMAs and summed
once at the end. Up to 64 rows are padded to 16 or 64 for ``tl.dot`` (tensor cores in
bf16/fp16); where there are too few column tiles to fill the GPU, K is split over programs and
the last slice of each tile adds the partials up (split-K with no second kernel).
SiLU-and-mul on the input of the down projection rides along so that it costs no launch of its
own. (RMSNorm fused the same way, every program recomputing the row's norm, never beat a
separate norm kernel on an H200, in the dot or in the FMA form, and was removed; nor did the norm
taken in the same pass as the product, squares summed while the row streams: 250.2 vs 251.4
tok/s in a decode step.) Behind a short kernel a one-row program loads its first weight tile
before it waits for that kernel (``PRELOAD_BEHIND``).

Which plan is fastest — a tile configuration, launched with or without programmatic dependent
launch (``pdl``), or cuBLAS — depends on (N, K), on the neighbour (timed with it: the norm
kernel in front, the SiLU fused or its own kernel) and on the GPU, so it is measured once per
weight shape (``tune``) before CUDA graphs are captured, and looked up after. Timing replays a
CUDA graph over several copies of the weight, so that it is read from memory as in a real step
and not from L2. The torch reference is ``torch.nn.functional.linear`` after the references of
the neighbours.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from phalanx.kernels import pdl, triton_ops
from phalanx.kernels.ops import ATTN, NORM, PLAIN, SILU  # noqa: F401  (what sits in front of the matmul)
from phalanx.kernels.pdl import prologue, release, wait
from phalanx.kernels.triton_ops import silu_mul

ROW_BUCKETS = (1, 16, 64)     # a plan is tuned for each, at its upper bound
MAX_ROWS = ROW_BUCKETS[-1]
# one row: (BLOCK_N, BLOCK_K, num_warps, num_stages). Five more, (4, 1024, 4, 3), (4, 2048, 4, 2),
# (8, 256, 4, 6), (16, 256, 4, 4) and (8, 2048, 8, 2), won alone for every shape (q/k/v 3.55 ->
# 3.79 TB/s) and lost in the decode step on an H200 (257.5 vs 258.1 tok/s): not tried.
CONFIGS = [
    (8, 512, 4, 4), (16, 512, 4, 3), (16, 1024, 8, 2), (32, 256, 4, 4), (8, 1024, 4, 3),
]
# more rows (padded to 16 or 64 for tl.dot): (BLOCK_N, BLOCK_K, num_warps, num_stages), each tried
# whole and split over K (``auto_splits``); each is a compile at start-up
ROWS_CONFIGS = [(32, 256, 4, 4), (64, 128, 4, 3)]


SMEM_BYTES = 200 << 10

# neighbours short enough that a one-row kernel behind them loads its first weight tile before the
# PDL wait (``_row_product``): on an H200 that took batch-1 decode from 251.3 to 256.7 tok/s
# (q/k/v and gate ‖ up behind their norms, o_proj behind the attention)
PRELOAD_BEHIND = (NORM, ATTN)


def _preload(kind: str) -> bool:
    """Whether a one-row kernel behind this kind of neighbour loads its first weight tile early."""
    return kind in PRELOAD_BEHIND


def _fit_stages(stages: int, bytes_per_stage: int) -> int:
    """Fewer pipeline stages where the tiles of a config would not fit in shared memory (fp32,
    wide K tiles, the padded rows of the dot path)."""
    while stages > 1 and stages * bytes_per_stage > SMEM_BYTES:
        stages -= 1
    return stages


@triton.jit
def _w_tile(w_ptr, s_wn, n, nm, k, km):
    """A [BLOCK_N, BLOCK_K] tile of W, loaded evict-first: each weight is read once per step, and
    keeping it out of L2's way measured 6 % faster at batch 1."""
    return tl.load(w_ptr + n[:, None] * s_wn + k[None, :], mask=nm[:, None] & km[None, :], other=0.0,
                   eviction_policy="evict_first")


@triton.jit
def _store_row(y_ptr, b_ptr, n, nm, y, HAS_BIAS: tl.constexpr):
    """One row: add the bias to the [BLOCK_N] sums, store."""
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=nm, other=0.0).to(tl.float32)
    tl.store(y_ptr + n, y.to(y_ptr.dtype.element_ty), mask=nm)


@triton.jit
def _store_rows(y_ptr, b_ptr, s_ym, n, nm, m, mm, acc, HAS_BIAS: tl.constexpr):
    """Padded rows: add the bias to the [BLOCK_M, BLOCK_N] dot result, store the real rows."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=nm, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + m[:, None] * s_ym + n[None, :], acc.to(y_ptr.dtype.element_ty), mask=mm[:, None] & nm[None, :])


@triton.jit
def _row_product(x_ptr, w_ptr, s_wn, n, nm, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SILU: tl.constexpr,
                 PRE: tl.constexpr, PDL: tl.constexpr):
    """x · W[n] for one row x ([1, K], or gate ‖ up [1, 2K] with SILU) over the weight rows n:
    float32 FMAs summed once at the end -> [BLOCK_N] float32.

    PRE: the first weight tile is loaded before the PDL wait (a weight: nothing in the chain writes
    it), so that it streams while the kernel in front finishes. That pays where the kernel in
    front is short (a norm, the attention) and leaves most of the GPU idle (``PRELOAD_BEHIND``).
    Preloading in every one-row GEMV measured 2-7 % slower on an H200: behind a long kernel the
    early programs hold registers and slots its later waves need."""
    release(PDL)
    k = tl.arange(0, BLOCK_K)
    km = k < K
    if PRE:
        w0 = _w_tile(w_ptr, s_wn, n, nm, k, km)
    wait(PDL)
    acc1 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    if PRE:
        acc1 = _fma_tile(acc1, w0, x_ptr, k, km, K, SILU)
    for k0 in range(BLOCK_K * PRE, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        km = k < K
        acc1 = _fma_tile(acc1, _w_tile(w_ptr, s_wn, n, nm, k, km), x_ptr, k, km, K, SILU)
    return tl.sum(acc1, 1)


@triton.jit
def _fma_tile(acc1, w, x_ptr, k, km, K, SILU: tl.constexpr):
    """acc1 + a weight tile times the matching tile of x (silu(gate) * up of it with SILU)."""
    x = tl.load(x_ptr + k, mask=km, other=0.0)
    if SILU:
        x = silu_mul(x, tl.load(x_ptr + K + k, mask=km, other=0.0))
    return acc1 + w.to(tl.float32) * x.to(tl.float32)[None, :]


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, s_wn,
                 HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SILU: tl.constexpr,
                 PRE: tl.constexpr, PDL: tl.constexpr):
    """One row: y[n] = x · W[n] (+ b) for BLOCK_N rows n of W per program. SILU: x holds
    gate ‖ up ([1, 2K]) and the kernel multiplies silu(gate) * up on the fly."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < N
    y = _row_product(x_ptr, w_ptr, s_wn, n, nm, K, BLOCK_N, BLOCK_K, SILU, PRE, PDL)
    _store_row(y_ptr, b_ptr, n, nm, y, HAS_BIAS)


@triton.jit
def _qkv_rope_kernel(x_ptr, w_ptr, b_ptr, pos_ptr, cs_ptr, slot_ptr, q_ptr, kc_ptr, vc_ptr, K, s_wn, s_qh, s_cs, s_ch,
                     H, Hkv, HAS_BIAS: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, PRE: tl.constexpr, PDL: tl.constexpr):
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
    y = _row_product(x_ptr, w_ptr, s_wn, n, nm, K, BLOCK_N, BLOCK_K, False, PRE, PDL)
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=nm, other=0.0).to(tl.float32)
    y = y.to(q_ptr.dtype.element_ty)
    if rotated:
        x1, x2 = tl.split(tl.reshape(y, [BLOCK_N // 2, 2]))
        x1 = x1.to(tl.float32)
        x2 = x2.to(tl.float32)
        r1 = x1 * cos - x2 * sin
        r2 = x2 * cos + x1 * sin
        if head < H:
            dst = q_ptr + head * s_qh
        else:
            dst = kc_ptr + slot * s_cs + (head - H) * s_ch
        tl.store(dst + j, r1.to(dst.dtype.element_ty))
        tl.store(dst + D // 2 + j, r2.to(dst.dtype.element_ty))
    else:
        vh = head - H - Hkv
        tl.store(vc_ptr + slot * s_cs + vh * s_ch + col0 % D + r, y.to(vc_ptr.dtype.element_ty))


@triton.jit
def _gate_up_silu_kernel(x_ptr, w_ptr, b_ptr, a_ptr, I, K, s_wn, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, PRE: tl.constexpr, PDL: tl.constexpr):
    """The gate ‖ up projection of one token with SiLU-and-mul as its epilogue: a program takes
    BLOCK_N // 2 pairs of rows (gate j and up j, interleaved) and writes silu(gate) * up for
    them, so the down projection reads I values instead of 2I and computes no SiLU. Outputs are
    rounded to the model's dtype before the SiLU, as when the two run apart: the same bits."""
    r = tl.arange(0, BLOCK_N)
    j0 = tl.program_id(0) * (BLOCK_N // 2)
    n = j0 + r // 2 + (r % 2) * I
    nm = j0 + r // 2 < I
    y = _row_product(x_ptr, w_ptr, s_wn, n, nm, K, BLOCK_N, BLOCK_K, False, PRE, PDL)
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=nm, other=0.0).to(tl.float32)
    gate, up = tl.split(tl.reshape(y.to(a_ptr.dtype.element_ty), [BLOCK_N // 2, 2]))
    j = j0 + tl.arange(0, BLOCK_N // 2)
    tl.store(a_ptr + j, silu_mul(gate, up), mask=j < I)


@triton.jit
def _rows_kernel(x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, count_ptr, M, N, K, k_per_split, s_xm, s_wn, s_ym,
                 HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PREC: tl.constexpr, SILU: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr):
    """Up to BLOCK_M rows, padded for tensor-core dots; program (n, s) multiplies K-slice s.
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
            _store_rows(y_ptr, b_ptr, s_ym, n, nm, m, mm, acc, HAS_BIAS)
    else:
        _store_rows(y_ptr, b_ptr, s_ym, n, nm, m, mm, acc, HAS_BIAS)


_COUNTS: dict[torch.device, torch.Tensor] = {}


def _counts(device: torch.device, tiles: int) -> torch.Tensor | None:
    """The split-K counters of a device (zero between kernels: the last slice resets its own),
    made on first use — the tuner's warm-up, before any CUDA graph is captured. None when a
    weight has more column tiles than there are counters."""
    if device not in _COUNTS:
        _COUNTS[device] = torch.zeros(1 << 16, dtype=torch.int32, device=device)
    return _COUNTS[device] if tiles <= _COUNTS[device].numel() else None


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: tuple[int, ...] = CONFIGS[1], silu: bool = False, use_pdl: bool = False,
         preload: bool = False) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS), weight [N, K] -> [M, N]. With ``silu``, x is [M, 2K] = gate ‖ up
    and the product is silu(gate) * up times Wᵀ. config: (BLOCK_N, BLOCK_K, warps, stages) for
    one row; for more, a ROWS_CONFIGS entry (BLOCK_N, BLOCK_K, warps, stages, K slices). ``use_pdl``:
    launch with programmatic dependent launch where the GPU has it (``pdl``); ``preload``: one row
    loads its first weight tile before the PDL wait (``PRELOAD_BEHIND``)."""
    M = x.shape[0]
    N, K = weight.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    bias_arg = bias if bias is not None else weight
    if M == 1:
        bn, bk, warps, stages = _row_tile(config, x, silu)
        _gemv_kernel[(triton.cdiv(N, bn),)](
            x, weight, bias_arg, y, N, K, weight.stride(0), HAS_BIAS=bias is not None, BLOCK_N=bn, BLOCK_K=bk,
            SILU=silu, PRE=preload, num_warps=warps, num_stages=stages, **pdl.launch(x, use_pdl))
        return y
    bn, bk, warps, stages, splits = _rows_tile(config)
    bm = max(16, bucket(M))                            # the rows the plan was tuned at: one compile each
    tiles = triton.cdiv(N, bn)
    k_per = triton.cdiv(triton.cdiv(K, splits), bk) * bk
    splits = triton.cdiv(K, k_per)
    counts = _counts(x.device, tiles) if splits > 1 else None
    if counts is None:
        splits, k_per = 1, K
    part = torch.empty(splits, M, N, dtype=torch.float32, device=x.device) if splits > 1 else y
    stages = _fit_stages(stages, (bn * bk + bm * bk * (2 if silu else 1)) * x.element_size())
    _rows_kernel[(tiles, splits)](
        x, weight, bias_arg, y, part, counts if counts is not None else y, M, N, K, k_per,
        x.stride(0), weight.stride(0), y.stride(0), HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        PREC="ieee" if x.dtype == torch.float32 else "tf32", SILU=silu, SPLIT=splits > 1, num_warps=warps,
        num_stages=stages, **pdl.launch(x, use_pdl))
    return y


def qkv_rope(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, positions: torch.Tensor,
             cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
             num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor | None:
    """For one token behind its norm, where the tuner chose the skinny kernel for the q/k/v
    weight: the projection, rotary and the K/V write in one kernel (``_qkv_rope_kernel``);
    returns the rotated q [1, H, D]. None where it does not apply (more rows, cuBLAS chosen, a
    tile that does not divide the head)."""
    if x.dim() != 2 or x.shape[0] != 1:
        return None
    plan = choice(weight, NORM, 1)
    D = head_dim
    if plan.kernel != "gemv" or D % plan.config[0] or plan.config[0] % 2 or D % 2:
        return None
    if x.stride(-1) != 1:
        x = x.contiguous()
    bn, bk, warps, stages = _row_tile(plan.config, x)
    H, Hkv = num_heads, num_kv_heads
    q = torch.empty(1, H, D, dtype=x.dtype, device=x.device)
    kc, vc = k_cache.view(-1, Hkv, D), v_cache.view(-1, Hkv, D)
    _qkv_rope_kernel[((H + 2 * Hkv) * D // bn,)](
        x, weight, bias if bias is not None else weight, positions, cos_sin, slot_mapping, q, kc, vc, x.shape[1],
        weight.stride(0), q.stride(1), kc.stride(0), kc.stride(1), H, Hkv, HAS_BIAS=bias is not None, D=D,
        BLOCK_N=bn, BLOCK_K=bk, PRE=_preload(NORM), num_warps=warps, num_stages=stages,
        **pdl.launch(x, plan.pdl))
    return q


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 down_weight: torch.Tensor) -> torch.Tensor | None:
    """For one token behind its norm: silu(gate) * up [1, I] straight from the gate ‖ up
    projection (``_gate_up_silu_kernel``), where ``tune_gate_up_silu`` measured that path faster
    than the projections apart, with the config it chose. None elsewhere (then: the projection,
    then ``silu_and_mul_linear``)."""
    if x.dim() != 2 or x.shape[0] != 1:
        return None
    plan = _ACT.get((_key(weight, NORM, 1), _key(down_weight, PLAIN, 1)))
    return None if plan is None else _gate_up_silu(x, weight, bias, plan)


def _gate_up_silu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, plan: Plan) -> torch.Tensor:
    if x.stride(-1) != 1:
        x = x.contiguous()
    bn, bk, warps, stages = _row_tile(plan.config, x)
    I = weight.shape[0] // 2
    act = torch.empty(1, I, dtype=x.dtype, device=x.device)
    _gate_up_silu_kernel[(triton.cdiv(I, bn // 2),)](
        x, weight, bias if bias is not None else weight, act, I, x.shape[1], weight.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=bn, BLOCK_K=bk, PRE=_preload(NORM), num_warps=warps,
        num_stages=stages, **pdl.launch(x, plan.pdl))
    return act


def _row_tile(config: tuple[int, ...], x: torch.Tensor, silu: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, stages) of a one-row config for input x (gate ‖ up with silu),
    the stages cut to what fits in shared memory."""
    bn, bk, warps, stages = config[:4]
    return bn, bk, warps, _fit_stages(stages, (bn * bk + bk * (2 if silu else 1)) * x.element_size())


def _rows_tile(config: tuple[int, ...]) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, stages, K slices) of a config for more than one row: a
    tensor-core dot needs 16 columns; a 4-entry config is unsplit."""
    bn, bk, warps, stages, splits = config if len(config) == 5 else (*config, 1)
    return max(bn, 16), bk, warps, stages, splits


def auto_splits(N: int, K: int, config: tuple[int, ...], num_sms: int) -> int:
    """K slices that give about two programs per SM for a tile config (at least 4 K steps each)."""
    bn, bk = _rows_tile(config)[:2]
    return max(1, min(triton.cdiv(2 * num_sms, triton.cdiv(N, bn)), K // (4 * bk)))


class Plan(NamedTuple):
    """How one (weight shape, neighbour) runs at decode batches of a bucket of row counts
    (ROW_BUCKETS: one row, and up to each larger bound; each takes its own code path or tile).

    kernel: "cublas" (the neighbour as its own kernel, then F.linear) or "gemv" (the skinny kernel;
    for SILU with the SiLU fused in, for NORM after the norm kernel; one row behind the kinds in
    PRELOAD_BEHIND loads its first weight tile early). config: the tile config; pdl: launched
    with PDL."""
    kernel: str
    config: tuple[int, ...] | None = None
    pdl: bool = False

    def __str__(self) -> str:
        return self.kernel if self.config is None else f"{self.kernel}{self.config}{'+pdl' if self.pdl else ''}"


CUBLAS = Plan("cublas")

# (N, K, dtype, neighbour, row bucket) -> the measured fastest Plan
_CHOICE: dict[tuple[int, int, torch.dtype, str, int], Plan] = {}
# (gate ‖ up key behind a norm, down key on a ready input), one row -> the gate ‖ up plan of the
# fused path (``gate_up_silu``), or None where the projections apart measured faster
_ACT: dict[tuple[tuple, tuple], Plan | None] = {}


def bucket(rows: int) -> int:
    """The row bucket (its upper bound) that a batch of ``rows`` rows is tuned and run as."""
    return next(b for b in ROW_BUCKETS if rows <= b)


def _key(weight: torch.Tensor, kind: str, rows: int) -> tuple[int, int, torch.dtype, str, int]:
    return weight.shape[0], weight.shape[1], weight.dtype, kind, bucket(rows)


def choice(weight: torch.Tensor, kind: str = PLAIN, rows: int = 1) -> Plan:
    return _CHOICE.get(_key(weight, kind, rows), CUBLAS)


def _time(fn, copies: int, reps: int = 24) -> float:
    """Milliseconds per call of fn(i) (i picks one of ``copies`` weight copies), replayed from a
    CUDA graph as decode runs, so launch overhead does not hide the kernel's own speed."""
    for i in range(3):
        fn(i % copies)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            fn(i % copies)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / (3 * reps)


def _candidates(kind: str, x: torch.Tensor, r: torch.Tensor, g: torch.Tensor, ws: list[torch.Tensor]):
    """Each Plan for the neighbour kind, as fn(i) over the weight copies, neighbour included. One
    row: every config with and without PDL; more: every config whole and split over K, with PDL
    where the GPU has it (fewer compiles at start-up), SiLU as its own kernel."""
    if x.shape[0] == 1:
        plans = [Plan("gemv", cfg, p) for cfg in CONFIGS for p in ((False, True) if pdl.enabled(x) else (False,))]
    else:
        N, K = ws[0].shape
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        plans = [Plan("gemv", (*cfg, k), pdl.enabled(x)) for cfg in ROWS_CONFIGS
                 for k in sorted({1, auto_splits(N, K, cfg, sms)})]
    if kind == SILU:
        yield CUBLAS, lambda i: F.linear(triton_ops.silu_and_mul(x), ws[i])
        # with more rows every column tile recomputes SiLU over [rows, K]: 3-10x slower than
        # cuBLAS on an H200 (tools/bench_gemv.py), so not tried
        for p in plans if x.shape[0] == 1 else []:
            yield p, lambda i, p=p: _apply(p, x, ws[i], silu=True)
    elif kind == NORM:
        yield CUBLAS, lambda i: F.linear(triton_ops.fused_add_rms_norm(x, r, g, 1e-6)[0], ws[i])
        for p in plans:
            yield p, lambda i, p=p: _apply(p, triton_ops.fused_add_rms_norm(x, r, g, 1e-6)[0], ws[i],
                                           preload=_preload(NORM))
    else:   # PLAIN, ATTN: timed back to back
        yield CUBLAS, lambda i: F.linear(x, ws[i])
        for p in plans:
            yield p, lambda i, p=p: _apply(p, x, ws[i], preload=_preload(kind))


def tune(weights: list[tuple[torch.Tensor, str]], rows: tuple[int, ...] = ROW_BUCKETS,
         l2_bytes: int = 256 << 20) -> dict[str, float]:
    """Measure every Plan on each distinct (weight shape, neighbour) at each row bucket's upper
    bound; remember the fastest for each. Returns the bandwidth each reaches (GB/s of weight), for
    the log."""
    report: dict[str, float] = {}
    for (w, kind), n_rows in [(wk, n) for n in rows for wk in weights]:
        if w.dim() != 2 or not w.is_cuda or _key(w, kind, n_rows) in _CHOICE:
            continue
        best, ms = _tune_one(w, kind, n_rows, l2_bytes)
        _CHOICE[_key(w, kind, n_rows)] = best
        report[f"{w.shape[0]}x{w.shape[1]}/{kind}/rows={n_rows}:{best}"] = w.numel() * w.element_size() / ms / 1e6
    return report


def tune_gate_up_silu(pairs: list[tuple[torch.Tensor, torch.Tensor]], l2_bytes: int = 256 << 20) -> dict[str, float]:
    """For each distinct (gate ‖ up, down) pair of weights, one token through the MLP two ways,
    each timed as the chain it runs as: the norm, gate ‖ up and down with SiLU in front, each as
    tuned (``tune``); against the norm, gate ‖ up with SiLU-and-mul as its epilogue (every
    one-row config, with and without PDL) and down on the ready input as tuned for one row of
    PLAIN. Remembers the fused plan where one wins (``gate_up_silu``). Timing the pair, not each
    kernel alone, matters: configs of gate ‖ up that tie alone differ by 9 % in a decode step.
    Returns GB/s of both weights for the log."""
    report: dict[str, float] = {}
    for gu, down in pairs:
        key = (_key(gu, NORM, 1), _key(down, PLAIN, 1))
        if not gu.is_cuda or key in _ACT or gu.shape[0] % 2:
            continue
        # the plans of each side (``tune`` skips those already tuned), down on a ready input too
        report.update(tune([(gu, NORM), (down, SILU), (down, PLAIN)], rows=(1,), l2_bytes=l2_bytes))
        gus, downs = _copies(gu, l2_bytes), _copies(down, l2_bytes)
        n = max(len(gus), len(downs))
        K = gu.shape[1]
        x, r = (torch.randn(1, K, dtype=gu.dtype, device=gu.device) for _ in range(2))
        g = torch.ones(K, dtype=gu.dtype, device=gu.device)
        norm = lambda: triton_ops.fused_add_rms_norm(x, r, g, 1e-6)[0]  # noqa: E731
        gu_plan, silu_plan, plain_plan = choice(gu, NORM, 1), choice(down, SILU, 1), choice(down, PLAIN, 1)

        def apart(i):
            y = _apply(gu_plan, norm(), gus[i % len(gus)], preload=_preload(NORM))
            _apply(silu_plan, y, downs[i % len(downs)], silu=True)

        best, best_ms = None, _time(apart, n)
        for plan in [Plan("gemv", cfg, p) for cfg in CONFIGS if cfg[0] % 2 == 0
                     for p in ((False, True) if pdl.enabled(x) else (False,))]:
            def fused(i, plan=plan):
                _apply(plain_plan, _gate_up_silu(norm(), gus[i % len(gus)], None, plan), downs[i % len(downs)])
            try:
                ms = _time(fused, n)
            except Exception:  # a config the compiler rejects on this GPU
                continue
            if ms < best_ms:
                best, best_ms = plan, ms
        _ACT[key] = best
        nbytes = (gu.numel() + down.numel()) * gu.element_size()
        report[f"{gu.shape[0]}x{gu.shape[1]}+{down.shape[0]}x{down.shape[1]}/mlp/rows=1:{best or 'apart'}"] = \
            nbytes / best_ms / 1e6
    return report


def _apply(plan: Plan, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
           silu: bool = False, preload: bool = False) -> torch.Tensor:
    """x Wᵀ (+ b) by a plan: the skinny kernel or cuBLAS (with silu(gate) * up of x in front)."""
    if plan.kernel == "gemv":
        return gemv(x, w, bias, plan.config, silu=silu, use_pdl=plan.pdl, preload=preload)
    return F.linear(triton_ops.silu_and_mul(x) if silu else x, w, bias)


def _copies(w: torch.Tensor, l2_bytes: int) -> list[torch.Tensor]:
    """w and random copies of it, together larger than L2: timing reads them from memory."""
    nbytes = w.numel() * w.element_size()
    return [w] + [torch.randn_like(w) for _ in range(min(31, -(-l2_bytes // nbytes) - 1))]


def _tune_one(w: torch.Tensor, kind: str, rows: int, l2_bytes: int) -> tuple[Plan, float]:
    """The fastest Plan for one weight shape and neighbour at ``rows`` rows, and its time (ms)."""
    ws = _copies(w, l2_bytes)
    K = w.shape[1]
    x = torch.randn(rows, 2 * K if kind == SILU else K, dtype=w.dtype, device=w.device)
    r = torch.randn(rows, K, dtype=w.dtype, device=w.device)
    g = torch.ones(K, dtype=w.dtype, device=w.device)
    best, best_ms = CUBLAS, float("inf")
    for plan, fn in _candidates(kind, x, r, g, ws):
        try:
            ms = _time(fn, len(ws))
        except Exception:  # a config the compiler rejects on this GPU
            continue
        if ms < best_ms:
            best, best_ms = plan, ms
    return best, best_ms


def silu_and_mul_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up times Wᵀ for small batches, as tuned (the SiLU fused into the skinny
    kernel, or its own kernel then cuBLAS); None for larger ones."""
    if x.dim() == 2 and x.shape[0] <= MAX_ROWS:
        return _apply(choice(weight, SILU, x.shape[0]), x, weight, silu=True)
    return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kind: str = PLAIN) -> torch.Tensor:
    """F.linear, or the skinny kernel tuned for this weight behind its ``kind`` of neighbour, for
    decode batches of at most MAX_ROWS rows."""
    if x.dim() == 2 and x.shape[0] <= MAX_ROWS:
        return _apply(choice(weight, kind, x.shape[0]), x, weight, bias, preload=_preload(kind))
    return F.linear(x, weight, bias)
