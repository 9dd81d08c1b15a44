"""ModelConfig: the few numbers a decoder needs, read from a Hugging Face config or GGUF metadata."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field, fields, replace
from typing import Any

# Hugging Face model_type -> our architecture family (built by models/llama.py, moe.py or gemma3.py)
SUPPORTED_MODEL_TYPES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "llama",
    "qwen3": "llama",
    "mixtral": "moe",
    "qwen2_moe": "moe",
    "qwen3_moe": "moe",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",     # Gemma3ForConditionalGeneration: its text decoder (no image inputs)
    "deepseek_v2": "deepseek",
    "deepseek_v3": "deepseek",
}
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear", "yarn")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] = ()   # sorted items of the rope parameters
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False        # Qwen2
    o_bias: bool = False          # Llama attention_bias
    mlp_bias: bool = False
    qk_norm: bool = False         # Qwen3
    sliding_windows: tuple[int | None, ...] = ()  # per layer; None = full attention
    # Gemma 3: GELU (tanh) MLPs, norms scaling by 1 + weight, the embedding's output times
    # sqrt(hidden), queries scaled by query_pre_attn_scalar^-1/2 instead of head_dim^-1/2, and the
    # sliding-window layers' own rotary base (default rope; 0: every layer takes rope_theta's)
    hidden_act: str = "silu"
    norm_unit_offset: bool = False
    embed_scale: float = 1.0
    query_pre_attn_scalar: float = 0.0
    rope_local_theta: float = 0.0
    # DeepSeek's multi-head latent attention (kv_lora_rank > 0: models/deepseek.py). The KV pool
    # holds one latent "head" a token, kv_lora_rank + qk_rope_head_dim wide (num_kv_heads 1 and
    # head_dim that width); each query head has qk_nope_head_dim + qk_rope_head_dim dimensions
    # against keys and v_head_dim of value; q comes through a rank-q_lora_rank bottleneck
    # (0: one projection); rope_interleave: the rotary pairs are adjacent dimensions
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None
    # mixture of experts (0 experts = dense)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = field(default=())
    # DeepSeek's routing: scores by softmax or sigmoid; top-k over all experts ("greedy"), within
    # the topk_group best of n_group groups ("group_limited_greedy": a group's best score;
    # "noaux_tc": its two best, biased by the gate's e_score_correction_bias, which picks the
    # experts but does not weight them); the routed sum times routed_scaling_factor; plus
    # n_shared_experts ungated shared experts (one MLP n_shared_experts times as wide)
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0
    # an FP8 checkpoint (quantization_config quant_method fp8, or compressed-tensors with FP8
    # weights): weights e4m3 with scales, served with quantization fp8 (per-tensor or per-row
    # scaled weights as they are, block-scaled ones dequantized at load and quantized again);
    # fp8_block = (rows, cols) when block-scaled
    fp8_checkpoint: bool = False
    fp8_block: tuple[int, ...] = ()
    # the modules an FP8 checkpoint keeps in full precision (modules_to_not_convert /
    # ignored_layers, compressed-tensors' ignore): names, name suffixes or "re:" patterns
    fp8_unquantized: tuple[str, ...] = ()
    # the checkpoint's KV cache is calibrated for FP8 (ModelOpt's kv_cache_quant_algo FP8,
    # compressed-tensors' or AutoFP8's kv_cache_scheme): kv_cache_config.dtype auto stores it so
    fp8_kv_cache: bool = False
    # the checkpoint's quantization_config.quant_method (fp8, compressed-tensors, modelopt), None: none
    quant_method: str | None = None
    # an EAGLE-3 head (architectures LlamaForCausalLMEagle3; models/eagle3.py): its output layer's
    # vocabulary (draft_vocab_size; 0: the target's), the target's hidden states it takes
    # (eagle_aux_hidden_state_layer_ids, vLLM's numbering: id j is layer j - 1's output; (): the
    # default for the target's depth) and whether its residual starts from the normed hidden state
    eagle3: bool = False
    draft_vocab_size: int = 0
    eagle_aux_layer_ids: tuple[int, ...] = ()
    eagle_norm_before_residual: bool = False

    @property
    def rope(self) -> dict[str, Any]:
        return dict(self.rope_scaling)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_gemma3(self) -> bool:
        return SUPPORTED_MODEL_TYPES.get(self.model_type) == "gemma3"

    @property
    def is_mla(self) -> bool:
        """DeepSeek's multi-head latent attention (models/deepseek.py)."""
        return self.kv_lora_rank > 0

    @property
    def rotary_dim(self) -> int:
        """The dimensions rotary embedding turns: a query head's rope part under MLA, else all."""
        return self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def kv_planes(self) -> int:
        """Planes of the KV pool: K and V, or under MLA one latent a token that is both."""
        return 1 if self.is_mla else 2

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return self.kv_planes * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def to_wire(self) -> dict[str, Any]:
        """Plain values (msgpack-able): tuples become lists; ``from_wire`` turns them back."""
        return {f.name: _listed(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> ModelConfig:
        """The config ``to_wire`` gave: every list a tuple again (rope_scaling's pairs too)."""
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"model config: unknown fields {sorted(unknown)}")
        return cls(**{k: _tupled(v) for k, v in d.items()})

    @classmethod
    def from_hf(cls, hf: Any) -> ModelConfig:
        """Build from a transformers ``PretrainedConfig``. Raises ValueError for what we do not run."""
        mt = getattr(hf, "model_type", None)
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {mt!r} is not supported; supported: "
                             f"{', '.join(sorted(SUPPORTED_MODEL_TYPES))}")
        if mt == "gemma3":
            return _gemma3_text_of(cls, hf)
        act = getattr(hf, "hidden_act", None) or "silu"
        if mt != "gemma3_text" and act not in ("silu", "swish"):   # (Gemma 3's is checked with its other fields)
            raise ValueError(f"{mt}: hidden_act {act!r} is not supported; supported: 'silu'")
        qc = (getattr(hf, "quantization_config", None)     # older compressed-tensors checkpoints:
              or getattr(hf, "compression_config", None))  # compression_config
        fp8_block = _fp8_checkpoint(qc)
        num_heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        eos = getattr(hf, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        dtype = getattr(hf, "torch_dtype", None) or getattr(hf, "dtype", None)
        num_experts = getattr(hf, "num_local_experts", None) or getattr(hf, "num_experts", None) or 0
        fields_: dict[str, Any] = dict(
            model_type=mt,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=getattr(hf, "intermediate_size", 0) or 0,
            num_layers=hf.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=getattr(hf, "rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(hf),
            rope_scaling=_rope_scaling(hf),
            max_position_embeddings=getattr(hf, "max_position_embeddings", 4096),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=mt in ("qwen2", "qwen2_moe") or bool(getattr(hf, "attention_bias", False)),
            o_bias=(mt not in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe")
                    and bool(getattr(hf, "attention_bias", False))),
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            qk_norm=mt in ("qwen3", "qwen3_moe", "gemma3_text"),
            sliding_windows=_sliding_windows(hf, mt),
            bos_token_id=getattr(hf, "bos_token_id", None),
            eos_token_ids=eos_ids,
            torch_dtype=str(dtype).replace("torch.", "") if dtype is not None else None,
            num_experts=int(num_experts),
            num_experts_per_tok=int(getattr(hf, "num_experts_per_tok", 0) or 0),
            moe_intermediate_size=int(getattr(hf, "moe_intermediate_size", 0)
                                      or getattr(hf, "intermediate_size", 0) or 0),
            norm_topk_prob=bool(getattr(hf, "norm_topk_prob", mt == "mixtral")),
            shared_expert_intermediate_size=int(getattr(hf, "shared_expert_intermediate_size", 0) or 0),
            decoder_sparse_step=int(getattr(hf, "decoder_sparse_step", 1) or 1),
            mlp_only_layers=tuple(getattr(hf, "mlp_only_layers", None) or ()),
            fp8_checkpoint=fp8_block is not None,
            fp8_block=fp8_block or (),
            fp8_unquantized=_fp8_unquantized(qc) if fp8_block is not None else (),
            fp8_kv_cache=bool(qc) and _fp8_kv_cache(qc),
            quant_method=_quant_method(qc),
            **_eagle3_fields(hf),
            **(_gemma3_fields(hf) if mt == "gemma3_text" else {}),
        )
        if SUPPORTED_MODEL_TYPES[mt] == "deepseek":   # (its fields replace the Llama-family reading)
            fields_.update(_deepseek_fields(hf))
        rope = dict(fields_["rope_scaling"])
        if rope["rope_type"] == "yarn":   # YaRN exists to reach factor x the original context (Qwen2.5: 4 x 32k)
            reach = int(float(rope["factor"]) * int(rope["original_max_position_embeddings"]))
            fields_["max_position_embeddings"] = max(int(fields_["max_position_embeddings"]), reach)
        return cls(**fields_)


EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


def _eagle3_fields(hf: Any) -> dict[str, Any]:
    """An EAGLE-3 head's settings from its config (``eagle_config`` may hold the layer ids)."""
    if not set(getattr(hf, "architectures", None) or ()) & set(EAGLE3_ARCHITECTURES):
        return {}
    eagle = getattr(hf, "eagle_config", None)
    eagle = eagle if isinstance(eagle, dict) else {}
    ids = getattr(hf, "eagle_aux_hidden_state_layer_ids", None) or eagle.get("eagle_aux_hidden_state_layer_ids")
    if ids is not None and not (isinstance(ids, (list, tuple)) and ids
                                and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)):
        raise ValueError(f"eagle_aux_hidden_state_layer_ids must be a list of layer ids, got {ids!r}")
    return {"eagle3": True, "draft_vocab_size": int(getattr(hf, "draft_vocab_size", None) or 0),
            "eagle_aux_layer_ids": tuple(ids or ()),
            "eagle_norm_before_residual": bool(getattr(hf, "norm_before_residual", False)
                                               or eagle.get("norm_before_residual", False))}


def _gemma3_text_of(cls: type[ModelConfig], hf: Any) -> ModelConfig:
    """A Gemma 3 checkpoint with its vision tower (``gemma3``: Gemma3ForConditionalGeneration, the
    4B, 12B and 27B): the config of its text decoder, which serves text prompts (the loader maps
    ``language_model.*`` and passes over the vision tower's tensors; no request can bring an image)."""
    if getattr(hf, "quantization_config", None):
        raise ValueError("gemma3: a quantized checkpoint with a vision tower is not supported")
    text = getattr(hf, "text_config", None)
    if text is None or getattr(text, "model_type", None) != "gemma3_text":
        raise ValueError(f"gemma3: text_config must be a gemma3_text config, got {text!r:.80}")
    cfg = cls.from_hf(text)
    eos = getattr(hf, "eos_token_id", None)
    top_eos = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
    dtype = getattr(hf, "torch_dtype", None) or getattr(hf, "dtype", None)
    return replace(cfg, model_type="gemma3", eos_token_ids=top_eos or cfg.eos_token_ids,
                   torch_dtype=str(dtype).replace("torch.", "") if dtype is not None else cfg.torch_dtype,
                   tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", cfg.tie_word_embeddings)))


def _gemma3_fields(hf: Any) -> dict[str, Any]:
    """Gemma 3's settings (``gemma3_text``: Gemma3ForCausalLM); what this decoder does not
    compute is refused by name."""
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(hf, name, None) is not None:
            raise ValueError(f"gemma3_text: {name} = {getattr(hf, name)!r} is not supported (Gemma 3 sets it to null)")
    if getattr(hf, "use_bidirectional_attention", False):
        raise ValueError("gemma3_text: use_bidirectional_attention is not supported (an embedding model, not a "
                         "causal decoder)")
    act = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", None) or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"gemma3_text: hidden_activation {act!r} is not supported; supported: 'gelu_pytorch_tanh'")
    params = getattr(hf, "rope_parameters", None)
    local = params.get("sliding_attention") if isinstance(params, dict) else None
    if isinstance(local, dict):   # transformers 5: rope parameters per layer type
        if (local.get("rope_type") or "default") != "default":
            raise ValueError(f"gemma3_text: the sliding layers' rope type {local.get('rope_type')!r} is not "
                             "supported; supported: 'default'")
        local_theta = local.get("rope_theta")
    else:
        local_theta = getattr(hf, "rope_local_base_freq", None)
    return {"hidden_act": "gelu_pytorch_tanh", "norm_unit_offset": True,
            "embed_scale": float(hf.hidden_size) ** 0.5,
            "query_pre_attn_scalar": float(getattr(hf, "query_pre_attn_scalar", None) or 0.0),
            "rope_local_theta": float(local_theta or 10000.0)}


DEEPSEEK_V2_TOPK_METHODS = ("greedy", "group_limited_greedy")


def _deepseek_fields(hf: Any) -> dict[str, Any]:
    """DeepSeek-V2 and V3, as transformers computes them: multi-head latent
    attention, the first ``first_k_dense_replace`` layers dense, then routed and shared experts.
    V2 scores by softmax, top-k over all experts or within the best groups, never renormalised
    (transformers drops ``norm_topk_prob``); V3 scores by sigmoid, picks by "noaux_tc" and
    renormalises per ``norm_topk_prob``."""
    mt = hf.model_type
    v3 = mt == "deepseek_v3"
    if v3:
        method = "noaux_tc"   # (transformers' V3 routes so whatever topk_method says)
    else:
        method = getattr(hf, "topk_method", None) or "greedy"
        if method not in DEEPSEEK_V2_TOPK_METHODS:
            raise ValueError(f"{mt}: topk_method {method!r} is not supported; supported: "
                             f"{', '.join(map(repr, DEEPSEEK_V2_TOPK_METHODS))}")
    n_group = int(getattr(hf, "n_group", None) or 1)
    topk_group = int(getattr(hf, "topk_group", None) or 1)
    experts = int(getattr(hf, "n_routed_experts", None) or 0)
    if method != "greedy" and (experts % n_group or not 1 <= topk_group <= n_group):
        raise ValueError(f"{mt}: n_group {n_group} must divide n_routed_experts {experts} and topk_group "
                         f"{topk_group} be 1 to n_group")
    top_k = int(getattr(hf, "num_experts_per_tok", None) or 0)
    if method != "greedy" and top_k > topk_group * (experts // n_group):   # (experts of dropped groups: weight 0)
        raise ValueError(f"{mt}: num_experts_per_tok {top_k} exceeds the experts of topk_group {topk_group} groups "
                         f"({topk_group * (experts // n_group)})")
    nope, rope, v = (int(getattr(hf, k)) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    kv_rank, q_rank = int(hf.kv_lora_rank), int(getattr(hf, "q_lora_rank", None) or 0)
    if min(nope, rope, v, kv_rank) <= 0 or rope % 2:
        raise ValueError(f"{mt}: qk_nope_head_dim, qk_rope_head_dim (even), v_head_dim and kv_lora_rank must be "
                         f"positive, got {nope}, {rope}, {v}, {kv_rank}")
    bias = bool(getattr(hf, "attention_bias", False))
    return {"num_kv_heads": 1, "head_dim": kv_rank + rope, "q_lora_rank": q_rank, "kv_lora_rank": kv_rank,
            "qk_nope_head_dim": nope, "qk_rope_head_dim": rope, "v_head_dim": v,
            "rope_interleave": bool(getattr(hf, "rope_interleave", True)) if v3 else True,
            "qkv_bias": bias, "o_bias": bias, "mlp_bias": bool(getattr(hf, "mlp_bias", False)) and not v3,
            "num_experts": experts,
            "norm_topk_prob": bool(getattr(hf, "norm_topk_prob", True)) if v3 else False,
            "mlp_only_layers": tuple(range(int(getattr(hf, "first_k_dense_replace", 0) or 0))),
            "decoder_sparse_step": 1, "shared_expert_intermediate_size": 0,
            "scoring_func": "sigmoid" if v3 else "softmax", "topk_method": method, "n_group": n_group,
            "topk_group": topk_group, "routed_scaling_factor": float(getattr(hf, "routed_scaling_factor", 1.0)),
            "n_shared_experts": int(getattr(hf, "n_shared_experts", None) or 0)}


def _listed(v: Any) -> Any:
    return [_listed(x) for x in v] if isinstance(v, (tuple, list)) else v


def _tupled(v: Any) -> Any:
    return tuple(_tupled(x) for x in v) if isinstance(v, (tuple, list)) else v


def _quant_getter(qc: Any) -> Any:
    """``get(key, default)`` over a ``quantization_config``, a dict or a config object; a key the
    top level lacks is looked up under ``quantization`` (ModelOpt's hf_quant_config.json form)."""
    top = qc.get if isinstance(qc, dict) else lambda k, d=None: getattr(qc, k, d)
    nested = top("quantization")
    nested = nested if isinstance(nested, dict) else {}

    def get(key: str, default: Any = None) -> Any:
        value = top(key)
        return value if value is not None else nested.get(key, default)
    return get


def _fp8_checkpoint(qc: Any) -> tuple[int, ...] | None:
    """A checkpoint's ``quantization_config``: None for a plain one, () for FP8 weights with
    per-tensor or per-channel scales, (rows, cols) for block-scaled FP8 (``weight_block_size``);
    every other method is refused by name (its tensors loaded as plain weights would run a wrong
    model)."""
    if not qc:
        return None
    get = _quant_getter(qc)
    method = get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors_fp8(get)
    if method == "modelopt":
        return _modelopt_fp8(get)
    if method != "fp8":
        raise ValueError(f"quantization_config.quant_method {method!r} is not supported; supported: 'fp8', "
                         "'compressed-tensors' or 'modelopt' with FP8 weights (or a bf16/fp16 checkpoint with "
                         "quantization='fp8')")
    block = get("weight_block_size")
    return () if block is None else _block_shape(block, "quantization_config.weight_block_size")


def _fp8_unquantized(qc: Any) -> tuple[str, ...]:
    """The modules an FP8 checkpoint lists as kept in full precision: ``modules_to_not_convert``
    or ``ignored_layers`` (quant_method fp8), ``ignore`` (compressed-tensors, ModelOpt's newer
    configs), ``exclude_modules`` (ModelOpt's; its wildcards, in either key, become "re:"
    patterns); the loader refuses a listed module the engine would serve in FP8
    (``loader.check_unquantized``)."""
    get = _quant_getter(qc)
    globs = get("quant_method") == "modelopt"     # ModelOpt's lists hold wildcards, whichever key
    names: list[str] = []
    for key in ("modules_to_not_convert", "ignored_layers", "ignore", "exclude_modules"):
        value = get(key) or []
        if isinstance(value, str):
            value = [value]
        if not (isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)):
            raise ValueError(f"quantization_config.{key} must be a list of module names, got {value!r}")
        names += ["re:" + fnmatch.translate(v) if (globs or key == "exclude_modules") and any(c in v for c in "*?[")
                  else v for v in value]
    return tuple(names)


def _quant_method(qc: Any) -> str | None:
    if not qc:
        return None
    method = _quant_getter(qc)("quant_method")
    return str(getattr(method, "value", method)) if method is not None else None   # (an enum in a config object)


def _fp8_kv_cache(qc: Any) -> bool:
    """Whether an FP8 checkpoint's KV cache is calibrated for FP8: ModelOpt's
    ``kv_cache_quant_algo`` FP8 (at the top or under ``quantization``), a ``kv_cache_scheme`` of
    8-bit floats (compressed-tensors, ModelOpt's newer configs) or AutoFP8's "static". Another
    KV scheme (integers) is refused by name: served as it is, its calibration would be lost."""
    get = _quant_getter(qc)
    algo = get("kv_cache_quant_algo")
    scheme = get("kv_cache_scheme")
    if scheme is None:
        return algo is not None and str(algo).upper() == "FP8"
    if isinstance(scheme, str) and scheme.lower() in ("static", "fp8"):
        return True
    if isinstance(scheme, dict) and scheme.get("num_bits") == 8 and str(scheme.get("type", "")).lower() == "float":
        if scheme.get("symmetric") is False:
            raise ValueError("quantization_config.kv_cache_scheme.symmetric must be true (an asymmetric KV cache, "
                             "with zero points, is not supported)")
        return True
    raise ValueError(f"quantization_config.kv_cache_scheme {scheme!r} is not supported; supported: 8-bit floats "
                     "(num_bits 8, type float)")


# ModelOpt's FP8 formats: a scale per tensor (weights and a static input scale, which is not used:
# activations get a scale per token) or per output channel (activations per token)
_MODELOPT_FP8 = ("FP8", "FP8_PER_CHANNEL_PER_TOKEN")


def _modelopt_fp8(get: Any) -> tuple[int, ...] | None:
    """A ModelOpt checkpoint (``quant_method: modelopt``; its ``quant_algo`` at the top, as newer
    exports write config.json, or under ``quantization``, as ``hf_quant_config.json`` holds it):
    FP8 weights scaled per tensor or per channel, the tensors of an ``fp8`` checkpoint, and a KV
    cache quantized to FP8 or not at all (its scales, ``self_attn.k_proj.k_scale``, are the
    loader's). No algorithm (``quant_algo`` null: the KV cache alone calibrated) is a plain
    checkpoint. Any other algorithm is refused by name."""
    top = "quantization_config"
    algo = get("quant_algo")
    kv = get("kv_cache_quant_algo")
    if kv is not None and str(kv).upper() != "FP8":
        raise ValueError(f"{top}.kv_cache_quant_algo {kv!r} is not supported; supported: 'FP8' or none")
    if algo is None:
        return None
    if str(algo).upper() not in _MODELOPT_FP8:
        raise ValueError(f"{top}.quant_algo {algo!r} is not supported; supported (ModelOpt): "
                         f"{', '.join(map(repr, _MODELOPT_FP8))}")
    return ()


def _block_shape(block: Any, field_name: str) -> tuple[int, ...]:
    """(rows, cols) of a block scale: two positive integers (or "RxC", an older spelling)."""
    if isinstance(block, str) and "x" in block:
        parts = block.split("x")
        block = [int(b) for b in parts] if all(b.strip().isdigit() for b in parts) else block
    if not (isinstance(block, (list, tuple)) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ValueError(f"{field_name} must be two positive integers, got {block!r}")
    return tuple(block)


# compressed-tensors formats whose FP8 weights are stored as e4m3 tensors beside their scales
# ("naive-quantized" is what llm-compressor wrote for FP8 before "float-quantized")
_CT_FP8_FORMATS = ("float-quantized", "naive-quantized")


def _compressed_tensors_fp8(get: Any) -> tuple[int, ...] | None:
    """A compressed-tensors checkpoint (llm-compressor's format) whose every config group holds
    8-bit float weights, symmetric and static, stored compressed (``format`` float-quantized
    or naive-quantized, at the top or per group under ``mixed-precision``), scaled per tensor,
    per channel or per block (``weight_scale``, one block shape for all): the same tensors as
    an ``fp8`` checkpoint. Activation schemes are taken as dynamic per token (static
    ``input_scale`` tensors are logged as not used); anything else (integer or 4-bit weights,
    zero points, dynamic weights, sparsity, an uncompressed status) is refused by name. No
    weight groups beside a ``kv_cache_scheme`` (the KV cache alone calibrated) is a plain
    checkpoint."""
    top = "quantization_config"
    status = get("quantization_status")
    if status not in (None, "compressed"):
        raise ValueError(f"{top}.quantization_status {status!r} is not supported; supported: 'compressed'")
    if get("sparsity_config"):
        raise ValueError(f"{top}.sparsity_config is not supported (compressed-tensors sparsity)")
    groups = get("config_groups")
    if not groups and get("kv_cache_scheme"):
        return None
    if not isinstance(groups, dict) or not groups:
        raise ValueError(f"{top}.config_groups must name at least one group of FP8 weights")
    blocks = set()
    for name, group in groups.items():
        where = f"{top}.config_groups.{name}"
        if not isinstance(group, dict):
            raise ValueError(f"{where} must be a mapping, got {group!r}")
        fmt = group.get("format") or get("format")
        if fmt not in _CT_FP8_FORMATS:
            raise ValueError(f"{where}: format {fmt!r} is not supported; supported: "
                             f"{', '.join(map(repr, _CT_FP8_FORMATS))} (FP8 weights)")
        for part in ("weights", "input_activations"):
            scheme = group.get(part)
            if scheme is None and part == "input_activations":
                continue
            if not (isinstance(scheme, dict) and scheme.get("num_bits") == 8
                    and str(scheme.get("type", "")).lower() == "float"):
                raise ValueError(f"{where}.{part} must be 8-bit floats (num_bits 8, type float), got {scheme!r}")
        weights = group["weights"]
        if weights.get("dynamic") is True:
            raise ValueError(f"{where}.weights.dynamic must be false (weights stored with their scales)")
        if weights.get("symmetric") is False:
            raise ValueError(f"{where}.weights.symmetric must be true (zero points are not supported)")
        strategy = weights.get("strategy")
        if strategy == "block":
            blocks.add(_block_shape(weights.get("block_structure"), f"{where}.weights.block_structure"))
        elif strategy not in (None, "tensor", "channel"):   # None: the scales' shapes say which
            raise ValueError(f"{where}.weights.strategy {strategy!r} is not supported; supported: 'tensor', "
                             "'channel', 'block'")
    if len(blocks) > 1:
        raise ValueError(f"{top}.config_groups: one block shape for all groups, got {sorted(blocks)}")
    return blocks.pop() if blocks else ()


def _rope_params(hf: Any) -> dict[str, Any]:
    params = getattr(hf, "rope_parameters", None)
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        return dict(params["full_attention"])   # per layer type (Gemma 3): the full layers' rope
    if isinstance(params, dict) and params:
        return dict(params)
    scaling = getattr(hf, "rope_scaling", None) or {}
    return dict(scaling)


def _rope_theta(hf: Any) -> float:
    params = _rope_params(hf)
    return float(params.get("rope_theta") or getattr(hf, "rope_theta", None) or 10000.0)


def _rope_scaling(hf: Any) -> tuple[tuple[str, Any], ...]:
    params = _rope_params(hf)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
    if getattr(hf, "partial_rotary_factor", 1.0) not in (None, 1.0) or params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    keep = {k: v for k, v in params.items() if k not in ("rope_theta", "type")}
    keep["rope_type"] = rope_type
    if "original_max_position_embeddings" not in keep and rope_type == "llama3":
        keep["original_max_position_embeddings"] = getattr(hf, "max_position_embeddings", 8192)
    if rope_type == "yarn":   # as transformers fills them: the config's own original length first
        old = int(getattr(hf, "original_max_position_embeddings", None) or keep.get("original_max_position_embeddings")
                  or getattr(hf, "max_position_embeddings", None) or 4096)
        keep["original_max_position_embeddings"] = old
        if keep.get("factor") is None:
            keep["factor"] = (getattr(hf, "max_position_embeddings", None) or old) / old
    return tuple(sorted(keep.items()))


def _sliding_windows(hf: Any, model_type: str) -> tuple[int | None, ...]:
    n = hf.num_hidden_layers
    window = getattr(hf, "sliding_window", None)
    layer_types = getattr(hf, "layer_types", None)
    if not layer_types and model_type == "gemma3_text":   # transformers before 4.53: every sixth layer full
        pattern = getattr(hf, "sliding_window_pattern", None) or getattr(hf, "_sliding_window_pattern", None) or 6
        layer_types = ["full_attention" if (i + 1) % int(pattern) == 0 else "sliding_attention" for i in range(n)]
    if layer_types:
        return tuple(window if t == "sliding_attention" and window else None for t in layer_types)
    if model_type in ("mistral", "mixtral") and window:
        return (int(window),) * n
    if getattr(hf, "use_sliding_window", False) and window:
        first = getattr(hf, "max_window_layers", n)
        return tuple(int(window) if i >= first else None for i in range(n))
    return (None,) * n
