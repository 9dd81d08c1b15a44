"""Model shapes for benchmarks with random weights (``load_format="dummy"``): a config.json
written to a temporary directory, nothing downloaded."""

from __future__ import annotations

import json
import os
import tempfile

SHAPES: dict[str, dict] = {
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": 128001,
    },
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
        "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
        "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "eos_token_id": 151645,
    },
    # google/gemma-3-1b-it's config.json (transformers 4's form)
    "gemma-3-1b": {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 262144,
        "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 256, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "rope_scaling": None, "sliding_window": 512,
        "sliding_window_pattern": 6, "query_pre_attn_scalar": 256, "hidden_activation": "gelu_pytorch_tanh",
        "attn_logit_softcapping": None, "final_logit_softcapping": None, "tie_word_embeddings": True,
        "torch_dtype": "bfloat16", "bos_token_id": 2, "eos_token_id": [1, 106],
    },
    # deepseek-ai/DeepSeek-V2-Lite-Chat's config.json (latent attention, 64 routed + 2 shared experts)
    "deepseek-v2-lite": {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 102400,
        "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
        "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": None, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 64,
        "n_shared_experts": 2, "num_experts_per_tok": 6, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": False,
        "scoring_func": "softmax", "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
        "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 100000,
        "eos_token_id": 100001,
    },
}
# the same shapes as block-scaled FP8 checkpoints (e4m3, a scale per 128 x 128 block, as Qwen3's and
# DeepSeek's FP8 checkpoints ship): random weights quantized a block at a time as they load
FP8_BLOCK_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                    "weight_block_size": [128, 128]}
# an EAGLE-3 head for the Llama-3.1-8B shape, as published heads for it are (one layer, a 32k draft
# vocabulary): ``speculative_model_dir: shape:llama-3.1-8b-eagle3`` (random weights with the target's)
SHAPES["llama-3.1-8b-eagle3"] = {
    **{k: v for k, v in SHAPES["llama-3.1-8b"].items() if k not in ("bos_token_id", "eos_token_id")},
    "architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1, "draft_vocab_size": 32000}
SHAPES["llama-3.1-8b-fp8-block"] = {**SHAPES["llama-3.1-8b"], "quantization_config": FP8_BLOCK_CONFIG}
SHAPES["qwen3-30b-a3b-fp8"] = {**SHAPES["qwen3-30b-a3b"], "quantization_config": FP8_BLOCK_CONFIG}


# a two-layer shape of the same family, to check a tool on a CPU
TINY_OVERRIDES = {"num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024}


def shape_dir(name: str, **overrides) -> str:
    """A directory holding only config.json for the named shape (for dummy weights)."""
    if name not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}; known: {', '.join(SHAPES)}")
    cfg = {**SHAPES[name], **overrides}
    d = tempfile.mkdtemp(prefix=f"phalanx-shape-{name}-")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    return d


def resolve_model_arg(model: str | None, **overrides) -> tuple[str | None, bool]:
    """``shape:NAME`` -> (a config-only directory, True); anything else unchanged."""
    if model and model.startswith("shape:"):
        return shape_dir(model[len("shape:"):], **overrides), True
    return model, False


def resolve_spec_shape(kwargs: dict) -> dict:
    """LLM arguments whose ``speculative_config`` names its draft as ``shape:NAME`` (random weights,
    as the target's): that name resolved to a config-only directory."""
    sc = kwargs.get("speculative_config")
    if not isinstance(sc, dict):
        return kwargs
    for key in ("speculative_model_dir", "speculative_model", "model"):
        if isinstance(sc.get(key), str) and sc[key].startswith("shape:"):
            return {**kwargs, "speculative_config": {**sc, key: resolve_model_arg(sc[key])[0]}}
    return kwargs


def profiling_engine_args(orchestrator: str, config: str | None) -> dict:
    """LLM arguments of the profiling tools' engine (tools/profile_ttft.py, profile_mixed.py):
    random weights, token-id prompts, 256 rows, 4k tokens, then the YAML's settings."""
    from phalanx.config import merge_yaml
    args: dict = {"load_format": "dummy", "skip_tokenizer_init": True, "max_batch_size": 256,
                  "orchestrator_type": orchestrator, "max_seq_len": 4096}
    return merge_yaml(args, config) if config else args
