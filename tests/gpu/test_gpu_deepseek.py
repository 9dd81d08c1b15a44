"""GPU-only: DeepSeek-V3 with the released models' latent width (kv_lora_rank 512 + qk_rope_head_dim
64: the pool's one 576-wide head, one plane) on the Triton kernels: greedy tokens equal transformers'
(float32) eager and in decode CUDA graphs (a mixture of experts takes no extend or piecewise
graphs); in bf16, the likeliest token at each prompt position agrees with transformers' float32
model. Skipped without CUDA."""

import pytest
import torch

from deepseek_reference import deepseek_dir
from hf_reference import assert_bf16_top1_agrees, gpu_greedy_runs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GRAPHS = {"batch_sizes": [1, 2, 4, 8]}
RUNS = {"eager": {"cuda_graph_config": None}, "graphs": {"cuda_graph_config": GRAPHS}}


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (1, 6, 20, 45)]


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    from transformers import AutoModelForCausalLM
    path = deepseek_dir(tmp_path_factory.mktemp("dsv3-576"), seed=9, hidden_size=256, num_attention_heads=8,
                        num_key_value_heads=8, q_lora_rank=96, kv_lora_rank=512, qk_rope_head_dim=64,
                        qk_nope_head_dim=32, v_head_dim=32)
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().cuda()


@pytest.mark.parametrize("run", list(RUNS))
def test_gpu_deepseek_greedy_equals_transformers(deepseek, run):
    path, hf = deepseek
    steps = gpu_greedy_runs(path, hf, prompts(hf.config.vocab_size), **RUNS[run])
    assert steps == (0, 0, 0) if run == "eager" else (steps[0] > 0 and steps[1:] == (0, 0)), steps


def test_gpu_deepseek_bf16_top1_agrees_with_transformers(deepseek):
    path, hf = deepseek
    assert_bf16_top1_agrees(path, hf, prompts(hf.config.vocab_size)[2:])


def test_gpu_deepseek_with_more_heads_than_a_kernel_program_takes(tmp_path):
    """24 latent heads a rank (two programs' head groups, the second partly masked; past the
    general kernels' 16 × 1,024): the latent kernels run them, in decode CUDA graphs too."""
    from transformers import AutoModelForCausalLM
    path = deepseek_dir(tmp_path, seed=5, hidden_size=256, num_attention_heads=24, num_key_value_heads=24,
                        q_lora_rank=96, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().cuda()
    steps = gpu_greedy_runs(path, hf, prompts(hf.config.vocab_size), **RUNS["graphs"])
    assert steps[0] > 0 and steps[1:] == (0, 0), steps
