"""Every Triton kernel against its torch reference. Without a GPU this runs in the Triton
interpreter at tiny sizes; with one, over a sweep of sizes and dtypes (tolerances stated)."""

import pytest
import torch

triton = pytest.importorskip("triton")

from phalanx.kernels import attention_ref, reference, triton_attention, triton_ops  # noqa: E402
from phalanx.kernels.metadata import AttentionMetadata  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
DTYPES = [torch.bfloat16, torch.float16] if CUDA else [torch.float32]
TOL = {torch.float32: 2e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def close(a, b, dtype):
    torch.testing.assert_close(a.float(), b.float(), atol=TOL[dtype], rtol=TOL[dtype])


def mostly_close(a, b, dtype, fraction, norm=0.02):
    """At most ``fraction`` of the elements past ``close``'s tolerance (at least one allowed), and
    the whole within ``norm`` of b's norm."""
    diff = (a.float() - b.float()).abs()
    off = int((diff > TOL[dtype] * (1 + b.float().abs())).sum())
    assert off <= max(1, fraction * diff.numel()), f"{off} of {diff.numel()} elements off"
    assert diff.norm() < norm * b.float().norm(), (diff.norm(), b.float().norm())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H", [(1, 64), (5, 96), (3, 4096)] if CUDA else [(1, 64), (5, 96)])
def test_rms_norm_and_fused_add(T, H, dtype):
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(T, H, generator=g).to(DEV, dtype)
    r = torch.randn(T, H, generator=g).to(DEV, dtype)
    w = torch.randn(H, generator=g).to(DEV, dtype)
    close(triton_ops.rms_norm(x, w, 1e-6), reference.rms_norm_ref(x, w, 1e-6), dtype)
    out, res = triton_ops.fused_add_rms_norm(x, r, w, 1e-6)
    ref_out, ref_res = reference.fused_add_rms_norm_ref(x, r, w, 1e-6)
    close(out, ref_out, dtype)
    close(res, ref_res, dtype)
    q = torch.randn(T, 4, 32, generator=g).to(DEV, dtype)   # per-head norm (Qwen3 q/k norm)
    wq = torch.randn(32, generator=g).to(DEV, dtype)
    close(triton_ops.rms_norm(q, wq, 1e-6), reference.rms_norm_ref(q, wq, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H,Hkv,D", [(1, 4, 2, 32), (7, 8, 2, 64), (3, 3, 1, 32), (5, 16, 8, 32)]
                         + ([(33, 32, 8, 128), (9, 40, 10, 128)] if CUDA else []))
def test_rope_and_write_kv(T, H, Hkv, D, dtype):
    """Every head of every token rotated and written, whatever the programs' share of heads
    (``rope_heads`` of the query / KV heads: 4 / 2, 8 / 2, 1 / 1, 8 / 8 here; on a GPU 8 / 8 and
    8 / 2)."""
    from phalanx.models.layers import RotaryEmbedding
    g = torch.Generator(device="cpu").manual_seed(1)
    rot = RotaryEmbedding(D, 256, 10000.0, {"rope_type": "default"}).to(DEV)
    qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=g).to(DEV, dtype)
    q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
    q, k, v = q.view(T, H, D), k.view(T, Hkv, D), v.view(T, Hkv, D)    # strided views, as in the model
    pos = torch.randint(0, 256, (T,), generator=g).to(DEV)
    nb, B = 8, 16
    slots = torch.randperm(nb * B, generator=g)[:T].to(DEV)
    kc, vc = torch.zeros(nb, B, Hkv, D, dtype=dtype, device=DEV), torch.zeros(nb, B, Hkv, D, dtype=dtype, device=DEV)
    q_out = triton_ops.rope_and_write_kv(pos, q, k, v, rot.cos_sin, kc, vc, slots)
    q_ref, k_ref = reference.rotary_ref(pos, q, k, rot.cos_sin)
    close(q_out, q_ref, dtype)
    close(kc.view(-1, Hkv, D)[slots], k_ref, dtype)
    close(vc.view(-1, Hkv, D)[slots], v, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("T,H,Hkv,D", [(1, 4, 2, 32), (3, 3, 1, 48)]
                         + ([(2, 32, 4, 128), (3, 8, 4, 256)] if CUDA else []))
def test_rope_with_head_norms_equals_the_norms_then_the_rotary(T, H, Hkv, D, unit_offset, dtype):
    """Qwen3's q/k norms (Gemma's with ``unit_offset``) inside the rotary's launch: the same q and
    pool rows as the norm kernel then the rotary (48: a head whose halves end inside the block)."""
    from phalanx.kernels.attention_ref import HeadNorms
    from phalanx.models.layers import RotaryEmbedding
    g = torch.Generator(device="cpu").manual_seed(2)
    rot = RotaryEmbedding(D, 256, 10000.0, {"rope_type": "default"}).to(DEV)
    qkv = (torch.randn(T, (H + 2 * Hkv) * D, generator=g) * 3).to(DEV, dtype)
    q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
    q, k, v = q.view(T, H, D), k.view(T, Hkv, D), v.view(T, Hkv, D)
    norms = HeadNorms(torch.rand(D, generator=g).to(DEV, dtype) + 0.5, torch.rand(D, generator=g).to(DEV, dtype) - 0.5,
                      1e-6, unit_offset)
    pos = torch.randint(0, 256, (T,), generator=g).to(DEV)
    nb, B = 8, 16
    slots = torch.randperm(nb * B, generator=g)[:T].to(DEV)
    kc, vc = torch.zeros(nb, B, Hkv, D, dtype=dtype, device=DEV), torch.zeros(nb, B, Hkv, D, dtype=dtype, device=DEV)
    q_out = triton_ops.rope_and_write_kv(pos, q, k, v, rot.cos_sin, kc, vc, slots, qk_norm=norms)
    qn = triton_ops.rms_norm(q, norms.q_weight, norms.eps, unit_offset)
    kn = triton_ops.rms_norm(k, norms.k_weight, norms.eps, unit_offset)
    q_ref, k_ref = reference.rotary_ref(pos, qn, kn, rot.cos_sin)
    close(q_out, q_ref, dtype)
    close(kc.view(-1, Hkv, D)[slots], k_ref, dtype)
    close(vc.view(-1, Hkv, D)[slots], v, dtype)
    # the norms did something: without them the rows differ
    unnormed = triton_ops.rope_and_write_kv(pos, q, k, v, rot.cos_sin, kc.clone(), vc.clone(), slots)
    assert not torch.allclose(unnormed.float(), q_ref.float(), atol=0.1)


def test_rope_programs_take_up_to_eight_heads_of_one_kind():
    for n in (32, 40, 10, 4, 3, 1, 8, 12, 64):
        heads = triton_ops.rope_heads(n)
        assert n % heads == 0 and heads <= triton_ops.ROPE_MAX_HEADS
        assert heads == triton_ops.ROPE_MAX_HEADS or n % (2 * heads)   # the largest that fits
    assert [triton_ops.rope_heads(n) for n in (32, 10, 4, 1)] == [8, 2, 4, 1]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,N", [(1, 64), (4, 100)] + ([(16, 14336)] if CUDA else []))
def test_silu_and_mul(T, N, dtype):
    x = torch.randn(T, 2 * N, generator=torch.Generator().manual_seed(2)).to(DEV, dtype)
    close(triton_ops.silu_and_mul(x), reference.silu_and_mul_ref(x), dtype)


def test_copy_blocks():
    pool = torch.randn(2, 2, 6, 16, 2, 8, generator=torch.Generator().manual_seed(3)).to(DEV)
    ref = pool.clone()
    triton_ops.copy_blocks(pool, [1, 4], [3, 0], [5, 16])
    attention_ref.copy_blocks_ref(ref, [1, 4], [3, 0], [5, 16])
    assert torch.equal(pool, ref)


def test_a_partial_reuse_of_an_fp8_pool_copies_whole_blocks():
    """An FP8 pool's values are key-minor (attention_ref.values_key_minor), not rows: the copy of
    a partly reused block takes the whole block, the rows past n included (stale either way)."""
    from phalanx.kernels import ops
    pool = torch.randn(2, 2, 6, 16, 2, 8, generator=torch.Generator().manual_seed(3)).to(DEV, torch.float8_e4m3fn)
    before = pool.view(torch.uint8).clone()
    ops.copy_blocks(pool, [1, 4], [3, 0], [5, 16])
    after = pool.view(torch.uint8)
    assert after[:, :, 3].equal(before[:, :, 1]) and after[:, :, 0].equal(before[:, :, 4])
    assert after[:, :, [1, 2, 4, 5]].equal(before[:, :, [1, 2, 4, 5]])


def _paged_case(seq_lens, q_lens, H, Hkv, D, B, dtype, seed=0):
    """Random pool with scattered blocks, packed queries; returns (q, kc, vc, meta)."""
    g = torch.Generator().manual_seed(seed)
    blocks_per = [-(-L // B) for L in seq_lens]
    nb = sum(blocks_per) + 3
    perm = torch.randperm(nb, generator=g).tolist()
    tables, i = [], 0
    for n in blocks_per:
        tables.append(perm[i:i + n])
        i += n
    M = max(blocks_per)
    bt = torch.tensor([t + [0] * (M - len(t)) for t in tables], dtype=torch.int32)
    kc = torch.randn(nb, B, Hkv, D, generator=g).to(dtype)
    vc = torch.randn(nb, B, Hkv, D, generator=g).to(dtype)
    qs = [0]
    for ql in q_lens:
        qs.append(qs[-1] + ql)
    q = torch.randn(qs[-1], H, D, generator=g).to(dtype)
    meta = AttentionMetadata(slot_mapping=torch.zeros(qs[-1], dtype=torch.long).to(DEV),
                             query_start=torch.tensor(qs, dtype=torch.int32).to(DEV),
                             seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(DEV), block_tables=bt.to(DEV),
                             max_query_len=max(q_lens), max_seq_len=max(seq_lens), tokens_per_block=B,
                             is_decode_only=all(x == 1 for x in q_lens))
    return q.to(DEV), kc.to(DEV), vc.to(DEV), meta


def _ref(q, kc, vc, meta, window):
    plan = attention_ref.build_ref_plan(meta.query_start, meta.seq_lens, meta.block_tables, meta.tokens_per_block,
                                        meta.max_query_len, meta.max_seq_len)
    return attention_ref.paged_attention_ref(q, kc, vc, plan, q.shape[-1] ** -0.5, window)


# key tiles: the default (several blocks), 16 keys (one block here, half of one on a GPU), and on a
# GPU one block and four
KEY_TILES = [None, (16, 4, 2)] + ([(32, 4, 3), (128, 4, 2), (128, 8, 3)] if CUDA else [])
DECODE_CASES = [([1], 4, 2, 32), ([5, 40, 17], 4, 2, 32), ([33, 64], 8, 1, 16), ([600, 3], 4, 2, 16)]
if CUDA:
    DECODE_CASES += [([1, 100, 1000, 4097], 32, 8, 128), ([32768], 32, 8, 128), ([7] * 64, 8, 8, 64),
                     ([300, 2000], 28, 4, 128)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seq_lens,H,Hkv,D", DECODE_CASES)
@pytest.mark.parametrize("window", [None, 24])
def test_decode_attention_split_kv(seq_lens, H, Hkv, D, dtype, window):
    B = 32 if CUDA else 16
    q, kc, vc, meta = _paged_case(seq_lens, [1] * len(seq_lens), H, Hkv, D, B, dtype)
    ref = _ref(q, kc, vc, meta, window)
    # 40 slices: at 600 keys 38 hold some
    for splits in (1, 3, 40, triton_attention.num_splits(len(seq_lens), Hkv, max(seq_lens), B)):
        for config in KEY_TILES:
            out = triton_attention.decode_attention(q, kc, vc, meta.block_tables, meta.seq_lens, D ** -0.5, window,
                                                    splits, config)
            close(out, ref, dtype)


EXTEND_CASES = [([9], [9], 4, 2, 32), ([20, 7, 40], [3, 7, 40], 4, 4, 16), ([50, 1], [17, 1], 4, 1, 32)]
if CUDA:
    EXTEND_CASES += [([128, 1000, 77], [128, 200, 1], 32, 8, 128), ([32768], [64], 32, 8, 128),
                     ([2048], [2048], 16, 2, 64)]


PREFILL_TILES = [None, (16, 16, 4, 2), (64, 32, 4, 2)] + ([(128, 32, 4, 3), (128, 128, 8, 2), (256, 64, 8, 3)]
                                                          if CUDA else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seq_lens,q_lens,H,Hkv,D", EXTEND_CASES + [([70, 33], [70, 30], 8, 2, 16),
                                                                     ([60, 25], [41, 25], 6, 2, 16),   # G = 3
                                                                     ([60, 9], [60, 9], 4, 2, 40)])    # D = 40
@pytest.mark.parametrize("window", [None, 12])
def test_prefill_kernel_equals_the_reference(seq_lens, q_lens, H, Hkv, D, dtype, window):
    """The prompt kernel (the G query heads of a KV head in one program; the keys below a query
    block's first position walked without masks, then the diagonal's with the causal mask)
    against the reference, for tiles of 16 to 64 rows here (to 256 on a GPU): query blocks of
    4 to 64 tokens, some with whole unmasked key tiles in front of them, some without; a
    group of 3 heads in a tile of 4 (a row of no head), a head size that is not a power of two
    (every tile masked)."""
    B = 32 if CUDA else 16
    q, kc, vc, meta = _paged_case(seq_lens, q_lens, H, Hkv, D, B, dtype, seed=len(seq_lens))
    ref = _ref(q, kc, vc, meta, window)
    for config in PREFILL_TILES:
        out = triton_attention.prefill_attention(q, kc, vc, meta.block_tables, meta.query_start, meta.seq_lens,
                                                 meta.max_query_len, D ** -0.5, window, config=config)
        close(out, ref, dtype)


def test_prefill_config_by_the_longest_query():
    """Taller programs once a step's longest query passes PREFILL_LONG tokens, per pool dtype."""
    bf16, fp8 = torch.zeros(1, 16, 2, 32, dtype=torch.bfloat16), torch.zeros(1, 16, 2, 32).to(torch.float8_e4m3fn)
    ta, b = triton_attention, torch.bfloat16
    assert ta.prefill_config(b, bf16, ta.PREFILL_LONG) == ta.PREFILL_CONFIG
    assert ta.prefill_config(b, bf16, ta.PREFILL_LONG + 1) == ta.PREFILL_CONFIG_LONG
    assert ta.prefill_config(b, fp8, 100) == ta.PREFILL_CONFIG_FP8
    assert ta.prefill_config(b, fp8, 5000) == ta.PREFILL_CONFIG_FP8_LONG
    assert ta.PREFILL_CONFIG_LONG[0] > ta.PREFILL_CONFIG[0]
    # float32 queries take the small tile at any length (the tall ones exceed an SM's shared memory)
    assert ta.prefill_config(torch.float32, bf16.float(), 5000) == ta.PREFILL_CONFIG_F32


def test_prefill_block_heights():
    """Query tokens a prefill program takes: the rows over the group, at most the step's longest
    query rounded up to a power of two but never under 16 tokens, and never under 16 rows."""
    assert triton_attention.prefill_block_m(128, 4, 2048) == 32
    assert triton_attention.prefill_block_m(128, 4, 1) == 16
    assert triton_attention.prefill_block_m(128, 1, 50) == 64
    assert triton_attention.prefill_block_m(128, 1, 5000) == 128
    assert triton_attention.prefill_block_m(16, 8, 100) == 2          # 16 rows: 2 tokens of 8 heads
    assert triton_attention.prefill_block_m(64, 32, 100) == 2


@pytest.mark.parametrize("seq_lens,q_lens,H,Hkv,D", [([40, 17], [1, 1], 4, 2, 32), ([20, 50], [3, 17], 4, 1, 32),
                                                     ([40, 17], [1, 1], 4, 2, 40)]   # a head size that masks
                         + ([([1000, 4097], [1, 1], 32, 8, 128), ([2048, 77], [64, 1], 32, 8, 128)] if CUDA else []))
@pytest.mark.parametrize("dtype", [torch.bfloat16] if CUDA else [torch.float32, torch.bfloat16])
def test_attention_over_an_fp8_pool_equals_the_reference(seq_lens, q_lens, H, Hkv, D, dtype):
    """kv_cache_config.dtype fp8: decode, extend and split-extend kernels read e4m3 keys and
    values (scale 1) — the reference's answer over the same pool — and the rope + K/V write
    kernel rounds what it writes to e4m3. A bf16 model's dots take float16 there
    (``FP8_POOL_F16``; the interpreter runs that form, not bf16 dots); a float32 model's, float32."""
    assert triton_attention._kv_f16(torch.zeros(1, dtype=dtype), torch.zeros(1, dtype=torch.float8_e4m3fn)) == (
        dtype != torch.float32)
    B = 32 if CUDA else 16
    q, kc, vc, meta = _paged_case(seq_lens, q_lens, H, Hkv, D, B, dtype, seed=3)
    kc, vc = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
    ref = _ref(q.float(), kc, vc, meta, None)
    if meta.is_decode_only:
        out = triton_attention.decode_attention(q, kc, vc, meta.block_tables, meta.seq_lens, D ** -0.5, None, 3)
        close(triton_attention.decode_attention(q, kc, vc, meta.block_tables, meta.seq_lens, D ** -0.5, None, 8),
              ref, dtype)    # (more than 4 key slices: DECODE_CONFIG_FP8_SPLIT)
    else:
        out = triton_attention.prefill_attention(q, kc, vc, meta.block_tables, meta.query_start, meta.seq_lens,
                                                 meta.max_query_len, D ** -0.5, None)
        close(triton_attention.prefill_attention(q, kc, vc, meta.block_tables, meta.query_start, meta.seq_lens,
                                                 meta.max_query_len, D ** -0.5, None, config=(32, 16, 4, 2)),
              ref, dtype)
        close(triton_attention.extend_attention_split(q, kc, vc, meta.block_tables, meta.query_start, meta.seq_lens,
                                                      meta.max_query_len, D ** -0.5, None, 2), ref, dtype)
    close(out, ref, dtype)
    T = q.shape[0]
    g = torch.Generator().manual_seed(4)   # not the global generator: what ran before must not matter
    k, v = (torch.randn(T, Hkv, D, generator=g).to(DEV, dtype) * 4 for _ in range(2))
    pos = torch.arange(T, device=DEV)
    cos_sin = torch.randn(T, D, generator=g).to(DEV, torch.float32)
    k8, v8 = torch.zeros_like(kc), torch.zeros_like(vc)
    meta.slot_mapping = torch.arange(T, device=DEV) * 3
    triton_ops.rope_and_write_kv(pos, q.clone(), k.clone(), v.clone(), cos_sin, k8, v8, meta.slot_mapping)
    want = v.to(torch.float8_e4m3fn).float()
    slots = meta.slot_mapping   # values key-minor: [block, Hkv, D, B]
    got = attention_ref._value_planes(v8)[slots // B, :, :, slots % B].view(torch.float8_e4m3fn).float()
    if CUDA:
        assert ((got - want).abs() <= want.abs() / 8 + 1e-3).all() and (got == want).float().mean() > 0.99
    else:   # the interpreter's e4m3 cast drops the carry of a mantissa that rounds up to a power of two
        # (8 -> 4) and breaks bf16's exact ties the other way: rare, and never further off than that
        assert (got == want).float().mean() > 0.9 and ((got - want).abs() <= want.abs() / 2 + 2 ** -9).all()


@pytest.mark.parametrize("q_lens", [[1, 1], [3, 5]])
@pytest.mark.parametrize("window", [None, 12])
def test_a_nan_value_written_into_an_fp8_pool_reaches_no_later_sequence(q_lens, window):
    """The attention kernels load an FP8 pool's values (key-minor) without a mask by key
    (attention_ref.values_key_minor): a key past a sequence's end adds its stale value times 0.
    A request whose activations went NaN writes its values as 0, through the rope + K/V write
    kernel as through the reference, so the rest of a block it leaves behind poisons no later
    sequence: decode, extend and split-extend answers stay the reference's."""
    B, H, Hkv, D, seq_lens = (32 if CUDA else 16), 4, 2, 32, [40, 17]
    q, kc, vc, meta = _paged_case(seq_lens, q_lens, H, Hkv, D, B, torch.bfloat16, seed=7)
    kc, vc = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
    # the earlier request held the tail of each sequence's last block
    tails = [int(meta.block_tables[s, (L - 1) // B]) * B + t for s, L in enumerate(seq_lens) for t in range(L % B, B)]
    T = len(tails)
    slots = torch.tensor(tails, device=DEV)
    nan = torch.full((T, Hkv, D), float("nan"), dtype=torch.bfloat16, device=DEV)
    cos_sin = torch.randn(T, D).to(DEV, torch.float32)
    ref_k, ref_v = kc.clone(), vc.clone()
    attention_ref.write_kv_ref(ref_k, ref_v, nan, nan, slots)
    triton_ops.rope_and_write_kv(torch.arange(T, device=DEV), torch.randn(T, H, D).to(DEV, torch.bfloat16), nan,
                                 nan.clone(), cos_sin, kc, vc, slots)
    assert vc.view(torch.uint8).equal(ref_v.view(torch.uint8))
    assert (attention_ref._value_planes(vc)[slots // B, :, :, slots % B] == 0).all()
    kc.view(torch.uint8).view(-1, Hkv, D)[slots] = 0x7F      # NaN keys: loaded with a mask by key
    ref = _ref(q.float(), kc, vc, meta, window)
    assert not ref.isnan().any()
    if meta.is_decode_only:
        outs = [triton_attention.decode_attention(q, kc, vc, meta.block_tables, meta.seq_lens, D ** -0.5, window, n)
                for n in (1, 2)]
    else:
        args = (q, kc, vc, meta.block_tables, meta.query_start, meta.seq_lens, meta.max_query_len, D ** -0.5, window)
        outs = [triton_attention.prefill_attention(*args),
                triton_attention.prefill_attention(*args, config=(32, 16, 4, 2)),
                triton_attention.extend_attention_split(*args, 2)]
    for out in outs:
        close(out, ref, torch.bfloat16)


@pytest.mark.parametrize("kv_dtype,H", [(torch.bfloat16, 4), (torch.float8_e4m3fn, 4), (torch.bfloat16, 32)])
def test_start_up_runs_every_attention_form_over_the_pool_and_leaves_it_as_it_was(kv_dtype, H, monkeypatch):
    """What the engine runs before its first request so that no step waits for a compile
    (creator.py): the decode kernel with every slice count, the extend kernels with every
    query-block height (the split form's only where a step can split: 8 query heads a KV head at
    most); they only read the pool."""
    B, Hkv, D = (32 if CUDA else 16), 2, 32
    pool = torch.randn(4, B, Hkv, D, device=DEV).to(kv_dtype)
    kc, vc = pool, pool.clone()
    before = (kc.clone(), vc.clone())
    split, heights = triton_attention.extend_attention_split, []
    monkeypatch.setattr(triton_attention, "extend_attention_split",
                        lambda q, *a, **k: heights.append(q.shape[0]) or split(q, *a, **k))
    prefill, forms = triton_attention.prefill_attention, set()

    def record(q, k_cache, v_cache, tables, starts, lens, max_query_len, *a, **k):
        rows, *tile = triton_attention.prefill_config(q.dtype, k_cache, max_query_len)
        forms.add((triton_attention.prefill_block_m(rows, H // Hkv, max_query_len), *tile))
        return prefill(q, k_cache, v_cache, tables, starts, lens, max_query_len, *a, **k)
    monkeypatch.setattr(triton_attention, "prefill_attention", record)
    triton_attention.compile_decode_splits(kc, vc, H, torch.bfloat16)
    triton_attention.compile_extend_forms(kc, vc, H, torch.bfloat16)
    assert heights == ([] if H // Hkv > 8 else [16, 32])   # _split_rows(2) = 32
    # every (query block, tile) a prompt step can take, up to prompts of 64k tokens
    can = set()
    for n in range(1, 1 << 16, 7):
        rows, *tile = triton_attention.prefill_config(torch.bfloat16, kc, n)
        can.add((triton_attention.prefill_block_m(rows, H // Hkv, n), *tile))
    assert can == forms
    assert kc.view(torch.uint8).equal(before[0].view(torch.uint8)) and vc.view(torch.uint8).equal(
        before[1].view(torch.uint8))


def test_a_query_past_float16_over_an_fp8_pool_is_clamped_and_a_nan_stays_nan():
    """The float16 dots over an FP8 pool take a bf16 query clamped to float16's range (one
    element of 1e6 gives what 65504 gives) and keep a NaN a NaN, as bf16 dots would."""
    B = 32 if CUDA else 16
    q, kc, vc, meta = _paged_case([40, 17], [1, 1], 4, 2, 32, B, torch.bfloat16, seed=5)
    kc, vc = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
    big, capped = q.clone(), q.clone()
    big[0, 0, 0], capped[0, 0, 0] = 1e6, 65504.0
    run = lambda x: triton_attention.decode_attention(x, kc, vc, meta.block_tables, meta.seq_lens, 32 ** -0.5,  # noqa: E731
                                                      None, 2)
    torch.testing.assert_close(run(big).float(), _ref(capped.float(), kc, vc, meta, None).float(),
                               atol=3e-2, rtol=3e-2)
    nan = q.clone()
    nan[1, 2, 5] = float("nan")
    out = run(nan)
    assert out[1, 2].isnan().all() and not out[0].isnan().any() and not out[1, 0].isnan().any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seq_lens,q_lens,H,Hkv,D",
                         EXTEND_CASES + [([300], [5], 8, 2, 32), ([90, 64], [33, 2], 6, 2, 16)])
@pytest.mark.parametrize("window", [None, 12])
def test_extend_attention_split_over_the_keys(seq_lens, q_lens, H, Hkv, D, dtype, window):
    """The split form (G heads a program, keys in slices, merged): the reference's answer for
    any number of slices, including more slices than a row has keys."""
    B = 32 if CUDA else 16
    q, kc, vc, meta = _paged_case(seq_lens, q_lens, H, Hkv, D, B, dtype, seed=len(seq_lens) + 7)
    ref = _ref(q, kc, vc, meta, window)
    planned = triton_attention.extend_splits(meta.max_query_len, 1, Hkv, H, num_sms=132)
    if CUDA:
        forms = [(n, c) for n in sorted({2, 5, 16, planned}) for c in KEY_TILES[:2]]
    else:   # the interpreter: each slice count once, the key tiles taking turns
        forms = [(n, KEY_TILES[i % 2]) for i, n in enumerate(sorted({5, 16, planned}))]
    for splits, config in forms:
        out = triton_attention.extend_attention_split(q, kc, vc, meta.block_tables, meta.query_start,
                                                      meta.seq_lens, meta.max_query_len, D ** -0.5, window,
                                                      splits, config)
        close(out, ref, dtype)


MIXED_CASES = [([40, 17, 33, 50], [1, 1, 1, 17], 4, 2, 32), ([9, 30, 64, 5], [1, 1, 30, 5], 4, 1, 16)]
if CUDA:
    MIXED_CASES += [([1100] * 96 + [1000], [1] * 96 + [1000], 32, 8, 128),
                    ([700, 2100, 64, 300], [1, 1, 64, 37], 28, 4, 128)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seq_lens,q_lens,H,Hkv,D", MIXED_CASES)
@pytest.mark.parametrize("window", [None, 12])
def test_mixed_step_decode_rows_apart_equal_the_reference(seq_lens, q_lens, H, Hkv, D, dtype, window):
    """A mixed step's leading one-query rows through the decode kernels and the rest through
    the extend kernels, into one output: the reference's answer for every row."""
    import numpy as np

    from phalanx.pyexecutor.model_runner import _leading_decode_rows
    B = 32 if CUDA else 16
    q, kc, vc, meta = _paged_case(seq_lens, q_lens, H, Hkv, D, B, dtype, seed=11)
    meta.num_decode_rows = _leading_decode_rows(np.asarray(q_lens))
    assert meta.num_decode_rows == q_lens.index(next(x for x in q_lens if x != 1))
    out = triton_attention.paged_attention(q, kc, vc, meta, D ** -0.5, window)
    ref = _ref(q, kc, vc, meta, window)
    close(out, ref, dtype)
    assert set(meta.cache) >= {"mixed"}
    # into a given buffer (piecewise graphs read attention's output from a static one): only its rows
    T = q.shape[0]
    buf = torch.full((T + 3, *q.shape[1:]), float("nan"), dtype=q.dtype, device=q.device)
    got = triton_attention.paged_attention(q, kc, vc, meta, D ** -0.5, window, out=buf[:T])
    assert got.data_ptr() == buf.data_ptr()
    close(buf[:T], ref, dtype)
    assert torch.isnan(buf[T:]).all()


def test_decode_slices_are_powers_of_two_and_all_compile_at_start_up():
    """num_splits gives a power of two for any batch (a mixed step's decode rows included), so
    the forms compile_decode_splits runs are all the split kernel will ever need."""
    seen = {triton_attention.num_splits(s, h, L, 16) for s in range(1, 300) for h in (1, 2, 8) for L in (16, 300, 4096)}
    assert seen <= {1 << i for i in range(triton_attention.MAX_SPLITS.bit_length())} and len(seen) >= 5
    B, Hkv, D = 16, 2, 32
    kc = torch.randn(3, B, Hkv, D).to(DEV)
    triton_attention.compile_decode_splits(kc, kc.clone(), 4, kc.dtype)
    for pool in (kc, kc.to(torch.float8_e4m3fn)):   # every grid's config is among the compiled ones
        for splits in (1, 2, 8):
            forms = triton_attention.decode_configs(pool, splits)
            assert {triton_attention.decode_config(pool, splits, p / 4) for p in range(200)} == set(forms)
    assert len(triton_attention.decode_configs(kc, 1)) == 2 and len(triton_attention.decode_configs(kc, 2)) == 1


def test_a_short_engine_decodes_one_sequence_over_slices_of_one_block():
    """The floor on a key slice is one block (``MIN_SLICE_BLOCKS``): an engine of 320 positions
    with 32-token blocks splits one sequence's keys 8 ways (a floor of 4 blocks gave 2), one of
    1,216 positions 32 ways; many sequences still fill the GPU without slicing."""
    assert triton_attention.num_splits(1, 8, 320, 32) == 8
    assert triton_attention.num_splits(1, 8, 1216, 32) == 32
    assert triton_attention.num_splits(1, 8, 131072, 32) == 32
    assert triton_attention.num_splits(256, 8, 320, 32) == 1


def test_leading_decode_rows_counts_only_a_mixed_steps_first_one_query_rows():
    import numpy as np

    from phalanx.pyexecutor.model_runner import _leading_decode_rows
    assert _leading_decode_rows(np.array([1, 1, 1, 40])) == 3
    assert _leading_decode_rows(np.array([1, 5, 1, 1])) == 1
    assert _leading_decode_rows(np.array([7, 1, 1])) == 0
    assert _leading_decode_rows(np.array([1, 1, 1])) == 0        # decode only: not a mixed step


def test_extend_splits_only_when_the_grid_is_small():
    assert triton_attention.extend_splits(2048, 1, 8, 32) == 1          # 32 query blocks x 32 heads
    assert triton_attention.extend_splits(32, 1, 8, 32) > 1             # 32 programs on 132 SMs
    assert triton_attention.extend_splits(32, 1, 8, 32) <= 16
    assert triton_attention.extend_splits(32, 64, 8, 32) == 1           # a mixed batch of 64 sequences
    assert triton_attention.extend_splits(32, 1, 4, 64) == 1            # 16 heads a KV head: tile too tall
    # the prefill kernel's own grid decides: 320 new tokens of one sequence are 10 query blocks x 8
    # KV heads, 80 programs on 132 SMs (a grid of a program per query head would count 160)
    assert triton_attention.extend_splits(320, 1, 8, 32) > 1


@pytest.mark.parametrize("M,N,K", [(1, 48, 64), (3, 100, 96), (20, 40, 160)]
                         + ([(1, 4096, 4096), (4, 14336, 4096), (2, 4096, 14336), (16, 6144, 4096), (64, 4096, 14336),
                             (37, 1000, 4096)] if CUDA else []))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32] if CUDA else [torch.float32])
def test_gemv_every_tile(M, N, K, dtype):
    from phalanx.kernels import gemv
    from phalanx.kernels.linear_plan import RowsTile
    g = torch.Generator().manual_seed(5)
    x = torch.randn(M, K, generator=g).to(DEV, dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(DEV, dtype)
    b = torch.randn(N, generator=g).to(DEV, dtype)
    ref = torch.nn.functional.linear(x.float(), w.float(), b.float())
    xx = torch.randn(M, 2 * K, generator=g).to(DEV, dtype)
    ref_silu = torch.nn.functional.linear(reference.silu_and_mul_ref(xx).float(), w.float())
    tiles = gemv.ONE_ROW_TILES if M == 1 else [RowsTile(*t[:4], k) for t in gemv.ROWS_TILES for k in (1, 3)]
    for tile, p in ([(t, p) for t in tiles for p in (False, True)] if CUDA else [(t, False) for t in tiles[:2]]):
        close(gemv.gemv(x, w, b, tile, pdl=p), ref, dtype)
        close(gemv.gemv(xx, w, None, tile, silu=True, pdl=p), ref_silu, dtype)
        if M == 1:   # the first weight tile loaded before the PDL wait: the same sums in the same order
            assert torch.equal(gemv.gemv(x, w, b, tile, pdl=p, preload=True), gemv.gemv(x, w, b, tile, pdl=p))


@pytest.mark.parametrize("M,N,K", [(1, 48, 64), (20, 40, 160)]
                         + ([(1, 4096, 4096), (16, 6144, 4096), (64, 4096, 14336), (37, 1000, 4096)] if CUDA else []))
def test_gemv_fp8_weights_equal_the_dequantized_reference(M, N, K):
    """FP8 weights with a scale per output row: the skinny kernels widen them and scale in their
    epilogue (one row, padded rows, split over K, SiLU in front) — the reference is the projection
    of the dequantized weight (kernels/fp8.py); many rows take fp8.linear (cuBLASLt on the GPU)."""
    from phalanx.kernels import fp8, gemv
    from phalanx.kernels.linear_plan import RowsTile
    dtype = torch.bfloat16 if CUDA else torch.float32
    g = torch.Generator().manual_seed(7)
    x = torch.randn(M, K, generator=g).to(DEV, dtype)
    w = torch.randn(N, K, generator=g) / K ** 0.5 * torch.logspace(-2, 1, N)[:, None]   # rows of many sizes
    q, scale = (t.to(DEV) for t in fp8.quantize_weight(w))
    b = torch.randn(N, generator=g).to(DEV, dtype)
    ref = fp8.reference(x.float(), q, b.float(), scale)
    xx = torch.randn(M, 2 * K, generator=g).to(DEV, dtype)
    ref_silu = fp8.reference(reference.silu_and_mul_ref(xx).float(), q, None, scale)
    tiles = (gemv.ONE_ROW_TILES[:1] + gemv.ONE_ROW_TILES_FP8[:2] if M == 1   # products folded, and not
             else [RowsTile(*t[:4], k) for t in gemv.ROWS_TILES[:1] for k in (1, 3)])
    for tile in tiles:
        close(gemv.gemv(x, q, b, tile, scale=scale), ref, dtype)
        close(gemv.gemv(xx, q, None, tile, silu=True, scale=scale), ref_silu, dtype)
    if CUDA and N % 16 == 0 and K % 16 == 0:   # activations quantized per row too: e4m3's own rounding
        torch.testing.assert_close(fp8.linear(x, q, b, scale).float(), ref, atol=0.1 * ref.abs().max().item(),
                                   rtol=0.1)


@pytest.mark.parametrize("M,N,K", [(1, 40, 160), (20, 40, 96), (150, 72, 160)]
                         + ([(1, 4096, 4096), (16, 6144, 4096), (64, 4096, 14336), (37, 1000, 4096),
                             (300, 6144, 4096), (2048, 28672, 4096)] if CUDA else []))
def test_block_scaled_fp8_weights_equal_the_dequantized_reference(M, N, K):
    """FP8 weights with a scale per block (a DeepSeek/Qwen3 FP8 checkpoint's layout, kept as it
    is): the skinny kernels scale each block's folded sums as they add them (one row, padded rows,
    split over K, SiLU in front), and the block GEMM of many rows scales each K step's FP8 dot —
    each against the projection of the dequantized weight (on the rows as quantized, for the
    GEMM). Rows of many sizes share blocks; N and K end inside a block."""
    from phalanx.kernels import fp8, fp8_block_gemm, gemv
    from phalanx.kernels.linear_plan import RowsTile
    block = (128, 128) if CUDA else (16, 32)
    dtype = torch.bfloat16 if CUDA else torch.float32
    g = torch.Generator().manual_seed(17)
    x = torch.randn(M, K, generator=g).to(DEV, dtype)
    w = torch.randn(N, K, generator=g) / K ** 0.5 * torch.logspace(-2, 1, N)[:, None]
    q, scale = (t.to(DEV) for t in fp8.quantize_blocks(w, block))
    assert scale.shape == (-(-N // block[0]), -(-K // block[1]))
    b = torch.randn(N, generator=g).to(DEV, dtype)
    ref = fp8.reference(x.float(), q, b.float(), scale, block)
    if M <= 64:
        xx = torch.randn(M, 2 * K, generator=g).to(DEV, dtype)
        ref_silu = fp8.reference(reference.silu_and_mul_ref(xx).float(), q, None, scale, block)
        tiles = (gemv.ONE_ROW_TILES[:1] + gemv.ONE_ROW_TILES_FP8[:2] if M == 1   # products folded, and not
                 else [RowsTile(*t[:4], k) for t in gemv.ROWS_TILES for k in (1, 3)])
        for tile in tiles:
            close(gemv.gemv(x, q, b, tile, scale=scale, block=block), ref, dtype)
            close(gemv.gemv(xx, q, None, tile, silu=True, scale=scale, block=block), ref_silu, dtype)
    rows = fp8.quantize_rows_reference(x)
    ref_rows = fp8.reference(rows.dequantize().float(), q, None, scale, block)
    tiles = fp8_block_gemm.TILES + fp8_block_gemm.FEW_ROW_TILES if CUDA else fp8_block_gemm.TILES[:1]
    for tile in tiles:
        y = fp8_block_gemm.gemm(rows.q, rows.scale, q, scale, block, tile, out_dtype=dtype)
        # (the tensor cores' FP8 dots sum a block's 128 products in a narrower format before the
        # scale promotes them: on an H100 up to 1,356 of 58.7 million bf16 outputs land just past
        # close's tolerance, all near zero; one in a thousand is allowed)
        mostly_close(y, ref_rows, dtype, 1e-3)
    if CUDA:   # through fp8.linear, the rows quantized by the kernel: e4m3's own rounding of x ...
        gemm = fp8_block_gemm.rows_gemm(tiles[0], block)
        y = fp8.linear(x, q, b, scale, gemm, block)
        torch.testing.assert_close(y.float(), ref, atol=0.1 * ref.abs().max().item(), rtol=0.1)
        # ... and behind SiLU, silu(gate) * up quantized by the SiLU-and-mul kernel
        xx = torch.randn(M, 2 * K, generator=g).to(DEV, dtype)
        ref_silu = fp8.reference(reference.silu_and_mul_ref(xx).float(), q, None, scale, block)
        y = fp8.silu_linear(xx, q, None, scale, gemm, block)
        torch.testing.assert_close(y.float(), ref_silu, atol=0.1 * ref_silu.abs().max().item(), rtol=0.1)
        # cuBLASLt's block-scaled GEMM (Hopper, CUDA 12.9 on), rows padded to a multiple of 4 (M = 1)
        cuda_version = tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2])
        if torch.cuda.get_device_capability() == (9, 0) and cuda_version >= (12, 9):
            assert fp8.blockwise_scaled_mm(x.device)
        if fp8.block_scaled_mm_fits(q, block):
            y = fp8.block_scaled_mm(rows.q, rows.scale, q, scale)
            assert y.shape == (M, N)
            mostly_close(y, ref_rows, dtype, 1e-3)
            y = fp8.linear(x, q, b, scale, fp8.block_scaled_mm, block)
            torch.testing.assert_close(y.float(), ref, atol=0.1 * ref.abs().max().item(), rtol=0.1)
    with pytest.raises(ValueError, match="2-D scale"):   # a block scale never reaches a per-row launch
        gemv.gemv(x[:1], q, b, gemv.ONE_ROW_TILES_FP8[0], scale=scale)


@pytest.mark.parametrize("M,N,K", [(20, 40, 300)]
                         + ([(16, 4096, 4096), (64, 4096, 14336), (5, 6144, 4096)] if CUDA else []))
def test_the_fp8_gemm_of_few_rows_split_over_k_equals_the_reference(M, N, K):
    """The Triton FP8 GEMM of few rows, whole and over slices of K (the slice that finishes last
    sums the partials), with a weight scaled per block or per row (the plan up to 64 rows may
    take for either), against the projection of the dequantized weight on the rows as
    quantized; called twice, so the second call finds its counters reset by the first."""
    from phalanx.kernels import fp8, fp8_block_gemm
    block = (128, 128) if CUDA else (16, 32)
    dtype = torch.bfloat16 if CUDA else torch.float32
    g = torch.Generator().manual_seed(29)
    x = torch.randn(M, K, generator=g).to(DEV, dtype)
    w = torch.randn(N, K, generator=g) / K ** 0.5 * torch.logspace(-2, 1, N)[:, None]
    rows = fp8.quantize_rows_reference(x)
    b = torch.randn(N, generator=g).to(DEV, dtype)
    weights = [(block, *fp8.quantize_blocks(w, block)), (None, *fp8.quantize_weight(w))]
    tiles = fp8_block_gemm.FEW_ROW_TILES if CUDA else fp8_block_gemm.FEW_ROW_TILES[:1]
    for blocks, q, scale in weights:
        q, scale = q.to(DEV), scale.to(DEV)
        ref = fp8.reference(rows.dequantize().float(), q, b.float(), scale, blocks)
        for tile in tiles:
            splits = {1, 3, fp8_block_gemm.auto_splits(M, N, K, tile, blocks, 132)}
            for k in sorted(splits):
                for _ in range(2):
                    y = fp8_block_gemm.gemm(rows.q, rows.scale, q, scale, blocks, tile._replace(splits=k), b,
                                            out_dtype=dtype)
                    mostly_close(y, ref, dtype, 1e-3)
    with pytest.raises(ValueError, match="1-D scale"):   # a row's scale never reaches a block launch
        fp8_block_gemm.gemm(rows.q, rows.scale, q, scale, block)


@pytest.mark.skipif(not CUDA, reason="cuBLASLt's block-scaled GEMM runs on a GPU")
def test_a_plan_of_cublas_block_scaled_gemm_equals_the_reference_in_a_cuda_graph():
    """A projection planned on cuBLASLt's block-scaled GEMM at every bucket, at row counts that
    pad to a multiple of 4 and that do not, eagerly and replayed from a CUDA graph on new rows."""
    from phalanx.kernels import fp8
    from phalanx.kernels.linear_plan import CUBLAS_BLOCK, MANY_ROW_BUCKETS, ROW_BUCKETS, LinearPlan, Neighbour
    block = (128, 128)
    g = torch.Generator().manual_seed(5)
    w = torch.randn(1024, 1536, generator=g) / 40 * torch.logspace(-2, 1, 1024)[:, None]
    q, scale = (t.to(DEV) for t in fp8.quantize_blocks(w, block))
    if not fp8.block_scaled_mm_fits(q, block):
        pytest.skip("no block-scaled cuBLASLt GEMM on this GPU or build")
    plan = LinearPlan(Neighbour.PLAIN, (CUBLAS_BLOCK,) * len(ROW_BUCKETS), True,
                      (CUBLAS_BLOCK,) * len(MANY_ROW_BUCKETS), block=block)
    for M in (1, 13, 64, 300):
        x = torch.randn(M, 1536, generator=g).to(DEV, torch.bfloat16)
        ref = fp8.reference(x.float(), q, None, scale, block)
        torch.testing.assert_close(plan(x, q, None, scale).float(), ref, atol=0.1 * ref.abs().max().item(), rtol=0.1)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = plan(x, q, None, scale)
        x.copy_(torch.randn(M, 1536, generator=g).to(DEV, torch.bfloat16))
        graph.replay()
        ref = fp8.reference(x.float(), q, None, scale, block)
        torch.testing.assert_close(y.float(), ref, atol=0.1 * ref.abs().max().item(), rtol=0.1)


def test_block_scaled_weights_quantize_and_dequantize_by_block():
    """``quantize_blocks``: one scale per block (its amax / 448; a partial block at the edge
    takes what it holds), values within e4m3's precision of W; an ``Fp8BlockWeight`` of the
    same blocks is kept as it is, of other blocks quantized again."""
    from phalanx.kernels import fp8
    g = torch.Generator().manual_seed(3)
    w = torch.randn(40, 70, generator=g) * torch.logspace(-3, 2, 40)[:, None]
    q, scale = fp8.quantize_blocks(w, (16, 32))
    assert scale.shape == (3, 3) and q.shape == w.shape and q.dtype == fp8.FP8
    assert torch.equal(scale[2, 2], w[32:, 64:].abs().max() / fp8.FP8_MAX)
    back = fp8.dequantize_blocks(q, scale, (16, 32), torch.float32)
    assert ((back - w).abs() <= w.abs() / 16 + fp8.expand_blocks(scale, (16, 32), 40, 70) * 2 ** -9).all()
    assert torch.equal(fp8.Fp8BlockWeight(q, scale, (16, 32)).dequantize(torch.float32), back)
    assert fp8.blocks_fit((128, 128)) and fp8.blocks_fit((16, 32))
    assert not any(fp8.blocks_fit(b) for b in [(16, 16), (8, 128), (128, 96), (1, 128), (128, 256), None])


@pytest.mark.parametrize("M,K", [(1, 64), (5, 3000)] + ([(64, 14336)] if CUDA else []))
def test_quantize_rows_fp8_kernel_equals_the_reference(M, K):
    from phalanx.kernels import fp8, triton_ops
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(M, K, generator=g) * torch.logspace(-3, 2, M)[:, None]).to(DEV, torch.bfloat16 if CUDA else
                                                                             torch.float32)
    x[0, :7] = 0.0
    q, scale = triton_ops.quantize_rows_fp8(x, fp8.FP8_MAX, 1e-12)
    q2, scale2 = triton_ops.quantize_rows_fp8(x, fp8.FP8_MAX, 1e-12, held=32)   # rows read twice, in tiles
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(scale, scale2)
    rq, rscale, _ = fp8.quantize_rows_reference(x)
    torch.testing.assert_close(scale, rscale)
    back, rback = q.float() * scale, rq.float() * rscale
    near = (back - rback).abs() <= rback.abs() / 8 + rscale / 64      # the same e4m3 value or a neighbour
    if CUDA:
        assert near.all() and (back == rback).float().mean() > 0.99
    else:   # the interpreter's e4m3 cast drops the carry of a mantissa that rounds up to a power of two
        assert (back == rback).float().mean() > 0.95


@pytest.mark.parametrize("T,H", [(1, 64), (5, 96)] + ([(70, 4096)] if CUDA else []))
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_quantized_per_row_equals_the_norm_and_the_quantization_apart(T, H, residual):
    """The norm in front of an FP8 product hands over e4m3 rows: the same bytes and scales as the
    norm kernel followed by the row quantization kernel (and the residual the fused add gives)."""
    from phalanx.kernels import fp8
    g = torch.Generator().manual_seed(12)
    dtype = torch.bfloat16 if CUDA else torch.float32
    x = (torch.randn(T, H, generator=g) * torch.logspace(-2, 2, T)[:, None]).to(DEV, dtype)
    r = torch.randn(T, H, generator=g).to(DEV, dtype)
    w = torch.randn(H, generator=g).to(DEV, dtype)
    q, scale, res = triton_ops.rms_norm_fp8(x, r if residual else None, w, 1e-6, fp8.FP8_MAX, fp8.TINY)
    if residual:
        h, res_apart = triton_ops.fused_add_rms_norm(x, r, w, 1e-6)
        assert torch.equal(res, res_apart)
    else:
        h = triton_ops.rms_norm(x, w, 1e-6)
        assert res is None
    q_apart, scale_apart = triton_ops.quantize_rows_fp8(h, fp8.FP8_MAX, fp8.TINY)
    assert q.dtype == fp8.FP8 and scale.shape == (T, 1)
    torch.testing.assert_close(scale, scale_apart, rtol=0, atol=0)
    assert torch.equal(q.view(torch.uint8), q_apart.view(torch.uint8))
    ref = fp8.quantize_rows_reference(h)                 # and near the torch quantization of the row
    back, rback = q.float() * scale, ref.q.float() * ref.scale
    if CUDA:   # the same e4m3 value or a neighbour
        assert ((back - rback).abs() <= rback.abs() / 8 + ref.scale / 64).all()
    else:      # the interpreter's e4m3 cast drops the carry of a mantissa that rounds up to a power of two
        assert (back == rback).float().mean() > 0.95


@pytest.mark.parametrize("T,N", [(1, 64), (4, 100)] + ([(70, 14336)] if CUDA else []))
def test_silu_and_mul_quantized_per_row_equals_the_two_kernels_apart(T, N):
    from phalanx.kernels import fp8
    g = torch.Generator().manual_seed(13)
    dtype = torch.bfloat16 if CUDA else torch.float32
    x = (torch.randn(T, 2 * N, generator=g) * torch.logspace(-2, 2, T)[:, None]).to(DEV, dtype)
    x[0, :5] = 0.0
    q, scale = triton_ops.silu_and_mul_fp8(x, fp8.FP8_MAX, fp8.TINY)
    q_apart, scale_apart = triton_ops.quantize_rows_fp8(triton_ops.silu_and_mul(x), fp8.FP8_MAX, fp8.TINY)
    torch.testing.assert_close(scale, scale_apart, rtol=0, atol=0)
    assert torch.equal(q.view(torch.uint8), q_apart.view(torch.uint8))
    with pytest.raises(ValueError, match="at most 32768"):
        triton_ops.silu_and_mul_fp8(torch.zeros(1, 2 * 40000, device=DEV, dtype=dtype), fp8.FP8_MAX, fp8.TINY)


@pytest.mark.parametrize("H,Hkv,D,bias",
                         [(4, 2, 32, False), (6, 2, 16, True)] + ([(32, 8, 128, False)] if CUDA else []))
def test_one_token_qkv_with_rotary_and_kv_write_equals_the_kernels_apart(H, Hkv, D, bias):
    """The fused q/k/v projection + rotary + K/V write gives the bits of the projection, then
    ``rope_and_write_kv`` — for every one-row tile that fits a head, with PDL where the GPU has it."""
    from phalanx.kernels import gemv
    from phalanx.kernels.linear_plan import QkvRopePlan
    g = torch.Generator().manual_seed(11)
    dtype = torch.bfloat16
    K, N, B, nb = 64 if not CUDA else 4096, (H + 2 * Hkv) * D, 16, 6
    x = torch.randn(1, K, generator=g).to(DEV, dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(DEV, dtype)
    b = torch.randn(N, generator=g).to(DEV, dtype) if bias else None
    cs = torch.randn(40, D, generator=g).to(DEV)
    pos, slot = torch.tensor([37], device=DEV), torch.tensor([3 * B + 5], device=DEV)
    for tile in gemv.ONE_ROW_TILES if CUDA else gemv.ONE_ROW_TILES[:2]:
        if not QkvRopePlan.fits(tile, D):   # a tile wider than a head: the tuner leaves the kernels apart
            with pytest.raises(ValueError):
                QkvRopePlan(tile, False)(x, w, b, pos, cs, *[torch.zeros(nb, B, Hkv, D, dtype=dtype, device=DEV)] * 2,
                                         slot, H, Hkv, D)
            continue
        for use_pdl in (False, True) if CUDA else (False,):
            caches = [torch.zeros(nb, B, Hkv, D, dtype=dtype, device=DEV) for _ in range(4)]
            q = QkvRopePlan(tile, use_pdl)(x, w, b, pos, cs, caches[0], caches[1], slot, H, Hkv, D)
            qkv = gemv.gemv(x, w, b, tile, pdl=use_pdl)
            q_part, k_part, v_part = qkv[:, :H * D], qkv[:, H * D:(H + Hkv) * D], qkv[:, (H + Hkv) * D:]
            q_ref = triton_ops.rope_and_write_kv(pos, q_part.view(1, H, D), k_part.view(1, Hkv, D),
                                                 v_part.view(1, Hkv, D), cs, caches[2], caches[3], slot)
            assert torch.equal(q, q_ref), tile
            assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3]), tile
            assert caches[0].view(-1, Hkv, D)[3 * B + 5].abs().sum() > 0   # it wrote the slot


@pytest.mark.parametrize("bias", [False, True])
def test_one_token_gate_up_with_silu_equals_the_kernels_apart(bias):
    """silu(gate) * up from the gate ‖ up kernel's epilogue gives the bits of the projection, then
    the SiLU-and-mul kernel, for every one-row tile; the MLP of one token takes that path only
    where its plan says so."""
    from phalanx.kernels import gemv
    from phalanx.kernels.linear_plan import CUBLAS, GateUpSiluPlan
    g = torch.Generator().manual_seed(12)
    dtype = torch.bfloat16 if CUDA else torch.float32   # the interpreter's bfloat16 SiLU is not exact
    K, I = (64, 40) if not CUDA else (4096, 14336)  # noqa: E741 (I: intermediate size)
    x = torch.randn(1, K, generator=g).to(DEV, dtype)
    w = (torch.randn(2 * I, K, generator=g) / K ** 0.5).to(DEV, dtype)
    b = torch.randn(2 * I, generator=g).to(DEV, dtype) if bias else None
    down = torch.randn(K, I, generator=g).to(DEV, dtype)
    for tile in gemv.ONE_ROW_TILES if CUDA else gemv.ONE_ROW_TILES[:2]:
        for use_pdl in (False, True) if CUDA else (False,):
            plan = GateUpSiluPlan(tile, use_pdl, CUBLAS)
            act = plan.gate_up_silu(x, w, b)
            assert torch.equal(act, triton_ops.silu_and_mul(gemv.gemv(x, w, b, tile, pdl=use_pdl))), tile
            close(plan.down_proj(act, down), torch.nn.functional.linear(act.float(), down.float()), dtype)


@pytest.mark.parametrize("fold,block", [(1, None), (16, None), (16, (32, 32)), (1, (16, 32))])
def test_one_token_fused_paths_with_fp8_weights_equal_the_kernels_apart(fold, block):
    """FP8 weights (a scale per row, or per block) through the one-token paths — q/k/v + rotary
    + K/V write into an FP8 pool, gate ‖ up + SiLU, then down — give the bits of the FP8 skinny
    kernels and the kernels after them run apart, with the products folded into a narrower
    accumulator (``OneRowTile.fold``) or not."""
    from phalanx.kernels import fp8, gemv
    from phalanx.kernels.linear_plan import GateUpSiluPlan, OneRowTile, Plan, QkvRopePlan
    g = torch.Generator().manual_seed(13)
    dtype = torch.bfloat16 if CUDA else torch.float32
    H, Hkv, D, B, nb = 4, 2, 32, 16, 6
    K, I = (64, 48) if not CUDA else (4096, 14336)  # noqa: E741 (I: intermediate size)

    def quantize(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, scale = fp8.quantize_weight(t) if block is None else fp8.quantize_blocks(t, block)
        return q.to(DEV), scale.to(DEV)
    x = torch.randn(1, K, generator=g).to(DEV, dtype)
    w, s = quantize(torch.randn((H + 2 * Hkv) * D, K, generator=g))
    cs = torch.randn(40, D, generator=g).to(DEV)
    pos, slot = torch.tensor([37], device=DEV), torch.tensor([3 * B + 5], device=DEV)
    tile = OneRowTile(16, 64 if not CUDA else 1024, 4, 2, fold)
    caches = [torch.zeros(nb, B, Hkv, D, dtype=torch.float8_e4m3fn, device=DEV) for _ in range(4)]
    q = QkvRopePlan(tile, False, block)(x, w, None, pos, cs, caches[0], caches[1], slot, H, Hkv, D, s)
    qkv = gemv.gemv(x, w, None, tile, scale=s, block=block)
    close(qkv, fp8.reference(x.float(), w, None, s, block), dtype)
    q_part, k_part, v_part = qkv[:, :H * D], qkv[:, H * D:(H + Hkv) * D], qkv[:, (H + Hkv) * D:]
    q_ref = triton_ops.rope_and_write_kv(pos, q_part.view(1, H, D), k_part.view(1, Hkv, D), v_part.view(1, Hkv, D),
                                         cs, caches[2], caches[3], slot)
    assert torch.equal(q, q_ref)
    assert torch.equal(caches[0].view(torch.uint8), caches[2].view(torch.uint8))
    assert torch.equal(caches[1].view(torch.uint8), caches[3].view(torch.uint8))
    gu, s_gu = quantize(torch.randn(2 * I, K, generator=g) / K ** 0.5)
    dn, s_dn = quantize(torch.randn(K, I, generator=g) / I ** 0.5)
    plan = GateUpSiluPlan(tile, False, Plan("gemv", tile), fp8=True, block=block)
    act = plan.gate_up_silu(x, gu, None, s_gu)
    assert torch.equal(act, triton_ops.silu_and_mul(gemv.gemv(x, gu, None, tile, scale=s_gu, block=block)))
    assert torch.equal(plan.down_proj(act, dn, s_dn), gemv.gemv(act, dn, None, tile, scale=s_dn, block=block))
    close(plan.down_proj(act, dn, s_dn), fp8.reference(act.float(), dn, None, s_dn, block), dtype)


@pytest.mark.skipif(not CUDA, reason="tuning times CUDA graphs")
def test_gate_up_silu_pair_tuning_picks_a_path_that_runs():
    """The pair tuner times both paths of a (gate ‖ up, down) pair and returns a plan or None;
    an MLP of one token given it gives the bits of the path it names."""
    from phalanx.kernels import gemv, gemv_tuner
    from phalanx.kernels.linear_plan import Neighbour
    from phalanx.models.llama import MLP
    from phalanx.models.parallel import TPGroup
    K, I, dtype = 1024, 2816, torch.bfloat16  # noqa: E741 (I: intermediate size)
    mlp = MLP(K, I, False, TPGroup()).to(DEV, dtype)
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=K ** -0.5)
    gu, dn = mlp.gate_up_proj, mlp.down_proj
    gu.plan = gemv_tuner.tune_linear(gu.weight, Neighbour.NORM)
    dn.plan = gemv_tuner.tune_linear(dn.weight, Neighbour.SILU)
    report = {}
    plan = gemv_tuner.gate_up_silu_plan(gu.weight, gu.plan, dn.weight, dn.plan, report)
    assert len(report) == 1 and all(v > 0 for v in report.values()), report
    x = torch.randn(1, K, device=DEV, dtype=dtype)
    apart = dn(gu(x))
    mlp.one_token = plan
    if plan is not None:
        act = triton_ops.silu_and_mul(gemv.gemv(x, gu.weight, None, plan.tile, pdl=plan.pdl))
        assert torch.equal(mlp(x), plan.down_proj(act, dn.weight))
    close(mlp(x), apart, dtype)


def test_split_k_adds_slices_in_order_and_resets_its_counters():
    """Split over K, the last slice to finish sums the partials in slice order: the same bits on
    every run and the same numbers as unsplit up to rounding; its counters are back at zero."""
    from phalanx.kernels import gemv
    from phalanx.kernels.linear_plan import RowsTile
    dtype = torch.bfloat16 if CUDA else torch.float32
    M, N, K = (48, 4096, 14336) if CUDA else (5, 40, 1024)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(M, K, generator=g).to(DEV, dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(DEV, dtype)
    b = torch.randn(N, generator=g).to(DEV, dtype)
    tile = gemv.ROWS_TILES[0]
    whole = gemv.gemv(x, w, b, RowsTile(*tile[:4], 1))
    split = [gemv.gemv(x, w, b, RowsTile(*tile[:4], 4)) for _ in range(3)]
    assert all(torch.equal(split[0], y) for y in split[1:])
    close(split[0], whole, dtype)
    close(split[0], torch.nn.functional.linear(x.float(), w.float(), b.float()), dtype)
    assert int(gemv._COUNTS[x.device].count_nonzero()) == 0


@pytest.mark.parametrize("behind", ["norm", "silu"])
def test_a_projection_runs_the_plan_of_its_row_bucket(behind, monkeypatch):
    """A plan runs the Plan of the batch's row bucket — the skinny kernel (with the SiLU fused
    in behind SILU) or cuBLAS — and cuBLAS past the last bucket; every path gives the reference."""
    from phalanx.kernels import gemv
    from phalanx.kernels.linear_plan import CUBLAS, LinearPlan, Neighbour, Plan, RowsTile
    neighbour = Neighbour(behind)
    dtype = torch.bfloat16 if CUDA else torch.float32
    K, N = 64, 48
    g = torch.Generator().manual_seed(11)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(DEV, dtype)
    calls = []
    real = gemv.gemv
    monkeypatch.setattr(gemv, "gemv", lambda *a, **kw: calls.append((a[0].shape[0], kw["silu"])) or real(*a, **kw))
    plan = LinearPlan(neighbour, (Plan("gemv", gemv.ONE_ROW_TILES[1]), CUBLAS,
                                  Plan("gemv", RowsTile(32, 256, 4, 4, 2))))
    for rows in (1, 2, 40, 70):
        x = torch.randn(rows, 2 * K if behind == "silu" else K, generator=g).to(DEV, dtype)
        want = reference.silu_and_mul_ref(x) if behind == "silu" else x
        close(plan(x, w), torch.nn.functional.linear(want.float(), w.float()), dtype)
    assert calls == [(1, behind == "silu"), (40, behind == "silu")], calls
    assert LinearPlan(neighbour).is_reference and not plan.is_reference


def test_pdl_only_on_gpus_that_have_it():
    """Programmatic dependent launch is requested only for CUDA tensors on compute capability
    9.0 or later; on CPU tensors (the interpreter) never."""
    import os

    from phalanx.kernels import pdl
    assert pdl.launch(torch.zeros(1)) == {"PDL": False, "launch_pdl": False}
    assert pdl.launch(torch.zeros(1), True) == {"PDL": False, "launch_pdl": False}
    if CUDA:
        want = (torch.cuda.get_device_capability()[0] >= 9 and pdl.gdc_wait is not None
                and os.environ.get("PHALANX_PDL", "1") != "0")
        assert pdl.launch(torch.zeros(1, device="cuda"))["launch_pdl"] == want


@pytest.mark.skipif(not CUDA, reason="CUDA graphs and PDL need a GPU")
def test_pdl_chain_in_a_graph_equals_the_chain_without(monkeypatch):
    """A dependent chain (norm -> projection -> SiLU projection -> norm ...), each kernel reading
    what the previous one wrote, replayed from a CUDA graph with PDL launches on a new input each
    time, gives bit for bit what the same kernels give launched without PDL: every read waits
    for the previous write."""
    from phalanx.kernels import gemv, pdl
    g = torch.Generator().manual_seed(3)
    H, I, L = 1024, 2048, 6  # noqa: E741 (I: intermediate size)
    ws = [((torch.randn(2 * I, H, generator=g) / H ** 0.5).to(DEV, torch.bfloat16),
           (torch.randn(H, I, generator=g) / I ** 0.5).to(DEV, torch.bfloat16)) for _ in range(L)]
    gn = torch.ones(H, device=DEV, dtype=torch.bfloat16)
    x0 = torch.empty(1, H, device=DEV, dtype=torch.bfloat16)

    def chain():
        x, r = x0, x0
        for up, down in ws:
            h, r = triton_ops.fused_add_rms_norm(x, r, gn, 1e-6)
            u = gemv.gemv(h, up, None, gemv.ONE_ROW_TILES[0], pdl=True)
            x = gemv.gemv(u, down, None, gemv.ONE_ROW_TILES[2], silu=True, pdl=True)
        return x
    x0.copy_(torch.randn(1, H, generator=g))
    static = chain()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = chain()
    for _ in range(20):
        x0.copy_(torch.randn(1, H, generator=g))
        graph.replay()
        with monkeypatch.context() as m:
            m.setattr(pdl, "enabled", lambda t: False)
            plain = chain()
        torch.cuda.synchronize()
        assert torch.equal(static, plain)


def test_cuda_graphs_only_where_every_attention_layer_runs_triton(tiny_models):
    """The rule the engine uses to decide whether decode steps may be captured in graphs is the
    one the attention dispatch uses to pick Triton over the host-planned reference."""
    from phalanx.kernels import ops
    from phalanx.models.loader import build_model
    from phalanx.models.parallel import TPGroup
    from phalanx.models.source import resolve_model
    model = build_model(resolve_model(tiny_models["llama"]), torch.float32, torch.device("cpu"), TPGroup(), "dummy", 0)
    assert ops.triton_attention_everywhere(model, 32) and ops.triton_attention_everywhere(model, 16)
    assert not ops.triton_attention_everywhere(model, 8)
    assert not triton_attention.supports_layout(32, 5, 2, uneven=True)
    assert not triton_attention.supports_layout(32, 5, 2, uneven=False)   # 5 query heads over 2 KV heads


def test_the_kernel_in_front_of_each_projection(tiny_models, tiny_moe_models):
    """What each projection declares runs in front of it (what the tuner times it with)."""
    from phalanx.models.layers import Projection
    from phalanx.models.loader import build_model
    from phalanx.models.parallel import TPGroup
    from phalanx.models.source import resolve_model

    def behind(path):
        model = build_model(resolve_model(path), torch.float32, torch.device("cpu"), TPGroup(), "dummy", 0)
        return {n: m.behind.value for n, m in model.named_modules() if isinstance(m, Projection)}
    dense = behind(tiny_models["llama"])
    assert dense["model.layers.1.self_attn.qkv_proj"] == "norm"
    assert dense["model.layers.1.mlp.gate_up_proj"] == "norm"
    assert dense["model.layers.1.mlp.down_proj"] == "silu"
    assert dense["model.layers.1.self_attn.o_proj"] == "attn"
    assert dense["lm_head"] == "plain"
    moe = behind(tiny_moe_models["qwen2_moe"])
    assert moe["model.layers.0.self_attn.qkv_proj"] == "norm"
    assert moe["model.layers.0.mlp.shared_expert.gate_up_proj"] == "plain"
    assert moe["model.layers.0.mlp.shared_expert.down_proj"] == "silu"


def test_whole_model_on_the_triton_path_equals_transformers(tiny_models, hf_models, monkeypatch):
    """All Triton kernels wired into the engine (interpreter on CPU; real kernels on a GPU): every
    projection given a skinny-kernel plan, the one-token q/k/v and MLP paths included."""
    from hf_reference import assert_same_greedy, hf_greedy
    from phalanx import LLM, SamplingParams
    from phalanx.kernels import gemv, ops, triton_attention, triton_ops
    from phalanx.kernels.linear_plan import CUBLAS, GateUpSiluPlan, LinearPlan, Neighbour, Plan, QkvRopePlan, RowsTile
    from phalanx.models.layers import Projection
    from phalanx.models.llama import MLP, Attention
    monkeypatch.setattr(ops, "FORCE_TRITON", True)
    if not CUDA:   # a GPU of 2 SMs: this model's prompt steps (2 KV heads, a few query blocks) fill it,
        # so they take the prefill kernel rather than the split form (extend_splits)
        monkeypatch.setattr(triton_attention, "_num_sms", lambda device: 2)
    calls = {}

    def counting(mod, name):
        real = getattr(mod, name)

        def wrapper(*a, **kw):
            calls[name] = calls.get(name, 0) + 1
            return real(*a, **kw)
        monkeypatch.setattr(mod, name, wrapper)

    for mod, name in ((gemv, "gemv"), (gemv, "qkv_rope"), (gemv, "gate_up_silu"),
                      (triton_attention, "decode_attention"),
                      (triton_attention, "prefill_attention"), (triton_ops, "rope_and_write_kv"),
                      (triton_ops, "copy_blocks"), (triton_ops, "fused_add_rms_norm"), (triton_ops, "silu_and_mul")):
        counting(mod, name)
    prompts = [[3, 1, 4, 1, 5], list(range(10, 50)), [7]]
    one_row = Plan("gemv", gemv.ONE_ROW_TILES[1])
    rows = Plan("gemv", RowsTile(*gemv.ROWS_TILES[0][:4], 2))     # the split-K path for more than one row
    with LLM(tiny_models["llama"], skip_tokenizer_init=True, orchestrator_type="inprocess",
             kv_cache_config={"tokens_per_block": 16}, max_num_tokens=24, cuda_graph_config=None) as llm:
        for m in llm._executor.engine.runner.model.modules():
            if isinstance(m, Projection):   # prefill chunks of 17-24 rows behind SILU: its kernel, cuBLAS
                m.plan = LinearPlan(m.behind, (one_row, rows, CUBLAS if m.behind is Neighbour.SILU else rows))
            elif isinstance(m, Attention):
                m.one_token_qkv = QkvRopePlan(one_row.tile, False)
            elif isinstance(m, MLP):
                m.one_token = GateUpSiluPlan(one_row.tile, False, one_row)
        outs = llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
        again = llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)  # prefix hits
        alone = llm.generate(prompts[:1], SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)  # batch 1
    for p, o, o2 in zip(prompts, outs, again, strict=True):
        ref, gaps = hf_greedy(hf_models["llama"], p, 6)
        assert_same_greedy(o.outputs[0].token_ids, ref, gaps)
        assert_same_greedy(o2.outputs[0].token_ids, ref, gaps)
    assert alone[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    missing = {n for n in ("gemv", "decode_attention", "prefill_attention", "rope_and_write_kv", "copy_blocks",
                           "fused_add_rms_norm", "silu_and_mul", "qkv_rope", "gate_up_silu") if not calls.get(n)}
    assert not missing, (missing, calls)


def experts_case(T: int, k: int, E: int, local: int, H: int, I: int, seed: int, dtype: torch.dtype):  # noqa: E741
    """x [T, H], k distinct experts of E a token with routing weights, and ``local`` experts'
    gate ‖ up [local, 2I, H] and down [local, H, I] weights (I: the intermediate size)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(DEV, dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(DEV)
    w = torch.rand(T, k, generator=g).to(DEV)
    w13 = (torch.randn(local, 2 * I, H, generator=g) / H ** 0.5).to(DEV, dtype)
    w2 = (torch.randn(local, H, I, generator=g) / I ** 0.5).to(DEV, dtype)
    return x, ids, w, w13, w2


@pytest.mark.parametrize("T,k,E,first,local", [(1, 2, 4, 0, 4), (7, 2, 8, 4, 4), (19, 3, 6, 0, 3)]
                         + ([(256, 8, 128, 64, 64), (2048, 8, 128, 0, 128)] if CUDA else []))
def test_fused_moe_against_the_reference(T, k, E, first, local):
    from phalanx.kernels import triton_moe
    from phalanx.kernels.reference import experts_ref
    dtype = torch.bfloat16 if CUDA else torch.float32
    H, I = (2048, 768) if CUDA and T >= 256 else (32, 24)  # noqa: E741 (I: intermediate size)
    x, ids, w, w13, w2 = experts_case(T, k, E, local, H, I, T, dtype)
    ref = experts_ref(x, ids, w, w13, w2, first)
    close(triton_moe.fused_moe(x, ids, w, w13, w2, first), ref, dtype)
    from phalanx.kernels.linear_plan import MoePlan
    tiles = {t for bucket in triton_moe.CANDIDATES for t in bucket} if CUDA else set(triton_moe.CANDIDATES[1][1:3])
    for tile in tiles:     # every tile the tuner may choose
        close(triton_moe.fused_moe(x, ids, w, w13, w2, first, MoePlan((tile,) * 4)), ref, dtype)
    # FP8 experts: a scale per (expert, output row), against the dequantized reference
    from phalanx.kernels import fp8
    q13, s13 = fp8.quantize_weight(w13.float().reshape(-1, H))
    q2, s2 = fp8.quantize_weight(w2.float().reshape(-1, I))
    q13, q2, s13, s2 = q13.view(w13.shape), q2.view(w2.shape), s13.view(local, 2 * I), s2.view(local, H)
    ref8 = experts_ref(x, ids, w, q13, q2, first, s13, s2)
    # (a token's k rows are summed in the activations' dtype: in bf16, over 2,048 tokens one element
    # in millions lands just past the tolerance; such a lone element is allowed, no more)
    mostly_close(triton_moe.fused_moe(x, ids, w, q13, q2, first, s13=s13, s2=s2, a8=False), ref8, dtype, 1e-5)
    # ... and multiplied in FP8, x and the SiLU-and-mul rows quantized per row (W8A8), against
    # the reference that rounds them the same way
    ref_a8 = experts_ref(x, ids, w, q13, q2, first, s13, s2, a8=True)
    got_a8 = triton_moe.fused_moe(x, ids, w, q13, q2, first, s13=s13, s2=s2, a8=True)
    # an activation near an FP8 rounding boundary (one e4m3 step is 1/16 of the value) may round
    # the other way than in the reference, where the sums before it were ordered otherwise (bf16):
    # on the H200 at 2,048 tokens 2.7 % of the elements are off, the whole 2.0 % of the norm (the
    # weights' rounding alone puts the result 4.7 % from the bf16 experts', with the activations' 6.5 %)
    mostly_close(got_a8, ref_a8, dtype, 0.05, norm=0.03)
    # the activations were rounded: nearer the reference that rounds them than the one that does not
    assert (got_a8.float() - ref_a8.float()).norm() < (got_a8.float() - ref8.float()).norm()
    fp8_tiles = ({t for bucket in triton_moe.CANDIDATES_FP8 for t in bucket} if CUDA
                 else {triton_moe.CANDIDATES_FP8[1][2]})
    for tile in fp8_tiles:     # every tile the tuner may choose for FP8 experts, both ways
        plan = MoePlan((tile,) * 4)
        mostly_close(triton_moe.fused_moe(x, ids, w, q13, q2, first, plan, s13, s2, a8=False), ref8, dtype, 1e-5)
        diff = (triton_moe.fused_moe(x, ids, w, q13, q2, first, plan, s13, s2, a8=True).float() - ref_a8.float()).abs()
        assert diff.norm() < 0.03 * ref_a8.float().norm(), tile
    # FP8 experts with a scale per block (I and H end inside a block here on the CPU), both ways
    from triton.runtime.errors import OutOfResources

    from phalanx.kernels.triton_moe import DEFAULT_PLAN
    block = (128, 128) if CUDA else (16, 32)
    b13 = [fp8.quantize_blocks(w13[e].float(), block) for e in range(local)]
    b2 = [fp8.quantize_blocks(w2[e].float(), block) for e in range(local)]
    q13, s13 = (torch.stack(t) for t in zip(*b13, strict=True))
    q2, s2 = (torch.stack(t) for t in zip(*b2, strict=True))
    ref8 = experts_ref(x, ids, w, q13, q2, first, s13, s2, block=block)
    ref_a8 = experts_ref(x, ids, w, q13, q2, first, s13, s2, a8=True, block=block)
    ran = set()
    for tile in fp8_tiles | set(DEFAULT_PLAN.tiles):
        plan = MoePlan((tile,) * 4)
        try:
            got = triton_moe.fused_moe(x, ids, w, q13, q2, first, plan, s13, s2, a8=False, block=block)
        except OutOfResources:   # scaling each step's dots takes more shared memory: the tuner skips such a tile
            assert CUDA and tile not in DEFAULT_PLAN.tiles, tile
            continue
        mostly_close(got, ref8, dtype, 1e-5)
        got = triton_moe.fused_moe(x, ids, w, q13, q2, first, plan, s13, s2, a8=True, block=block)
        assert (got.float() - ref_a8.float()).norm() < 0.03 * ref_a8.float().norm(), tile
        ran.add(tile)
    assert len(ran & fp8_tiles) >= len(fp8_tiles) // 2, ran


@pytest.mark.parametrize("T,k,E,first,local,block_m", [(1, 2, 4, 0, 4, 16), (37, 3, 8, 4, 4, 16), (300, 2, 6, 0, 3, 32),
                                                        (600, 4, 40, 0, 40, 16)]
                         + ([(4096, 8, 128, 64, 64, 64)] if CUDA else []))
def test_moe_alignment_places_every_local_pair_once_in_its_experts_blocks(T, k, E, first, local, block_m):
    """Skewed routing (half the pairs on one expert), experts of other ranks, several programs."""
    from phalanx.kernels import triton_moe
    g = torch.Generator().manual_seed(T)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    ids[::2, 0] = first + local - 1 if ids.shape[1] == 1 else ids[::2, 0]
    ids[1::2, -1] = torch.where((ids[1::2, :-1] == first).any(1), ids[1::2, -1], first)
    sorted_pair, block_expert = triton_moe.align(ids.to(DEV), first, local, block_m)
    sorted_pair, block_expert = sorted_pair.cpu(), block_expert.cpu()
    P = ids.numel()
    flat = ids.reshape(-1) - first
    is_local = (flat >= 0) & (flat < local)
    assert sorted_pair.shape[0] == triton_moe.num_rows(P, local, block_m)
    placed = sorted_pair[sorted_pair < P]
    assert sorted(placed.tolist()) == torch.nonzero(is_local).flatten().tolist()    # every local pair once
    expected_blocks = [-(-int((flat == e).sum()) // block_m) for e in range(local)]
    expected = torch.tensor(sum(([e] * n for e, n in enumerate(expected_blocks)), []), dtype=torch.long)
    assert block_expert[:len(expected)].tolist() == expected.tolist()
    assert (block_expert[len(expected):] == local).all()                            # empty blocks past the runs
    row_expert = block_expert.repeat_interleave(block_m)
    rows = torch.nonzero(sorted_pair < P).flatten()
    assert (row_expert[rows] == flat[sorted_pair[rows]]).all()                      # each pair in its expert's blocks
    for b in range(len(expected)):     # a run's pairs come first in its blocks, empties after
        e = int(block_expert[b])
        start = sum(expected_blocks[:e]) * block_m
        n = int((flat == e).sum())
        run = sorted_pair[start:start + expected_blocks[e] * block_m]
        assert (run[:n] < P).all() and (run[n:] == P).all()


@pytest.mark.skipif(not CUDA, reason="tuning times CUDA graphs")
def test_moe_tuning_picks_a_tile_of_each_bucket_that_runs():
    from phalanx.kernels import triton_moe
    from phalanx.kernels.linear_plan import PAIR_BUCKETS
    E, H, I = 16, 1024, 384  # noqa: E741 (I: intermediate size)
    w13 = torch.randn(E, 2 * I, H, device=DEV, dtype=torch.bfloat16) / H ** 0.5
    w2 = torch.randn(E, H, I, device=DEV, dtype=torch.bfloat16) / I ** 0.5
    plan = triton_moe.tune(w13, w2, 4, 2 * E, E)
    assert len(plan.tiles) == len(PAIR_BUCKETS) + 1
    assert all(t in triton_moe.CANDIDATES[i] for i, t in enumerate(plan.tiles))
    from phalanx.kernels import fp8  # FP8 experts: tiles of their own
    q13, s13 = fp8.quantize_weight(w13.reshape(-1, H))
    q2, s2 = fp8.quantize_weight(w2.reshape(-1, I))
    plan8 = triton_moe.tune(q13.view(w13.shape), q2.view(w2.shape), 4, 2 * E, E, s13.view(E, -1), s2.view(E, -1),
                            torch.bfloat16)
    assert all(t in triton_moe.CANDIDATES_FP8[i] for i, t in enumerate(plan8.tiles))


def test_skinny_kernel_stages_shrink_to_the_shared_memory_budget():
    """The stage count is cut only as far as the budget needs (the kernels themselves run at
    every tile in fp32 and bf16, one and several rows, in test_gemv_every_tile)."""
    from phalanx.kernels import gemv
    assert gemv._fit_stages(4, 16 << 10) == 4
    assert gemv._fit_stages(4, 60 << 10) == 3
    assert gemv._fit_stages(2, 128 << 10) == 1          # 16 x 1024 fp32 tile + 16 rows of x
    assert gemv._fit_stages(3, 300 << 10) == 1          # never below one stage


def test_tiles_narrow_for_heads_of_256_and_the_kernels_stay_exact():
    """Heads twice as wide as the tuned ones (Gemma 3's 256): the decode and prefill tiles take
    half the keys and rows (``narrowed``), so a stage's shared memory stays what it was at 128
    (the tuned prefill tile at 256 asked an H100 SM for 262 KB and did not compile); the default
    configs' kernels equal the reference at that head size (a window too)."""
    ta = triton_attention
    pool = torch.zeros(1, 16, 1, 256, dtype=torch.bfloat16)
    rows, block_n, warps, stages = ta.prefill_config(torch.bfloat16, pool, 100)
    assert (rows, block_n) == (ta.PREFILL_CONFIG[0] // 2, ta.PREFILL_CONFIG[1] // 2) and stages == ta.PREFILL_CONFIG[3]
    assert ta.prefill_config(torch.bfloat16, pool, 5000)[:2] == (ta.PREFILL_CONFIG_LONG[0] // 2,
                                                               ta.PREFILL_CONFIG_LONG[1] // 2)
    assert ta.decode_config(pool, 1)[0] == ta.DECODE_CONFIG[0] // 2
    assert ta.prefill_config(torch.bfloat16, pool[..., :128], 100) == ta.PREFILL_CONFIG   # 128: as tuned
    dtype = DTYPES[0]
    for window in (None, 12):
        q, kc, vc, meta = _paged_case([40, 9], [40, 9], 4, 1, 256, 16, dtype, seed=3)
        out = ta.prefill_attention(q, kc, vc, meta.block_tables, meta.query_start, meta.seq_lens, meta.max_query_len,
                                   256 ** -0.5, window)
        close(out, _ref(q, kc, vc, meta, window), dtype)
        q, kc, vc, meta = _paged_case([40, 9], [1, 1], 4, 1, 256, 16, dtype, seed=4)
        out = ta.decode_attention(q, kc, vc, meta.block_tables, meta.seq_lens, 256 ** -0.5, window, 1)
        close(out, _ref(q, kc, vc, meta, window), dtype)


def test_wide_latent_heads_take_no_split_form_and_too_many_heads_fall_back():
    """DeepSeek's latent heads (576 wide, padded to 1,024): the split extend form, whose tile would
    ask an sm_90 SM for 512 KB of shared memory, is never chosen for them; a KV head of 16 such
    query heads runs the kernels (~99 KB), one of 32 falls back to the reference (as Llama's 128
    heads of 128 still run them)."""
    from phalanx.kernels import triton_attention as ta
    assert ta.extend_splits(16, 1, 1, 8, head_dim=128) > 1
    assert ta.extend_splits(16, 1, 1, 8, head_dim=576) == 1
    assert ta.supports_layout(16, 16, 1, False, 576) and ta.supports_layout(16, 8, 1, False, 576)
    assert not ta.supports_layout(16, 32, 1, False, 576)
    assert ta.supports_layout(16, 128, 1, False, 128) and ta.supports_layout(16, 32, 8, False, 128)
