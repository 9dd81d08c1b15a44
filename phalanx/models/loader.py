"""Where weights come from, for a model ``source.resolve_model`` found: a Hugging Face
directory (config.json + safetensors shards), a GGUF file (dequantized through the ``gguf``
package), or random weights (``load_format="dummy"``). Weights are read only from safetensors
or GGUF: nothing here unpickles.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from phalanx.kernels.fp8 import FP8, Fp8BlockWeight, Fp8Weight, blocks_fit
from phalanx.models.config import SUPPORTED_MODEL_TYPES, ModelConfig
from phalanx.models.parallel import TPGroup
from phalanx.models.source import ModelSource, gguf_file

if TYPE_CHECKING:
    from phalanx.models.llama import CausalLM

logger = logging.getLogger("phalanx")

_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def gguf_to_hf_name(name: str) -> str | None:
    if name in _GGUF_NAMES:
        return _GGUF_NAMES[name]
    parts = name.split(".")  # blk.N.attn_q.weight
    if parts[0] != "blk" or len(parts) != 4 or parts[2] not in _GGUF_LAYER_NAMES:
        return None
    return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{parts[3]}"


def iter_gguf_weights(source: ModelSource) -> Iterator[tuple[str, torch.Tensor]]:
    """Dequantized tensors under Hugging Face names. llama.cpp stores Llama's q/k rows
    permuted for its interleaved rotary; they are permuted back to rotate-half order."""
    cfg = source.config
    gf = gguf_file(source.path)
    for t in gf.tensors:
        name = gguf_to_hf_name(t.name)
        if name is None:
            continue
        w = torch.from_numpy(gf.dequantize(t).copy())
        if cfg.model_type in ("llama", "mistral"):
            if name.endswith("q_proj.weight"):
                w = _unpermute(w, cfg.num_heads)
            elif name.endswith("k_proj.weight"):
                w = _unpermute(w, cfg.num_kv_heads)
        yield name, w


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


# -- Hugging Face directory ---------------------------------------------------------------------
def safetensors_files(path: str) -> list[str]:
    """The weight files of a Hugging Face directory: those its index names (a repository may hold
    other .safetensors files, as Mistral's consolidated one), else every .safetensors file."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {path} (pickled .bin checkpoints are refused)")
    return files


def safetensors_specs(path: str) -> list[dict[str, Any]]:
    """Name, dtype and shape of every tensor of a Hugging Face directory's weight files, from
    their headers (nothing copied)."""
    from safetensors import safe_open
    specs = []
    names = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
    for fname in safetensors_files(path):
        with safe_open(os.path.join(path, fname), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                sl = f.get_slice(key)
                specs.append({"name": key, "dtype": names.get(sl.get_dtype(), sl.get_dtype()),
                              "shape": list(sl.get_shape())})
    return specs


def iter_hf_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open
    for fname in safetensors_files(path):
        with safe_open(os.path.join(path, fname), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                yield key, f.get_tensor(key)


_WEIGHT_SCALES = (".weight_scale_inv", ".weight_scale")
_UNUSED_SCALES = (".input_scale", ".k_scale", ".v_scale", ".kv_scale", ".output_scale", ".q_scale", ".prob_scale")
# zero points of a KV cache quantization (llm-compressor writes them, zero, beside the scales)
_KV_ZERO_POINTS = (".self_attn.k_zero_point", ".self_attn.v_zero_point", ".self_attn.q_zero_point")


FP8_SCALE_SUFFIXES = _WEIGHT_SCALES + _UNUSED_SCALES + _KV_ZERO_POINTS

# a layer's calibrated KV cache scales as checkpoints name them (after "self_attn."), and which of
# the layer's two scales (K, V) each gives: llm-compressor's and vLLM's k_scale/v_scale, ModelOpt's
# on the projections, the older kv_scale (both) and compressed-tensors' projection output scales
_KV_SCALE_NAMES = {
    "k_scale": "k", "v_scale": "v", "attn.k_scale": "k", "attn.v_scale": "v",
    "k_proj.k_scale": "k", "v_proj.v_scale": "v", "kv_scale": "kv",
    "k_proj.output_scale": "k", "v_proj.output_scale": "v",
}


def _kv_zero_point(name: str, t: torch.Tensor) -> bool:
    """Whether a tensor is a KV cache zero point (dropped: the pool's quantization is symmetric);
    one that is not zero is refused by name."""
    if not name.endswith(_KV_ZERO_POINTS):
        return False
    if t.float().abs().max() > 0 if t.numel() else False:
        raise ValueError(f"checkpoint tensor {name!r}: a KV cache zero point that is not 0 (an asymmetric KV "
                         "cache) is not supported")
    return True


def kv_scale_names(name: str) -> list[str]:
    """The layer's KV cache scales a checkpoint tensor gives, under the names the model takes
    (``model.layers.N.self_attn.k_scale``/``v_scale``, ``llama.KV_SCALE_SUFFIXES``); [] for any
    other tensor."""
    head, sep, tail = name.partition(".self_attn.")
    kinds = _KV_SCALE_NAMES.get(tail) if sep else None
    return [f"{head}.self_attn.{kind}_scale" for kind in kinds] if kinds else []


def check_fp8_checkpoint(specs: list[dict], block: tuple[int, ...]) -> None:
    """From a checkpoint's tensor headers (name, safetensors dtype, shape), before any tensor is
    copied: every FP8 weight has exactly one scale tensor and every scale its FP8 weight, of a
    shape ``_fp8_weight`` takes. ValueError naming the first tensor that does not."""
    weights = {s["name"].removesuffix(".weight"): s["shape"] for s in specs
               if str(s["dtype"]).startswith("F8") and not s["name"].endswith(_KV_ZERO_POINTS)}
    scales: dict[str, list] = {}
    for s in specs:
        if s["name"].endswith(_WEIGHT_SCALES):
            base = s["name"].rsplit(".", 1)[0]
            if base in scales:
                raise ValueError(f"FP8 checkpoint: {base} has two scale tensors")
            scales[base] = s["shape"]
    for base in sorted(set(weights) ^ set(scales)):
        raise ValueError(f"FP8 checkpoint: {base} has a {'weight' if base in weights else 'scale'} without its "
                         f"{'scale' if base in weights else 'FP8 weight'}")
    for base, shape in weights.items():
        if len(shape) != 2:
            raise ValueError(f"FP8 checkpoint: {base}.weight has {len(shape)} dimensions; an FP8 weight is one "
                             "matrix (experts one by one, as transformers writes them)")
        _scale_layout(scales[base], shape[0], shape[1], block, base)


def _scale_layout(shape: list[int] | tuple[int, ...], N: int, K: int, block: tuple[int, ...], name: str) -> str:
    """How a scale tensor of ``shape`` covers an N x K weight: "tensor", "row" or "block"."""
    numel = 1
    for d in shape:
        numel *= d
    if numel == 1:
        return "tensor"
    if numel == N and (len(shape) == 1 or shape[-1] == 1):
        return "row"
    if block and len(shape) == 2 and tuple(shape) == (-(-N // block[0]), -(-K // block[1])):
        return "block"
    raise ValueError(f"FP8 checkpoint: {name} has {tuple(shape)} scales for a {N}x{K} weight"
                     + (f" (blocks of {block[0]}x{block[1]})" if block else ""))


def checkpoint_weights(source: ModelSource, dtype: torch.dtype, headers_checked: bool = False
                       ) -> Iterator[tuple[str, torch.Tensor | Fp8Weight | Fp8BlockWeight]]:
    """The checkpoint's tensors under Hugging Face names; an FP8 checkpoint's weights as
    ``fp8_checkpoint_weights`` gives them, once its headers showed every weight paired with a
    scale that fits it (``check_fp8_checkpoint``: a broken checkpoint is refused before a tensor
    is read; ``headers_checked``: the caller did so, as a weight update does)."""
    if source.kind == "gguf":
        return iter_gguf_weights(source)
    weights = _kv_scales_named(iter_hf_weights(source.path))
    if source.config.fp8_checkpoint:
        if not headers_checked:
            check_fp8_checkpoint(safetensors_specs(source.path), source.config.fp8_block)
        return fp8_checkpoint_weights(weights, source.config.fp8_block, dtype)
    return weights


def _kv_scales_named(weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's tensors, its KV cache scales (an FP8 checkpoint's, or those of one whose KV
    cache alone was calibrated) under the names the model takes (``kv_scale_names``), its KV zero
    points dropped (``_kv_zero_point``)."""
    for name, t in weights:
        kv = kv_scale_names(name)
        if not kv and _kv_zero_point(name, t):
            continue
        yield from ((n, t) for n in kv) if kv else ((name, t),)


def fp8_checkpoint_weights(weights: Iterator[tuple[str, torch.Tensor]], block: tuple[int, ...],
                           dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor | Fp8Weight | Fp8BlockWeight]]:
    """An FP8 checkpoint (``quantization_config.quant_method: fp8``, or compressed-tensors FP8)
    with each e4m3 ``X.weight`` paired with its ``X.weight_scale_inv`` or ``X.weight_scale``,
    whichever shard brings either first:
    - one scale per tensor or per row (Llama FP8 checkpoints, llm-compressor's per-channel
      ones): the e4m3 bytes and a scale a row as they are (``fp8.Fp8Weight``), which the
      engine's FP8 projections store without rounding them again (a full-precision parameter
      dequantizes them);
    - one scale per ``block`` = (rows, cols) tile (DeepSeek, Qwen3 FP8): the e4m3 bytes and
      the block scales as they are (``fp8.Fp8BlockWeight``), which the engine's FP8 projections
      and experts store without rounding them again where their rows and columns fall on whole
      blocks (``layers.fp8_weights``; elsewhere dequantized and quantized again per row);
    - e5m2 weights: dequantized to ``dtype``, and quantized again by the engine;
    - a layer's calibrated KV cache scales, as ``_kv_scales_named`` names them in front
      (``model.layers.N.self_attn.k_scale``/``v_scale``), as they are: an FP8 KV pool stores K and V
      with them.
    Static activation scales (``input_scale``) and other output scales are not used: activations
    get a scale per token at run time."""
    waiting_w: dict[str, torch.Tensor] = {}
    waiting_s: dict[str, torch.Tensor] = {}
    unused: list[str] = []
    for name, t in weights:
        if kv_scale_names(name):    # (named as the model takes them by _kv_scales_named)
            yield name, t
            continue
        if name.endswith(_UNUSED_SCALES):
            unused.append(name)
            continue
        if name.endswith(_WEIGHT_SCALES):
            base = name.rsplit(".", 1)[0]
            if base in waiting_w:
                yield base + ".weight", _fp8_weight(waiting_w.pop(base), t, block, dtype, base)
            else:
                waiting_s[base] = t
        elif t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            base = name.removesuffix(".weight")
            if base in waiting_s:
                yield name, _fp8_weight(t, waiting_s.pop(base), block, dtype, base)
            else:
                waiting_w[base] = t
        else:
            yield name, t
    if waiting_w or waiting_s:
        alone = sorted(waiting_w)[:4] + sorted(waiting_s)[:4]
        raise ValueError(f"FP8 checkpoint: weights and scales that do not pair up: {', '.join(alone)}")
    if unused:
        logger.warning("FP8 checkpoint: %d static activation/output scales not used (activations are scaled "
                       "per token), e.g. %s", len(unused), unused[0])


def _fp8_weight(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, ...], dtype: torch.dtype,
                name: str) -> torch.Tensor | Fp8Weight | Fp8BlockWeight:
    if q.dim() != 2:
        raise ValueError(f"FP8 checkpoint: {name}.weight has {q.dim()} dimensions; an FP8 weight is one matrix "
                         "(experts one by one, as transformers writes them)")
    if not scale.dtype.is_floating_point or not bool(torch.isfinite(scale).all()):
        raise ValueError(f"FP8 checkpoint: {name}'s scale must be finite floats ({scale.dtype}"
                         f"{'' if not scale.dtype.is_floating_point else ', not finite'})")
    s = scale.float()
    N, K = q.shape
    layout = _scale_layout(tuple(s.shape), N, K, block, name)
    if layout != "block" and q.dtype == FP8:
        return Fp8Weight(q, s.reshape(-1).expand(N).contiguous())
    if q.dtype == FP8:
        return Fp8BlockWeight(q, s.contiguous(), (block[0], block[1]))
    w = q.float()
    if layout != "block":
        return (w * s.reshape(-1, 1)).to(dtype)
    rows, cols = block
    return (w * s.repeat_interleave(rows, 0)[:N].repeat_interleave(cols, 1)[:, :K]).to(dtype)


# -- building ----------------------------------------------------------------------------------
_DTYPES = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype: str, source: ModelSource, device: torch.device) -> torch.dtype:
    """"auto": float32 on the CPU; on a GPU the checkpoint's dtype (bfloat16 for GGUF and
    float32 checkpoints)."""
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {dtype!r}")
        return _DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32
    ckpt = _DTYPES.get(source.config.torch_dtype or "", torch.bfloat16)
    return torch.bfloat16 if ckpt == torch.float32 else ckpt


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def model_class(cfg: ModelConfig):
    family = SUPPORTED_MODEL_TYPES[cfg.model_type]
    if family == "moe":
        from phalanx.models.moe import MoECausalLM
        return MoECausalLM
    if family == "gemma3":
        from phalanx.models.gemma3 import Gemma3ForCausalLM
        return Gemma3ForCausalLM
    if family == "deepseek":
        from phalanx.models.deepseek import DeepseekForCausalLM
        return DeepseekForCausalLM
    from phalanx.models.llama import CausalLM
    return CausalLM


def build_model(source: ModelSource, dtype: torch.dtype, device: torch.device,
                tp: TPGroup | None = None, load_format: str = "auto", seed: int = 0, fp8: bool = False,
                **model_kwargs: Any) -> CausalLM:
    """Instantiate the model on ``device`` in ``dtype`` and fill its weights. ``fp8``: the
    projections and experts are FP8 from the start and quantized as they load (layers.fp8_weights:
    the model is never held in ``dtype``); embeddings, the output layer, norms and routers stay in it.
    A block-scaled FP8 checkpoint whose blocks the kernels take (``fp8.blocks_fit``) is kept
    scaled per block where a layer's split allows."""
    from phalanx.models.layers import fp8_weights
    cls = model_class(source.config)
    cfg = source.config
    block = (cfg.fp8_block[0], cfg.fp8_block[1]) if fp8 and cfg.fp8_checkpoint and blocks_fit(cfg.fp8_block) else None
    with torch.device(device), default_dtype(dtype), fp8_weights(fp8, block):
        model = cls(source.config, tp, **model_kwargs)
    model.eval()
    weights: Iterator[tuple[str, torch.Tensor | Fp8Weight | Fp8BlockWeight]]
    if load_format == "dummy":
        weights = iter_dummy_weights(model, seed)
    elif load_format == "auto":
        weights = checkpoint_weights(source, dtype)
    else:
        raise ValueError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")
    if fp8 and cfg.fp8_unquantized:
        check_unquantized(model, cfg.fp8_unquantized)
    if block is not None:
        _log_split_blocks(model, block)
    with torch.no_grad():
        model.load_weights(weights)
    if device.type == "cpu":
        cpu_plans(model)
    return model


def _log_split_blocks(model: CausalLM, block: tuple[int, int]) -> None:
    """Say how many FP8 layers of a block-scaled checkpoint keep a scale per row (their split
    cuts inside a block: their weights are rounded a second time)."""
    from phalanx.models.layers import Projection
    from phalanx.models.moe import SparseMoE
    layers = [m for m in model.modules() if isinstance(m, (Projection, SparseMoE))
              and getattr(m, "w13_scale", getattr(m, "weight_scale", None)) is not None]
    split = [m for m in layers if m.fp8_block is None]
    if split:
        logger.warning("FP8 checkpoint in blocks of %dx%d: %d of %d FP8 layers are split inside a block on this "
                       "rank and keep a scale per row (dequantized and quantized again)", block[0], block[1],
                       len(split), len(layers))


def check_unquantized(model: CausalLM, listed: tuple[str, ...]) -> None:
    """Refuse, naming it, a module an FP8 checkpoint keeps in full precision (``listed``: names,
    their last parts, or "re:" patterns, as vLLM and compressed-tensors match them) that this
    engine would serve in FP8: its weight would be rounded where the checkpoint kept it exact.
    Modules the engine keeps in full precision anyway (lm_head, norms, routers) pass."""
    import re
    params = dict(model.named_parameters(remove_duplicate=False))
    for name in model.checkpoint_shapes():
        if not name.endswith(".weight"):
            continue
        module = name.removesuffix(".weight")
        hit = next((e for e in listed if (re.fullmatch(e[3:], module) if e.startswith("re:") else
                                          module == e or module.endswith("." + e) or f".{e}." in module)), None)
        target = params.get(model.map_weight_name(name)[0])
        if hit is not None and target is not None and target.dtype == FP8:
            raise ValueError(f"quantization_config lists {hit!r}: the checkpoint keeps {module} in full precision, "
                             "which this engine would serve in FP8 (rounding it); refused rather than rounded")


def native_half_cpu() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX), where F.linear keeps it."""
    return any(getattr(torch.cpu, name, lambda: False)() for name in
               ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


def cpu_plans(model: torch.nn.Module) -> None:
    """Full-precision projections on a CPU take ``LinearPlan.cpu``: float32 weights for every
    bucket, bf16/fp16 ones from ``CPU_HALF_FROM_ROWS`` rows where the CPU has no native bf16."""
    from phalanx.kernels.linear_plan import CPU_HALF_FROM_ROWS, LinearPlan
    from phalanx.models.layers import Projection
    half = not native_half_cpu()
    for m in model.modules():
        if not isinstance(m, Projection) or m.plan.fp8:
            continue
        if m.weight.dtype == torch.float32:
            m.plan = LinearPlan.cpu(m.plan.neighbour)
        elif half and m.weight.dtype in (torch.bfloat16, torch.float16):
            m.plan = LinearPlan.cpu(m.plan.neighbour, CPU_HALF_FROM_ROWS)


def iter_dummy_weights(model: CausalLM, seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """Random full-size checkpoint tensors, made on the model's device: norms a scale of 1, the rest
    N(0, 0.02). Each tensor's generator is seeded from its name, so every tensor-parallel rank
    sees the same full tensor and takes its own slice."""
    import zlib
    p0 = next(model.parameters())
    unit = 0.0 if model.config.norm_unit_offset else 1.0   # a scale of 1 (Gemma's norms scale by 1 + w)
    for name, shape in model.checkpoint_shapes().items():
        if "norm" in name:
            yield name, torch.full(shape, unit, device=p0.device, dtype=p0.dtype)
            continue
        g = torch.Generator(device=p0.device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        yield name, torch.empty(shape, device=p0.device, dtype=p0.dtype).normal_(0.0, 0.02, generator=g)
