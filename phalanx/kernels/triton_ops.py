"""Triton kernels for the per-token ops; each mirrors a torch reference in ``reference.py``.

RMSNorm (+ fused residual add), rotary embedding of q and k fused with the K/V write into the
paged pool (one launch per layer), SiLU-and-mul, and the partial-reuse block copy. Shapes are in
the docstrings; every kernel is checked against its reference by tests/kernels (interpreter on
CPU, full sweep on a GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from phalanx.kernels import attention_ref, pdl
from phalanx.kernels.attention_ref import UNIT_KV_SCALE, HeadNorms, KvScale, inverse_kv_scale
from phalanx.kernels.pdl import prologue, release, wait


def _pow2(n: int) -> int:
    return triton.next_power_of_2(n)


# -- RMSNorm ---------------------------------------------------------------------------------------
@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, s_ptr, stride_x, stride_r, stride_o,
                     H, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
                     FP8_OUT: tl.constexpr = False, FMAX: tl.constexpr = 448.0, TINY: tl.constexpr = 1e-12,
                     UNIT_OFFSET: tl.constexpr = False):
    """One row. ``FP8_OUT``: the normed row leaves quantized (``quantize_row``), its scale in s_ptr.
    ``UNIT_OFFSET`` (Gemma): scaled by 1 + w in float32, then rounded (reference.rms_norm_ref)."""
    release(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)     # a weight: read before the wait
    wait(PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RES:
        x = x + tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        tl.store(res_out_ptr + row * H + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / H + eps)
    if UNIT_OFFSET:   # noqa: SIM108 - a constexpr branch: one of the two is compiled
        y = (xf * rstd * (1.0 + w.to(tl.float32))).to(x.dtype)
    else:
        y = (xf * rstd).to(x.dtype) * w
    if FP8_OUT:
        quantize_row(y, out_ptr + row * stride_o + cols, mask, s_ptr + row, FMAX, TINY)
    else:
        tl.store(out_ptr + row * stride_o + cols, y, mask=mask)


@triton.jit
def quantize_row(y, q_ptrs, mask, s_ptr, FMAX: tl.constexpr, TINY: tl.constexpr):
    """A whole row held by one program -> e4m3 at ``q_ptrs`` with its scale max |y| / FMAX at
    ``s_ptr``: what ``_quantize_rows_kernel`` computes from the row in memory, so that a fused
    producer and the kernels apart give the same bytes."""
    yf = y.to(tl.float32)
    scale = tl.maximum(tl.max(tl.where(mask, tl.abs(yf), 0.0), 0) / FMAX, TINY)
    tl.store(s_ptr, scale)
    q = tl.minimum(tl.maximum(yf / scale, -FMAX), FMAX)
    tl.store(q_ptrs, q.to(q_ptrs.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """A 2-D [rows, H] view with unit column stride (copies only when it must)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
    """x [..., H] -> [..., H]."""
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    H = x2.shape[1]
    _rms_norm_kernel[(x2.shape[0],)](x2, x2, weight, out, out, out, x2.stride(0), 0, out.stride(0), H, eps,
                                     HAS_RES=False, BLOCK=_pow2(H), UNIT_OFFSET=unit_offset, **pdl.launch(x2))
    return out.view(x.shape)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       unit_offset: bool = False):
    """(x + residual) -> (rms_norm of it, the sum as the new residual); x, residual [T, H]."""
    x2, r2 = _rows(x), _rows(residual)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    res_out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    H = x2.shape[1]
    _rms_norm_kernel[(x2.shape[0],)](x2, r2, weight, out, res_out, out, x2.stride(0), r2.stride(0), out.stride(0),
                                     H, eps, HAS_RES=True, BLOCK=_pow2(H), UNIT_OFFSET=unit_offset, **pdl.launch(x2))
    return out.view(x.shape), res_out.view(x.shape)


def rms_norm_fp8(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, fmax: float,
                 tiny: float, unit_offset: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """RMSNorm of x [T, H] (of x + residual, also returned as the new residual), quantized per row
    in the same kernel: (q [T, H] float8_e4m3fn, scale [T, 1] float32, new residual or None)."""
    x2 = _rows(x)
    T, H = x2.shape
    q = torch.empty(T, H, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(T, 1, dtype=torch.float32, device=x.device)
    r2 = _rows(residual) if residual is not None else x2
    res_out = torch.empty(x2.shape, dtype=x.dtype, device=x.device) if residual is not None else q
    if T:
        _rms_norm_kernel[(T,)](x2, r2, weight, q, res_out, scale, x2.stride(0), r2.stride(0), q.stride(0), H, eps,
                               HAS_RES=residual is not None, BLOCK=_pow2(H), FP8_OUT=True, FMAX=fmax, TINY=tiny,
                               UNIT_OFFSET=unit_offset, **pdl.launch(x2))
    return q, scale, res_out if residual is not None else None


# -- rotary + K/V write -----------------------------------------------------------------------------
@triton.jit
def _rotate(x1, x2, cos, sin):
    """Rotate-half of one head: (x1, x2) halves in float32 -> rotated halves."""
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def value_offsets(slot, vh, s_cs, s_ch, d, VB: tl.constexpr):
    """Where element d of KV head vh's value at a slot lives in a pool layer viewed as
    [slots, Hkv, D] (strides s_cs, s_ch): there, or with ``VB`` tokens a block (a key-minor pool,
    ``attention_ref.values_key_minor``; 0: rows) at [block, vh, d, slot % VB]."""
    if VB > 0:
        return (slot - slot % VB) * s_cs + vh * s_ch * VB + d * VB + slot % VB
    else:
        return slot * s_cs + vh * s_ch + d


@triton.jit
def value_to_pool(x, dtype: tl.constexpr, VB: tl.constexpr, v_inv):
    """A value as the pool stores it: a key-minor pool (``VB`` > 0: an FP8 one) takes a NaN as 0
    and stores the value times ``v_inv`` (1 / its layer's V scale, ``attention_ref.KvScale``)."""
    if VB > 0:
        x = x.to(tl.float32)     # (the interpreter compares bf16 as bits: a NaN would equal itself)
        x = tl.where(x == x, x, 0.0) * v_inv
    return x.to(dtype)


@triton.jit
def key_to_pool(x, dtype: tl.constexpr, VB: tl.constexpr, k_inv):
    """A rotated key (float32) as the pool stores it: an FP8 pool (``VB`` > 0) the key times
    ``k_inv`` (1 / its layer's K scale)."""
    if VB > 0:
        x = x * k_inv
    return x.to(dtype)


def value_block(v_cache: torch.Tensor) -> int:
    """``VB`` of the kernels that write values: tokens a block for a key-minor pool, else 0."""
    return v_cache.shape[1] if attention_ref.values_key_minor(v_cache) else 0


@triton.jit
def _head_norm(x1, x2, w_ptr, i, eps, HALF: tl.constexpr, NORM: tl.constexpr):
    """Per-head RMSNorm of heads held as their two halves [heads, BLOCK] (masked lanes 0), as
    ``_rms_norm_kernel`` norms a row: NORM 1 scales the rounded rows by w, 2 (Gemma) by 1 + w in
    float32, then rounds; NORM 0 leaves them. Returned in float32, for the rotation."""
    if NORM == 0:
        return x1.to(tl.float32), x2.to(tl.float32)
    m = i < HALF
    w1 = tl.load(w_ptr + i, mask=m, other=0.0)
    w2 = tl.load(w_ptr + HALF + i, mask=m, other=0.0)
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    rstd = (1.0 / tl.sqrt((tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)) / (2 * HALF) + eps))[:, None]
    if NORM == 2:
        y1 = (f1 * rstd * (1.0 + w1.to(tl.float32))).to(x1.dtype)
        y2 = (f2 * rstd * (1.0 + w2.to(tl.float32))).to(x2.dtype)
    else:
        y1 = ((f1 * rstd).to(x1.dtype) * w1).to(x1.dtype)   # (stored in q's dtype, as the norm kernel's rows)
        y2 = ((f2 * rstd).to(x2.dtype) * w2).to(x2.dtype)
    return y1.to(tl.float32), y2.to(tl.float32)


@triton.jit
def _rope_qkv_kernel(pos_ptr, cs_ptr, slot_ptr, q_ptr, k_ptr, v_ptr, qo_ptr, kc_ptr, vc_ptr, qn_ptr, kn_ptr,
                     s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_ot, s_oh, s_cs, s_ch, H, k_inv, v_inv, eps,
                     HALF: tl.constexpr, BLOCK: tl.constexpr, QH: tl.constexpr, KVH: tl.constexpr,
                     VB: tl.constexpr, PDL: tl.constexpr, NORM: tl.constexpr = 0):
    """One launch for a whole layer: program (t, g) of token t rotates ``QH`` query heads from
    g·QH while those last (H is a multiple of QH), else rotates ``KVH`` KV heads and writes them,
    with their V, into the pool. NORM > 0 (Qwen3's and Gemma's q/k norms): each q and k head is
    RMS-normed first by its norm's weight (qn, kn; ``_head_norm``). Positions, slots and the
    cos/sin table are read before the PDL wait (written before the forward)."""
    release(PDL)
    t = tl.program_id(0)
    g = tl.program_id(1)
    i = tl.arange(0, BLOCK)[None, :]
    pos = tl.load(pos_ptr + t)
    cos = tl.load(cs_ptr + pos * (2 * HALF) + i, mask=i < HALF, other=0.0)
    sin = tl.load(cs_ptr + pos * (2 * HALF) + HALF + i, mask=i < HALF, other=0.0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    wait(PDL)
    if g * QH < H:   # the two branches store apart: the pool's dtype may differ from q's (an FP8 pool)
        hh = g * QH + tl.arange(0, QH)[:, None]
        m = (i < HALF) & (hh < H)        # (hh < H holds: it gives the mask its [QH, BLOCK] shape)
        base = q_ptr + t * s_qt + hh * s_qh
        q1, q2 = _head_norm(tl.load(base + i, mask=m, other=0.0), tl.load(base + HALF + i, mask=m, other=0.0),
                            qn_ptr, i, eps, HALF, NORM)
        r1, r2 = _rotate(q1, q2, cos, sin)
        # each branch names its own pointer: Triton merges a name both branches assign
        qd = qo_ptr + t * s_ot + hh * s_oh
        tl.store(qd + i, r1.to(qo_ptr.dtype.element_ty), mask=m)
        tl.store(qd + HALF + i, r2.to(qo_ptr.dtype.element_ty), mask=m)
    else:
        kvh = (g - H // QH) * KVH + tl.arange(0, KVH)[:, None]
        mk = (i < HALF) & (kvh >= 0)      # (kvh >= 0 holds: it gives the mask its [KVH, BLOCK] shape)
        kb = k_ptr + t * s_kt + kvh * s_kh        # names of their own: the two branches' shapes differ
        vb = v_ptr + t * s_vt + kvh * s_vh
        for half in tl.static_range(2):
            tl.store(vc_ptr + value_offsets(slot, kvh, s_cs, s_ch, half * HALF + i, VB),
                     value_to_pool(tl.load(vb + half * HALF + i, mask=mk, other=0.0), vc_ptr.dtype.element_ty, VB,
                                   v_inv), mask=mk)
        k1, k2 = _head_norm(tl.load(kb + i, mask=mk, other=0.0), tl.load(kb + HALF + i, mask=mk, other=0.0),
                            kn_ptr, i, eps, HALF, NORM)
        k1, k2 = _rotate(k1, k2, cos, sin)
        kd = kc_ptr + slot * s_cs + kvh * s_ch
        tl.store(kd + i, key_to_pool(k1, kc_ptr.dtype.element_ty, VB, k_inv), mask=mk)
        tl.store(kd + HALF + i, key_to_pool(k2, kc_ptr.dtype.element_ty, VB, k_inv), mask=mk)


ROPE_MAX_HEADS = 8     # heads a program of the rotary + K/V write kernel takes at most


def rope_heads(n: int) -> int:
    """Heads of one kind (query or KV) a program takes: the largest power of two up to
    ``ROPE_MAX_HEADS`` that divides their count, so that no program holds both kinds. One head
    a program left ~20k programs of 64 lanes for 512 tokens of Llama-3.1-8B: 26 µs a layer for
    ~10 MB (11 µs with 8; docs/gpu_notes.md, twenty-second round)."""
    heads = 1
    while heads < ROPE_MAX_HEADS and n % (2 * heads) == 0:
        heads *= 2
    return heads


def rope_and_write_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, kv_scale: KvScale = UNIT_KV_SCALE,
                      qk_norm: HeadNorms | None = None) -> torch.Tensor:
    """Rotate q (returned, contiguous) and k; write rotated k and v into the paged pool.

    q [T, H, D], k/v [T, Hkv, D]; k_cache/v_cache [num_blocks, B, Hkv, D] (an FP8 pool's values
    key-minor, ``attention_ref.values_key_minor``, and K and V divided by ``kv_scale``);
    slot_mapping [T]. ``qk_norm``: q and k heads RMS-normed first, in the same launch."""
    T, H, D = q.shape
    Hkv = k.shape[1]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if T:
        kc, vc = k_cache.view(-1, Hkv, D), v_cache.view(-1, Hkv, D)
        qh, kvh = rope_heads(H), rope_heads(Hkv)
        qn, kn, eps, norm = (q, q, 0.0, 0) if qk_norm is None else (*qk_norm[:3], 2 if qk_norm.unit_offset else 1)
        _rope_qkv_kernel[(T, H // qh + Hkv // kvh)](
            positions, cos_sin, slot_mapping, q, k, v, q_out, kc, vc, qn, kn, q.stride(0), q.stride(1), k.stride(0),
            k.stride(1), v.stride(0), v.stride(1), q_out.stride(0), q_out.stride(1), kc.stride(0), kc.stride(1), H,
            *inverse_kv_scale(kv_scale), eps, HALF=D // 2, BLOCK=_pow2(D // 2), QH=qh, KVH=kvh,
            VB=value_block(v_cache), NORM=norm, **pdl.launch(q))
    return q_out


# -- SiLU and mul -------------------------------------------------------------------------------------
@triton.jit
def silu_mul(gate, up):
    """silu(gate) * up, the sigmoid in float32, the product in up's dtype (as the reference)."""
    g = gate.to(tl.float32)
    return (g / (1.0 + tl.exp(-g))).to(up.dtype) * up


@triton.jit
def gelu_tanh_mul(gate, up):
    """gelu(gate) * up with GELU's tanh approximation, the GELU in float32 (tanh(y) written as
    1 − 2 / (1 + e^2y), which saturates to ±1 at either end), the product in up's dtype."""
    g = gate.to(tl.float32)
    y = 0.7978845608028654 * (g + 0.044715 * g * g * g)   # sqrt(2 / pi) (g + 0.044715 g^3)
    t = 1.0 - 2.0 / (1.0 + tl.exp(2.0 * y))
    return (0.5 * g * (1.0 + t)).to(up.dtype) * up


@triton.jit
def _gated_block(x_ptr, out_ptr, stride_x, stride_o, N, GELU: tl.constexpr, BLOCK: tl.constexpr):
    """A block of one row's act(gate) * up (SiLU, or GELU's tanh form)."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < N
    gate = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0)
    up = tl.load(x_ptr + row * stride_x + N + cols, mask=m, other=0.0)
    if GELU:   # noqa: SIM108 - a constexpr branch: one of the two is compiled
        y = gelu_tanh_mul(gate, up)
    else:
        y = silu_mul(gate, up)
    tl.store(out_ptr + row * stride_o + cols, y, mask=m)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, N, BLOCK: tl.constexpr, PDL: tl.constexpr):
    prologue(PDL)
    _gated_block(x_ptr, out_ptr, stride_x, stride_o, N, False, BLOCK)


@triton.jit
def _gelu_tanh_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, N, BLOCK: tl.constexpr, PDL: tl.constexpr):
    prologue(PDL)
    _gated_block(x_ptr, out_ptr, stride_x, stride_o, N, True, BLOCK)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2N] (gate ‖ up) -> silu(gate) * up [T, N]."""
    return _gated(x, _silu_mul_kernel)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2N] (gate ‖ up) -> gelu_tanh(gate) * up [T, N] (Gemma's MLP)."""
    return _gated(x, _gelu_tanh_mul_kernel)


def _gated(x: torch.Tensor, kernel) -> torch.Tensor:
    T, N2 = x.shape
    N = N2 // 2
    out = torch.empty(T, N, dtype=x.dtype, device=x.device)
    if T:
        BLOCK = min(1024, _pow2(N))
        kernel[(T, triton.cdiv(N, BLOCK))](x, out, x.stride(0), out.stride(0), N, BLOCK=BLOCK, **pdl.launch(x))
    return out


# a program holds a whole row of silu(gate) * up (its amax comes before the first store): rows up to
# this many elements (Llama-3.1-70B's 28,672 at one rank); wider ones take the two kernels apart
SILU_FP8_MAX_ROW = 32768


@triton.jit
def _silu_mul_fp8_kernel(x_ptr, q_ptr, s_ptr, stride_x, stride_q, N, FMAX: tl.constexpr, TINY: tl.constexpr,
                         BLOCK: tl.constexpr, PDL: tl.constexpr):
    prologue(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    m = cols < N
    y = silu_mul(tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0),
                 tl.load(x_ptr + row * stride_x + N + cols, mask=m, other=0.0))
    quantize_row(y, q_ptr + row * stride_q + cols, m, s_ptr + row, FMAX, TINY)


def silu_and_mul_fp8(x: torch.Tensor, fmax: float, tiny: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, 2N] (gate ‖ up) -> silu(gate) * up quantized per row, one kernel: (q [T, N]
    float8_e4m3fn, scale [T, 1] float32); N ≤ ``SILU_FP8_MAX_ROW``."""
    T, N2 = x.shape
    N = N2 // 2
    if _pow2(N) > SILU_FP8_MAX_ROW:
        raise ValueError(f"silu_and_mul_fp8: rows of {N} elements, at most {SILU_FP8_MAX_ROW}")
    q = torch.empty(T, N, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(T, 1, dtype=torch.float32, device=x.device)
    if T:
        BLOCK = _pow2(N)
        _silu_mul_fp8_kernel[(T,)](x, q, scale, x.stride(0), q.stride(0), N, FMAX=fmax, TINY=tiny, BLOCK=BLOCK,
                                   num_warps=max(4, min(16, BLOCK // 1024)), **pdl.launch(x))
    return q, scale


# -- FP8 activations -----------------------------------------------------------------------------------
@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, stride_x, stride_q, K, FMAX: tl.constexpr, TINY: tl.constexpr,
                          BLOCK: tl.constexpr, HELD: tl.constexpr, PDL: tl.constexpr):
    """One row: scale = max |x| / FMAX, q = x / scale in e4m3 (kernels/fp8.py quantize_rows). With
    ``HELD`` the row (at most BLOCK elements) is read once and held (``quantize_row``), else it
    is read twice, BLOCK elements at a time."""
    prologue(PDL)
    row = tl.program_id(0)
    if HELD:
        k = tl.arange(0, BLOCK)
        quantize_row(tl.load(x_ptr + row * stride_x + k, mask=k < K, other=0.0), q_ptr + row * stride_q + k, k < K,
                     s_ptr + row, FMAX, TINY)
    else:
        amax = tl.zeros([BLOCK], tl.float32)
        for k0 in range(0, K, BLOCK):
            k = k0 + tl.arange(0, BLOCK)
            amax = tl.maximum(amax, tl.abs(tl.load(x_ptr + row * stride_x + k, mask=k < K, other=0.0).to(tl.float32)))
        scale = tl.maximum(tl.max(amax, 0) / FMAX, TINY)
        tl.store(s_ptr + row, scale)
        for k0 in range(0, K, BLOCK):
            k = k0 + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + row * stride_x + k, mask=k < K, other=0.0).to(tl.float32)
            q = tl.minimum(tl.maximum(x / scale, -FMAX), FMAX)
            tl.store(q_ptr + row * stride_q + k, q.to(q_ptr.dtype.element_ty), mask=k < K)


# rows up to this many elements are held by their program and read once (Llama-3.1-8B's o
# projection input at 512 rows: 14 µs a layer with two passes of 2,048-element tiles)
QUANTIZE_ROW_HELD = 16384


def quantize_rows_fp8(x: torch.Tensor, fmax: float, tiny: float, held: int = QUANTIZE_ROW_HELD
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] float8_e4m3fn, scale [M, 1] float32): one kernel, a program a row."""
    M, K = x.shape
    q = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(M, 1, dtype=torch.float32, device=x.device)
    if M:
        BLOCK = min(held, _pow2(K))
        _quantize_rows_kernel[(M,)](x, q, scale, x.stride(0), q.stride(0), K, FMAX=fmax, TINY=tiny, BLOCK=BLOCK,
                                    HELD=K <= BLOCK, num_warps=max(4, min(16, BLOCK // 512)), **pdl.launch(x))
    return q, scale


# -- partial-reuse block copy --------------------------------------------------------------------------
@triton.jit
def _copy_blocks_kernel(pool_ptr, src_ptr, dst_ptr, n_ptr, stride_plane, stride_block, ROW: tl.constexpr,
                        BLOCK: tl.constexpr, MAX_ROWS: tl.constexpr):
    op = tl.program_id(0)
    plane = tl.program_id(1)            # layer * 2 + (K or V)
    src = tl.load(src_ptr + op).to(tl.int64)
    dst = tl.load(dst_ptr + op).to(tl.int64)
    n = tl.load(n_ptr + op)
    base = pool_ptr + plane.to(tl.int64) * stride_plane
    for r in range(0, MAX_ROWS):
        if r < n:
            for c in range(0, ROW, BLOCK):
                offs = c + tl.arange(0, BLOCK)
                m = offs < ROW
                val = tl.load(base + src * stride_block + r * ROW + offs, mask=m)
                tl.store(base + dst * stride_block + r * ROW + offs, val, mask=m)


def copy_blocks(kv_pool: torch.Tensor, src: list[int], dst: list[int], num_tokens: list[int]) -> None:
    """kv_pool [L, 2, num_blocks, B, Hkv, D]: rows [0, n) of block src -> block dst, every plane."""
    if not src:
        return
    L, two, NB, B, Hkv, D = kv_pool.shape
    # one copy from pinned memory, queued: a tensor made on the device from a list would copy
    # from pageable memory and wait for the stream, stalling the host until the device drains.
    # Each row padded to an even length: Triton specializes a pointer on 16-byte alignment, so
    # rows starting at n * 8 bytes compiled the kernel again for every other n while serving
    pad = [0] * (len(src) % 2)
    idx = torch.tensor([src + pad, dst + pad, num_tokens + pad], dtype=torch.int64)
    if kv_pool.device.type == "cuda":
        idx = idx.pin_memory().to(kv_pool.device, non_blocking=True)
    row = Hkv * D
    _copy_blocks_kernel[(len(src), L * two)](kv_pool, idx[0], idx[1], idx[2], kv_pool.stride(1),
                                             kv_pool.stride(2), ROW=row, BLOCK=min(1024, _pow2(row)), MAX_ROWS=B)
