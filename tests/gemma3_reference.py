"""A tiny random Gemma 3 (``gemma3_text``) checkpoint for the tests: every difference from Llama
exercised — norms scaling by 1 + weight (random weights, not Gemma's zeros), four norms a layer,
GELU (tanh), sqrt(hidden) embedding scale, query_pre_attn_scalar ≠ head_dim, sliding-window
layers with their own rotary base beside full layers with linear rope scaling, tied embeddings."""

from __future__ import annotations


def gemma3_config(head_dim: int = 32, **overrides):
    from transformers import Gemma3TextConfig
    cfg = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=512, sliding_window=12,
               query_pre_attn_scalar=24, sliding_window_pattern=2,
               rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}})
    cfg.update(overrides)
    return Gemma3TextConfig(**cfg)


def gemma3_dir(path, seed: int = 5, **overrides) -> str:
    """config.json + model.safetensors (float32) of a seeded random Gemma 3 at ``path``."""
    import torch
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    cfg = gemma3_config(**overrides)
    cfg.initializer_range = 0.1     # peakier logits: fewer near-ties
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:      # Gemma initializes them to 0 (a scale of 1): make 1 + w matter
                p.normal_(0.0, 0.3)
    model.save_pretrained(path)
    return str(path)


def gemma3_vision_dir(path, seed: int = 6) -> str:
    """A seeded random Gemma3ForConditionalGeneration (``model_type: gemma3``): the text decoder
    of ``gemma3_config`` beside a one-layer vision tower, saved as published (``language_model.*``,
    ``vision_tower.*``, ``multi_modal_projector.*``)."""
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig
    torch.manual_seed(seed)
    text = gemma3_config()
    text.initializer_range = 0.1
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    cfg = Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                       image_token_index=250, boi_token_index=251, eoi_token_index=252, eos_token_id=[1, 106])
    model = Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and "language_model" in name:
                p.normal_(0.0, 0.3)
    model.save_pretrained(path)
    return str(path)
