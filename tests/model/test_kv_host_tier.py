"""The KV cache's host tier through the engine (CPU, fp32): a prefix the device pool evicted is
found on the host and onboarded, the request reuses it (``cached_tokens``), and its greedy tokens
equal transformers'; the same prompts without the tier recompute it. With a draft model the
draft's pool moves its blocks with the target's; with an FP8 pool the onboarded bytes give the
tokens of a hit that never left the device. A size that holds no block is refused."""

import pytest
import torch

from hf_reference import assert_same_greedy, hf_greedy
from phalanx import LLM, SamplingParams

NEW = 6
BLOCK = 8


def _prompts(vocab: int) -> tuple[list[int], list[list[int]]]:
    g = torch.Generator().manual_seed(5)
    first = torch.randint(0, vocab, (41,), generator=g).tolist()           # 5 full blocks + 1 token
    churn = [torch.randint(0, vocab, (41,), generator=g).tolist() for _ in range(4)]
    return first, churn


def _engine(model_dir: str) -> LLM:
    """A 12-block device pool with a 1 MB host tier (``_run``'s engine, for tests that drive it)."""
    kv = {"tokens_per_block": BLOCK, "max_tokens": 12 * BLOCK, "host_cache_size": 1 << 20}
    return LLM(model_dir, skip_tokenizer_init=True, kv_cache_config=kv, orchestrator_type="inprocess",
               max_num_tokens=64, max_seq_len=64)


def _run(model_dir: str, first: list[int], churn: list[list[int]], host_bytes: int | None, **extra):
    """``first``, then the churn one prompt at a time (a 12-block device pool: ``first``'s
    blocks are evicted), then ``first`` with a new last token. Returns its outputs and the stats."""
    kv = {"tokens_per_block": BLOCK, "max_tokens": 12 * BLOCK, "host_cache_size": host_bytes,
          **extra.pop("kv", {})}
    params = SamplingParams(max_tokens=NEW, ignore_eos=True)
    with LLM(model_dir, skip_tokenizer_init=True, kv_cache_config=kv, orchestrator_type="inprocess",
             max_num_tokens=64, max_seq_len=64, **extra) as llm:
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in [first, *churn]]
        again = llm.generate([first[:-1] + [7]], params, use_tqdm=False)[0]
        engine = llm._executor.engine
        engine.scheduler.kv.check_integrity()
        return outs[0], again, engine.stats()


def test_an_evicted_prefix_comes_back_from_the_host(tiny_models, hf_models):
    hf = hf_models["llama"]
    first, churn = _prompts(hf.config.vocab_size)
    _, again, s = _run(tiny_models["llama"], first, churn, 1 << 20)
    assert s["kv_host_blocks"] > 12 and s["kv_offloaded_blocks"] >= 5 and s["kv_onboarded_blocks"] >= 5
    assert again.cached_tokens == 40, "first's five full blocks came back from the host"
    ref, gaps = hf_greedy(hf, first[:-1] + [7], NEW)
    assert_same_greedy(again.outputs[0].token_ids, ref, gaps, "onboarded prefix")

    _, cold, s0 = _run(tiny_models["llama"], first, churn, None)
    assert s0["kv_host_blocks"] == 0 and s0["kv_offloaded_blocks"] == 0
    assert cold.cached_tokens == 0, "without the host tier the evicted prefix is computed again"
    assert cold.outputs[0].token_ids == again.outputs[0].token_ids


def test_a_draft_models_pool_moves_with_the_targets(tiny_models, hf_models):
    hf = hf_models["llama"]
    first, churn = _prompts(hf.config.vocab_size)
    spec = {"decoding_type": "DraftTarget", "max_draft_len": 3, "speculative_model_dir": tiny_models["llama"],
            "adaptive": False}
    _, again, s = _run(tiny_models["llama"], first, churn, 1 << 20, speculative_config=spec)
    assert again.cached_tokens == 40 and s["kv_onboarded_blocks"] >= 5
    ref, gaps = hf_greedy(hf, first[:-1] + [7], NEW)
    assert_same_greedy(again.outputs[0].token_ids, ref, gaps, "onboarded prefix, draft model")
    # the draft equals the target: every draft is accepted only if the draft's onboarded KV is right
    assert s["spec_accepted_drafts"] == s["spec_draft_tokens"] > 0


def test_an_fp8_pools_onboarded_bytes_give_the_tokens_of_a_device_hit(tiny_models):
    first, churn = _prompts(256)
    model = tiny_models["llama"]
    _, host_hit, s = _run(model, first, churn, 1 << 20, kv={"dtype": "fp8"})
    assert host_hit.cached_tokens == 40 and s["kv_onboarded_blocks"] >= 5
    # the same prompt hitting a prefix that never left the device (no churn)
    _, device_hit, s = _run(model, first, [], 1 << 20, kv={"dtype": "fp8"})
    assert device_hit.cached_tokens == 40 and s["kv_onboarded_blocks"] == 0
    assert host_hit.outputs[0].token_ids == device_hit.outputs[0].token_ids


def test_a_host_cache_size_that_holds_no_block_is_refused(tiny_models):
    with pytest.raises(Exception, match="host_cache_size"):
        LLM(tiny_models["llama"], skip_tokenizer_init=True, orchestrator_type="inprocess",
            kv_cache_config={"host_cache_size": 100})
    with pytest.raises(Exception, match="host_cache_size"):
        LLM(tiny_models["llama"], skip_tokenizer_init=True, orchestrator_type="inprocess",
            kv_cache_config={"host_cache_size": 1 << 20, "enable_block_reuse": False})


@pytest.mark.parametrize("victim", ["onboards", "offloads"])
def test_a_step_that_fails_before_its_forward_still_moves_its_blocks(victim, tiny_models, hf_models):
    """The tree moves blocks when a step is scheduled; the copies run with the forward. A step
    that fails before it (here an injected failure) must still run them, or the prefix cache
    would serve a later request rows that never arrived (an onboarded block) or were never
    saved (an offloaded one)."""
    from phalanx.llmapi.outputs import RequestError
    hf = hf_models["llama"]
    first, churn = _prompts(hf.config.vocab_size)
    params = SamplingParams(max_tokens=NEW, ignore_eos=True)
    with _engine(tiny_models["llama"]) as llm:
        engine = llm._executor.engine
        shown = [first, *churn] if victim == "onboards" else [first, churn[0]]
        for p in shown:
            llm.generate([p], params, use_tqdm=False)
        moved = (engine.scheduler.kv.tree.num_onboarded, engine.scheduler.kv.tree.num_offloaded)
        llm.control("fail_next_forward:0")
        doomed = first[:-1] + [3] if victim == "onboards" else churn[1]   # a host hit / evicts first's blocks
        with pytest.raises(RequestError):
            llm.generate_async(doomed, params).result(timeout=60)
        after = (engine.scheduler.kv.tree.num_onboarded, engine.scheduler.kv.tree.num_offloaded)
        assert after[0 if victim == "onboards" else 1] > moved[0 if victim == "onboards" else 1]
        again = llm.generate([first[:-1] + [9]], params, use_tqdm=False)[0]
        engine.scheduler.kv.check_integrity()
    assert again.cached_tokens == 40
    ref, gaps = hf_greedy(hf, first[:-1] + [9], NEW)
    assert_same_greedy(again.outputs[0].token_ids, ref, gaps, f"after a failed step that {victim}")


def test_sleep_forgets_the_host_tier_and_the_engine_serves_after_waking(tiny_models, hf_models):
    """Sleep releases the KV memory (a new epoch): the host tier's blocks can never match again
    and are let go; after waking, an evicted prefix is computed again, right."""
    hf = hf_models["llama"]
    first, churn = _prompts(hf.config.vocab_size)
    params = SamplingParams(max_tokens=NEW, ignore_eos=True)
    with _engine(tiny_models["llama"]) as llm:
        for p in [first, *churn]:
            llm.generate([p], params, use_tqdm=False)
        assert llm.stats()[0]["kv_host_cached_blocks"] > 0
        llm.sleep(level=1)
        assert llm.stats()[0]["kv_host_cached_blocks"] == 0
        llm.wake_up()
        again = llm.generate([first[:-1] + [9]], params, use_tqdm=False)[0]
        llm._executor.engine.scheduler.kv.check_integrity()
    assert again.cached_tokens == 0
    ref, gaps = hf_greedy(hf, first[:-1] + [9], NEW)
    assert_same_greedy(again.outputs[0].token_ids, ref, gaps, "after sleep and wake-up")


def test_copies_that_fail_part_of_the_way_drop_the_prefix_cache(tiny_models, hf_models):
    """Copies that raise inside the step (here after the first op) cannot be run again (an
    offload of a block a later onboard overwrote would copy the wrong rows): the step fails and
    nothing cached may match again, so the next request computes its prefix, right."""
    from phalanx.kv_manager.manager import ONBOARD
    from phalanx.llmapi.outputs import RequestError
    hf = hf_models["llama"]
    first, churn = _prompts(hf.config.vocab_size)
    params = SamplingParams(max_tokens=NEW, ignore_eos=True)
    with _engine(tiny_models["llama"]) as llm:
        engine = llm._executor.engine
        for p in [first, *churn]:
            llm.generate([p], params, use_tqdm=False)
        pool = engine.runner.kv_pool
        real = pool.copy_blocks

        def fails_after_one(ops):   # the first op runs, then the copies raise
            if any(op.kind == ONBOARD for op in ops):
                pool.copy_blocks = real
                real(ops[:1])
                raise RuntimeError("injected: the copies failed part of the way")
            real(ops)
        pool.copy_blocks = fails_after_one
        with pytest.raises(RequestError):
            llm.generate_async(first[:-1] + [3], params).result(timeout=60)
        assert pool.copy_blocks is real, "the injected failure ran"
        assert llm.stats()[0]["kv_host_cached_blocks"] == 0
        again = llm.generate([first[:-1] + [9]], params, use_tqdm=False)[0]
        engine.scheduler.kv.check_integrity()
    assert again.cached_tokens == 0
    ref, gaps = hf_greedy(hf, first[:-1] + [9], NEW)
    assert_same_greedy(again.outputs[0].token_ids, ref, gaps, "after copies that failed")


def test_vllms_kv_offloading_size_is_the_host_tier(tiny_models, hf_models):
    """``LLM(kv_offloading_size=GiB, kv_offloading_backend="native")`` as vLLM's users write it:
    the same host tier as kv_cache_config.host_cache_size of that many bytes; mixing the two, or
    a backend without a size, is refused by name."""
    hf = hf_models["llama"]
    first, churn = _prompts(hf.config.vocab_size)
    _, again, s = _run(tiny_models["llama"], first, churn, None, kv_offloading_size=1 / 1024,
                       kv_offloading_backend="native")
    assert again.cached_tokens == 40 and s["kv_onboarded_blocks"] >= 5
    _, _, s_bytes = _run(tiny_models["llama"], first, [], 1 << 20)
    assert s["kv_host_blocks"] == s_bytes["kv_host_blocks"]
    for bad, what in (({"kv_offloading_backend": "native"}, "kv_offloading_backend"),
                      ({"kv_offloading_size": 1.0, "kv_cache_config": {"host_cache_size": 1 << 20}},
                       "kv_offloading_size"),
                      ({"kv_offloading_size": 1.0, "kv_offloading_backend": "lmcache"}, "kv_offloading_backend")):
        with pytest.raises(ValueError, match=what):
            LLM(tiny_models["llama"], skip_tokenizer_init=True, orchestrator_type="inprocess", **bad)
