"""Gemma 3 (``gemma3_text``: Gemma3ForCausalLM; and the text decoder of ``gemma3``:
Gemma3ForConditionalGeneration), the Llama decoder with Gemma's differences.

- Every norm scales by 1 + weight, in float32 (``RMSNorm.unit_offset``), q and k included.
- Four norms a layer ("sandwich"): attention's output is normed before the residual add, and so
  is the MLP's (``post_attention_layernorm`` / ``post_feedforward_layernorm``); the MLP's input
  norm is ``pre_feedforward_layernorm``.
- The MLP is down(gelu_tanh(gate) * up) (``GeluMLP``).
- The embedding's output is multiplied by sqrt(hidden), queries are scaled by
  query_pre_attn_scalar^-1/2, and the sliding-window layers (five of every six) rotate with a base
  of their own (``DecoderModel.local_rotary``); all set from ``ModelConfig``.

Nothing is deferred across tensor-parallel ranks: a norm sits right after each row-parallel
projection, so each reduces its output itself.
"""

from __future__ import annotations

import torch
from torch import nn

from phalanx.kernels import ops
from phalanx.kernels.linear_plan import Neighbour
from phalanx.models.config import ModelConfig
from phalanx.models.layers import MergedColumnParallelLinear, Projection, RMSNorm, RotaryEmbedding, RowParallelLinear
from phalanx.models.llama import Attention, CausalLM, DecoderLayer, DecoderModel, MlpFactory
from phalanx.models.parallel import TPGroup


class GeluMLP(nn.Module):
    """down(gelu_tanh(gate) * up) of x: gate ‖ up, the activation in a kernel of its own, then
    the down projection on the ready rows."""

    def __init__(self, hidden: int, intermediate: int, bias: bool, tp: TPGroup) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate, intermediate], bias, tp, Neighbour.NORM)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias, tp, behind=Neighbour.PLAIN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.gelu_tanh_and_mul(self.gate_up_proj(x)))


def gelu_mlp(cfg: ModelConfig, layer_idx: int, tp: TPGroup) -> nn.Module:
    return GeluMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, tp)


class Gemma3DecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, layer_idx: int, tp: TPGroup, rotary: RotaryEmbedding,
                 mlp_factory: MlpFactory) -> None:
        super().__init__(cfg, layer_idx, tp, rotary, mlp_factory)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, unit_offset=True)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, unit_offset=True)
        self.self_attn.o_proj.deferred = False

    @property
    def output_partial(self) -> bool:
        return False

    def mlp_block(self, attn_out, residual):
        """Attention's projected output -> (post-feedforward-normed MLP output, residual)."""
        h, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(attn_out), residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual

    def projections(self) -> tuple[list[tuple[RMSNorm, Projection]], list[Projection]]:
        mlp, attn = self.mlp, self.self_attn
        assert isinstance(mlp, GeluMLP) and isinstance(attn, Attention)
        return ([(self.input_layernorm, attn.qkv_proj), (self.pre_feedforward_layernorm, mlp.gate_up_proj)],
                [self.self_attn.o_proj, mlp.down_proj])


class Gemma3Model(DecoderModel):
    layer_class = Gemma3DecoderLayer


# a checkpoint with a vision tower (``gemma3``) names its text decoder's tensors so: as published,
# and as transformers 4.52+ holds them in memory (a weight update from a trainer)
TEXT_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                 ("language_model.lm_head.", "lm_head."))
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


class Gemma3ForCausalLM(CausalLM):
    """Gemma 3's decoder and output layer (tied to the embedding in every published size). Of a
    checkpoint with a vision tower (``model_type: gemma3``) the text decoder is loaded and the
    vision tower's tensors are passed over."""

    decoder_class = Gemma3Model

    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None, mlp_factory: MlpFactory = gelu_mlp) -> None:
        super().__init__(cfg, tp, mlp_factory)

    def checkpoint_name(self, name: str) -> str | None:
        if self.config.model_type != "gemma3":
            return name
        if name.startswith(VISION_PREFIXES):
            return None
        for old, new in TEXT_PREFIXES:
            if name.startswith(old):
                return new + name[len(old):]
        return name

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """(In the text-only names: the dummy weights and the FP8 checks read them.)"""
        shapes = super().checkpoint_shapes()
        H = self.config.hidden_size
        for i in range(self.config.num_layers):
            for norm in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
                shapes[f"model.layers.{i}.{norm}.weight"] = (H,)
        return shapes

