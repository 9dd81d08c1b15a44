"""Plain torch references for the per-token ops and the grouped experts of a MoE layer. Used on
the CPU and as the ground truth the Triton kernels are tested against."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
    """x: [..., H] -> [..., H]; statistics in float32, scaled in the input dtype. ``unit_offset``
    (Gemma): scaled by 1 + weight, in float32, then rounded to the input dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (h * (1.0 + weight.float())).to(x.dtype)
    return weight * h.to(x.dtype)


def fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float, unit_offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x; returns (rms_norm(residual), residual)."""
    residual = x + residual
    return rms_norm_ref(residual, weight, eps, unit_offset), residual


def rotary_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
               cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half rotary. positions [T]; q [T, H, D]; k [T, Hkv, D]; cos_sin [P, D] (cos ‖ sin
    of D/2 frequencies, float32)."""
    cos, sin = cos_sin[positions].chunk(2, dim=-1)          # [T, D/2] each
    cos = torch.cat([cos, cos], dim=-1).unsqueeze(1)         # [T, 1, D]
    sin = torch.cat([sin, sin], dim=-1).unsqueeze(1)

    def rot(x: torch.Tensor) -> torch.Tensor:
        c, s = cos.to(x.dtype), sin.to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return x * c + torch.cat([-x2, x1], dim=-1) * s

    return rot(q), rot(k)


def latent_rope_ref(positions: torch.Tensor, q: torch.Tensor, latent: torch.Tensor, norm_weight: torch.Tensor,
                    eps: float, cos_sin: torch.Tensor, pe_order: torch.Tensor | None,
                    nope: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's latent attention, one layer's rows (``triton_mla.latent_rope_and_write``): q [T,
    H, nope + P], latent [T, R + P] (c ‖ k_pe) -> (the pool's rows [T, 1, R + P] = [norm(c) ‖
    rot(k_pe)], each head's rot(q_pe) [T, H, P]), the rope dimensions taken in ``pe_order``
    first where given (a checkpoint's adjacent pairs, evens then odds)."""
    R = latent.shape[1] - (q.shape[2] - nope)
    c = rms_norm_ref(latent[:, :R], norm_weight, eps)
    q_pe, k_pe = q[..., nope:], latent[:, None, R:]
    if pe_order is not None:
        q_pe, k_pe = q_pe[..., pe_order], k_pe[..., pe_order]
    q_pe, k_pe = rotary_ref(positions, q_pe, k_pe, cos_sin)
    return torch.cat([c[:, None], k_pe], dim=-1), q_pe


def grouped_topk_ref(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, sigmoid: bool, method: str,
                     n_group: int, topk_group: int, renormalize: bool,
                     scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's routing of router logits [T, E] (taken as float32) -> (weights [T, k] float32, ids [T, k]):
    scores by softmax or sigmoid; ``method`` "greedy" (the k best), "group_limited_greedy" (the
    k best of the topk_group groups with the best top score) or "noaux_tc" (groups by the sum
    of their two best biased scores; the bias picks, the unbiased scores weigh); renormalised
    where asked, times ``scaling``."""
    logits = logits.float()
    scores = logits.sigmoid() if sigmoid else logits.softmax(dim=-1)
    T = scores.shape[0]
    if method == "greedy":
        weights, ids = scores.topk(top_k, dim=-1)
    else:
        choice = scores if bias is None else scores + bias
        grouped = choice.view(T, n_group, -1)
        if method == "noaux_tc":      # a group's two best (biased) scores
            group_score, fill = grouped.topk(2, dim=-1).values.sum(dim=-1), -math.inf
        else:                         # "group_limited_greedy": a group's best
            group_score, fill = grouped.amax(dim=-1), 0.0
        best = group_score.topk(topk_group, dim=-1).indices
        kept = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, best, True)
        choice = grouped.masked_fill(~kept[..., None], fill).view(T, -1)
        ids = choice.topk(top_k, dim=-1).indices
        weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2N] (gate ‖ up) -> silu(gate) * up: [T, N]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2N] (gate ‖ up) -> gelu(gate) * up with GELU's tanh approximation (Gemma's
    ``gelu_pytorch_tanh``): [T, N]."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def experts_ref(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                first: int, s13: torch.Tensor | None = None, s2: torch.Tensor | None = None,
                a8: bool = False, block: tuple[int, int] | None = None) -> torch.Tensor:
    """Reference grouped expert computation.

    x [T, H]; ids/weights [T, k] (global expert ids, routing weights); w13 [E_local, 2I, H]
    (gate ‖ up); w2 [E_local, H, I]; experts ``first .. first + E_local`` are local. Returns
    Σ over the local (token, expert) pairs of weight · down(silu(gate) * up): [T, H]. With
    ``s13`` [E, 2I] / ``s2`` [E, H] the experts are FP8, each used one dequantized here
    (kernels/fp8.py; scales per ``block`` where given); with ``a8`` as well, x and each pair's
    SiLU-and-mul output are rounded through FP8 with a scale per row first (W8A8).
    """
    from phalanx.kernels.fp8 import dequantize_any, quantize_rows_reference

    def rows_through_fp8(t: torch.Tensor) -> torch.Tensor:
        q, scale, _ = quantize_rows_reference(t)
        return (q.float() * scale).to(t.dtype)
    if a8:
        x = rows_through_fp8(x)
    out = torch.zeros_like(x, dtype=torch.float32)
    local = ids - first
    for e in torch.unique(local).tolist():
        if not 0 <= e < w13.shape[0]:
            continue
        tok, pos = torch.where(local == e)
        w13_e = w13[e] if s13 is None else dequantize_any(w13[e], s13[e], block, x.dtype)
        w2_e = w2[e] if s2 is None else dequantize_any(w2[e], s2[e], block, x.dtype)
        gate, up = F.linear(x[tok], w13_e).chunk(2, dim=-1)
        act = F.silu(gate) * up
        y = F.linear(rows_through_fp8(act) if a8 else act, w2_e)
        out.index_add_(0, tok, (y * weights[tok, pos, None]).float())
    return out.to(x.dtype)
