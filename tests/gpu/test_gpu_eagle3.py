"""GPU-only: EAGLE-3 speculative decoding on CUDA (fp32), with CUDA graphs on and off. The
target's captured hidden states are written inside the graphs (decode graphs for steps without
drafts, extend graphs for batch-1 verify steps, piecewise graphs for prompts): a head trained to
predict the target has as many drafts accepted with graphs as without, and greedy tokens equal
transformers'. Skipped without CUDA."""

import pytest
import torch

from eagle3_reference import prompts, target_config, train_head, write_head
from hf_reference import assert_same_greedy, hf_greedy, tiny_model_dirs
from phalanx import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_gpu_eagle3_graphs_accept_what_eager_accepts_and_tokens_equal_transformers(tmp_path_factory):
    from transformers import AutoModelForCausalLM
    path = tiny_model_dirs(lambda name: tmp_path_factory.mktemp(name), {"target4": target_config()}, seed=77)["target4"]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    head = write_head(tmp_path_factory.mktemp("head"), train_head(hf), draft_vocab_size=None)
    ps = prompts(hf.config.vocab_size)
    refs = [hf_greedy(hf, p, 20) for p in ps]
    seen = {}
    for name, graphs, adaptive in (("eager", None, False), ("graphs", {"batch_sizes": [1, 2, 4, 8]}, False),
                                   ("graphs adaptive", {"batch_sizes": [1, 2, 4, 8]}, True)):
        with LLM(path, skip_tokenizer_init=True, dtype="float32", orchestrator_type="inprocess",
                 cuda_graph_config=graphs, kv_cache_config={"tokens_per_block": 16},
                 speculative_config={"decoding_type": "Eagle3", "max_draft_len": 3, "speculative_model_dir": head,
                                     "adaptive": adaptive}) as llm:
            params = SamplingParams(max_tokens=20, ignore_eos=True)
            outs = llm.generate(ps, params, use_tqdm=False)
            alone = [llm.generate([p], params, use_tqdm=False)[0] for p in ps]      # batch-1 verify steps
            s = llm._executor.engine.stats()
        for out in list(outs) + alone:
            ref, gaps = refs[ps.index(out.prompt_token_ids)]
            assert_same_greedy(out.outputs[0].token_ids, ref, gaps, name)
        if graphs:
            assert s["num_graph_steps"] + s["num_extend_graph_steps"] > 0
        seen[name] = (s["spec_accepted_drafts"], s["spec_draft_tokens"])
        assert s["spec_accepted_drafts"] > 0.25 * s["spec_draft_tokens"], name
    assert seen["graphs"] == seen["eager"]
