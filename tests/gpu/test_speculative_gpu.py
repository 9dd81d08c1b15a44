"""GPU-only: speculative decoding on CUDA — greedy tokens equal transformers (fp32) and equal
plain decoding with CUDA graphs on (verify steps replay extend graphs) and off. Skipped without CUDA."""

import pytest
import torch

from hf_reference import assert_same_greedy, hf_greedy
from phalanx import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def prompts(vocab, n=10, seed=3):
    g = torch.Generator().manual_seed(seed)
    out = [torch.randint(0, vocab, (int(torch.randint(1, 50, (1,), generator=g)),), generator=g).tolist()
           for _ in range(n)]
    return out + [[100] * 10, [5, 6, 7, 8] * 5]


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_gpu_speculative_greedy_equals_transformers_fp32(proposer, tiny_models, hf_models):
    hf = hf_models["llama"].to("cuda")
    ps = prompts(hf.config.vocab_size)
    spec = ({"decoding_type": "NGram", "max_draft_len": 4, "adaptive": False} if proposer == "ngram" else
            {"decoding_type": "DraftTarget", "max_draft_len": 4, "speculative_model_dir": tiny_models["llama"],
             "adaptive": False})
    with LLM(tiny_models["llama"], skip_tokenizer_init=True, dtype="float32", orchestrator_type="inprocess",
             speculative_config=spec) as llm:
        outs = llm.generate(ps, SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
        single = llm.generate(ps[-2:-1], SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
        stats = llm._executor.engine.stats()
        assert stats["num_extend_graph_steps"] > 0          # batch-1 verify steps replayed extend graphs
        llm._executor.engine.scheduler.kv.check_integrity()
    for i, (p, o) in enumerate(zip(ps, outs, strict=True)):
        ref, gaps = hf_greedy(hf, p, 16)
        assert_same_greedy(o.outputs[0].token_ids, ref, gaps, f"{proposer} prompt {i}")
    assert single[0].outputs[0].token_ids == outs[-2].outputs[0].token_ids
    assert 0 < stats["spec_accepted_drafts"] <= stats["spec_draft_tokens"]
    hf.to("cpu")


def test_speculative_with_graphs_equals_plain_eager(tiny_models):
    """fp32: the verify step's extend kernels and the decode kernels round alike enough. Drafts
    on every step (graphs on and off) and adaptive (steps without drafts replay decode graphs,
    their rows mixed with plain ones)."""
    ps = prompts(256, n=14, seed=5)
    # every third request asks for logprobs: it decodes plainly, batched with speculative rows
    sp = [SamplingParams(max_tokens=6 + i % 11, ignore_eos=True, logprobs=1 if i % 3 == 0 else None)
          for i in range(len(ps))]
    ngram = {"decoding_type": "NGram", "max_draft_len": 3, "adaptive": False}
    runs = {"plain eager": (None, False), "drafts graphs": (ngram, True), "drafts eager": (ngram, False),
            "adaptive graphs": ({**ngram, "adaptive": True}, True)}
    out = {}
    for name, (spec, graphs) in runs.items():
        cfg = {"batch_sizes": [1, 2, 4, 8, 16]} if graphs else None
        with LLM(tiny_models["qwen3"], skip_tokenizer_init=True, dtype="float32", orchestrator_type="inprocess",
                 cuda_graph_config=cfg, speculative_config=spec) as llm:
            batched = [o.outputs[0].token_ids for o in llm.generate(ps, sp, use_tqdm=False)]
            # one at a time: batch-1 verify steps (extend graphs when on)
            alone = [llm.generate([p], s, use_tqdm=False)[0].outputs[0].token_ids
                     for p, s in zip(ps[:4], sp[:4], strict=True)]
            out[name] = (batched, alone)
            if graphs:
                assert llm._executor.engine.stats()["num_graph_steps"] > 0
    assert all(v == out["plain eager"] for v in out.values()), [k for k, v in out.items() if v != out["plain eager"]]
