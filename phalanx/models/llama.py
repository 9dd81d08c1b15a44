"""The Llama family as one decoder: Llama 2/3.x (rope scaling "llama3"), SmolLM2 (tied
embeddings), Qwen2/2.5 (q/k/v bias), Qwen3 (q/k RMSNorm), Mistral (sliding window).

Attention reads and writes the paged KV pool through the step's block tables; the MLP may be
replaced by a mixture of experts (models/moe.py) through ``mlp_factory``. Gemma 3 (models/gemma3.py)
subclasses the layer, the decoder and the model (``layer_class``, ``decoder_class``).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from phalanx.kernels import fp8, ops
from phalanx.kernels.attention_ref import UNIT_KV_SCALE, HeadNorms, KvScale
from phalanx.kernels.linear_plan import GateUpSiluPlan, Neighbour, QkvRopePlan
from phalanx.kernels.metadata import AttentionMetadata
from phalanx.models.config import ModelConfig
from phalanx.models.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    Projection,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from phalanx.models.lora import LoraState
from phalanx.models.parallel import HeadShard, TPGroup, shard_heads

logger = logging.getLogger("phalanx")

# a layer's calibrated KV cache scales, as the loader names them (``loader.fp8_checkpoint_weights``)
KV_SCALE_SUFFIXES = (".self_attn.k_scale", ".self_attn.v_scale")


class AttentionBase(nn.Module):
    """What a decoder layer, the piecewise CUDA graphs and the KV scales see of an attention
    layer: ``qkv_rope`` (the rotated q, K/V written), ``attend`` (q over the pool), ``project_out``
    (attention's output through o_proj), and the heads, head size and KV scales. ``Attention``
    (here) and DeepSeek's latent attention (models/deepseek.py) are the two."""

    heads: HeadShard
    head_dim: int
    o_proj: RowParallelLinear
    kv_scale: KvScale
    checkpoint_kv_scale: dict[str, float]

    def forward(self, positions: torch.Tensor, h: torch.Tensor, meta: AttentionMetadata,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        return self.project_out(self.attend(self.qkv_rope(positions, h, meta, k_cache, v_cache), meta, k_cache,
                                            v_cache))

    def qkv_rope(self, positions: torch.Tensor, h: torch.Tensor, meta: AttentionMetadata,
                 k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def attend(self, q: torch.Tensor, meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor,
               out: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def project_out(self, attn_out: torch.Tensor) -> torch.Tensor:
        """Attention's output [T, H, D] -> the layer's [T, hidden] (this rank's partial sum when
        o_proj is deferred)."""
        return self.o_proj(attn_out.reshape(attn_out.shape[0], -1))


class Attention(AttentionBase):
    """Self-attention over the paged KV pool. One token may take the fused q/k/v + rotary + K/V
    write kernel (``one_token_qkv``, set by the tuner where its q/k/v plan allows). An FP8 pool
    holds K and V divided by ``kv_scale``: the checkpoint's calibrated scales where it brings them
    (``checkpoint_kv_scale``, set by ``load_weights``; the engine decides once, at build, whether
    the pool uses them: ``use_kv_scales``), else 1."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, tp: TPGroup, rotary: RotaryEmbedding) -> None:
        super().__init__()
        D = cfg.head_dim
        self.heads = shard_heads(cfg.num_heads, cfg.num_kv_heads, tp.rank, tp.size)
        self.head_dim, self.scale = D, (cfg.query_pre_attn_scalar or D) ** -0.5
        self.window = cfg.sliding_windows[layer_idx] if cfg.sliding_windows else None
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, D, self.heads, cfg.qkv_bias, behind=Neighbour.NORM)
        q0, nq = self.heads.q_start, self.heads.num_heads
        self.o_proj = RowParallelLinear(cfg.num_heads * D, cfg.hidden_size, cfg.o_bias, tp,
                                        in_ranges=[(q0 * D, (q0 + nq) * D)], behind=Neighbour.ATTN)
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps, cfg.norm_unit_offset) if cfg.qk_norm else None
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps, cfg.norm_unit_offset) if cfg.qk_norm else None
        self.rotary: list[RotaryEmbedding] = [rotary]  # shared; a list keeps it out of this module's parameters
        kv_of_q = None if self.heads.uniform_groups else torch.tensor(self.heads.kv_of_q)
        self.kv_of_q: torch.Tensor | None
        self.register_buffer("kv_of_q", kv_of_q, persistent=False)
        self.one_token_qkv: QkvRopePlan | None = None
        self.kv_scale: KvScale = UNIT_KV_SCALE
        self.checkpoint_kv_scale: dict[str, float] = {}     # "k", "v" -> the checkpoint's scale

    def forward(self, positions: torch.Tensor, h: torch.Tensor, meta: AttentionMetadata,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """h: the normed hidden states [T, hidden] (the decoder layer's input norm; above 64 rows
        already quantized, ``fp8.Fp8Rows``, where q/k/v multiplies FP8 rows)."""
        T = h.shape[0]
        H, D = self.heads.num_heads, self.head_dim
        if T == 1 and self.one_token_qkv is not None:
            q = self.one_token_qkv(h, self.qkv_proj.weight, self.qkv_proj.bias, positions, self.rotary[0].cos_sin,
                                   k_cache, v_cache, meta.slot_mapping, H, self.heads.num_kv_heads, D,
                                   self.qkv_proj.weight_scale, self.kv_scale)
        else:
            q = self.qkv_rope(positions, h, meta, k_cache, v_cache)
        return self.project_out(self.attend(q, meta, k_cache, v_cache))

    def attend(self, q: torch.Tensor, meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """The rotated q [T, H, D] over the paged pool -> [T, H, D] (into ``out`` when given)."""
        return ops.paged_attention(q, k_cache, v_cache, meta, self.scale, self.window, self.kv_of_q, out=out,
                                   kv_scale=self.kv_scale)

    def qkv_rope(self, positions: torch.Tensor, h: torch.Tensor, meta: AttentionMetadata,
                 k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """q/k/v projection, q/k norms, rotary, K/V write -> the rotated q [T, H, D]."""
        T = h.shape[0]
        H, Hkv, D = self.heads.num_heads, self.heads.num_kv_heads, self.head_dim
        q, k, v = self.qkv_proj(h)
        q, k, v = q.view(T, H, D), k.view(T, Hkv, D), v.view(T, Hkv, D)
        norms = None
        if self.q_norm is not None and self.k_norm is not None:   # normed inside the rotary's launch
            norms = HeadNorms(self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, self.q_norm.unit_offset)
        return ops.rope_and_write_kv(positions, q, k, v, self.rotary[0].cos_sin, k_cache, v_cache, meta, self.kv_scale,
                                     norms)


class MLP(nn.Module):
    """down(silu(gate) * up) of x. One token may take silu(gate) * up straight from the gate ‖ up
    kernel (``one_token``, set by the tuner where that measured faster)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool, tp: TPGroup,
                 behind: Neighbour = Neighbour.NORM) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate, intermediate], bias, tp, behind)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias, tp, behind=Neighbour.SILU)
        self.one_token: GateUpSiluPlan | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1 and self.one_token is not None:
            act = self.one_token.gate_up_silu(x, self.gate_up_proj.weight, self.gate_up_proj.bias,
                                              self.gate_up_proj.weight_scale)
            return self.down_proj.output(self.one_token.down_proj(act, self.down_proj.weight,
                                                                  self.down_proj.weight_scale))
        return self.down_proj(self.gate_up_proj(x))   # down takes gate ‖ up: silu(gate) * up in front


MlpFactory = Callable[[ModelConfig, int, TPGroup], nn.Module]


def dense_mlp(cfg: ModelConfig, layer_idx: int, tp: TPGroup) -> nn.Module:
    return MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, tp)


class DecoderLayer(nn.Module):
    attention_class: Callable[[ModelConfig, int, TPGroup, RotaryEmbedding], AttentionBase] = Attention

    def __init__(self, cfg: ModelConfig, layer_idx: int, tp: TPGroup, rotary: RotaryEmbedding,
                 mlp_factory: MlpFactory) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_unit_offset)
        self.self_attn = self.attention_class(cfg, layer_idx, tp, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_unit_offset)
        self.mlp = mlp_factory(cfg, layer_idx, tp)
        self.tp = tp
        # row-parallel outputs reach the next norm as partial sums, and the norm reduces them
        # (with the custom all-reduce: all-reduce, residual add and RMSNorm in one kernel)
        self.self_attn.o_proj.deferred = self.self_attn.o_proj.can_defer
        if isinstance(self.mlp, MLP):
            self.mlp.down_proj.deferred = self.mlp.down_proj.can_defer

    @property
    def output_partial(self) -> bool:
        """Whether forward() returns this rank's partial sum (the next norm reduces it)."""
        return isinstance(self.mlp, MLP) and self.mlp.down_proj.deferred

    def forward(self, positions, x, residual, meta, k_cache, v_cache, x_partial: bool = False):
        """x: the previous layer's output (its partial sum when ``x_partial``); returns this
        layer's (output, residual)."""
        h, residual = self.input_norm(x, residual, x_partial)
        return self.mlp_block(self.self_attn(positions, h, meta, k_cache, v_cache), residual)

    def prepare_fp8_rows(self, act_dtype: torch.dtype, norms: bool = True) -> None:
        """Where the projection after a norm multiplies FP8 rows (``fp8.takes_fp8_rows``), the norm
        quantizes the batches that projection runs on cuBLASLt (more rows than the skinny kernels'
        buckets) in its own kernel (``RMSNorm.fp8_rows_above``). Set once, by the engine on a GPU,
        which then runs every kernel form of such rows once on one zero row — the norms', the
        SiLU-and-mul's and the o projection's row quantization — so that none compiles while
        serving (a draft model, say, has no start-up forward of its own). Without ``norms`` (LoRA:
        each adapter takes the normed rows in the activation dtype) the norms quantize nothing,
        and every projection's own row quantization is run instead."""
        from phalanx.kernels import fp8
        from phalanx.kernels.linear_plan import ROW_BUCKETS
        after, later = self.projections()
        for norm, proj in after if norms else ():
            if proj.weight_scale is not None and fp8.takes_fp8_rows(proj.weight, act_dtype, proj.fp8_block):
                norm.fp8_rows_above = ROW_BUCKETS[-1]
                zero = torch.zeros(1, proj.weight.shape[1], dtype=act_dtype, device=proj.weight.device)
                ops.rms_norm_fp8(zero, None, norm.weight, norm.eps, norm.unit_offset)
                ops.rms_norm_fp8(zero, zero, norm.weight, norm.eps, norm.unit_offset)
        if not norms:
            later += [proj for _, proj in after]
        for proj in later:
            if proj.weight_scale is not None and fp8.takes_fp8_rows(proj.weight, act_dtype, proj.fp8_block):
                width = proj.weight.shape[1] * (2 if proj.behind is Neighbour.SILU else 1)
                proj.plan(torch.zeros(ROW_BUCKETS[-1] + 1, width, dtype=act_dtype, device=proj.weight.device),
                          proj.weight, None, proj.weight_scale)

    def projections(self) -> tuple[list[tuple[RMSNorm, Projection]], list[Projection]]:
        """([(a norm, the projection right after it)], [the other dense projections])."""
        assert isinstance(self.self_attn, Attention)
        after: list[tuple[RMSNorm, Projection]] = [(self.input_layernorm, self.self_attn.qkv_proj)]
        if isinstance(self.mlp, MLP):
            after.append((self.post_attention_layernorm, self.mlp.gate_up_proj))
        return after, [self.self_attn.o_proj, *([self.mlp.down_proj] if isinstance(self.mlp, MLP) else [])]

    # the halves around attention (a piecewise CUDA graph captures them apart: cuda_graph.py)
    def input_norm(self, x, residual, x_partial: bool = False):
        """(normed x, residual) for attention: the residual add first after the first layer."""
        if residual is None:
            return self.input_layernorm(x), x
        return self.input_layernorm(x, residual, self.tp if x_partial else None)

    def mlp_block(self, attn_out, residual):
        """Attention's projected output -> this layer's (output, residual): the post-attention
        norm (reducing a deferred o_proj) and the MLP."""
        deferred = self.self_attn.o_proj.deferred
        h, residual = self.post_attention_layernorm(attn_out, residual, self.tp if deferred else None)
        return self.mlp(h), residual


class DecoderModel(nn.Module):
    layer_class: type[DecoderLayer] = DecoderLayer

    def __init__(self, cfg: ModelConfig, tp: TPGroup, mlp_factory: MlpFactory) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.rotary = RotaryEmbedding(cfg.rotary_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope)
        # sliding-window layers with a rotary base of their own (Gemma 3: default rope)
        self.local_rotary = (RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_local_theta, {})
                             if cfg.rope_local_theta else self.rotary)
        windows = cfg.sliding_windows or (None,) * cfg.num_layers
        self.layers = nn.ModuleList(
            self.layer_class(cfg, i, tp, self.rotary if windows[i] is None else self.local_rotary, mlp_factory)
            for i in range(cfg.num_layers))
        # the embedding's output times this (Gemma: sqrt(hidden) rounded to the model's dtype, as
        # transformers multiplies it); None: 1
        self.embed_scale = (float(torch.tensor(cfg.embed_scale, dtype=torch.get_default_dtype()))
                            if cfg.embed_scale != 1.0 else None)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_unit_offset)
        self.tp = tp
        self.decoder_layers: list[DecoderLayer] = list(self.layers)   # type: ignore[arg-type]  # typed view
        self.aux_slots: list[list[int]] = [[] for _ in range(cfg.num_layers)]   # capture_hidden's
        self.aux_out: torch.Tensor | None = None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x if self.embed_scale is None else x * self.embed_scale

    def capture_hidden(self, layers: tuple[int, ...], rows: int) -> torch.Tensor:
        """Set once at build (an EAGLE-3 head reads them): every forward writes the output of
        each layer in ``layers`` (x + residual: the residual stream after it), for each of its
        tokens, into its slice of ``aux_out`` [rows, len(layers) · hidden], in the order given.
        The buffer is the same one in every forward, CUDA graphs' included. A captured layer's
        down projection is not deferred: its output is whole on every rank."""
        for j, i in enumerate(layers):     # (a layer named twice fills both slices)
            self.aux_slots[i].append(j)
            layer = self.decoder_layers[i]
            if isinstance(layer.mlp, MLP):
                layer.mlp.down_proj.deferred = False
        p = self.norm.weight
        self.aux_out = torch.zeros(rows, len(layers) * p.shape[0], dtype=p.dtype, device=p.device)
        return self.aux_out

    def _capture(self, i: int, x: torch.Tensor, residual: torch.Tensor) -> None:
        if self.aux_slots[i] and self.aux_out is not None:
            H, out = x.shape[-1], x + residual
            for j in self.aux_slots[i]:
                self.aux_out[:x.shape[0], j * H:(j + 1) * H] = out

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_pool: torch.Tensor) -> torch.Tensor:
        # input_ids, positions: [T]; kv_pool: [L, planes, num_blocks, B, Hkv, D] (planes K, V; or one that
        # is both: KVPool) -> hidden [T, hidden]
        x, residual, partial = self.embed(input_ids), None, False
        for i, layer in enumerate(self.decoder_layers):
            x, residual = layer(positions, x, residual, meta, kv_pool[i, 0], kv_pool[i, -1], partial)
            partial = layer.output_partial
            self._capture(i, x, residual)
        x, _ = self.norm(x, residual, self.tp if partial else None)
        return x

    def piece(self, i: int, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
              kv_pool: torch.Tensor, residual: torch.Tensor | None, attn_out: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Stretch i of ``forward`` between two attention calls (piecewise CUDA graphs capture
        each apart, pyexecutor/cuda_graph.py): i = 0 embeds ``input_ids`` and runs layer 0 up to
        its rotated q (K/V written); 0 < i < L takes layer i − 1's attention output ``attn_out``
        [T, H, D] through its o projection and MLP, then layer i up to its q; i = L ends with the
        final norm. Returns (residual, q), and after the last stretch (hidden, None)."""
        if i == 0:
            x, partial = self.embed(input_ids), False
        else:
            prev = self.decoder_layers[i - 1]
            x, residual = prev.mlp_block(prev.self_attn.project_out(attn_out), residual)
            partial = prev.output_partial
            assert residual is not None
            self._capture(i - 1, x, residual)
        if i == len(self.decoder_layers):
            return self.norm(x, residual, self.tp if partial else None)[0], None
        layer = self.decoder_layers[i]
        h, residual = layer.input_norm(x, residual, partial)
        return residual, layer.self_attn.qkv_rope(positions, h, meta, kv_pool[i, 0], kv_pool[i, -1])


class CausalLM(nn.Module):
    """Decoder + LM head. ``forward`` returns hidden states; ``compute_logits`` the float32
    logits of the rows that sample."""

    # checkpoint name fragment -> (our parameter fragment, shard id)
    stacked = (
        ("q_proj", "qkv_proj", "q"), ("k_proj", "qkv_proj", "k"), ("v_proj", "qkv_proj", "v"),
        ("gate_proj", "gate_up_proj", 0), ("up_proj", "gate_up_proj", 1),
    )

    decoder_class: type[DecoderModel] = DecoderModel

    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None,
                 mlp_factory: MlpFactory = dense_mlp) -> None:
        super().__init__()
        self.config, self.tp = cfg, tp or TPGroup()
        self.model = self.decoder_class(cfg, self.tp, mlp_factory)
        tied = self.model.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, self.tp, tied=tied)
        self.lora: LoraState | None = None   # LoRA adapters' step state (models/lora.install)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_pool: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions, meta, kv_pool)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    @property
    def activation_dtype(self) -> torch.dtype:
        """The dtype the model computes in (the output layer's: never quantized)."""
        return self.lm_head.weight.dtype

    @contextlib.contextmanager
    def padded_step(self, tokens: int) -> Iterator[None]:
        """Steps run inside: every rank brings ``tokens`` tokens (a CUDA graph of that batch
        size), so nothing about the step has to be exchanged first (see MoECausalLM)."""
        yield

    # -- weights -------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | fp8.Fp8Weight | fp8.Fp8BlockWeight]],
                     partial: bool = False) -> int:
        """Copy checkpoint tensors (Hugging Face names, full unsharded shapes) into this rank's
        parameters; returns how many were copied. Raises ValueError naming any parameter left
        unloaded, unless ``partial`` (a weight update may bring some tensors only). A tensor is
        taken under its ``checkpoint_name``, and one the model passes over (None) is skipped."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        count = 0
        for given, w in weights:
            name = self.checkpoint_name(given)
            if name is None or "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            if name.endswith(KV_SCALE_SUFFIXES):
                count += self._load_kv_scale(name, w, partial)
                continue
            target, shard = self.map_weight_name(name)
            param = params.get(target)
            if param is None or getattr(param, "written_by_loader", False):
                raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            if isinstance(w, (fp8.Fp8Weight, fp8.Fp8BlockWeight)):   # an FP8 checkpoint's: kept by an FP8 parameter
                w = w if param.dtype == fp8.FP8 else w.dequantize(param.dtype)
            else:   # an FP8 parameter quantizes full precision as it loads
                w = w.to(getattr(param, "load_dtype", param.dtype))
            param.weight_loader(param, w, shard)  # type: ignore[attr-defined]  # set by layers._param
            loaded.add(target)
            count += 1
        if self.config.tie_word_embeddings:
            loaded.add("lm_head.weight")
        # FP8 scales are written by their weights' loaders (layers.fp8_weights), never by name
        missing = sorted(n for n in set(params) - loaded if not getattr(params[n], "written_by_loader", False))
        if missing and not partial:
            raise ValueError(f"weights missing from the checkpoint: {', '.join(missing[:8])}"
                             + (" ..." if len(missing) > 8 else ""))
        return count

    def _load_kv_scale(self, name: str, w: object, partial: bool) -> int:
        """A layer's calibrated K or V scale (``model.layers.N.self_attn.k_scale``/``v_scale``, as
        ``loader.fp8_checkpoint_weights`` names every layout of them): positive and finite, one
        for the layer or one per KV head (compressed-tensors' ``attn_head``: the largest is taken,
        which no head's K or V overflows; the pool keeps one scale a layer). A weight update keeps
        the scales the engine started with: the pool's K and V were written with them."""
        parts = name.split(".")
        if not (isinstance(w, torch.Tensor) and len(parts) == 5 and parts[:2] == ["model", "layers"]
                and parts[2].isdigit() and int(parts[2]) < len(self.model.decoder_layers)):
            raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
        value = float(w.float().max()) if w.numel() else math.nan
        attn = self.model.decoder_layers[int(parts[2])].self_attn
        kind = parts[4][0]      # "k" or "v"
        if partial:
            kept = attn.checkpoint_kv_scale.get(kind, 1.0)
            if kept != value:
                logger.warning("weight update: %s = %g is not taken; the layer keeps %g (the pool's K/V were "
                               "written with it)", name, value, kept)
            return 0
        if w.numel() not in (1, self.config.num_kv_heads):
            raise ValueError(f"checkpoint tensor {name!r}: a KV cache scale is one number for the layer or one per KV "
                             f"head ({self.config.num_kv_heads}), got shape {tuple(w.shape)}")
        if not (math.isfinite(value) and value > 0 and float(w.float().min()) > 0):
            raise ValueError(f"checkpoint tensor {name!r}: a KV cache scale must be positive and finite, got "
                             f"{w.flatten()[:4].tolist()}")
        attn.checkpoint_kv_scale[kind] = value
        return 1

    def kv_scales_in_use(self) -> bool:
        """Whether the pool stores K and V with a checkpoint's scales (``use_kv_scales``)."""
        return any(layer.self_attn.kv_scale != UNIT_KV_SCALE for layer in self.model.decoder_layers)

    def use_kv_scales(self, fp8_pool: bool) -> int:
        """Decided once, when the engine builds its pool: an FP8 pool stores each layer's K and V
        divided by the checkpoint's scales (1 where it brought none); any other pool stores them as
        they are, and the checkpoint's scales go unused (logged). Returns the layers scaled."""
        layers = [layer.self_attn for layer in self.model.decoder_layers if layer.self_attn.checkpoint_kv_scale]
        if layers and not fp8_pool:
            logger.info("the checkpoint's KV cache scales (%d layers) are not used: the KV pool is not FP8 "
                        "(kv_cache_config.dtype: fp8 uses them)", len(layers))
        for attn in layers:
            ck = attn.checkpoint_kv_scale
            attn.kv_scale = (ck.get("k", 1.0), ck.get("v", 1.0)) if fp8_pool else UNIT_KV_SCALE
        return len(layers) if fp8_pool else 0

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """Hugging Face tensor names and full (unsharded) shapes of this architecture."""
        c = self.config
        H, D, V = c.hidden_size, c.head_dim, c.vocab_size
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
        if not c.tie_word_embeddings:
            shapes["lm_head.weight"] = (V, H)
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            shapes[p + "input_layernorm.weight"] = (H,)
            shapes[p + "post_attention_layernorm.weight"] = (H,)
            for proj, rows in (("q_proj", c.num_heads * D), ("k_proj", c.num_kv_heads * D),
                               ("v_proj", c.num_kv_heads * D)):
                shapes[p + f"self_attn.{proj}.weight"] = (rows, H)
                if c.qkv_bias:
                    shapes[p + f"self_attn.{proj}.bias"] = (rows,)
            shapes[p + "self_attn.o_proj.weight"] = (H, c.num_heads * D)
            if c.o_bias:
                shapes[p + "self_attn.o_proj.bias"] = (H,)
            if c.qk_norm:
                shapes[p + "self_attn.q_norm.weight"] = (D,)
                shapes[p + "self_attn.k_norm.weight"] = (D,)
            shapes.update(self.mlp_checkpoint_shapes(i))
        return shapes

    def mlp_checkpoint_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        c, p = self.config, f"model.layers.{layer}.mlp."
        shapes: dict[str, tuple[int, ...]] = {p + "gate_proj.weight": (c.intermediate_size, c.hidden_size),
                  p + "up_proj.weight": (c.intermediate_size, c.hidden_size),
                  p + "down_proj.weight": (c.hidden_size, c.intermediate_size)}
        if c.mlp_bias:
            shapes.update({p + "gate_proj.bias": (c.intermediate_size,), p + "up_proj.bias": (c.intermediate_size,),
                           p + "down_proj.bias": (c.hidden_size,)})
        return shapes

    def fused_shapes(self) -> dict[str, tuple[int, ...]]:
        """Tensors a trainer may send fused, as transformers holds them in memory, beside their
        checkpoint names (``checkpoint_shapes``): name -> full shape (a mixture of experts' layers:
        models/moe.py)."""
        return {}

    def checkpoint_name(self, name: str) -> str | None:
        """A checkpoint tensor's name as ``checkpoint_shapes`` names it, or None for one this
        model passes over (Gemma 3's vision tower: models/gemma3.py)."""
        return name

    def map_weight_name(self, name: str) -> tuple[str, object]:
        for ckpt, ours, shard in self.stacked:
            if f".{ckpt}." in name:
                return name.replace(f".{ckpt}.", f".{ours}."), shard
        return name, None
