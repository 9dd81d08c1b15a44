"""Our logits equal transformers' within 1e-4 at prefill and at every decode step (fp32),
through the real scheduler, paged KV pool, chunked prefill and a sliding window."""

import pytest
import torch

from hf_reference import assert_logits_every_step


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("max_num_tokens", [16, 512])
def test_logits_match_transformers_every_step(kind, max_num_tokens, tiny_models, hf_models):
    torch.manual_seed(0)
    prompt = torch.randint(0, hf_models[kind].config.vocab_size, (37,)).tolist()
    assert_logits_every_step(tiny_models[kind], hf_models[kind], prompt, 12, max_num_tokens)


@pytest.mark.parametrize("scaling", [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},   # attention factor from ln 4
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 256, "beta_fast": 24, "beta_slow": 1,
     "attention_factor": 0.9, "truncate": False},   # the ramp's ends between dimensions
])
def test_yarn_rope_matches_transformers_every_step(scaling, tmp_path):
    """YaRN (Qwen2.5's long-context setting) on a Llama-family model: the ramp between the
    dimensions kept and those interpolated, and the attention factor on cos and sin."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from hf_reference import TINY, tiny_model_dirs
    cfg = Qwen2Config(**TINY, rope_parameters={**scaling, "rope_theta": 10000.0}, tie_word_embeddings=False)
    path = tiny_model_dirs(lambda name: tmp_path / name, {"qwen2-yarn": cfg})["qwen2-yarn"]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(4)).tolist()   # past 16
    assert_logits_every_step(path, hf, prompt, 6, 16)


def test_yarn_reaches_factor_times_the_original_context():
    """Qwen2.5's long-context form (max_position_embeddings 32,768 beside YaRN of factor 4 over
    32,768): requests may run to 131,072 positions, as YaRN is there for (and as vLLM takes it)."""
    from transformers import Qwen2Config

    from hf_reference import TINY
    from phalanx.models.config import ModelConfig
    hf = Qwen2Config(**{**TINY, "max_position_embeddings": 32768},
                     rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})
    assert ModelConfig.from_hf(hf).max_position_embeddings == 131072
    assert ModelConfig.from_hf(Qwen2Config(**TINY)).max_position_embeddings == 512
