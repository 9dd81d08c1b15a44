"""DeepSeek-V2 and V3 (``deepseek_v2``, ``deepseek_v3``): multi-head latent
attention (MLA) over the paged pool, and experts routed DeepSeek's way beside shared ones.

**Latent attention, absorbed.** Each token's keys and values come from one latent vector: c, the
kv_lora_rank-wide normed output of ``kv_a_proj_with_mqa``, and k_pe, qk_rope_head_dim wide and
rotated, shared by every head. The pool keeps only [c ‖ k_pe] a token: one KV "head" of
kv_lora_rank + qk_rope_head_dim (``ModelConfig.head_dim``; 576 for the released models, against
2 × 128 heads × 192 a token if K and V were kept per head). Per head h, ``kv_b_proj`` holds
W_UK[h] (k_nope = W_UK[h] c) and W_UV[h] (v = W_UV[h] c), so

    q_nope · k_nope = (W_UK[h]ᵀ q_nope) · c,      softmax(...) · v = W_UV[h] (softmax(...) · c).

A query head is therefore [W_UK[h]ᵀ q_nope ‖ rotated q_pe] against keys [c ‖ k_pe]: multi-query
attention with heads of the latent's width, whose values are the keys' first kv_lora_rank
dimensions. The pool has one plane (``ModelConfig.kv_planes``), passed as keys and values, and
the paged kernels run it as they are; W_UV then takes each head's attended latent to v_head_dim,
and o_proj follows. The softmax scale is that of the model's (qk_nope + qk_rope)-wide heads, times
YaRN's mscale(mscale_all_dim)² where the rope is scaled.

Rotary: q_pe and k_pe turn by rotate-half after their dimensions are taken evens-then-odds where
the checkpoint pairs adjacent dimensions (``rope_interleave``: every V3 release, and V2's complex
rotation) — the same dot products transformers computes.

Tensor parallelism splits the heads (q_b_proj or q_proj by rows, kv_b_proj's heads, o_proj by
columns); the latent projections (q_a_proj, kv_a_proj_with_mqa) and the pool's one head are whole
on every rank.

**Experts** (``DeepseekMoE``): the router in float32 (its weight and the V3 selection bias kept
in float32, as transformers keeps them), scores and choice per ``ModelConfig.topk_method``, the
routed sum times ``routed_scaling_factor``, plus the shared experts (one MLP, ungated). The first
``first_k_dense_replace`` layers are dense.
"""

from __future__ import annotations

import torch
from torch import nn

from phalanx.kernels import ops
from phalanx.kernels.attention_ref import UNIT_KV_SCALE, KvScale
from phalanx.kernels.linear_plan import Neighbour
from phalanx.kernels.metadata import AttentionMetadata
from phalanx.models.config import ModelConfig
from phalanx.models.layers import (
    ColumnParallelLinear,
    Projection,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    _param,
    default_loader,
    fp8_weights,
    yarn_mscale,
)
from phalanx.models.llama import MLP, AttentionBase, DecoderLayer, DecoderModel
from phalanx.models.moe import EPGroup, MoECausalLM, SparseMoE
from phalanx.models.parallel import TPGroup, shard_heads, split_range

# transformers' q_a_layernorm and kv_a_layernorm take this epsilon whatever the config says
LATENT_NORM_EPS = 1e-6


def mla_softmax_scale(cfg: ModelConfig) -> float:
    """(qk_nope + qk_rope)^-1/2, times mscale(factor, mscale_all_dim)² under a scaled rope."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    rope = cfg.rope
    all_dim = rope.get("mscale_all_dim")
    if rope.get("rope_type", "default") != "default" and all_dim:
        m = yarn_mscale(float(rope["factor"]), float(all_dim))
        scale *= m * m
    return scale


class HeadRows(nn.Module):
    """A weight kept in full precision whose rows are this rank's heads' (``kv_b_proj``: per head,
    qk_nope_head_dim rows of W_UK then v_head_dim rows of W_UV, over the latent). Never FP8: its
    two halves multiply per head (``torch.bmm``), not as one projection."""

    def __init__(self, heads: int, rows_per_head: int, cols: int, tp: TPGroup) -> None:
        super().__init__()
        self.start, self.end = split_range(heads * rows_per_head, tp.rank, tp.size)
        self.weight = _param((self.end - self.start, cols), self._load)

    def _load(self, param: torch.Tensor, w: torch.Tensor, shard_id: object = None) -> None:
        default_loader(param, w[self.start:self.end])


class LatentAttention(AttentionBase):
    """DeepSeek's multi-head latent attention, absorbed (module docstring)."""

    latent = True     # its attention runs the latent kernels (kernels/triton_mla.py), whatever its heads

    def __init__(self, cfg: ModelConfig, layer_idx: int, tp: TPGroup, rotary: RotaryEmbedding) -> None:
        super().__init__()
        if cfg.num_heads % tp.size:
            raise ValueError(f"tensor_parallel_size {tp.size} must divide the {cfg.num_heads} attention heads "
                             "(latent attention splits whole heads)")
        H = cfg.hidden_size
        self.heads = shard_heads(cfg.num_heads, 1, tp.rank, tp.size)
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.rank = cfg.kv_lora_rank
        self.head_dim = self.rank + self.rope          # the pool's one head, and each query head here
        self.scale = mla_softmax_scale(cfg)
        qk, n = self.nope + self.rope, cfg.num_heads
        whole = TPGroup()                              # the latent projections: every rank all of them
        self.q_lora_rank = cfg.q_lora_rank
        if cfg.q_lora_rank:
            self.q_a_proj = ColumnParallelLinear(H, cfg.q_lora_rank, cfg.qkv_bias, whole, Neighbour.NORM)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, n * qk, False, tp, Neighbour.NORM)
        else:
            self.q_proj = ColumnParallelLinear(H, n * qk, False, tp, Neighbour.NORM)
        self.kv_a_proj_with_mqa = ColumnParallelLinear(H, self.rank + self.rope, cfg.qkv_bias, whole)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS)
        with fp8_weights(False):
            self.kv_b_proj = HeadRows(n, self.nope + self.v_dim, self.rank, tp)
        self.o_proj = RowParallelLinear(n * self.v_dim, H, cfg.o_bias, tp)
        self.rotary: list[RotaryEmbedding] = [rotary]  # shared; a list keeps it out of this module's parameters
        # the checkpoint's adjacent rotary pairs, taken evens then odds (None: already rotate-half)
        perm = (torch.cat([torch.arange(0, self.rope, 2), torch.arange(1, self.rope, 2)])
                if cfg.rope_interleave else None)
        self.pe_order: torch.Tensor | None
        self.register_buffer("pe_order", perm, persistent=False)
        self.kv_of_q: torch.Tensor | None
        self.register_buffer("kv_of_q", None, persistent=False)   # one KV head: every query head's
        self.kv_scale: KvScale = UNIT_KV_SCALE
        self.checkpoint_kv_scale: dict[str, float] = {}

    def projections(self) -> list[Projection]:
        if self.q_lora_rank:
            return [self.q_a_proj, self.q_b_proj, self.kv_a_proj_with_mqa, self.o_proj]
        return [self.q_proj, self.kv_a_proj_with_mqa, self.o_proj]

    def _absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [h, nope, rank], W_UV [h, v, rank]) of this rank's heads: views of kv_b_proj."""
        w = self.kv_b_proj.weight.view(self.heads.num_heads, self.nope + self.v_dim, self.rank)
        return w[:, :self.nope], w[:, self.nope:]

    def qkv_rope(self, positions: torch.Tensor, h: torch.Tensor, meta: AttentionMetadata,
                 k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """[c ‖ rotated k_pe] of each token into the pool; returns the queries [T, heads, rank + rope]:
        W_UK[h]ᵀ q_nope (one batched product, written in place) beside the rotated q_pe."""
        T, nh = h.shape[0], self.heads.num_heads
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(h))) if self.q_lora_rank else self.q_proj(h)
        q = q.view(T, nh, self.nope + self.rope)
        out = torch.empty(T, nh, self.head_dim, dtype=q.dtype, device=q.device)
        w_uk, _ = self._absorbed()
        torch.bmm(q[..., :self.nope].transpose(0, 1), w_uk, out=out[..., :self.rank].transpose(0, 1))
        norm = self.kv_a_layernorm
        ops.latent_rope_and_write(positions, q, self.kv_a_proj_with_mqa(h), norm.weight, norm.eps,
                                  self.rotary[0].cos_sin, k_cache, meta, out, self.nope, self.pe_order)
        return out

    def attend(self, q: torch.Tensor, meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, heads, rank + rope] over the pool's latents -> [T, heads, rank + rope], whose first
        kv_lora_rank dimensions are each head's attended latent (the values are the keys)."""
        return ops.latent_attention(q, k_cache, meta, self.scale, self.rank, out=out)

    def project_out(self, attn_out: torch.Tensor) -> torch.Tensor:
        T = attn_out.shape[0]
        _, w_uv = self._absorbed()
        v = torch.bmm(attn_out[..., :self.rank].transpose(0, 1), w_uv.transpose(1, 2))   # [heads, T, v]
        return self.o_proj(v.transpose(0, 1).reshape(T, self.heads.num_heads * self.v_dim))


class RouterGate(nn.Module):
    """The router's weight [E, hidden] and, for V3, the experts' selection bias [E], both float32."""

    def __init__(self, hidden: int, experts: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, hidden, dtype=torch.float32), requires_grad=False)
        self.weight.weight_loader = default_loader  # type: ignore[attr-defined]
        self.e_score_correction_bias: nn.Parameter | None = None
        if bias:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(experts, dtype=torch.float32), requires_grad=False)
            self.e_score_correction_bias.weight_loader = default_loader  # type: ignore[attr-defined]


class DeepseekMoE(SparseMoE):
    """Routed experts (the fused kernels, expert parallelism and attention DP as ``SparseMoE``)
    routed DeepSeek's way, plus the ungated shared experts."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, ep: EPGroup) -> None:
        super().__init__(cfg, tp, ep)
        self.gate = RouterGate(cfg.hidden_size, cfg.num_experts, cfg.topk_method == "noaux_tc")  # type: ignore[assignment]
        self.renormalize = cfg.norm_topk_prob
        self.shared_experts = (MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, cfg.mlp_bias,
                                   tp, behind=Neighbour.PLAIN) if cfg.n_shared_experts else None)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c, gate = self.cfg, self.gate
        assert isinstance(gate, RouterGate)
        return ops.route(x, gate.weight, gate.e_score_correction_bias, self.route_counts, self.top_k,
                         c.scoring_func == "sigmoid", c.topk_method, c.n_group, c.topk_group, self.renormalize,
                         c.routed_scaling_factor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return y if self.shared_experts is None else y + self.shared_experts(x)


class DeepseekDecoderLayer(DecoderLayer):
    attention_class = LatentAttention

    def projections(self) -> tuple[list[tuple[RMSNorm, Projection]], list[Projection]]:
        """Nothing is quantized by a norm in front: two projections share the input norm's rows
        (q and the latent), and the latent's own norms feed one each of a different width."""
        attn = self.self_attn
        assert isinstance(attn, LatentAttention)
        later = attn.projections()
        if isinstance(self.mlp, MLP):
            later += [self.mlp.gate_up_proj, self.mlp.down_proj]
        elif isinstance(self.mlp, DeepseekMoE) and self.mlp.shared_experts is not None:
            later += [self.mlp.shared_experts.gate_up_proj, self.mlp.shared_experts.down_proj]
        return [], later


class DeepseekModel(DecoderModel):
    layer_class = DeepseekDecoderLayer


class DeepseekForCausalLM(MoECausalLM):
    """DeepSeek-V2/V3's decoder and output layer. Tensors of layers past ``num_hidden_layers`` (V3's
    multi-token-prediction layer, which transformers does not load either) are passed over."""

    decoder_class = DeepseekModel
    moe_class = DeepseekMoE

    def checkpoint_name(self, name: str) -> str | None:
        parts = name.split(".")
        if name.startswith("model.layers.") and len(parts) > 2 and parts[2].isdigit() \
                and int(parts[2]) >= self.config.num_layers:
            return None
        return super().checkpoint_name(name)

    def map_weight_name(self, name: str) -> tuple[str, object]:
        if ".self_attn." in name:          # its projections are named as the checkpoint names them
            return name, None
        return super().map_weight_name(name)

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        c = self.config
        H, n = c.hidden_size, c.num_heads
        qk = c.qk_nope_head_dim + c.qk_rope_head_dim
        shapes = {k: v for k, v in super().checkpoint_shapes().items() if ".self_attn." not in k}
        for i in range(c.num_layers):
            p = f"model.layers.{i}.self_attn."
            if c.q_lora_rank:
                shapes[p + "q_a_proj.weight"] = (c.q_lora_rank, H)
                shapes[p + "q_a_layernorm.weight"] = (c.q_lora_rank,)
                shapes[p + "q_b_proj.weight"] = (n * qk, c.q_lora_rank)
                if c.qkv_bias:
                    shapes[p + "q_a_proj.bias"] = (c.q_lora_rank,)
            else:
                shapes[p + "q_proj.weight"] = (n * qk, H)
            shapes[p + "kv_a_proj_with_mqa.weight"] = (c.kv_lora_rank + c.qk_rope_head_dim, H)
            if c.qkv_bias:
                shapes[p + "kv_a_proj_with_mqa.bias"] = (c.kv_lora_rank + c.qk_rope_head_dim,)
            shapes[p + "kv_a_layernorm.weight"] = (c.kv_lora_rank,)
            shapes[p + "kv_b_proj.weight"] = (n * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)
            shapes[p + "o_proj.weight"] = (H, n * c.v_head_dim)
            if c.o_bias:
                shapes[p + "o_proj.bias"] = (H,)
        return shapes

    def mlp_checkpoint_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        c = self.config
        if not self.is_sparse(c, layer):
            return super().mlp_checkpoint_shapes(layer)
        H, I = c.hidden_size, c.moe_intermediate_size  # noqa: E741 (I: intermediate size)
        p = f"model.layers.{layer}.mlp."
        shapes: dict[str, tuple[int, ...]] = {p + "gate.weight": (c.num_experts, H)}
        if c.topk_method == "noaux_tc":
            shapes[p + "gate.e_score_correction_bias"] = (c.num_experts,)
        for e in range(c.num_experts):
            shapes.update({f"{p}experts.{e}.gate_proj.weight": (I, H), f"{p}experts.{e}.up_proj.weight": (I, H),
                           f"{p}experts.{e}.down_proj.weight": (H, I)})
        if c.n_shared_experts:
            S = I * c.n_shared_experts
            shapes.update({p + "shared_experts.gate_proj.weight": (S, H), p + "shared_experts.up_proj.weight": (S, H),
                           p + "shared_experts.down_proj.weight": (H, S)})
            if c.mlp_bias:
                shapes.update({p + "shared_experts.gate_proj.bias": (S,), p + "shared_experts.up_proj.bias": (S,),
                               p + "shared_experts.down_proj.bias": (H,)})
        return shapes
