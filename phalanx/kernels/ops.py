"""Device dispatch for the kernels that are not projections: Triton on CUDA when available, torch
references elsewhere. (Projections run their plan: kernels/linear_plan.py.)

Implementations are imported lazily so that importing this module needs neither triton nor a GPU.
Set ``PHALANX_KERNELS=ref`` to force the references everywhere (debugging, comparisons), or
``PHALANX_KERNELS=triton`` to run the Triton kernels on CPU tensors too (with TRITON_INTERPRET=1:
how the whole model is checked on the Triton path without a GPU).
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from phalanx.kernels import attention_ref, reference
from phalanx.kernels.attention_ref import UNIT_KV_SCALE, HeadNorms, KvScale
from phalanx.kernels.metadata import AttentionMetadata

if TYPE_CHECKING:
    from phalanx.kernels.linear_plan import MoePlan


@functools.cache
def triton_available() -> bool:
    if os.environ.get("PHALANX_KERNELS", "auto") == "ref":
        return False
    import importlib.util
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return importlib.util.find_spec("phalanx.kernels.triton_ops") is not None


FORCE_TRITON = os.environ.get("PHALANX_KERNELS") == "triton"


def use_triton(x: torch.Tensor) -> bool:
    return (x.is_cuda or FORCE_TRITON) and triton_available()


def triton_attention_everywhere(model: torch.nn.Module, tokens_per_block: int) -> bool:
    """Whether every attention layer runs the Triton kernels on a GPU. The torch reference plans
    on the host (uneven head splits, small blocks), so a CUDA graph can hold only the former."""
    if not triton_available():
        return False
    from phalanx.kernels import triton_attention
    layers: list[Any] = [m for m in model.modules() if hasattr(m, "kv_of_q")]   # the attention layers
    return all(latent_kernels_take(tokens_per_block) if getattr(m, "latent", False) else
               triton_attention.supports_layout(tokens_per_block, m.heads.num_heads, m.heads.num_kv_heads,
                                                m.kv_of_q is not None, m.head_dim) for m in layers)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
    """``unit_offset`` (Gemma): x is scaled by 1 + weight (reference.rms_norm_ref)."""
    if use_triton(x):
        from phalanx.kernels import triton_ops
        return triton_ops.rms_norm(x, weight, eps, unit_offset)
    return reference.rms_norm_ref(x, weight, eps, unit_offset)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       unit_offset: bool = False):
    if use_triton(x):
        from phalanx.kernels import triton_ops
        return triton_ops.fused_add_rms_norm(x, residual, weight, eps, unit_offset)
    return reference.fused_add_rms_norm_ref(x, residual, weight, eps, unit_offset)


def rms_norm_fp8(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 unit_offset: bool = False):
    """RMSNorm of x (of x + residual) quantized per row for an FP8 product: (fp8.Fp8Rows, the new
    residual or None), one kernel on the Triton path."""
    from phalanx.kernels import fp8
    if use_triton(x):
        from phalanx.kernels import triton_ops
        q, scale, res = triton_ops.rms_norm_fp8(x, residual, weight, eps, fp8.FP8_MAX, fp8.TINY, unit_offset)
        return fp8.Fp8Rows(q, scale, x.dtype), res
    if residual is None:
        return fp8.quantize_rows_reference(reference.rms_norm_ref(x, weight, eps, unit_offset)), None
    h, res = reference.fused_add_rms_norm_ref(x, residual, weight, eps, unit_offset)
    return fp8.quantize_rows_reference(h), res


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if use_triton(x):
        from phalanx.kernels import triton_ops
        return triton_ops.silu_and_mul(x)
    return reference.silu_and_mul_ref(x)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    if use_triton(x):
        from phalanx.kernels import triton_ops
        return triton_ops.gelu_tanh_and_mul(x)
    return reference.gelu_tanh_and_mul_ref(x)


def rope_and_write_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta: AttentionMetadata, kv_scale: KvScale = UNIT_KV_SCALE,
                      qk_norm: HeadNorms | None = None) -> torch.Tensor:
    """Rotate q and k (each head RMS-normed first with ``qk_norm``), write k and v into the paged
    pool (an FP8 pool's divided by ``kv_scale``); returns the rotated q."""
    if use_triton(q):
        from phalanx.kernels import triton_ops
        return triton_ops.rope_and_write_kv(positions, q, k, v, cos_sin, k_cache, v_cache, meta.slot_mapping,
                                            kv_scale, qk_norm)
    if qk_norm is not None:
        q = reference.rms_norm_ref(q, qk_norm.q_weight, qk_norm.eps, qk_norm.unit_offset)
        k = reference.rms_norm_ref(k, qk_norm.k_weight, qk_norm.eps, qk_norm.unit_offset)
    q, k = reference.rotary_ref(positions, q, k, cos_sin)
    attention_ref.write_kv_ref(k_cache, v_cache, k, v, meta.slot_mapping, kv_scale)
    return q


def latent_rope_and_write(positions: torch.Tensor, q: torch.Tensor, latent: torch.Tensor, norm_weight: torch.Tensor,
                          eps: float, cos_sin: torch.Tensor, pool: torch.Tensor, meta: AttentionMetadata,
                          q_out: torch.Tensor, nope: int, pe_order: torch.Tensor | None) -> None:
    """DeepSeek's latent attention: each token's pool row [norm(c) ‖ rot(k_pe)] from latent [T,
    R + P], and every head's rot(q_pe) from q [T, H, nope + P] into q_out[..., R:]
    (``reference.latent_rope_ref``; ``pe_order``: the checkpoint's interleaved pairs)."""
    if use_triton(q):
        from phalanx.kernels import triton_mla
        triton_mla.latent_rope_and_write(positions, q, latent, norm_weight, eps, cos_sin, pool, meta.slot_mapping,
                                         q_out, nope, pe_order is not None)
        return
    row, q_pe = reference.latent_rope_ref(positions, q, latent, norm_weight, eps, cos_sin, pe_order, nope)
    pool.view(-1, 1, pool.shape[-1]).index_copy_(0, meta.slot_mapping, row.to(pool.dtype))
    q_out[..., q_out.shape[2] - q_pe.shape[2]:] = q_pe


def latent_attention(q: torch.Tensor, pool: torch.Tensor, meta: AttentionMetadata, scale: float, rank: int,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """DeepSeek's absorbed attention: q [T, H, R + P] over the one-plane pool (the values are the
    rows' first R = ``rank`` dimensions) -> [T, H, R + P] whose first R are each head's attended
    latent (into ``out`` when given)."""
    if use_triton(q) and latent_kernels_take(pool.shape[1]):
        from phalanx.kernels import triton_mla
        return triton_mla.latent_attention(q, pool, meta, scale, rank, out)
    return paged_attention(q, pool, pool, meta, scale, out=out)   # (the reference: small blocks, or no GPU)


def latent_kernels_take(tokens_per_block: int) -> bool:
    """Whether the latent kernels (``triton_mla``) run a pool of these blocks: any head count."""
    return tokens_per_block >= 16


def fused_moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              first: int, plan: MoePlan, s13: torch.Tensor | None = None,
              s2: torch.Tensor | None = None, block: tuple[int, int] | None = None) -> torch.Tensor:
    """Σ over this rank's (token, expert) pairs of weight · down(silu(gate) · up) -> [T, H]
    (``plan``: the fused kernels' tiles, where they run; ``s13``/``s2``: FP8 experts' scales,
    per ``block`` where given)."""
    if use_triton(x):
        from phalanx.kernels import triton_moe
        return triton_moe.fused_moe(x, ids, weights, w13, w2, first, plan, s13, s2, block=block)
    return reference.experts_ref(x, ids, weights, w13, w2, first, s13, s2, block=block)


def route(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor | None, counts: torch.Tensor, top_k: int,
          sigmoid: bool, method: str, n_group: int, topk_group: int, renormalize: bool,
          scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens x [T, H] through the router ``gate`` [E, H] (x taken in the gate's dtype, as
    ``F.linear`` of it), then ``grouped_topk``'s routing: (weights [T, k] float32, ids [T, k]).
    On the GPU a step of at most ``counts.numel()`` tokens (the layer's router counters) does both
    in one launch; its logits add up in another order than a GEMM's, so an expert whose score
    ties another's to the last bit may be picked by one and not the other."""
    if use_triton(x) and x.shape[0] <= counts.numel():
        from phalanx.kernels import triton_moe
        return triton_moe.route(x, gate, bias, counts, top_k, sigmoid, method, n_group, topk_group, renormalize,
                                scaling)
    return grouped_topk(F.linear(x.to(gate.dtype), gate), bias, top_k, sigmoid, method, n_group, topk_group,
                        renormalize, scaling)


def grouped_topk(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, sigmoid: bool, method: str,
                 n_group: int, topk_group: int, renormalize: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing of router logits [T, E] (float32, or the model's dtype: read as float32) ->
    (weights [T, k] float32, ids [T, k]): DeepSeek's, and with ``method`` "greedy" over softmax
    scores every other MoE's (``reference.grouped_topk_ref``)."""
    if use_triton(logits):
        from phalanx.kernels import triton_moe
        return triton_moe.grouped_topk(logits, bias, top_k, sigmoid, method, n_group, topk_group, renormalize,
                                       scaling)
    return reference.grouped_topk_ref(logits, bias, top_k, sigmoid, method, n_group, topk_group, renormalize, scaling)


def copy_blocks(kv_pool: torch.Tensor, src: list[int], dst: list[int], num_tokens: list[int]) -> None:
    """Rows [0, n) of block src into block dst, every layer (a partial reuse); whole blocks of a
    pool whose values are key-minor (``attention_ref.values_key_minor``), not stored by row.
    The rows past n are stale in either case (never attended)."""
    if attention_ref.values_key_minor(kv_pool):
        num_tokens = [kv_pool.shape[3]] * len(src)
    if use_triton(kv_pool):
        from phalanx.kernels import triton_ops
        return triton_ops.copy_blocks(kv_pool, src, dst, num_tokens)
    attention_ref.copy_blocks_ref(kv_pool, src, dst, num_tokens)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, window: int | None = None,
                    kv_of_q: torch.Tensor | None = None, out: torch.Tensor | None = None,
                    kv_scale: KvScale = UNIT_KV_SCALE) -> torch.Tensor:
    """q [T, H, D] over the paged cache -> [T, H, D] (causal, GQA, optional sliding window),
    written into ``out`` when given; an FP8 pool's K and V read times ``kv_scale``."""
    if use_triton(q):
        from phalanx.kernels import triton_attention
        if triton_attention.supports(q, k_cache, kv_of_q):
            return triton_attention.paged_attention(q, k_cache, v_cache, meta, scale, window, kv_of_q, out=out,
                                                    kv_scale=kv_scale)
    plan = meta.cache.get("ref")
    if plan is None:
        plan = meta.cache["ref"] = attention_ref.build_ref_plan(
            meta.query_start, meta.seq_lens, meta.block_tables, meta.tokens_per_block,
            meta.max_query_len, meta.max_seq_len)
    o = attention_ref.paged_attention_ref(q, k_cache, v_cache, plan, scale, window, kv_of_q, kv_scale)
    return o if out is None else out.copy_(o)
