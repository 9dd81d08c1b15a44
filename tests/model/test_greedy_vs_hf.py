"""Batched greedy generation through LLM equals transformers, token for token, with prefix
reuse on/off, chunked prefill forced/not and preemption forced/not."""

import itertools

import pytest
import torch

from hf_reference import assert_same_greedy, hf_greedy
from phalanx import LLM, SamplingParams

NEW_TOKENS = 10


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(0, vocab, (40,), generator=g).tolist()
    out = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (1, 3, 9, 17, 33, 50)]
    out += [shared + [5, 6, 7], shared + [8]]          # share 40 tokens (reuse within the batch)
    return out


COMBOS = list(itertools.product([True, False], [True, False], [True, False]))


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("reuse,chunked,preempt", COMBOS,
                         ids=[f"reuse{int(a)}-chunk{int(b)}-preempt{int(c)}" for a, b, c in COMBOS])
def test_batched_greedy_equals_transformers(kind, reuse, chunked, preempt, tiny_models, hf_models):
    hf = hf_models[kind]
    ps = prompts(hf.config.vocab_size)
    refs = [hf_greedy(hf, p, NEW_TOKENS) for p in ps]
    kv_cfg = {"enable_block_reuse": reuse, "tokens_per_block": 8}
    extra = {}
    if preempt:   # a pool far smaller than the batch needs, with recompute on preemption
        kv_cfg["max_tokens"] = 96
        extra["scheduler_config"] = {"capacity_scheduler_policy": "MAX_UTILIZATION"}
    llm = LLM(tiny_models[kind], skip_tokenizer_init=True, kv_cache_config=kv_cfg, orchestrator_type="inprocess",
              max_num_tokens=16 if chunked else 512, **extra)
    try:
        # twice: the second round hits the prefix cache left by the first
        for round_ in range(2):
            outs = llm.generate(ps, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)
            for i, (out, (ref, gaps)) in enumerate(zip(outs, refs, strict=True)):
                assert_same_greedy(out.outputs[0].token_ids, ref, gaps, f"{kind} prompt {i} round {round_}")
            if reuse and not preempt and round_ == 1:
                assert all(o.cached_tokens == len(p) - 1 for o, p in zip(outs, ps, strict=True)), \
                    [o.cached_tokens for o in outs]
            if not reuse:
                assert all(o.cached_tokens == 0 for o in outs)
        engine = llm._executor.engine
        if preempt:
            assert engine.scheduler.num_preemptions > 0
        engine.scheduler.kv.check_integrity()
    finally:
        llm.shutdown()
