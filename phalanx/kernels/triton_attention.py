"""Triton paged attention, checked against ``attention_ref.paged_attention_ref``.

Two kernels over the pool layout [num_blocks, B, Hkv, D] (B = tokens_per_block >= 16; an FP8
pool's values key-minor, ``values_key_minor``):

* decode (one query per sequence): split-KV "flash decoding". Grid (S, Hkv, SPLITS); each
  program takes the G = H / Hkv query heads of one KV head over one slice of the context and
  writes a partial output and its log-sum-exp; a second kernel merges the slices (with one
  slice, the first kernel writes the answer itself). The slice length is computed from each
  sequence's length inside the kernel, so the grid depends only on (S, SPLITS): CUDA graphs can
  capture it. Slices are whole blocks, so a short context fills only the first few; the others
  return at once and the merge reads only the filled ones. (Merging in the split kernel instead,
  by the slice that finishes last behind an atomic counter, measured 4 % slower at batch 1.)
* extend (packed variable-length queries: prefill over a cached prefix, chunked prefill,
  partial reuse, mixed batches); causal within the new tokens, optional sliding window. The
  prefill kernel (``_prefill_kernel``) takes the G query heads of a KV head in one program
  (grid (Hkv, S, query blocks), the blocks with the most keys launched first), walks the keys
  below its query block without masks and the diagonal's with them, scores in base 2.
  When that grid is too small to fill the GPU — a few new tokens over a
  long cached prefix: 32 tokens of one sequence are 32 programs, each walking the whole context —
  the split form runs instead: grid (query blocks, S, Hkv × SPLITS), each program taking the G
  query heads of one KV head (so a key tile is loaded once for all of them) over one slice of
  the keys its query block can see, writing partial outputs and log-sum-exps that a second
  kernel merges per token and head. Slices past the keys a row sees give it no weight.

Both walk the context in tiles of BLOCK_N keys (``_kv_tile``); each key looks up its own block
in the table, so a tile spans several 32-token blocks and each step has more bytes in flight.

Masked scores use a large finite negative instead of -inf so that a row whose first keys are
all masked never computes inf - inf.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from phalanx.kernels import pdl
from phalanx.kernels.attention_ref import UNIT_KV_SCALE, KvScale, pool_kv_scale, values_key_minor
from phalanx.kernels.metadata import AttentionMetadata
from phalanx.kernels.pdl import release, wait

NEG = tl.constexpr(-1.0e30)


def _precision(dtype: torch.dtype) -> tl.constexpr:
    return "ieee" if dtype == torch.float32 else "tf32"


# Over an FP8 pool the dots of a bf16 (or float16) model take float16: e4m3 widens to float16 in
# one instruction (two values at a time) where bf16 takes a detour through float32. H200
# (tools/bench_attention.py --kv-dtype fp8 --fp8-dots f16 bf16, docs/results/gpu19_attention_fp8_dots.txt):
# decode at 512 sequences x 1,500 tokens 689 against 703 us; a 1,000 / 2,048-token prompt over
# the pool 69 / 211 against 77 / 234 us.
FP8_POOL_F16 = True


def _kv_f16(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    return FP8_POOL_F16 and k_cache.element_size() == 1 and q.dtype != torch.float32


# One compiled form of a kernel for every step: the block tables' width (``s_bt``) varies step to
# step (and a sliding window need not be a multiple of 16: ``window`` is not specialized either),
# and so does the alignment of the per-sequence metadata (a mixed step's extend rows start
# at ``seq_lens[d:]``, 16-byte aligned only when d is a multiple of 4). Triton compiles a form for
# each on first sight, a second or so in the middle of a step. On an H200 at 512 requests in
# flight, such compiles stalled the first steps of the first 128/128 run 0.4-1.4 s each (the
# step timing lists them, kernels/compiles.py). These arguments are read an element or a block id
# at a time, so their alignment buys nothing.
PER_STEP_POINTERS = ["bt_ptr", "len_ptr", "qstart_ptr"]


@triton.jit
def _online_softmax_step(m_i, l_i, acc, qk, v, PREC: tl.constexpr, BASE2: tl.constexpr = False):
    """Fold one tile of masked scores qk [M, N] and values v [N, D] into the running max m_i,
    normaliser l_i and unnormalised output acc (flash-attention update). ``BASE2``: the scores
    are already scaled by log2(e), and exp2 (one instruction where exp is two) takes them."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    if BASE2:
        p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
    else:
        p = tl.exp(qk - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return m_new, l_i, acc


@triton.jit
def _masked(qk, kpos, km, q_pos, window):
    """Scores of keys a query does not see (later than it, outside [lo, hi), before its sliding
    window) set to NEG."""
    ok = (kpos[None, :] <= q_pos[:, None]) & km[None, :]
    ok = ok & ((kpos[None, :] > q_pos[:, None] - window) | (window <= 0))
    return tl.where(ok, qk, NEG)


@triton.jit
def _load(ptrs, mask, other, MASKED: tl.constexpr):
    """tl.load of ``ptrs``, under ``mask`` (``other`` where it is off) only if ``MASKED``."""
    if MASKED:  # noqa: SIM108 - a branch on a constexpr: only one load is compiled
        x = tl.load(ptrs, mask=mask, other=other)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _kv_tile(kc_ptr, vc_ptr, bt_row, p0, lo, hi, kvh, s_cb, s_ct, s_ch, d, dm,
             B: tl.constexpr, BLOCK_N: tl.constexpr, KV_F16: tl.constexpr, V_KEYS: tl.constexpr,
             MASKED: tl.constexpr = True):
    """The keys and values of positions p0 .. p0 + BLOCK_N (those in [lo, hi)) of one KV head:
    each position finds its block in the sequence's table, so a tile may span several blocks.
    An FP8 pool's are widened here, exactly, to float16 (``KV_F16``) or bf16 (their scales are
    applied apart: the K scale in the softmax scale, the V scale on the output, ``_v_scaled``).

    ``V_KEYS``: the pool's values are key-minor (``values_key_minor``, an FP8 pool), read as a
    [D, BLOCK_N] tile of 16-byte runs of keys and transposed. Those loads are not masked by key:
    every tile starts at a multiple of 16 keys (a block's start, then BLOCK_N at a time) and B is
    a multiple of 16, so a run never leaves its block; a key outside [lo, hi) in a block the tile
    reads (block 0 past the slice's last block) gives its finite stale value no weight.

    Not ``MASKED``: every key of the tile is in [lo, hi) and BLOCK_D == D, so nothing is masked
    (the caller knows; the loads then need no predicate)."""
    kpos = p0 + tl.arange(0, BLOCK_N)
    km = (kpos >= lo) & (kpos < hi)
    blk = _load(bt_row + kpos // B, kpos < tl.cdiv(hi, B) * B, 0, MASKED).to(tl.int64)
    row = blk * s_cb + (kpos % B) * s_ct + kvh * s_ch
    k = _widen(_load(kc_ptr + row[:, None] + d[None, :], km[:, None] & dm[None, :], 0.0, MASKED), KV_F16)
    if V_KEYS:
        col = tl.max_contiguous(tl.multiple_of(blk * s_cb + kvh * s_ch * B + kpos % B, 16), 16)
        v = _widen(tl.trans(_load(vc_ptr + col[None, :] + d[:, None] * B, dm[:, None], 0.0, MASKED)), KV_F16)
    else:
        v = _widen(_load(vc_ptr + row[:, None] + d[None, :], km[:, None] & dm[None, :], 0.0, MASKED), KV_F16)
    return kpos, km, k, v


@triton.jit
def _widen(x, KV_F16: tl.constexpr):
    """An FP8 (e4m3) tile in float16 (``KV_F16``) or bf16, exactly; any other tile as it is."""
    if x.dtype == tl.float8e4nv:
        x = x.to(tl.float16) if KV_F16 else x.to(tl.bfloat16)
    return x


@triton.jit
def _query(q, KV_F16: tl.constexpr):
    """The query as the dots take it: with ``KV_F16`` (an FP8 pool under a bf16 or float16
    model) in float16, clamped to its range (a NaN stays NaN)."""
    if KV_F16:
        q = q.to(tl.float32)
        q = tl.where(q > 65504.0, 65504.0, tl.where(q < -65504.0, -65504.0, q)).to(tl.float16)
    return q


@triton.jit
def _v_scaled(out, v_scale, V_KEYS: tl.constexpr):
    """An output over an FP8 pool (the only key-minor one, ``V_KEYS``) times its V scale (the
    pool holds v / v_scale; ``attention_ref.KvScale``); the K scale is in the softmax scale."""
    if V_KEYS:
        out = out * v_scale
    return out


@triton.jit
def _slice(L, window, SPLITS: tl.constexpr, B: tl.constexpr):
    """Where a sequence of L keys starts (sliding window) and its slice length: whole blocks,
    the context spread over SPLITS slices; the slices past the last key have none."""
    first = tl.where(window > 0, tl.maximum(L - window, 0), 0)
    return first, tl.cdiv(tl.cdiv(L - first, SPLITS), B) * B


@triton.jit(do_not_specialize=["s_bt", "window"], do_not_specialize_on_alignment=PER_STEP_POINTERS)
def _decode_split_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, len_ptr, out_ptr, lse_ptr,
                         s_qs, s_qh, s_cb, s_ct, s_ch, s_bt, s_os, s_oh, s_osp, s_ls, s_lh,
                         scale, v_scale, window,
                         G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                         B: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, PREC: tl.constexpr,
                         PDL: tl.constexpr, KV_F16: tl.constexpr, V_KEYS: tl.constexpr):
    release(PDL)
    s = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    L = tl.load(len_ptr + s)        # metadata, copied in before the forward: read before the wait
    first, chunk = _slice(L, window, SPLITS, B)
    lo = first + split * chunk
    hi = tl.minimum(lo + chunk, L)
    wait(PDL)
    if lo < hi:   # a slice past the last key writes nothing: the merge reads only those before
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        gm = g < G
        dm = d < D
        h = kvh * G + g
        q = _query(tl.load(q_ptr + s * s_qs + h[:, None] * s_qh + d[None, :], mask=gm[:, None] & dm[None, :],
                           other=0.0), KV_F16)
        m_i = tl.full([BLOCK_G], NEG, tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for p0 in range(lo - lo % B, hi, BLOCK_N):
            kpos, km, k, v = _kv_tile(kc_ptr, vc_ptr, bt_ptr + s * s_bt, p0, lo, hi, kvh, s_cb, s_ct, s_ch, d, dm,
                                      B, BLOCK_N, KV_F16, V_KEYS)
            qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PREC) * scale
            qk = tl.where(km[None, :], qk, NEG)
            m_i, l_i, acc = _online_softmax_step(m_i, l_i, acc, qk, v.to(q.dtype), PREC)
        out = _v_scaled(acc / tl.maximum(l_i, 1e-30)[:, None], v_scale, V_KEYS)
        tl.store(out_ptr + s * s_os + h[:, None] * s_oh + split * s_osp + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=gm[:, None] & dm[None, :])
        if SPLITS > 1:
            tl.store(lse_ptr + s * s_ls + h * s_lh + split, m_i + tl.log(tl.maximum(l_i, 1e-30)), mask=gm)


@triton.jit(do_not_specialize=["window"], do_not_specialize_on_alignment=PER_STEP_POINTERS)
def _decode_merge_kernel(part_ptr, lse_ptr, out_ptr, len_ptr, s_ps, s_ph, s_psp, s_ls, s_lh, s_os, s_oh, window,
                         D: tl.constexpr, BLOCK_D: tl.constexpr, B: tl.constexpr, SPLITS: tl.constexpr,
                         BLOCK_SP: tl.constexpr, PDL: tl.constexpr):
    release(PDL)
    s = tl.program_id(0)
    h = tl.program_id(1)
    L = tl.load(len_ptr + s)
    wait(PDL)
    first, chunk = _slice(L, window, SPLITS, B)
    sp = tl.arange(0, BLOCK_SP)
    spm = sp < tl.cdiv(L - first, chunk)        # the slices that have keys
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    lse = tl.load(lse_ptr + s * s_ls + h * s_lh + sp, mask=spm, other=NEG)
    mx = tl.max(lse, 0)
    w = tl.where(spm, tl.exp(lse - mx), 0.0)
    parts = tl.load(part_ptr + s * s_ps + h * s_ph + sp[:, None] * s_psp + d[None, :],
                    mask=spm[:, None] & dm[None, :], other=0.0)
    out = tl.sum(parts * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + s * s_os + h * s_oh + d, out.to(out_ptr.dtype.element_ty), mask=dm)


MAX_SPLITS = 64


# the shortest key slice, in blocks. Slices of one or two blocks pay in the step: batch-1 decode
# of Llama-3.1-8B with FP8 weights on an H200 (tools/ablate_decode.py, docs/gpu_notes.md,
# twenty-eighth round), 128-256 tokens of context: 398.6 tok/s with 2 slices (what a floor of 4
# blocks gave an engine of 320 positions), 410.2 with 8, 409.9 with 32; 1,024-1,152 tokens: 380.7
# with 8 (the floor of 4 again), 404.6 with 32.
MIN_SLICE_BLOCKS = 1


def _scales(scale: float, k_cache: torch.Tensor, kv_scale: KvScale) -> tuple[float, float]:
    """The kernels' (softmax scale, V scale): an FP8 pool's K scale joins the softmax scale."""
    k_s, v_s = pool_kv_scale(k_cache, kv_scale)
    return scale * k_s, v_s


def num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, tokens_per_block: int, num_sms: int = 132) -> int:
    """Enough programs to fill the GPU about twice, but no slice shorter than
    ``MIN_SLICE_BLOCKS``; a power of two, so that the split kernel (SPLITS is a compile-time
    constant) has few forms — seven slice counts, one key slice in two or three configs
    (``decode_configs``) — all compiled at start-up (``compile_decode_splits``): a batch of any
    size, a mixed step's decode rows included, never waits for a compile while serving."""
    want = triton.cdiv(2 * num_sms, max(1, num_seqs * num_kv_heads))
    cap = max(1, triton.cdiv(max_seq_len, MIN_SLICE_BLOCKS * tokens_per_block))
    n = int(max(1, min(want, cap, MAX_SPLITS)))
    return 1 << (n.bit_length() - 1)


def compile_decode_splits(k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, dtype: torch.dtype) -> None:
    """Run the decode kernels once with every slice count ``num_splits`` can give, in every config
    of it (one query over one block of this pool layer), so that each form is compiled before the
    first request. The
    block tables' row stride (their width, which varies step to step) is not specialized on
    (``do_not_specialize``): one compiled form serves every width."""
    _, B, _, D = k_cache.shape
    q = torch.zeros(1, num_heads, D, dtype=dtype, device=k_cache.device)
    tables = torch.zeros(1, 1, dtype=torch.int32, device=k_cache.device)
    lens = torch.ones(1, dtype=torch.int32, device=k_cache.device)
    for i in range(MAX_SPLITS.bit_length()):
        for config in decode_configs(k_cache, 1 << i):
            decode_attention(q, k_cache, v_cache, tables, lens, D ** -0.5, None, 1 << i, config)


# keys per inner step, and the launch's warps and pipeline stages
DECODE_CONFIG = (64, 4, 3)
# H200, Llama-3.1-8B heads (docs/results/gpu14_attention_hit.txt): the split form, 32 new tokens
# over 2,048 cached, 14.9 us (split and merge) against 21.6 with 64 keys, 3 stages and 128-row programs
EXTEND_SPLIT_CONFIG = (32, 4, 2)
# over an FP8 pool (values key-minor). H200, Llama-3.1-8B heads, sequences of 1,500 tokens
# (tools/bench_attention.py --kv-dtype fp8, docs/results/gpu21_attention_fp8.txt): decode of
# 64 / 256 / 512 sequences (one key slice) 55.6 / 204.9 / 401.5 us, 76-85 % of the read
# bandwidth (with the values stored by row, read as columns: 337 / 662 us at 256 / 512); 16
# sequences in 2 slices 25.9 us against 31.5 with (64, 4, 2), which takes one sequence in 32 slices
# in 6.4 us against 8.5.
# the prefill kernel (``_prefill_kernel``): (rows a program takes, keys per step, warps, stages),
# taller programs for steps whose longest query passes PREFILL_LONG tokens. H200, Llama-3.1-8B
# heads, one prompt alone (tools/bench_attention.py --extend, docs/results/gpu24_prefill_*.txt), µs
# for 1,000 / 2,048 / 8,192 tokens, against 68.4 / 209.9 / 2,458.9 (bf16 pool) and 66.3 / 200.4
# (FP8 pool) for the kernel before it (a program per query head, every key tile masked):
#   bf16 pool: (128, 64, 8, 3) 34.7 / 117.6 / 1,687.3, (256, 64, 8, 3) 44.3 / 95.2 / 1,289.5
#   FP8 pool:  (128, 64, 8, 2) 41.8 / 140.9,            (256, 64, 8, 2) 54.5 / 116.1
# Heaviest query blocks first took the 2,048-token prompt from 150.2 to 117.6 µs with (128, 64, 8, 3).
PREFILL_LONG = 1024
# float32 queries (a float32 model): tiles of twice the bytes; the bf16 tiles above would ask an
# sm_90 SM for more shared memory than it has (263 KB for the long form with 128-wide heads)
PREFILL_CONFIG_F32 = (64, 32, 4, 2)
PREFILL_CONFIG = (128, 64, 8, 3)
PREFILL_CONFIG_LONG = (256, 64, 8, 3)
PREFILL_CONFIG_FP8 = (128, 64, 8, 2)
PREFILL_CONFIG_FP8_LONG = (256, 64, 8, 2)
DECODE_CONFIG_FP8 = (128, 4, 3)
DECODE_CONFIG_FP8_SPLIT = (64, 4, 2)       # more than 4 key slices
# One key slice over a grid that fills every SM many times over (large batches): small programs,
# so that many stay resident on an SM; the larger tiles above leave 2-3 programs an SM, which
# short contexts (one or two tiles a program) cannot keep busy. H200, Llama-3.1-8B heads (8 KV
# heads: 15.5 / 31 programs an SM at 256 / 512 sequences), tools/bench_attention.py,
# docs/results/gpu22_attention_*.txt; sequences of 150 / 400 / 1,500 tokens, µs:
#   bf16 pool, 512 seqs: (64, 4, 3) 92.3 / 208.3 / 708.3, (32, 2, 2) 82.0 / 197.4 / 700.0
#   bf16 pool, 256 seqs: (64, 4, 3) 50.1 / 108.7 / 357.2, (32, 2, 2) 42.8 / 100.8 / 355.0
#   FP8 pool, 512 seqs: (128, 4, 3) 94.3 / 153.7 / 398.4, (64, 1, 2) 62.9 / 127.1 / 395.3,
#                       (32, 1, 3) 50.0 / 115.1 / 390.7
#   FP8 pool, 256 seqs: (128, 4, 3) 47.4 / 79.9 / 205.2, (64, 1, 2) 32.8 / 65.1 / 202.0,
#                       (32, 1, 3) 29.8 / 67.8 / 224.2
WIDE_GRID = 12                             # programs an SM from which a grid counts as wide
DECODE_CONFIG_WIDE = (32, 2, 2)
DECODE_CONFIG_FP8_WIDE = (64, 1, 2)
DECODE_CONFIG_FP8_WIDEST = (32, 1, 3)      # from twice WIDE_GRID


def narrowed(tile: int, head_dim: int) -> int:
    """A tile's rows or keys for heads of ``head_dim``: the tuned value above (128-wide heads)
    divided by how many times wider the heads are (Gemma's 256), at least 16: a stage's K and V
    tiles, and a program's queries, then take the shared memory they take at 128 (at 256 the
    tuned tiles would ask an sm_90 SM for 262 KB)."""
    return max(16, tile // max(1, triton.next_power_of_2(head_dim) // 128))


def decode_config(k_cache: torch.Tensor, splits: int, programs_per_sm: float = 0.0) -> tuple[int, int, int]:
    """(keys per step, warps, stages) of the decode kernel over this pool with ``splits`` key
    slices, for a grid of ``programs_per_sm`` (sequences × KV heads × slices over the SMs)."""
    block_n, warps, stages = _decode_config(k_cache, splits, programs_per_sm)
    return narrowed(block_n, k_cache.shape[-1]), warps, stages


def _decode_config(k_cache: torch.Tensor, splits: int, programs_per_sm: float) -> tuple[int, int, int]:
    fp8 = k_cache.element_size() == 1
    if splits == 1 and programs_per_sm >= WIDE_GRID:
        if not fp8:
            return DECODE_CONFIG_WIDE
        return DECODE_CONFIG_FP8_WIDEST if programs_per_sm >= 2 * WIDE_GRID else DECODE_CONFIG_FP8_WIDE
    if not fp8:
        return DECODE_CONFIG
    return DECODE_CONFIG_FP8 if splits <= 4 else DECODE_CONFIG_FP8_SPLIT


def decode_configs(k_cache: torch.Tensor, splits: int) -> list[tuple[int, int, int]]:
    """Every config ``decode_config`` gives this pool with ``splits`` slices, whatever the grid
    (each is a compiled form of the kernel: ``compile_decode_splits`` runs them all)."""
    return list(dict.fromkeys(decode_config(k_cache, splits, p) for p in (0.0, WIDE_GRID, 2 * WIDE_GRID)))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, window: int | None, splits: int,
                     config: tuple[int, int, int] | None = None, out: torch.Tensor | None = None,
                     kv_scale: KvScale = UNIT_KV_SCALE) -> torch.Tensor:
    """q [S, H, D] (one query per sequence) -> [S, H, D] (into ``out`` when given). config: (keys
    per step, warps, stages), ``decode_config`` of this grid by default. ``kv_scale``: an FP8
    pool's K and V scales (``attention_ref.KvScale``)."""
    S, H, D = q.shape
    _, B, Hkv, _ = k_cache.shape
    G = H // Hkv
    block_n, warps, stages = config or decode_config(k_cache, splits, S * Hkv * splits / _num_sms(q.device))
    out = torch.empty(S, H, D, dtype=q.dtype, device=q.device) if out is None else out
    if splits == 1:   # one slice is the whole answer: written in q's dtype, no merge
        part, lse = out.unsqueeze(2), out      # lse: a placeholder, never written with one slice
    else:
        part = torch.empty(S, H, splits, D, dtype=torch.float32, device=q.device)
        lse = torch.empty(S, H, splits, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(S, Hkv, splits)](
        q, k_cache, v_cache, block_tables, seq_lens, part, lse,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
        *_scales(scale, k_cache, kv_scale), window or 0, G=G, BLOCK_G=max(16, triton.next_power_of_2(G)), D=D,
        BLOCK_D=max(16, triton.next_power_of_2(D)), B=B, BLOCK_N=max(block_n, 16), SPLITS=splits,
        PREC=_precision(q.dtype), KV_F16=_kv_f16(q, k_cache), V_KEYS=values_key_minor(v_cache), num_warps=warps,
        num_stages=stages, **pdl.launch(q))
    if splits == 1:
        return out
    _decode_merge_kernel[(S, H)](part, lse, out, seq_lens, part.stride(0), part.stride(1), part.stride(2),
                                 lse.stride(0), lse.stride(1), out.stride(0), out.stride(1), window or 0,
                                 D=D, BLOCK_D=triton.next_power_of_2(D), B=B, SPLITS=splits,
                                 BLOCK_SP=max(2, triton.next_power_of_2(splits)), **pdl.launch(q))
    return out


LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit(do_not_specialize=["s_bt", "window"], do_not_specialize_on_alignment=PER_STEP_POINTERS)
def _prefill_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, qstart_ptr, len_ptr, out_ptr,
                    s_qt, s_qh, s_cb, s_ct, s_ch, s_bt, s_ot, s_oh, scale, v_scale, window,
                    G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                    B: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
                    KV_F16: tl.constexpr, V_KEYS: tl.constexpr):
    """The extend kernel with the G query heads of a KV head in one program (a key tile is
    loaded once for all of them; row r: query token r // BLOCK_G, head r % BLOCK_G), the keys
    every row of the block sees walked first without masks, then the diagonal's tiles with the
    causal mask, scores in base 2. Grid (Hkv, S, query blocks), the last query blocks (the most
    keys) launched first, so that the short ones fill the last wave."""
    kvh = tl.program_id(0)
    s = tl.program_id(1)
    mb = tl.num_programs(2) - 1 - tl.program_id(2)
    q0 = tl.load(qstart_ptr + s)
    q_len = tl.load(qstart_ptr + s + 1) - q0
    if mb * BLOCK_M < q_len:
        L = tl.load(len_ptr + s)
        ctx = L - q_len
        r = tl.arange(0, BLOCK_M * BLOCK_G)
        m = mb * BLOCK_M + r // BLOCK_G
        g = r % BLOCK_G
        rm = (m < q_len) & (g < G)
        h = kvh * G + g
        q_pos = ctx + m
        d = tl.arange(0, BLOCK_D)
        dm = d < D
        q = _query(tl.load(q_ptr + (q0 + m)[:, None] * s_qt + h[:, None] * s_qh + d[None, :],
                           mask=rm[:, None] & dm[None, :], other=0.0), KV_F16)
        qk_scale = scale * LOG2E
        m_i = tl.full([BLOCK_M * BLOCK_G], NEG, tl.float32)
        l_i = tl.zeros([BLOCK_M * BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_M * BLOCK_G, BLOCK_D], tl.float32)
        first = ctx + mb * BLOCK_M                      # the block's first query position
        hi = tl.minimum(L, first + BLOCK_M)
        lo = tl.where(window > 0, tl.maximum(first - window + 1, 0), 0)
        start = lo - lo % B
        # without a window, the keys below the block's first query: seen by every row, no mask
        full = tl.where(window > 0, start, first // BLOCK_N * BLOCK_N)
        if BLOCK_D == D:
            for p0 in range(start, full, BLOCK_N):
                kpos, km, k, v = _kv_tile(kc_ptr, vc_ptr, bt_ptr + s * s_bt, p0, lo, hi, kvh, s_cb, s_ct, s_ch, d,
                                          dm, B, BLOCK_N, KV_F16, V_KEYS, False)
                qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PREC) * qk_scale
                m_i, l_i, acc = _online_softmax_step(m_i, l_i, acc, qk, v.to(q.dtype), PREC, True)
        else:
            full = start
        for p0 in range(full, hi, BLOCK_N):
            kpos, km, k, v = _kv_tile(kc_ptr, vc_ptr, bt_ptr + s * s_bt, p0, lo, hi, kvh, s_cb, s_ct, s_ch, d, dm,
                                      B, BLOCK_N, KV_F16, V_KEYS)
            qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PREC) * qk_scale
            qk = _masked(qk, kpos, km, q_pos, window)
            m_i, l_i, acc = _online_softmax_step(m_i, l_i, acc, qk, v.to(q.dtype), PREC, True)
        out = _v_scaled(acc / tl.maximum(l_i, 1e-30)[:, None], v_scale, V_KEYS)
        tl.store(out_ptr + (q0 + m)[:, None] * s_ot + h[:, None] * s_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=rm[:, None] & dm[None, :])


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      query_start: torch.Tensor, seq_lens: torch.Tensor, max_query_len: int, scale: float,
                      window: int | None, config: tuple[int, int, int, int] | None = None,
                      out: torch.Tensor | None = None, kv_scale: KvScale = UNIT_KV_SCALE) -> torch.Tensor:
    """q [T, H, D] packed over S sequences -> [T, H, D] (into ``out`` when given), through
    ``_prefill_kernel``. config:
    (rows a program takes — query tokens × BLOCK_G heads —, keys per step, warps, stages),
    ``prefill_config`` by default."""
    T, H, D = q.shape
    _, B, Hkv, _ = k_cache.shape
    S = seq_lens.shape[0]
    G = H // Hkv
    BLOCK_G = triton.next_power_of_2(G)
    rows, block_n, warps, stages = config or prefill_config(q.dtype, k_cache, max_query_len)
    block_m = prefill_block_m(rows, BLOCK_G, max_query_len)
    out = torch.empty_like(q) if out is None else out
    _prefill_kernel[(Hkv, S, triton.cdiv(max_query_len, block_m))](
        q, k_cache, v_cache, block_tables, query_start, seq_lens, out,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1), *_scales(scale, k_cache, kv_scale), window or 0,
        G=G, BLOCK_G=BLOCK_G, D=D, BLOCK_D=max(16, triton.next_power_of_2(D)), B=B, BLOCK_M=block_m,
        BLOCK_N=max(block_n, 16), PREC=_precision(q.dtype), KV_F16=_kv_f16(q, k_cache),
        V_KEYS=values_key_minor(v_cache), num_warps=warps, num_stages=stages)
    return out


def prefill_config(q_dtype: torch.dtype, k_cache: torch.Tensor, max_query_len: int) -> tuple[int, int, int, int]:
    """The prefill kernel's (rows, keys per step, warps, stages) for queries of ``q_dtype`` over
    this pool, in a step whose longest query has ``max_query_len`` tokens."""
    long = max_query_len > PREFILL_LONG
    if q_dtype == torch.float32:
        config = PREFILL_CONFIG_F32
    elif k_cache.element_size() == 1:
        config = PREFILL_CONFIG_FP8_LONG if long else PREFILL_CONFIG_FP8
    else:
        config = PREFILL_CONFIG_LONG if long else PREFILL_CONFIG
    rows, block_n, warps, stages = config
    D = k_cache.shape[-1]
    return narrowed(rows, D), narrowed(block_n, D), warps, stages


def prefill_block_m(rows: int, group: int, max_query_len: int) -> int:
    """Query tokens a prefill program takes: ``rows`` // ``group`` (the heads of a KV head, a
    power of two), or the step's longest query rounded up to a power of two if that is fewer
    (but never under 16 tokens: the forms ``compile_extend_forms`` runs); at least 16 rows."""
    return max(-(-16 // group), min(max(1, rows // group), max(16, triton.next_power_of_2(max_query_len))))


# the slice count is an argument, not a constant (nor are the log-sum-exps' strides, which follow
# it): one compiled form serves every count ``extend_splits`` gives (with a head size a multiple
# of 16, which keeps the partial outputs' strides multiples of 16 too)
@triton.jit(do_not_specialize=["s_bt", "s_lt", "s_lh", "SPLITS", "window"],
            do_not_specialize_on_alignment=PER_STEP_POINTERS)
def _extend_split_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, qstart_ptr, len_ptr, part_ptr, lse_ptr,
                         s_qt, s_qh, s_cb, s_ct, s_ch, s_bt, s_pt, s_ph, s_psp, s_lt, s_lh, scale, v_scale, window,
                         SPLITS,
                         G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                         B: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         PREC: tl.constexpr, KV_F16: tl.constexpr, V_KEYS: tl.constexpr):
    mb = tl.program_id(0)
    s = tl.program_id(1)
    kvh = tl.program_id(2) // SPLITS
    split = tl.program_id(2) % SPLITS
    q0 = tl.load(qstart_ptr + s)
    q_len = tl.load(qstart_ptr + s + 1) - q0
    if mb * BLOCK_M < q_len:
        L = tl.load(len_ptr + s)
        ctx = L - q_len
        r = tl.arange(0, BLOCK_M * BLOCK_G)          # row r: query token r // BLOCK_G, head r % BLOCK_G
        m = mb * BLOCK_M + r // BLOCK_G
        g = r % BLOCK_G
        rm = (m < q_len) & (g < G)
        h = kvh * G + g
        q_pos = ctx + m
        d = tl.arange(0, BLOCK_D)
        dm = d < D
        q = _query(tl.load(q_ptr + (q0 + m)[:, None] * s_qt + h[:, None] * s_qh + d[None, :],
                           mask=rm[:, None] & dm[None, :], other=0.0), KV_F16)
        # the keys this query block sees, [lo, hi), cut into SPLITS slices of whole key tiles
        hi = tl.minimum(L, ctx + (mb + 1) * BLOCK_M)
        lo = tl.where(window > 0, tl.maximum(ctx + mb * BLOCK_M - window + 1, 0), 0)
        start = lo - lo % B
        chunk = tl.cdiv(tl.cdiv(hi - start, SPLITS), BLOCK_N) * BLOCK_N
        my_lo = start + split * chunk
        my_hi = tl.minimum(hi, my_lo + chunk)
        m_i = tl.full([BLOCK_M * BLOCK_G], NEG, tl.float32)
        l_i = tl.zeros([BLOCK_M * BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_M * BLOCK_G, BLOCK_D], tl.float32)
        for p0 in range(my_lo, my_hi, BLOCK_N):
            kpos, km, k, v = _kv_tile(kc_ptr, vc_ptr, bt_ptr + s * s_bt, p0, tl.maximum(lo, my_lo), my_hi, kvh,
                                      s_cb, s_ct, s_ch, d, dm, B, BLOCK_N, KV_F16, V_KEYS)
            qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PREC) * scale
            qk = _masked(qk, kpos, km, q_pos, window)
            m_i, l_i, acc = _online_softmax_step(m_i, l_i, acc, qk, v.to(q.dtype), PREC)
        # a row that saw no key here (masked scores only) carries no weight into the merge
        seen = m_i > NEG * 0.5
        out = tl.where(seen[:, None], _v_scaled(acc / tl.maximum(l_i, 1e-30)[:, None], v_scale, V_KEYS), 0.0)
        lse = tl.where(seen, m_i + tl.log(tl.maximum(l_i, 1e-30)), NEG)
        tl.store(part_ptr + (q0 + m)[:, None] * s_pt + h[:, None] * s_ph + split * s_psp + d[None, :], out,
                 mask=rm[:, None] & dm[None, :])
        tl.store(lse_ptr + (q0 + m) * s_lt + h * s_lh + split, lse, mask=rm)


@triton.jit(do_not_specialize=["s_lt", "s_lh", "SPLITS"])
def _extend_merge_kernel(part_ptr, lse_ptr, out_ptr, s_pt, s_ph, s_psp, s_lt, s_lh, s_ot, s_oh, SPLITS,
                         D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SP: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, BLOCK_SP)
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    lse = tl.load(lse_ptr + t * s_lt + h * s_lh + sp, mask=sp < SPLITS, other=NEG)
    mx = tl.max(lse, 0)
    w = tl.where(lse > NEG * 0.5, tl.exp(lse - mx), 0.0)
    parts = tl.load(part_ptr + t * s_pt + h * s_ph + sp[:, None] * s_psp + d[None, :],
                    mask=(sp < SPLITS)[:, None] & dm[None, :], other=0.0)
    out = tl.sum(parts * w[:, None], 0) / tl.maximum(tl.sum(w, 0), 1e-30)
    tl.store(out_ptr + t * s_ot + h * s_oh + d, out.to(out_ptr.dtype.element_ty), mask=dm)


def _split_rows(group: int) -> int:
    """Query tokens a split program takes: 64 rows of (token, head), at least 16 tokens."""
    return max(16, 64 // group)


MAX_EXTEND_SPLITS = 16
MAX_SPLIT_GROUP = 8     # query heads a KV head beyond which the split form's tile is too tall
MAX_SPLIT_HEAD_DIM = 256   # and heads beyond which it is too wide (DeepSeek's 576: 512 KB of shared memory)


def extend_splits(max_query_len: int, num_seqs: int, num_kv_heads: int, num_heads: int, num_sms: int = 132,
                  head_dim: int = 128) -> int:
    """Slices of the keys for a step's extend rows: 1 (the prefill kernel, no split) when the
    prefill kernel's grid (of its short-step tile) already fills the GPU once, or a KV head has
    more than 8 query heads; else enough to fill it twice, at most 16."""
    group = triton.next_power_of_2(max(1, num_heads // num_kv_heads))
    block_m = prefill_block_m(narrowed(PREFILL_CONFIG[0], head_dim), group, max_query_len)
    if group > MAX_SPLIT_GROUP or head_dim > MAX_SPLIT_HEAD_DIM \
            or triton.cdiv(max_query_len, block_m) * num_seqs * num_kv_heads >= num_sms:
        return 1      # (more than 8 heads a KV head, or heads over 256 wide: too large a split tile)
    programs = triton.cdiv(max_query_len, _split_rows(group)) * num_seqs * num_kv_heads
    return int(max(1, min(MAX_EXTEND_SPLITS, triton.cdiv(2 * num_sms, programs))))


def extend_attention_split(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           query_start: torch.Tensor, seq_lens: torch.Tensor, max_query_len: int, scale: float,
                           window: int | None, splits: int, config: tuple[int, int, int] | None = None,
                           out: torch.Tensor | None = None, block_m: int | None = None,
                           kv_scale: KvScale = UNIT_KV_SCALE) -> torch.Tensor:
    """``prefill_attention`` with the keys cut into ``splits`` slices and the G query heads of a
    KV head in one program (few new tokens over a long context). ``block_m``: query tokens a
    program takes (``_split_rows`` by default); config: EXTEND_SPLIT_CONFIG by default."""
    T, H, D = q.shape
    _, B, Hkv, _ = k_cache.shape
    S = seq_lens.shape[0]
    G = H // Hkv
    BLOCK_G = triton.next_power_of_2(G)
    block_m = min(block_m or _split_rows(BLOCK_G), max(16, triton.next_power_of_2(max_query_len)))
    block_n, warps, stages = config or EXTEND_SPLIT_CONFIG
    part = torch.empty(T, H, splits, D, dtype=torch.float32, device=q.device)
    lse = torch.empty(T, H, splits, dtype=torch.float32, device=q.device)
    _extend_split_kernel[(triton.cdiv(max_query_len, block_m), S, Hkv * splits)](
        q, k_cache, v_cache, block_tables, query_start, seq_lens, part, lse,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
        *_scales(scale, k_cache, kv_scale), window or 0, splits,
        G=G, BLOCK_G=BLOCK_G, D=D, BLOCK_D=max(16, triton.next_power_of_2(D)), B=B, BLOCK_M=block_m,
        BLOCK_N=max(block_n, 16), PREC=_precision(q.dtype), KV_F16=_kv_f16(q, k_cache),
        V_KEYS=values_key_minor(v_cache), num_warps=warps, num_stages=stages)
    out = torch.empty_like(q) if out is None else out
    _extend_merge_kernel[(T, H)](part, lse, out, part.stride(0), part.stride(1), part.stride(2), lse.stride(0),
                                 lse.stride(1), out.stride(0), out.stride(1), splits, D=D,
                                 BLOCK_D=triton.next_power_of_2(D),
                                 BLOCK_SP=max(MAX_EXTEND_SPLITS, triton.next_power_of_2(splits)))
    return out


def compile_extend_forms(k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, dtype: torch.dtype) -> None:
    """Run the extend kernels once with every query-block height a step can pick (16 to 128
    new tokens, and the long prompts' form; the split form's up to ``_split_rows``), over one
    block of this pool layer, so that a short prompt or a prefix hit never waits for a compile
    while serving."""
    _, B, Hkv, D = k_cache.shape
    dev = k_cache.device
    group = triton.next_power_of_2(max(1, num_heads // Hkv))
    rows = _split_rows(group) if group <= MAX_SPLIT_GROUP and D <= MAX_SPLIT_HEAD_DIM else 0   # (else never split)
    for n in (16, 32, 64, 128):
        q = torch.zeros(n, num_heads, D, dtype=dtype, device=dev)
        tables = torch.zeros(1, triton.cdiv(n, B), dtype=torch.int32, device=dev)
        starts = torch.tensor([0, n], dtype=torch.int32, device=dev)
        lens = torch.tensor([n], dtype=torch.int32, device=dev)
        prefill_attention(q, k_cache, v_cache, tables, starts, lens, n, D ** -0.5, None)
        if n == 16:   # the taller programs of long prompts (the step's longest query sets the form)
            prefill_attention(q, k_cache, v_cache, tables, starts, lens, PREFILL_LONG + 1, D ** -0.5, None)
        if n <= rows:
            extend_attention_split(q, k_cache, v_cache, tables, starts, lens, n, D ** -0.5, None, 2)


# a program holds every query head of a KV head: at most this many (query head, dimension) pairs,
# padded to powers of two (16 of DeepSeek's 576-wide latent heads, padded to 1,024, take ~99 KB of an
# sm_90 SM's shared memory; 32 would not fit)
MAX_GROUP_WIDTH = 16 * 1024


def supports_layout(tokens_per_block: int, num_heads: int, num_kv_heads: int, uneven: bool,
                    head_dim: int = 128) -> bool:
    """Layouts these kernels handle (others fall back to the reference)."""
    return (not uneven and tokens_per_block >= 16 and num_heads % num_kv_heads == 0
            and triton.next_power_of_2(num_heads // num_kv_heads) * triton.next_power_of_2(head_dim)
            <= MAX_GROUP_WIDTH)


def supports(q: torch.Tensor, k_cache: torch.Tensor, kv_of_q: torch.Tensor | None) -> bool:
    return supports_layout(k_cache.shape[1], q.shape[1], k_cache.shape[2], kv_of_q is not None, q.shape[2])


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, window: int | None = None, kv_of_q: torch.Tensor | None = None,
                    out: torch.Tensor | None = None, kv_scale: KvScale = UNIT_KV_SCALE) -> torch.Tensor:
    if meta.is_decode_only:
        splits = meta.cache.get("splits")
        if splits is None:
            splits = meta.cache["splits"] = num_splits(meta.num_seqs, k_cache.shape[2], meta.max_seq_len,
                                                       k_cache.shape[1], _num_sms(q.device))
        return decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, window, splits, out=out,
                                kv_scale=kv_scale)
    if meta.num_decode_rows:
        return mixed_attention(q, k_cache, v_cache, meta, scale, window, out=out, kv_scale=kv_scale)
    splits = meta.cache.get("extend_splits")
    if splits is None:   # decided once per step
        seqs = meta.plan_num_seqs or meta.num_seqs
        splits = meta.cache["extend_splits"] = extend_splits(meta.max_query_len, seqs, k_cache.shape[2], q.shape[1],
                                                             _num_sms(q.device), q.shape[2])
    if splits > 1:
        return extend_attention_split(q, k_cache, v_cache, meta.block_tables, meta.query_start, meta.seq_lens,
                                      meta.max_query_len, scale, window, splits, out=out, kv_scale=kv_scale)
    return prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.query_start, meta.seq_lens,
                             meta.max_query_len, scale, window, out=out, kv_scale=kv_scale)


def mixed_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, window: int | None = None, out: torch.Tensor | None = None,
                    kv_scale: KvScale = UNIT_KV_SCALE) -> torch.Tensor:
    """A step whose first ``meta.num_decode_rows`` sequences have one query each (decode rows:
    the scheduler puts them first) and the others more: the decode rows through the decode
    kernels (a program per KV head and key slice, its G query heads together), the others
    through the extend kernels, into one output. An extend kernel over every row would give
    each decode row one 64-query tile per query head for its single query: a step of 96 decode
    rows of ~1.1k tokens and one 1,000-token prompt spent 22 ms of its 45 ms in attention on an
    H200 (tools/profile_mixed.py). The two row sets' metadata are sliced once per step."""
    d = meta.num_decode_rows
    decode, extend = mixed_parts(meta)
    out = torch.empty_like(q) if out is None else out
    paged_attention(q[:d], k_cache, v_cache, decode, scale, window, out=out[:d], kv_scale=kv_scale)
    paged_attention(q[d:], k_cache, v_cache, extend, scale, window, out=out[d:], kv_scale=kv_scale)
    return out


def mixed_parts(meta: AttentionMetadata) -> tuple[AttentionMetadata, AttentionMetadata]:
    """A mixed step's metadata as (its decode rows', its extend rows'), sliced once a step."""
    parts = meta.cache.get("mixed")
    if parts is None:
        d = meta.num_decode_rows
        decode = AttentionMetadata(meta.slot_mapping[:d], meta.query_start[:d + 1], meta.seq_lens[:d],
                                   meta.block_tables[:d], 1, meta.max_seq_len, meta.tokens_per_block,
                                   is_decode_only=True)
        extend = AttentionMetadata(meta.slot_mapping[d:], meta.query_start[d:] - d, meta.seq_lens[d:],
                                   meta.block_tables[d:], meta.max_query_len, meta.max_seq_len, meta.tokens_per_block)
        parts = meta.cache["mixed"] = (decode, extend)
    return parts


_SMS: dict = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device]
