"""The overlap loop (step n+1 launched before step n is read) gives exactly the tokens of the
sync loop: batch sizes 1-32, mixed lengths, EOS / stop ids / max_tokens at every position,
chunked prefill, preemption, aborts; the KV cache is intact after each."""

import pytest
import torch

from phalanx import LLM, SamplingParams


def make_llm(model, overlap: bool, **kw):
    return LLM(model, skip_tokenizer_init=True, orchestrator_type="inprocess",
               disable_overlap_scheduler=not overlap, kv_cache_config=kw.pop("kv", {"tokens_per_block": 8}), **kw)


@pytest.fixture(scope="module")
def pair(tiny_models):
    """(sync LLM, overlap LLM) on the same tiny Llama."""
    a, b = make_llm(tiny_models["llama"], False), make_llm(tiny_models["llama"], True)
    yield a, b
    a.shutdown()
    b.shutdown()


def prompts(n, vocab=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def run(llm, ps, sps):
    outs = llm.generate(ps, sps, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]


def integrity(llm):
    assert llm._executor.check_integrity() == ["ok"]
    s = llm._executor.stats()[0]
    assert s["num_running"] == 0 and s["num_available_blocks"] == s["num_blocks"]


@pytest.mark.parametrize("batch", [1, 2, 5, 8, 17, 32])
def test_mixed_lengths_equal(pair, batch):
    sync, ovl = pair
    ps = prompts(batch, seed=batch)
    sps = [SamplingParams(max_tokens=1 + (i * 5) % 13, ignore_eos=True) for i in range(batch)]
    assert run(ovl, ps, sps) == run(sync, ps, sps)
    integrity(ovl)


def test_eos_stop_ids_and_max_tokens_at_every_position(pair):
    sync, ovl = pair
    p = [11, 22, 33, 44]
    ref = run(sync, [p], SamplingParams(max_tokens=12, ignore_eos=True))[0][0]
    cases = []
    for k in range(12):
        cases.append(SamplingParams(max_tokens=12, end_id=ref[k]))             # EOS at position k
        cases.append(SamplingParams(max_tokens=12, stop_token_ids=[ref[k]], ignore_eos=True))
        cases.append(SamplingParams(max_tokens=k + 1, ignore_eos=True))
    ps = [p] * len(cases)
    got, want = run(ovl, ps, cases), run(sync, ps, cases)
    assert got == want
    for (toks, reason), sp in zip(got, cases, strict=True):
        if sp.end_id is not None:
            assert toks == ref[:ref.index(sp.end_id) + 1] and reason == "stop"
    integrity(ovl)


def test_chunked_prefill_equal(tiny_models):
    ps = prompts(9, seed=3)
    sps = SamplingParams(max_tokens=9, ignore_eos=True)
    with make_llm(tiny_models["qwen3"], False, max_num_tokens=16) as a, \
            make_llm(tiny_models["qwen3"], True, max_num_tokens=16) as b:
        assert run(b, ps, sps) == run(a, ps, sps)
        integrity(b)


def test_prefill_cap_while_decoding_keeps_every_token(tiny_models):
    """scheduler_config.max_prefill_tokens_while_decoding: prompts computed a few positions a step
    beside the decoders give the same tokens as an engine without the cap; a cap of 0 is refused
    by name."""
    ps = prompts(9, seed=6)
    sps = SamplingParams(max_tokens=12, ignore_eos=True)
    with make_llm(tiny_models["qwen3"], True, max_num_tokens=32, max_batch_size=4) as a, \
            make_llm(tiny_models["qwen3"], True, max_num_tokens=32, max_batch_size=4,
                     scheduler_config={"max_prefill_tokens_while_decoding": 3}) as b:
        assert run(b, ps, sps) == run(a, ps, sps)
        integrity(b)
        steps = [llm._executor.stats()[0]["iteration"] for llm in (a, b)]
        assert steps[1] > steps[0], steps      # the cap spread the prompts over more steps
    with pytest.raises(ValueError, match="max_prefill_tokens_while_decoding"):
        make_llm(tiny_models["qwen3"], True, scheduler_config={"max_prefill_tokens_while_decoding": 0})


def test_preemption_equal(tiny_models):
    ps = prompts(10, seed=4)
    sps = SamplingParams(max_tokens=14, ignore_eos=True)
    kw = dict(kv={"tokens_per_block": 8, "max_tokens": 96},
              scheduler_config={"capacity_scheduler_policy": "MAX_UTILIZATION"})
    with make_llm(tiny_models["mistral"], False, **kw) as a, make_llm(tiny_models["mistral"], True, **kw) as b:
        assert run(b, ps, sps) == run(a, ps, sps)
        assert b._executor.stats()[0]["num_preemptions"] > 0
        integrity(b)


def test_penalties_and_seeds_equal(pair):
    sync, ovl = pair
    ps = prompts(6, seed=5)
    sps = [SamplingParams(max_tokens=10, temperature=0.8, seed=i, ignore_eos=True) for i in range(3)] + \
          [SamplingParams(max_tokens=10, repetition_penalty=1.5, presence_penalty=0.5, ignore_eos=True,
                          min_tokens=3) for _ in range(3)]
    assert run(ovl, ps, sps) == run(sync, ps, sps)
    integrity(ovl)


def test_abort_mid_flight_leaves_the_rest_exact(pair):
    sync, ovl = pair
    ps = prompts(12, seed=6)
    sp = SamplingParams(max_tokens=30, ignore_eos=True)
    want = run(sync, ps, sp)
    futs = [ovl.generate_async(p, sp, streaming=True) for p in ps]
    for i in (0, 5, 7):
        next(iter(futs[i]))
        futs[i].abort()
    for i, f in enumerate(futs):
        out = f.result(timeout=60).outputs[0]
        if i in (0, 5, 7):
            assert out.finish_reason in ("abort", "length")
            assert out.token_ids == want[i][0][:len(out.token_ids)]
        else:
            assert (out.token_ids, out.finish_reason) == want[i]
    integrity(ovl)


def test_stop_strings_equal_with_the_real_model():
    with LLM(orchestrator_type="inprocess", disable_overlap_scheduler=True) as a:
        prompt = a.apply_chat_template([{"role": "user", "content": "Describe a forest in two sentences."}])
        full = a.generate(prompt, SamplingParams(max_tokens=40), use_tqdm=False).outputs[0].text
        stop = full[len(full) // 2:len(full) // 2 + 5]
        want = a.generate([prompt] * 3, SamplingParams(max_tokens=40, stop=stop), use_tqdm=False)
    with LLM(orchestrator_type="inprocess", disable_overlap_scheduler=False) as b:
        got = b.generate([prompt] * 3, SamplingParams(max_tokens=40, stop=stop), use_tqdm=False)
        assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want] == [full[:full.find(stop)]] * 3
        integrity(b)
