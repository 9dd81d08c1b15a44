"""Mixture-of-experts models against transformers on one rank, with tensor/expert parallelism
and with attention data parallelism (2 ranks, gloo); routing and aborts under attention DP."""

import pytest
import torch

from hf_reference import assert_same_greedy, hf_greedy
from phalanx import LLM, SamplingParams

pytestmark = pytest.mark.mpi


def prompts(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (int(torch.randint(2, 30, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def check(llm, hf, ps, n=8):
    outs = llm.generate(ps, SamplingParams(max_tokens=n, ignore_eos=True), use_tqdm=False)
    for i, (p, o) in enumerate(zip(ps, outs, strict=True)):
        ref, gaps = hf_greedy(hf, p, n)
        assert_same_greedy(o.outputs[0].token_ids, ref, gaps, f"prompt {i}")
    return outs


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe", "qwen2_moe"])
def test_one_rank_equals_transformers(kind, tiny_moe_models, hf_moe_models):
    with LLM(tiny_moe_models[kind], skip_tokenizer_init=True, orchestrator_type="inprocess") as llm:
        check(llm, hf_moe_models[kind], prompts())


@pytest.mark.parametrize("kind,ep", [("mixtral", 2), ("qwen3_moe", 2), ("mixtral", 1)])
def test_tp2_with_expert_parallelism_equals_transformers(kind, ep, tiny_moe_models, hf_moe_models):
    with LLM(tiny_moe_models[kind], skip_tokenizer_init=True, tensor_parallel_size=2,
             moe_expert_parallel_size=ep) as llm:
        check(llm, hf_moe_models[kind], prompts())
        assert llm._executor.check_integrity() == ["ok", "ok"]


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_attention_dp_equals_transformers_and_spreads_requests(kind, tiny_moe_models, hf_moe_models):
    with LLM(tiny_moe_models[kind], skip_tokenizer_init=True, tensor_parallel_size=2,
             enable_attention_dp=True) as llm:
        outs = check(llm, hf_moe_models[kind], prompts(8, seed=1))
        ranks = [o.metrics["rank"] for o in outs]
        assert sorted(set(ranks)) == [0, 1]
        assert llm._executor.check_integrity() == ["ok", "ok"]


def test_deepseek_attention_dp_equals_transformers(tmp_path):
    """DeepSeek-V3 under attention DP: each rank its own requests over its own latent pool, every
    head on each rank, the routed experts split (EP=2) over both ranks' tokens gathered."""
    from transformers import AutoModelForCausalLM

    from deepseek_reference import deepseek_dir
    path = deepseek_dir(tmp_path / "dsv3")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with LLM(path, skip_tokenizer_init=True, tensor_parallel_size=2, enable_attention_dp=True) as llm:
        outs = check(llm, hf, prompts(8, seed=1))
        assert sorted({o.metrics["rank"] for o in outs}) == [0, 1]
        assert llm._executor.check_integrity() == ["ok", "ok"]


def test_attention_dp_uneven_load_neither_hangs_nor_changes_results(tiny_moe_models, hf_moe_models):
    hf = hf_moe_models["qwen3_moe"]
    with LLM(tiny_moe_models["qwen3_moe"], skip_tokenizer_init=True, tensor_parallel_size=2,
             enable_attention_dp=True) as llm:
        p = [5, 6, 7, 8]
        out = llm.generate(p, SamplingParams(max_tokens=40, ignore_eos=True), use_tqdm=False)
        ref, gaps = hf_greedy(hf, p, 40)
        assert_same_greedy(out.outputs[0].token_ids, ref, gaps)
        stats = llm._executor.stats()
        idle = [s for s in stats if s["rank"] != out.metrics["rank"]][0]
        assert idle["num_dummy_steps"] >= 39          # the other rank stepped along, idle
        for s in stats:   # token counts cross ranks once per forward, not once per MoE layer
            assert s["moe_forwards"] >= 40 and s["moe_count_exchanges"] == s["moe_forwards"], s
        check(llm, hf, prompts(5, seed=2))            # and everything still works afterwards


def test_attention_dp_places_a_burst_over_several_iterations(tiny_moe_models, hf_moe_models):
    """Twelve requests at once, where an iteration places at most 4 (a batch of 2 rows a rank):
    placed a few at a time over both ranks, and each still equal to transformers."""
    with LLM(tiny_moe_models["mixtral"], skip_tokenizer_init=True, tensor_parallel_size=2,
             enable_attention_dp=True, max_batch_size=2, max_num_tokens=64) as llm:
        ps = prompts(12, seed=3)
        outs = check(llm, hf_moe_models["mixtral"], ps)
        stats = llm._executor.stats()
        assert sum(stats[0]["num_placed"]) == 12 and all(s["num_placements"] >= 3 for s in stats), stats
        assert {o.metrics["rank"] for o in outs} == {0, 1}
        assert llm._executor.check_integrity() == ["ok", "ok"]


def test_attention_dp_conversations_stay_on_their_rank(tiny_moe_models):
    with LLM(tiny_moe_models["mixtral"], skip_tokenizer_init=True, tensor_parallel_size=2,
             enable_attention_dp=True, kv_cache_config={"tokens_per_block": 8}) as llm:
        g = torch.Generator().manual_seed(3)
        history = [torch.randint(0, 256, (40,), generator=g).tolist() for _ in range(8)]
        first_rank = {}
        for turn in range(4):
            outs = llm.generate(history, SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
            for c, out in enumerate(outs):
                if turn == 0:
                    first_rank[c] = out.metrics["rank"]
                else:
                    assert out.metrics["rank"] == first_rank[c], f"conversation {c} moved at turn {turn}"
                    assert out.cached_tokens >= len(history[c]) - 6 - 8 - 1
                history[c] = history[c] + out.outputs[0].token_ids + torch.randint(0, 256, (5,), generator=g).tolist()
        counts = [list(first_rank.values()).count(r) for r in (0, 1)]
        assert abs(counts[0] - counts[1]) <= 1          # distinct conversations spread evenly


def test_abort_of_a_request_owned_by_rank1(tiny_moe_models):
    with LLM(tiny_moe_models["qwen3_moe"], skip_tokenizer_init=True, tensor_parallel_size=2,
             enable_attention_dp=True) as llm:
        futs = [llm.generate_async([i + 1, 2, 3], SamplingParams(max_tokens=300, ignore_eos=True), streaming=True)
                for i in range(4)]
        for f in futs:
            next(iter(f))
        owned_by_1 = [f for f in futs if f.metrics["rank"] == 1]
        assert owned_by_1
        for f in owned_by_1:
            f.abort()
        for f in owned_by_1:
            assert f.result(timeout=60).outputs[0].finish_reason == "abort"
        s1 = [s for s in llm._executor.stats() if s["rank"] == 1][0]
        assert s1["num_owned"] == 0 and s1["num_available_blocks"] == s1["num_blocks"]
        assert llm._executor.check_integrity() == ["ok", "ok"]
        for f in futs:
            if f not in owned_by_1:
                f.abort()


def test_attention_dp_paused_runs_no_steps_and_resumes(tiny_moe_models, hf_moe_models):
    """pause_generation('keep') holds every rank: no forward (real or dummy) runs until
    continue_generation, and the kept request then finishes with transformers' tokens."""
    import time
    hf = hf_moe_models["qwen3_moe"]
    with LLM(tiny_moe_models["qwen3_moe"], skip_tokenizer_init=True, tensor_parallel_size=2,
             enable_attention_dp=True) as llm:
        p = [5, 6, 7, 8]
        fut = llm.generate_async(p, SamplingParams(max_tokens=200, ignore_eos=True))
        time.sleep(0.5)
        llm.pause_generation("keep")
        before = [(s["iteration"], s["num_dummy_steps"], s["num_padding_steps"]) for s in llm._executor.stats()]
        time.sleep(1.0)
        after = [(s["iteration"], s["num_dummy_steps"], s["num_padding_steps"]) for s in llm._executor.stats()]
        assert before == after and not fut.done
        llm.continue_generation()
        out = fut.result(timeout=120)
        ref, gaps = hf_greedy(hf, p, 200)
        assert_same_greedy(out.outputs[0].token_ids, ref, gaps)
