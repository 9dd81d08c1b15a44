"""DeepSeek's latent-attention kernels (``kernels/triton_mla.py``) against the torch path of the
same model: the rows written into the pool and the rotated queries (``reference.latent_rope_ref``),
and decode over the latent pool (``attention_ref.paged_attention_ref`` with the pool as keys and
values). The interpreter at tiny widths on the CPU; the released widths (512 + 64) on a GPU."""

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from test_triton_kernels import _paged_case  # noqa: E402  (the general kernels' paged case, beside this file)

from phalanx.kernels import attention_ref, ops, reference, triton_mla  # noqa: E402
from phalanx.kernels.metadata import AttentionMetadata  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
DTYPES = [torch.bfloat16] if CUDA else [torch.float32]
TOL = {torch.float32: 2e-4, torch.bfloat16: 3e-2}
# (kv_lora_rank, qk_rope_head_dim): tiny ones, and the releases' on a GPU
WIDTHS = [(32, 16), (48, 8)] + ([(512, 64)] if CUDA else [])


def close(a, b, dtype):
    torch.testing.assert_close(a.float(), b.float(), atol=TOL[dtype], rtol=TOL[dtype])


def _cos_sin(positions: int, rope: int) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, rope, 2, dtype=torch.float32) / rope))
    f = torch.outer(torch.arange(positions, dtype=torch.float32), inv)
    return torch.cat([f.cos(), f.sin()], dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("R,P", WIDTHS)
@pytest.mark.parametrize("T,H,nope", [(1, 4, 16), (5, 20, 24)])
@pytest.mark.parametrize("interleave", [False, True])
def test_latent_rows_and_rotated_queries_equal_the_torch_path(T, H, nope, R, P, interleave, dtype):
    g = torch.Generator().manual_seed(T + H + R)
    q = torch.randn(T, H, nope + P, generator=g).to(DEV, dtype)
    latent = torch.randn(T, R + P, generator=g).to(DEV, dtype) * 3
    w = (1 + 0.1 * torch.randn(R, generator=g)).to(DEV, dtype)
    cs = _cos_sin(64, P).to(DEV)
    positions = torch.randint(0, 64, (T,), generator=g).to(DEV)
    order = torch.cat([torch.arange(0, P, 2), torch.arange(1, P, 2)]).to(DEV) if interleave else None
    pool = torch.zeros(6, 16, 1, R + P, dtype=dtype, device=DEV)
    slots = torch.randperm(6 * 16, generator=g)[:T].to(DEV)
    q_out = torch.full((T, H, R + P), 7.0, dtype=dtype, device=DEV)
    ref_pool, ref_q = torch.zeros_like(pool).cpu(), q_out.cpu().clone()
    triton_mla.latent_rope_and_write(positions, q, latent, w, 1e-6, cs, pool, slots, q_out, nope, interleave)
    row, q_pe = reference.latent_rope_ref(positions, q, latent, w, 1e-6, cs, order, nope)
    close(pool.view(-1, R + P)[slots], row[:, 0], dtype)
    close(q_out[..., R:], q_pe, dtype)
    assert (q_out[..., :R] == 7.0).all()                                   # the absorbed half is not touched
    assert int((pool.view(-1, R + P).abs().sum(-1) > 0).sum()) == T         # nothing else written
    # the engine's torch path (ops on the CPU) writes the same rows and queries
    cpu_order = None if order is None else order.cpu()
    ops.latent_rope_and_write(positions.cpu(), q.cpu(), latent.cpu(), w.cpu(), 1e-6, cs.cpu(), ref_pool,
                              AttentionMetadata.kv_writes(slots.cpu()), ref_q, nope, cpu_order)
    close(pool.cpu(), ref_pool, dtype)
    close(q_out.cpu(), ref_q, dtype)


def _latent_case(seq_lens, H, R, P, B, dtype, seed=0, q_lens=None):
    """q [T, H, R + P] over a pool of one latent head (scattered blocks), and its metadata: the
    general kernels' case with one KV head of the latent's width (one query a sequence by default)."""
    q, pool, _, meta = _paged_case(seq_lens, q_lens or [1] * len(seq_lens), H, 1, R + P, B, dtype, seed)
    return q, pool, meta


def _reference(q, pool, meta, scale):
    plan = attention_ref.build_ref_plan(meta.query_start, meta.seq_lens, meta.block_tables, meta.tokens_per_block,
                                        meta.max_query_len, meta.max_seq_len)
    return attention_ref.paged_attention_ref(q, pool, pool, plan, scale)


DECODE_CASES = [([1], 4), ([5, 40, 17], 16), ([33, 64], 20), ([300, 3], 2)]
if CUDA:
    DECODE_CASES += [([1, 100, 1000, 4097], 16), ([7] * 64, 128), ([2000], 8)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("R,P", WIDTHS)
@pytest.mark.parametrize("seq_lens,H", DECODE_CASES)
def test_latent_decode_equals_the_reference(seq_lens, H, R, P, dtype):
    """Every head group (20 heads: two programs' worth), one key slice and several (their merge),
    slices past the last key."""
    B = 32 if CUDA else 16
    q, pool, meta = _latent_case(seq_lens, H, R, P, B, dtype)
    scale = (R + P) ** -0.5
    ref = _reference(q, pool, meta, scale)[..., :R]
    for splits in (1, 4, 32, triton_mla.latent_splits(len(seq_lens), H, max(seq_lens), B, 8)):
        out = triton_mla.latent_decode(q, pool, meta.block_tables, meta.seq_lens, scale, R, splits)
        close(out[..., :R], ref, dtype)


# (seq_lens, q_lens, heads, R, P): the interpreter takes ~1 s a small case, so the CPU run keeps few
EXTEND_CASES = [([9], [9], 4, 48, 8), ([20, 7, 40], [3, 7, 40], 16, 32, 16), ([50, 1], [17, 1], 20, 32, 16),
                ([70, 33], [2, 30], 2, 48, 8)]
if CUDA:
    EXTEND_CASES += [(lens, q, h, *w) for lens, q, h in (([128, 1000, 77], [128, 200, 1], 16), ([2080], [32], 16),
                                                         ([2048], [2048], 16), ([300, 40], [5, 40], 128))
                     for w in WIDTHS]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seq_lens,q_lens,H,R,P", EXTEND_CASES)
def test_latent_extend_equals_the_reference(seq_lens, q_lens, H, R, P, dtype):
    """New tokens over cached ones (prompts whole, chunks, prefix hits, one-token rows), causal:
    one key slice and several (merged; slices a query block never reaches), every head group."""
    B = 32 if CUDA else 16
    q, pool, meta = _latent_case(seq_lens, H, R, P, B, dtype, q_lens=q_lens)
    scale = (R + P) ** -0.5
    ref = _reference(q, pool, meta, scale)[..., :R]
    for splits in sorted({1, 3, 16 if CUDA else 5, triton_mla.latent_extend_splits(max(q_lens), len(seq_lens), H, 8)}):
        out = triton_mla.latent_extend(q, pool, meta.block_tables, meta.query_start, meta.seq_lens, max(q_lens), scale,
                                       R, splits)
        close(out[..., :R], ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_mixed_step_takes_the_latent_decode_for_its_decode_rows(dtype, monkeypatch):
    """Decode rows first, then prompt rows: the first through the latent decode, the others through
    the latent extend, into one output equal to the reference's."""
    R, P, H, B = 32, 16, 4, 16
    q, pool, meta = _latent_case([40, 17, 30], H, R, P, B, dtype, 3, [1, 1, 9])
    meta = dataclasses.replace(meta, num_decode_rows=2)
    calls = []
    for name in ("latent_decode", "latent_extend"):
        real = getattr(triton_mla, name)
        monkeypatch.setattr(triton_mla, name, lambda *a, name=name, real=real, **kw: calls.append(
            (name, a[0].shape[0])) or real(*a, **kw))
    out = triton_mla.latent_attention(q, pool, meta, (R + P) ** -0.5, R)
    assert calls == [("latent_decode", 2), ("latent_extend", 9)]
    close(out[..., :R], _reference(q, pool, meta, (R + P) ** -0.5)[..., :R], dtype)


ROUTES = [  # (experts, top_k, sigmoid, method, n_group, topk_group, renormalize, scaling, bias)
    (64, 6, False, "greedy", 1, 1, False, 1.0, False),                 # V2-Lite
    (160, 6, False, "group_limited_greedy", 8, 3, False, 16.0, False),  # V2: groups of 20 (padded to 256)
    (256, 8, True, "noaux_tc", 8, 4, True, 2.5, True),                  # V3
    (16, 3, True, "noaux_tc", 4, 2, False, 1.0, True),
    (12, 2, False, "group_limited_greedy", 3, 1, True, 1.0, False),
    (16, 3, True, "greedy", 1, 1, True, 1.0, True),                    # a bias greedy routing does not take
]


@pytest.mark.parametrize("route", ROUTES)
def test_grouped_topk_equals_the_torch_routing(route):
    """DeepSeek's routing in one program a token picks the experts torch.topk picks, in its order,
    with the same weights: every method, groups of sizes other than powers of two, a bias."""
    from phalanx.kernels import triton_moe
    E, k, sigmoid, method, n_group, topk_group, renorm, scaling, has_bias = route
    g = torch.Generator().manual_seed(E + k)
    logits = (torch.randn(9, E, generator=g) * 2).to(DEV)
    bias = (torch.randn(E, generator=g) * 0.3).to(DEV) if has_bias else None
    w, ids = triton_moe.grouped_topk(logits, bias, k, sigmoid, method, n_group, topk_group, renorm, scaling)
    ref_w, ref_ids = reference.grouped_topk_ref(logits, bias, k, sigmoid, method, n_group, topk_group, renorm,
                                                scaling)
    assert ids.dtype == ref_ids.dtype and ids.equal(ref_ids)
    torch.testing.assert_close(w, ref_w, atol=1e-6, rtol=1e-5)
