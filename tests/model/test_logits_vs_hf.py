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
