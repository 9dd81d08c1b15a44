"""Tiny random DeepSeek checkpoints for the tests, each difference from Llama exercised.

V3 (``deepseek_v3``): q through its rank bottleneck, the latent's norm, interleaved rotary pairs,
YaRN with mscale ≠ mscale_all_dim (both the cos/sin factor and the softmax scale move), one dense
layer then MoE layers routed by sigmoid with the selection bias (random, so it changes choices)
over groups (noaux_tc), renormalised and scaled, and a shared expert. V2 (``deepseek_v2``): q in
one projection and YaRN with mscale = mscale_all_dim (V2-Lite's form), softmax routing, greedy or
within groups, two shared experts."""

from __future__ import annotations


def deepseek_v3_config(**overrides):
    from transformers import DeepseekV3Config
    cfg = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
               qk_rope_head_dim=8, v_head_dim=24, n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
               n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
               max_position_embeddings=512, rope_interleave=True,
               rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                             "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8,
                             "rope_theta": 10000.0})
    cfg.update(overrides)
    return DeepseekV3Config(**cfg)


def deepseek_v2_config(**overrides):
    from transformers import DeepseekV2Config
    cfg = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
               qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2,
               first_k_dense_replace=1, routed_scaling_factor=1.5, topk_method="greedy",
               max_position_embeddings=512,
               rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                             "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707,
                             "rope_theta": 10000.0})   # (as V2-Lite ships it)
    cfg.update(overrides)
    return DeepseekV2Config(**cfg)


def deepseek_dir(path, version: int = 3, seed: int = 7, **overrides) -> str:
    """config.json + model.safetensors (float32) of a seeded random DeepSeek-V2 or V3 at ``path``."""
    import torch
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    cfg = (deepseek_v3_config if version == 3 else deepseek_v2_config)(**overrides)
    cfg.initializer_range = 0.1     # peakier logits: fewer near-ties
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:      # initialised to 1: make the latent's norms matter
                p.normal_(1.0, 0.3)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):   # zeros at init: make it change choices
                b.normal_(0.0, 0.2)
    model.save_pretrained(path)
    return str(path)
