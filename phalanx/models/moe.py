"""Mixture-of-experts decoders: Mixtral, Qwen2-MoE (with its gated shared expert), Qwen3-MoE.

Routing as each model defines it: softmax over the router logits in float32, top-k, and
renormalised top-k weights where the model asks for it (Mixtral always, Qwen per
``norm_topk_prob``).

Experts are split across the ranks of the expert-parallel group (``EPGroup``): rank r holds
experts [r·E/ep, (r+1)·E/ep). With ``ep == 1`` and tensor parallelism, every expert's
intermediate dimension is split instead. Each rank computes its experts' share for the tokens
it sees and the shares are summed: an all-reduce when every rank sees the same tokens (tensor
parallel), or — with attention data parallelism, where each rank has its own tokens —
all-gather of the tokens (ragged counts), local experts, then reduce-scatter back.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from phalanx.kernels import fp8, ops
from phalanx.kernels.linear_plan import MoePlan, Neighbour
from phalanx.models.config import ModelConfig
from phalanx.models.layers import (
    _param,
    block_slice,
    building_fp8,
    building_fp8_block,
    default_loader,
    fp8_param,
    scale_param,
    sections_fit,
)
from phalanx.models.llama import MLP, CausalLM
from phalanx.models.parallel import TPGroup, split_range


@dataclass
class EPGroup:
    """The expert-parallel group; ``attention_dp`` means each rank brings its own tokens."""

    rank: int = 0
    size: int = 1
    group: Any = None
    attention_dp: bool = False
    # attention DP: every rank's token count for the step being run, exchanged once per forward
    # (MoECausalLM.forward) so that the MoE layers need no host synchronisation of their own
    step_counts: list[int] | None = None
    padded_tokens: int | None = None   # a CUDA-graph step: every rank brings this many tokens
    num_forwards: int = 0           # attention-DP forwards, and host exchanges of token counts
    num_count_exchanges: int = 0


# -- token exchange for attention DP -------------------------------------------------------------------
def exchange_counts(n: int, ep: EPGroup, device: torch.device) -> list[int]:
    """Every rank's row count (one host synchronisation)."""
    ep.num_count_exchanges += 1
    counts_t = torch.tensor([n], dtype=torch.long, device=device)
    all_counts = [torch.zeros_like(counts_t) for _ in range(ep.size)]
    torch.distributed.all_gather(all_counts, counts_t, group=ep.group)
    return torch.cat(all_counts).tolist()


def gather_tokens(x: torch.Tensor, ep: EPGroup) -> tuple[torch.Tensor, list[int]]:
    """Every rank's rows of x concatenated in rank order, and the row counts (ragged)."""
    counts = ep.step_counts          # set by MoECausalLM.forward for the step being run
    assert counts is not None and counts[ep.rank] == x.shape[0], "gather_tokens outside MoECausalLM.forward"
    pad = max(counts)
    xp = x.new_zeros(pad, x.shape[1])
    xp[:x.shape[0]] = x
    parts = [torch.empty_like(xp) for _ in range(ep.size)]
    torch.distributed.all_gather(parts, xp, group=ep.group)
    return torch.cat([p[:n] for p, n in zip(parts, counts, strict=True)]), counts


def scatter_tokens(y: torch.Tensor, counts: list[int], ep: EPGroup) -> torch.Tensor:
    """Sum every rank's y (rows in gather order) and keep this rank's rows (reduce-scatter)."""
    pad = max(counts)
    full = y.new_zeros(ep.size, pad, y.shape[1])
    start = 0
    for r, n in enumerate(counts):
        full[r, :n] = y[start:start + n]
        start += n
    if y.is_cuda and hasattr(torch.distributed, "reduce_scatter_tensor"):
        out = y.new_empty(pad, y.shape[1])
        torch.distributed.reduce_scatter_tensor(out, full.view(ep.size * pad, -1), group=ep.group)
    else:  # gloo has no reduce-scatter: all-reduce and keep ours
        torch.distributed.all_reduce(full, group=ep.group)
        out = full[ep.rank]
    return out[:counts[ep.rank]]


ROUTE_IN_ONE_LAUNCH = 16   # steps of at most this many tokens: the router's product and routing in one launch


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, ep: EPGroup) -> None:
        super().__init__()
        H, E, I = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size  # noqa: E741 (I: intermediate size)
        self.cfg, self.tp, self.ep = cfg, tp, ep
        self.top_k = cfg.num_experts_per_tok
        self.renormalize = cfg.norm_topk_prob or cfg.model_type == "mixtral"
        self.first, last = split_range(E, ep.rank, ep.size)
        self.num_local = last - self.first
        # ep == 1 under tensor parallelism: split each expert's intermediate dim instead
        self.i_range = split_range(I, tp.rank, tp.size) if ep.size == 1 else (0, I)
        i_local = self.i_range[1] - self.i_range[0]
        self.gate = nn.Linear(H, E, bias=False)
        self.gate.weight.weight_loader = default_loader  # type: ignore[attr-defined]
        # a counter a token for the router's product and routing in one launch (ops.route)
        self.route_counts: torch.Tensor
        self.register_buffer("route_counts", torch.zeros(ROUTE_IN_ONE_LAUNCH, dtype=torch.int32), persistent=False)
        self.w13 = self._experts((self.num_local, 2 * i_local, H))
        self.w2 = self._experts((self.num_local, H, i_local))
        # FP8 experts (built under layers.fp8_weights): a scale per (expert, output row), or per
        # (expert, block) of a block-scaled checkpoint where this rank's slice of the
        # intermediate dimension falls on whole blocks
        block = building_fp8_block()
        s, t = self.i_range
        self.fp8_block = block if block is not None and sections_fit([(s, t - s, I), (s, t - s, I)], block[0]) \
            and sections_fit([(s, t - s, I)], block[1]) else None
        if self.fp8_block is None:
            self.w13_scale = self._scales((self.num_local, 2 * i_local))
            self.w2_scale = self._scales((self.num_local, H))
        else:
            r, c = self.fp8_block
            self.w13_scale = self._scales((self.num_local, 2 * i_local // r, -(-H // c)))
            self.w2_scale = self._scales((self.num_local, -(-H // r), -(-i_local // c)))
        self.moe_plan = MoePlan()    # the fused kernels' tiles: tuned on a GPU at build time
        self.shared_expert = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = MLP(H, cfg.shared_expert_intermediate_size, False, tp, behind=Neighbour.PLAIN)
            self.shared_expert_gate = nn.Linear(H, 1, bias=False)
            self.shared_expert_gate.weight.weight_loader = default_loader  # type: ignore[attr-defined]

    def _load_expert(self, param: torch.Tensor, w: torch.Tensor, shard: Any) -> None:
        """shard = (global expert id, "gate" | "up" | "down"); other ranks' experts are skipped.
        FP8 experts: the rows written are quantized here, each with its own scale, unless they
        come as an FP8 checkpoint's rows and scales (``fp8.Fp8Weight``), stored as they are.
        Block-scaled experts take ``_load_expert_blocks``."""
        expert, kind = shard
        e = expert - self.first
        if not 0 <= e < self.num_local:
            return
        s, t = self.i_range
        n = t - s
        if self.fp8_block is not None:
            return self._load_expert_blocks(param, w, e, kind)
        if isinstance(w, fp8.Fp8BlockWeight):   # experts split inside a block: a scale a row
            w = w.dequantize(torch.float32)
        rows, scale = ((slice(None), self.w2_scale) if kind == "down" else
                       (slice(0, n) if kind == "gate" else slice(n, 2 * n), self.w13_scale))
        src: torch.Tensor | fp8.Fp8Weight
        if isinstance(w, fp8.Fp8Weight):   # an FP8 checkpoint's rows with a scale each: stored as they are
            src = (fp8.Fp8Weight(w.q[:, s:t], w.scale) if kind == "down" else fp8.Fp8Weight(w.q[s:t], w.scale[s:t]))
            shape = src.q.shape
        else:
            src = w[:, s:t] if kind == "down" else w[s:t]
            shape = src.shape
        if shape != param.data[e, rows].shape:
            raise ValueError(f"expert weight shape {tuple(shape)} does not fit {tuple(param.data[e, rows].shape)}")
        if scale is None:
            assert isinstance(src, torch.Tensor)   # the model's loader dequantizes for full-precision experts
            param.data[e, rows].copy_(src)
            return
        q, row_scale = fp8.weight_rows(src, param.device)   # checkpoint tensors arrive on the host
        param.data[e, rows].copy_(q)
        scale.data[e, rows].copy_(row_scale)

    def _load_expert_blocks(self, param: torch.Tensor, w: torch.Tensor | fp8.Fp8Weight | fp8.Fp8BlockWeight,
                            e: int, kind: str) -> None:
        """``_load_expert`` for experts scaled per block: a block-scaled checkpoint tensor of the
        same blocks keeps its bytes and scales (its slice of the intermediate dimension, on whole
        blocks); anything else is quantized a block at a time."""
        assert self.fp8_block is not None and self.w13_scale is not None and self.w2_scale is not None
        r, c = self.fp8_block
        s, t = self.i_range
        n = t - s
        if kind == "down":   # [H, I]: this rank's columns
            rows, brows, scale = slice(None), slice(None), self.w2_scale
            cols, bcols = slice(s, t), slice(s // c, -(-t // c))
        else:                # [I, H]: this rank's rows, gate then up
            rows = slice(0, n) if kind == "gate" else slice(n, 2 * n)
            brows, scale = block_slice(rows, r), self.w13_scale
            cols, bcols = slice(s, t), slice(s // r, -(-t // r))
        if isinstance(w, fp8.Fp8BlockWeight) and tuple(w.block) == self.fp8_block:
            q = w.q[:, cols] if kind == "down" else w.q[cols]
            blocks = w.scale[:, bcols] if kind == "down" else w.scale[bcols]
        else:
            full = w.dequantize(torch.float32) if isinstance(w, (fp8.Fp8Weight, fp8.Fp8BlockWeight)) else w
            q, blocks = fp8.quantize_blocks((full[:, cols] if kind == "down" else full[cols]).to(param.device),
                                            self.fp8_block)
        if q.shape != param.data[e, rows].shape or blocks.shape != scale.data[e, brows].shape:
            raise ValueError(f"expert weight shape {tuple(q.shape)} (scales {tuple(blocks.shape)}) does not fit "
                             f"{tuple(param.data[e, rows].shape)} (scales {tuple(scale.data[e, brows].shape)})")
        param.data[e, rows].copy_(q)
        scale.data[e, brows].copy_(blocks)

    def _experts(self, shape: tuple[int, int, int]) -> nn.Parameter:
        """Experts' weights: full precision, or under ``fp8_weights`` FP8 (the loader quantizes
        the rows it writes)."""
        return fp8_param(shape, self._load_expert) if building_fp8() else _param(shape, self._load_expert)

    @staticmethod
    def _scales(shape: tuple[int, ...]) -> nn.Parameter | None:
        return scale_param(shape) if building_fp8() else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The k best experts of the softmax over the router's logits (taken in the model's dtype, as
        transformers does, then float32), renormalised where the config says: the product and the
        routing in one launch on a GPU for a few tokens (``ops.route``)."""
        return ops.route(x, self.gate.weight, None, self.route_counts, self.top_k, False, "greedy", 1, 1,
                         self.renormalize, 1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        counts = None
        tokens = x
        if self.ep.attention_dp and self.ep.size > 1:
            tokens, counts = gather_tokens(x, self.ep)
        weights, ids = self.route(tokens)
        y = ops.fused_moe(tokens, ids, weights, self.w13, self.w2, self.first, self.moe_plan, self.w13_scale,
                          self.w2_scale, self.fp8_block)
        if counts is not None:
            y = scatter_tokens(y, counts, self.ep)
        elif self.ep.size > 1 or self.tp.size > 1:   # outside attention DP the groups are one: all ranks
            y = self.tp.all_reduce(y)
        if self.shared_expert is not None:
            y = y + torch.sigmoid(F.linear(x, self.shared_expert_gate.weight)) * self.shared_expert(x)
        return y


_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\."
                     r"(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_KIND = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}
# a layer's experts as transformers 5 holds them in memory (a trainer's weight update): gate ‖ up of
# every expert in one [E, 2I, H] tensor, down in one [E, H, I]
_FUSED_EXPERTS = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


class MoECausalLM(CausalLM):
    """Llama-family attention with sparse MoE MLPs (dense where the config says so)."""

    moe_class: type[SparseMoE] = SparseMoE   # (DeepSeek's routing: models/deepseek.py)

    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None, ep: EPGroup | None = None) -> None:
        self.ep = ep or EPGroup()
        tp = tp or TPGroup()

        def mlp(c: ModelConfig, i: int, t: TPGroup) -> nn.Module:
            return self.moe_class(c, t, self.ep) if self.is_sparse(c, i) else MLP(c.hidden_size, c.intermediate_size,
                                                                                 c.mlp_bias, t)
        super().__init__(cfg, tp, mlp)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta, kv_pool: torch.Tensor) -> torch.Tensor:
        if not (self.ep.attention_dp and self.ep.size > 1):
            return super().forward(input_ids, positions, meta, kv_pool)
        # the ranks' token counts once per step, not once per MoE layer: a host wait in every
        # layer would stop the CPU from queueing the next layers while the GPU works; a padded
        # step (a CUDA graph) knows them already, and its collectives have fixed sizes
        self.ep.num_forwards += 1
        if self.ep.padded_tokens is not None:
            self.ep.step_counts = [self.ep.padded_tokens] * self.ep.size
        else:
            self.ep.step_counts = exchange_counts(input_ids.shape[0], self.ep, input_ids.device)
        try:
            return super().forward(input_ids, positions, meta, kv_pool)
        finally:
            self.ep.step_counts = None

    @contextlib.contextmanager
    def padded_step(self, tokens: int) -> Iterator[None]:
        self.ep.padded_tokens = tokens
        try:
            yield
        finally:
            self.ep.padded_tokens = None

    @staticmethod
    def is_sparse(cfg: ModelConfig, layer: int) -> bool:
        return layer not in cfg.mlp_only_layers and (layer + 1) % cfg.decoder_sparse_step == 0

    def map_weight_name(self, name: str) -> tuple[str, object]:
        m = _EXPERT.match(name)
        if m:
            layer, expert, kind = int(m.group(1)), int(m.group(2)), _KIND[m.group(3)]
            return f"model.layers.{layer}.mlp.{'w2' if kind == 'down' else 'w13'}", (expert, kind)
        name = name.replace(".block_sparse_moe.gate.", ".mlp.gate.")
        return super().map_weight_name(name)

    def mlp_checkpoint_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        c = self.config
        if not self.is_sparse(c, layer):
            return super().mlp_checkpoint_shapes(layer)
        H, I = c.hidden_size, c.moe_intermediate_size  # noqa: E741 (I: intermediate size)
        if c.model_type == "mixtral":
            p = f"model.layers.{layer}.block_sparse_moe."
            names = {"w1": (I, H), "w3": (I, H), "w2": (H, I)}
        else:
            p = f"model.layers.{layer}.mlp."
            names = {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}
        shapes: dict[str, tuple[int, ...]] = {p + "gate.weight": (c.num_experts, H)}
        for e in range(c.num_experts):
            for n, shape in names.items():
                shapes[f"{p}experts.{e}.{n}.weight"] = shape
        if c.shared_expert_intermediate_size:
            S = c.shared_expert_intermediate_size
            shapes.update({p + "shared_expert.gate_proj.weight": (S, H), p + "shared_expert.up_proj.weight": (S, H),
                           p + "shared_expert.down_proj.weight": (H, S), p + "shared_expert_gate.weight": (1, H)})
        return shapes

    def checkpoint_name(self, name: str) -> str | None:
        """Mixtral's router as transformers 5 holds it in memory (``mlp.gate``) under its checkpoint
        name (``block_sparse_moe.gate``)."""
        if self.config.model_type == "mixtral" and ".mlp.gate.weight" in name:
            return name.replace(".mlp.gate.weight", ".block_sparse_moe.gate.weight")
        return name

    def fused_shapes(self) -> dict[str, tuple[int, ...]]:
        c = self.config
        H, I, E = c.hidden_size, c.moe_intermediate_size, c.num_experts  # noqa: E741 (I: intermediate size)
        shapes: dict[str, tuple[int, ...]] = {}
        for i in range(c.num_layers):
            if self.is_sparse(c, i):
                shapes[f"model.layers.{i}.mlp.experts.gate_up_proj"] = (E, 2 * I, H)
                shapes[f"model.layers.{i}.mlp.experts.down_proj"] = (E, H, I)
        return shapes

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | fp8.Fp8Weight | fp8.Fp8BlockWeight]],
                     partial: bool = False) -> int:
        # experts of other ranks are skipped by the loader, so every expert tensor counts as placed
        return super().load_weights(self._unfused(weights), partial)

    def _unfused(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """A layer's experts held fused (``fused_shapes``) as the tensors of each expert, named as
        checkpoints name them; everything else as it comes."""
        fused = self.fused_shapes()
        for name, w in weights:
            m = _FUSED_EXPERTS.match(name)
            if m is None or not isinstance(w, torch.Tensor):
                yield name, w
                continue
            p = f"model.layers.{m.group(1)}.mlp.experts."
            want = fused.get(f"{p}{m.group(2)}")
            if want is None or tuple(w.shape) != want:
                raise ValueError(f"checkpoint tensor {name!r}: shape {tuple(w.shape)} does not match the model's "
                                 f"{want}")
            for e in range(w.shape[0]):
                if m.group(2) == "down_proj":
                    yield f"{p}{e}.down_proj.weight", w[e]
                else:
                    gate, up = w[e].chunk(2, dim=0)
                    yield f"{p}{e}.gate_proj.weight", gate
                    yield f"{p}{e}.up_proj.weight", up
