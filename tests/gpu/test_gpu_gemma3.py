"""GPU-only: Gemma 3 on the Triton kernels at Gemma's head size (256), with sliding-window layers:
greedy tokens equal transformers' (float32) eager and in CUDA graphs (decode, extend and piecewise);
in bf16, the likeliest token at each prompt position agrees with transformers' float32 model.
Skipped without CUDA."""

import pytest
import torch

from gemma3_reference import gemma3_dir
from hf_reference import assert_bf16_top1_agrees, gpu_greedy_runs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GRAPHS = {"batch_sizes": [1, 2, 4, 8]}
RUNS = {
    "eager": {"cuda_graph_config": None},
    "graphs": {"cuda_graph_config": GRAPHS},
    "piecewise": {"cuda_graph_config": {**GRAPHS, "extend_num_tokens": [], "piecewise_num_tokens": [16]},
                  "max_num_tokens": 16},
}


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (1, 6, 20, 45)]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    from transformers import AutoModelForCausalLM
    path = gemma3_dir(tmp_path_factory.mktemp("gemma3-256"), seed=9, head_dim=256, sliding_window=16)
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().cuda()


@pytest.mark.parametrize("run", list(RUNS))
def test_gpu_gemma3_greedy_equals_transformers(gemma, run):
    path, hf = gemma
    steps = gpu_greedy_runs(path, hf, prompts(hf.config.vocab_size), **RUNS[run])
    # decode, extend and piecewise graph steps: none eager, decode and extend ones with graphs,
    # decode and piecewise ones with piecewise graphs
    assert steps == (0, 0, 0) if run == "eager" else (steps[0] > 0 and (steps[1] > 0) == (run == "graphs")
                                                        and (steps[2] > 0) == (run == "piecewise")), steps


def test_gpu_gemma3_bf16_top1_agrees_with_transformers(gemma):
    path, hf = gemma
    assert_bf16_top1_agrees(path, hf, prompts(hf.config.vocab_size)[2:])
