"""GPU-only: DeepSeek-V3 with the released models' latent width (kv_lora_rank 512 + qk_rope_head_dim
64: the pool's one 576-wide head, one plane) on the Triton kernels: greedy tokens equal transformers'
(float32) eager and in decode CUDA graphs (a mixture of experts takes no extend or piecewise
graphs); in bf16, the likeliest token at each prompt position agrees with transformers' float32
model. Skipped without CUDA."""

import pytest
import torch

from deepseek_reference import deepseek_dir
from hf_reference import assert_same_greedy, hf_greedy
from phalanx import LLM, SamplingParams

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
    ps = prompts(hf.config.vocab_size)
    refs = [hf_greedy(hf, p, 16) for p in ps]
    with LLM(path, skip_tokenizer_init=True, dtype="float32", orchestrator_type="inprocess",
             kv_cache_config={"tokens_per_block": 16}, **RUNS[run]) as llm:
        alone = [llm.generate([p], SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)[0] for p in ps]
        batched = llm.generate(ps, SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
        runner = llm._executor.engine.runner
        steps = (runner.num_graph_steps, runner.num_extend_graph_steps, runner.num_piecewise_steps)
    for i, (a, b, (ref, gaps)) in enumerate(zip(alone, batched, refs, strict=True)):
        assert_same_greedy(a.outputs[0].token_ids, ref, gaps, f"{run} prompt {i} alone")
        assert_same_greedy(b.outputs[0].token_ids, ref, gaps, f"{run} prompt {i} batched")
    assert steps == (0, 0, 0) if run == "eager" else (steps[0] > 0 and steps[1:] == (0, 0)), steps


def test_gpu_deepseek_bf16_top1_agrees_with_transformers(deepseek):
    path, hf = deepseek
    ps = prompts(hf.config.vocab_size)[2:]
    with LLM(path, skip_tokenizer_init=True, dtype="bfloat16", orchestrator_type="inprocess",
             kv_cache_config={"tokens_per_block": 16}) as llm:
        outs = llm.generate(ps, SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    agree = total = 0
    for p, o in zip(ps, outs, strict=True):
        with torch.no_grad():
            want = hf(torch.tensor([p], device="cuda")).logits[0, :-1].argmax(-1).tolist()
        for entry, w in zip(o.prompt_logprobs[1:], want, strict=True):
            top = next(t for t, lp in entry.items() if lp.rank == 1)
            agree += top == w
            total += 1
    assert agree >= 0.9 * total, (agree, total)
