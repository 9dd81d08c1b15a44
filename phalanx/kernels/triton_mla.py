"""Triton kernels of DeepSeek's absorbed latent attention (``models/deepseek.py``), checked
against the torch path of the same model (``reference.latent_rope_ref`` and
``attention_ref.paged_attention_ref`` over the one-plane pool).

The pool holds one row a token, [c ‖ k_pe]: the normed latent (R = kv_lora_rank wide, 512 for
the releases) and the rotated rope key (P = qk_rope_head_dim, 64). A query head is [q_lat ‖
q_pe] of the same widths; the values are the rows' first R dimensions.

* ``latent_rope_and_write``: one launch a layer for what the torch path does in ~25 small
  kernels — the latent's RMS norm, the rotation of k_pe and of every head's q_pe (adjacent
  pairs taken evens-then-odds where the checkpoint interleaves them, the order the pool keeps),
  the row's write into the pool, and q_pe into the query rows beside the absorbed q_lat.
* ``latent_decode``: decode over the latent rows. The general paged kernels take a 576-wide
  head padded to 1,024 and load each key row twice (as K, then as V); here c is loaded once a
  tile, scores are q_lat·c + q_pe·k_pe, and the output accumulates p·c over R only. A program
  takes ``LATENT_HEADS`` query heads (the one KV head serves all), so any head count runs; key
  slices ("flash decoding") and their merge as ``triton_attention``'s decode.

* ``latent_extend``: prompt rows (prompts, chunks, prefix hits, mixed steps' prompt rows) the
  same way, BLOCK_T new tokens × 16 heads a program, causal; a few new tokens over a long cached
  prefix cut the keys into slices merged as ``triton_attention``'s split extend. (The absorbed
  form spends 576 + 512 multiply-adds a key a head where per-head K and V would spend 192 + 128
  after decompressing the context; it reads one latent row a key instead of 16 heads' K and V.)

Neither kernel limits the heads a rank holds (128 under attention DP), as the general kernels'
16 × 1,024 does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from phalanx.kernels import pdl
from phalanx.kernels.metadata import AttentionMetadata
from phalanx.kernels.pdl import release, wait
from phalanx.kernels.triton_attention import (
    MAX_EXTEND_SPLITS,
    MAX_SPLITS,
    NEG,
    PER_STEP_POINTERS,
    _decode_merge_kernel,
    _extend_merge_kernel,
    _num_sms,
    _online_softmax_step,
    _precision,
    _slice,
    mixed_parts,
    num_splits,
)
from phalanx.kernels.triton_ops import _rotate


@triton.jit
def _latent_rope_kernel(pos_ptr, cs_ptr, slot_ptr, q_ptr, lat_ptr, w_ptr, qo_ptr, kc_ptr,
                        s_qt, s_qh, s_lt, s_ot, s_oh, s_cs, H, eps,
                        NOPE: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr, HALF: tl.constexpr,
                        BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr, INTERLEAVE: tl.constexpr,
                        PDL: tl.constexpr):
    """Token t: the pool's row [norm(c) · w ‖ rot(k_pe)] at its slot, and rot(q_pe) of every head
    into the query rows at R. The norm as ``_rms_norm_kernel`` (float32, rounded, times w); the
    rotation in float32, rounded once."""
    release(PDL)
    t = tl.program_id(0).to(tl.int64)     # (t × the rows' strides passes 2^31 in long steps of many heads)
    pos = tl.load(pos_ptr + t)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    im = i < HALF
    cos = tl.load(cs_ptr + pos * (2 * HALF) + i, mask=im, other=0.0)
    sin = tl.load(cs_ptr + pos * (2 * HALF) + HALF + i, mask=im, other=0.0)
    r = tl.arange(0, BLOCK_R)
    rm = r < R
    w = tl.load(w_ptr + r, mask=rm, other=0.0)           # a weight: read before the wait
    if INTERLEAVE:   # the checkpoint's adjacent pairs (x[2i], x[2i+1]), stored evens then odds
        o1 = 2 * i
        o2 = 2 * i + 1
    else:
        o1 = i
        o2 = HALF + i
    wait(PDL)
    row = lat_ptr + t * s_lt
    c = tl.load(row + r, mask=rm, other=0.0)
    cf = c.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(cf * cf, axis=0) / R + eps)
    kd = kc_ptr + slot * s_cs
    tl.store(kd + r, ((cf * rstd).to(c.dtype) * w).to(kc_ptr.dtype.element_ty), mask=rm)
    k1, k2 = _rotate(tl.load(row + R + o1, mask=im, other=0.0).to(tl.float32),
                     tl.load(row + R + o2, mask=im, other=0.0).to(tl.float32), cos, sin)
    tl.store(kd + R + i, k1.to(kc_ptr.dtype.element_ty), mask=im)
    tl.store(kd + R + HALF + i, k2.to(kc_ptr.dtype.element_ty), mask=im)
    h = tl.arange(0, BLOCK_H)[:, None]
    m = (h < H) & im[None, :]
    qb = q_ptr + t * s_qt + h * s_qh + NOPE
    q1, q2 = _rotate(tl.load(qb + o1[None, :], mask=m, other=0.0).to(tl.float32),
                     tl.load(qb + o2[None, :], mask=m, other=0.0).to(tl.float32), cos[None, :], sin[None, :])
    qd = qo_ptr + t * s_ot + h * s_oh + R
    tl.store(qd + i[None, :], q1.to(qo_ptr.dtype.element_ty), mask=m)
    tl.store(qd + HALF + i[None, :], q2.to(qo_ptr.dtype.element_ty), mask=m)


def latent_rope_and_write(positions: torch.Tensor, q: torch.Tensor, latent: torch.Tensor, norm_weight: torch.Tensor,
                          eps: float, cos_sin: torch.Tensor, pool: torch.Tensor, slot_mapping: torch.Tensor,
                          q_out: torch.Tensor, nope: int, interleave: bool) -> None:
    """q [T, H, nope + P] (q_pe at nope), latent [T, R + P] (the raw c ‖ k_pe); writes each
    token's pool row (pool [num_blocks, B, 1, R + P]) and rot(q_pe) into q_out[..., R:]."""
    T, H, _ = q.shape
    D = pool.shape[-1]
    P = q.shape[2] - nope
    R = D - P
    if not T:
        return
    kc = pool.view(-1, D)
    _latent_rope_kernel[(T,)](
        positions, cos_sin, slot_mapping, q, latent, norm_weight, q_out, kc,
        q.stride(0), q.stride(1), latent.stride(0), q_out.stride(0), q_out.stride(1), kc.stride(0), H, eps,
        NOPE=nope, R=R, BLOCK_R=triton.next_power_of_2(R), HALF=P // 2, BLOCK_HALF=triton.next_power_of_2(P // 2),
        BLOCK_H=triton.next_power_of_2(H), INTERLEAVE=interleave, **pdl.launch(q))


@triton.jit
def _latent_tile(kc_ptr, bt_row, p0, hi, s_cb, s_ct, q_lat, q_pe, r, rm, p, pm, R: tl.constexpr, B: tl.constexpr,
                 BLOCK_N: tl.constexpr, PREC: tl.constexpr):
    """Keys p0 .. p0 + BLOCK_N (those below hi) of one sequence: each position finds its block in
    the sequence's table, its row is loaded once — c (the values too) and k_pe — and scored
    q_lat·c + q_pe·k_pe. Returns (positions, their mask, c in q's dtype, the unscaled scores)."""
    kpos = p0 + tl.arange(0, BLOCK_N)
    km = kpos < hi
    blk = tl.load(bt_row + kpos // B, mask=km, other=0).to(tl.int64)
    row = blk * s_cb + (kpos % B) * s_ct
    c = tl.load(kc_ptr + row[:, None] + r[None, :], mask=km[:, None] & rm[None, :], other=0.0).to(q_lat.dtype)
    pe = tl.load(kc_ptr + row[:, None] + R + p[None, :], mask=km[:, None] & pm[None, :], other=0.0)
    qk = tl.dot(q_lat, tl.trans(c), input_precision=PREC)
    qk += tl.dot(q_pe, tl.trans(pe.to(q_pe.dtype)), input_precision=PREC)
    return kpos, km, c, qk


@triton.jit(do_not_specialize=["s_bt"], do_not_specialize_on_alignment=PER_STEP_POINTERS)
def _latent_decode_kernel(q_ptr, kc_ptr, bt_ptr, len_ptr, out_ptr, lse_ptr,
                          s_qs, s_qh, s_cb, s_ct, s_bt, s_os, s_oh, s_osp, s_ls, s_lh, scale, H,
                          R: tl.constexpr, BLOCK_R: tl.constexpr, P: tl.constexpr, BLOCK_P: tl.constexpr,
                          BLOCK_H: tl.constexpr, B: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
                          PREC: tl.constexpr, PDL: tl.constexpr):
    """Program (s, g, split): query heads g·BLOCK_H.. of sequence s over one key slice; writes
    their attended latents [BLOCK_H, R] (and log-sum-exps with SPLITS > 1)."""
    release(PDL)
    s = tl.program_id(0)
    g = tl.program_id(1)
    split = tl.program_id(2)
    L = tl.load(len_ptr + s)        # metadata, copied in before the forward: read before the wait
    first, chunk = _slice(L, 0, SPLITS, B)
    lo = first + split * chunk
    hi = tl.minimum(lo + chunk, L)
    wait(PDL)
    if lo < hi:   # a slice past the last key writes nothing: the merge reads only those before
        h = g * BLOCK_H + tl.arange(0, BLOCK_H)
        hm = h < H
        r = tl.arange(0, BLOCK_R)
        rm = r < R
        p = tl.arange(0, BLOCK_P)
        pm = p < P
        qb = q_ptr + s * s_qs + h[:, None] * s_qh
        q_lat = tl.load(qb + r[None, :], mask=hm[:, None] & rm[None, :], other=0.0)
        q_pe = tl.load(qb + R + p[None, :], mask=hm[:, None] & pm[None, :], other=0.0)
        m_i = tl.full([BLOCK_H], NEG, tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
        bt_row = bt_ptr + s * s_bt
        for p0 in range(lo, hi, BLOCK_N):     # lo: a block's start (slices are whole blocks)
            kpos, km, c, qk = _latent_tile(kc_ptr, bt_row, p0, hi, s_cb, s_ct, q_lat, q_pe, r, rm, p, pm, R, B,
                                           BLOCK_N, PREC)
            qk = tl.where(km[None, :], qk * scale, NEG)
            m_i, l_i, acc = _online_softmax_step(m_i, l_i, acc, qk, c, PREC)
        out = acc / tl.maximum(l_i, 1e-30)[:, None]
        tl.store(out_ptr + s * s_os + h[:, None] * s_oh + split * s_osp + r[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=hm[:, None] & rm[None, :])
        if SPLITS > 1:
            tl.store(lse_ptr + s * s_ls + h * s_lh + split, m_i + tl.log(tl.maximum(l_i, 1e-30)), mask=hm)


@triton.jit(do_not_specialize=["s_bt", "s_lt", "s_lh", "SPLITS"], do_not_specialize_on_alignment=PER_STEP_POINTERS)
def _latent_extend_kernel(q_ptr, kc_ptr, bt_ptr, qstart_ptr, len_ptr, out_ptr, lse_ptr,
                          s_qt, s_qh, s_cb, s_ct, s_bt, s_ot, s_oh, s_osp, s_lt, s_lh, scale, H, SPLITS,
                          R: tl.constexpr, BLOCK_R: tl.constexpr, P: tl.constexpr, BLOCK_P: tl.constexpr,
                          HB: tl.constexpr, BLOCK_T: tl.constexpr, B: tl.constexpr, BLOCK_N: tl.constexpr,
                          PARTS: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr):
    """Program (query block, s, group × SPLITS + split): BLOCK_T new tokens of sequence s, query
    heads g·HB.. of each (rows: token r // HB, head r % HB), over one slice of the keys the block
    sees (causal). One slice writes the attended latents; several write partial ones and their
    log-sum-exps (a row that saw no key in its slice: weight 0), which the merge joins."""
    release(PDL)
    qb = tl.program_id(0)
    s = tl.program_id(1)
    g = tl.program_id(2) // SPLITS
    split = tl.program_id(2) % SPLITS
    q0 = tl.load(qstart_ptr + s)
    q_len = tl.load(qstart_ptr + s + 1) - q0
    L = tl.load(len_ptr + s)
    wait(PDL)
    if qb * BLOCK_T < q_len:
        ctx = L - q_len
        r = tl.arange(0, BLOCK_T * HB)
        t = qb * BLOCK_T + r // HB
        row_q = (q0 + t).to(tl.int64)       # (× the rows' strides: past 2^31 in long steps of many heads)
        h = g * HB + r % HB
        rm = (t < q_len) & (h < H)
        q_pos = ctx + t
        c_r = tl.arange(0, BLOCK_R)
        crm = c_r < R
        p = tl.arange(0, BLOCK_P)
        pm = p < P
        qb_ptr = q_ptr + row_q[:, None] * s_qt + h[:, None] * s_qh
        q_lat = tl.load(qb_ptr + c_r[None, :], mask=rm[:, None] & crm[None, :], other=0.0)
        q_pe = tl.load(qb_ptr + R + p[None, :], mask=rm[:, None] & pm[None, :], other=0.0)
        hi = tl.minimum(L, ctx + (qb + 1) * BLOCK_T)       # the keys the block sees: [0, hi)
        chunk = tl.cdiv(tl.cdiv(hi, SPLITS), BLOCK_N) * BLOCK_N
        lo = split * chunk
        my_hi = tl.minimum(hi, lo + chunk)
        m_i = tl.full([BLOCK_T * HB], NEG, tl.float32)
        l_i = tl.zeros([BLOCK_T * HB], tl.float32)
        acc = tl.zeros([BLOCK_T * HB, BLOCK_R], tl.float32)
        bt_row = bt_ptr + s * s_bt
        for p0 in range(lo, my_hi, BLOCK_N):
            kpos, km, c, qk = _latent_tile(kc_ptr, bt_row, p0, my_hi, s_cb, s_ct, q_lat, q_pe, c_r, crm, p, pm, R,
                                           B, BLOCK_N, PREC)
            ok = (kpos[None, :] <= q_pos[:, None]) & km[None, :]
            qk = tl.where(ok, qk * scale, NEG)
            m_i, l_i, acc = _online_softmax_step(m_i, l_i, acc, qk, c, PREC)
        seen = m_i > NEG * 0.5
        out = tl.where(seen[:, None], acc / tl.maximum(l_i, 1e-30)[:, None], 0.0)
        tl.store(out_ptr + row_q[:, None] * s_ot + h[:, None] * s_oh + split * s_osp + c_r[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=rm[:, None] & crm[None, :])
        if PARTS:
            tl.store(lse_ptr + row_q * s_lt + h * s_lh + split,
                     tl.where(seen, m_i + tl.log(tl.maximum(l_i, 1e-30)), NEG), mask=rm)


# query heads a program takes (16: the least a tensor-core dot takes), keys per step, warps, stages
LATENT_HEADS = 16
LATENT_DECODE_CONFIG = (32, 4, 2)
# prompt rows: new tokens a program takes (rows: tokens × LATENT_HEADS), keys per step, warps, stages
LATENT_EXTEND_CONFIG = (2, 32, 4, 2)


def latent_splits(num_seqs: int, num_heads: int, max_seq_len: int, tokens_per_block: int, num_sms: int) -> int:
    """Key slices of a decode step: ``num_splits`` with the programs' head groups as its heads."""
    return num_splits(num_seqs, triton.cdiv(num_heads, LATENT_HEADS), max_seq_len, tokens_per_block, num_sms)


def latent_decode(q: torch.Tensor, pool: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                  scale: float, rank: int, splits: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """q [S, H, R + P] (one query a sequence) over pool [num_blocks, B, 1, R + P] -> each head's
    attended latent in out[..., :R] (out [S, H, ≥ R], allocated R + P wide when not given)."""
    S, H, D = q.shape
    _, B, _, _ = pool.shape
    P = D - rank
    block_n, warps, stages = LATENT_DECODE_CONFIG
    out = torch.empty(S, H, D, dtype=q.dtype, device=q.device) if out is None else out
    if splits == 1:   # one slice is the whole answer: written in q's dtype, no merge
        part, lse = out.unsqueeze(2), out      # lse: a placeholder, never written with one slice
    else:
        part = torch.empty(S, H, splits, rank, dtype=torch.float32, device=q.device)
        lse = torch.empty(S, H, splits, dtype=torch.float32, device=q.device)
    kc = pool.view(pool.shape[0], B, D)
    _latent_decode_kernel[(S, triton.cdiv(H, LATENT_HEADS), splits)](
        q, kc, block_tables, seq_lens, part, lse,
        q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), block_tables.stride(0),
        part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1), scale, H,
        R=rank, BLOCK_R=max(16, triton.next_power_of_2(rank)), P=P, BLOCK_P=max(16, triton.next_power_of_2(P)),
        BLOCK_H=LATENT_HEADS, B=B, BLOCK_N=block_n, SPLITS=splits, PREC=_precision(q.dtype),
        num_warps=warps, num_stages=stages, **pdl.launch(q))
    if splits == 1:
        return out
    _decode_merge_kernel[(S, H)](part, lse, out, seq_lens, part.stride(0), part.stride(1), part.stride(2),
                                 lse.stride(0), lse.stride(1), out.stride(0), out.stride(1), 0,
                                 D=rank, BLOCK_D=triton.next_power_of_2(rank), B=B, SPLITS=splits,
                                 BLOCK_SP=max(2, triton.next_power_of_2(splits)), **pdl.launch(q))
    return out


def latent_extend_splits(max_query_len: int, num_seqs: int, num_heads: int, num_sms: int) -> int:
    """Key slices of a step's prompt rows: 1 where the grid fills the GPU once, else enough to
    fill it twice (a few new tokens over a long cached prefix), at most the split extend merge's
    ``MAX_EXTEND_SPLITS``."""
    programs = triton.cdiv(max_query_len, LATENT_EXTEND_CONFIG[0]) * num_seqs * triton.cdiv(num_heads, LATENT_HEADS)
    if programs >= num_sms:
        return 1
    return int(min(MAX_EXTEND_SPLITS, triton.cdiv(2 * num_sms, programs)))


def latent_extend(q: torch.Tensor, pool: torch.Tensor, block_tables: torch.Tensor, query_start: torch.Tensor,
                  seq_lens: torch.Tensor, max_query_len: int, scale: float, rank: int, splits: int,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Packed new tokens q [T, H, R + P] (sequence s's from query_start[s]; its keys the pool's
    first seq_lens[s] positions, the new ones last, causal) -> each head's attended latent in
    out[..., :R] (allocated R + P wide when not given)."""
    T, H, D = q.shape
    S = seq_lens.shape[0]
    B = pool.shape[1]
    P = D - rank
    block_t, block_n, warps, stages = LATENT_EXTEND_CONFIG
    out = torch.empty(T, H, D, dtype=q.dtype, device=q.device) if out is None else out
    if splits == 1:
        part, lse = out.unsqueeze(2), out      # lse: never written by the one-slice form
    else:
        part = torch.empty(T, H, splits, rank, dtype=torch.float32, device=q.device)
        lse = torch.empty(T, H, splits, dtype=torch.float32, device=q.device)
    kc = pool.view(pool.shape[0], B, D)
    _latent_extend_kernel[(triton.cdiv(max_query_len, block_t), S, triton.cdiv(H, LATENT_HEADS) * splits)](
        q, kc, block_tables, query_start, seq_lens, part, lse,
        q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), block_tables.stride(0),
        part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1), scale, H, splits,
        R=rank, BLOCK_R=max(16, triton.next_power_of_2(rank)), P=P, BLOCK_P=max(16, triton.next_power_of_2(P)),
        HB=LATENT_HEADS, BLOCK_T=block_t, B=B, BLOCK_N=block_n, PARTS=splits > 1, PREC=_precision(q.dtype),
        num_warps=warps,
        num_stages=stages, **pdl.launch(q))
    if splits > 1:
        _extend_merge_kernel[(T, H)](part, lse, out, part.stride(0), part.stride(1), part.stride(2), lse.stride(0),
                                     lse.stride(1), out.stride(0), out.stride(1), splits, D=rank,
                                     BLOCK_D=triton.next_power_of_2(rank),
                                     BLOCK_SP=max(MAX_EXTEND_SPLITS, triton.next_power_of_2(splits)))
    return out


def compile_latent_forms(pool: torch.Tensor, num_heads: int, rank: int, dtype: torch.dtype) -> None:
    """Run the latent kernels once in every form a step can take — the decode with every slice
    count ``latent_splits`` can give, the prompt rows' with one slice and with several (one token
    over one block) — so that no form compiles while serving."""
    D = pool.shape[-1]
    q = torch.zeros(1, num_heads, D, dtype=dtype, device=pool.device)
    tables = torch.zeros(1, 1, dtype=torch.int32, device=pool.device)
    lens = torch.ones(1, dtype=torch.int32, device=pool.device)
    for i in range(MAX_SPLITS.bit_length()):
        latent_decode(q, pool, tables, lens, D ** -0.5, rank, 1 << i)
    starts = torch.tensor([0, 1], dtype=torch.int32, device=pool.device)
    for splits in (1, 2):
        latent_extend(q, pool, tables, starts, lens, 1, D ** -0.5, rank, splits)


def latent_attention(q: torch.Tensor, pool: torch.Tensor, meta: AttentionMetadata, scale: float, rank: int,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, R + P] over the pool -> [T, H, R + P], each head's attended latent in its first
    R dimensions: decode rows through ``latent_decode``, prompt rows through the general kernels."""
    if meta.is_decode_only:
        splits = meta.cache.get("latent_splits")
        if splits is None:
            splits = meta.cache["latent_splits"] = latent_splits(meta.num_seqs, q.shape[1], meta.max_seq_len,
                                                                 pool.shape[1], _num_sms(q.device))
        return latent_decode(q, pool, meta.block_tables, meta.seq_lens, scale, rank, splits, out)
    if not meta.num_decode_rows:
        splits = meta.cache.get("latent_extend_splits")
        if splits is None:   # decided once a step
            splits = meta.cache["latent_extend_splits"] = latent_extend_splits(
                meta.max_query_len, meta.plan_num_seqs or meta.num_seqs, q.shape[1], _num_sms(q.device))
        return latent_extend(q, pool, meta.block_tables, meta.query_start, meta.seq_lens, meta.max_query_len, scale,
                             rank, splits, out)
    d = meta.num_decode_rows
    decode, extend = mixed_parts(meta)
    out = torch.empty_like(q) if out is None else out
    latent_attention(q[:d], pool, decode, scale, rank, out=out[:d])
    latent_attention(q[d:], pool, extend, scale, rank, out=out[d:])
    return out
