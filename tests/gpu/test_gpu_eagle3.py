"""GPU-only: EAGLE-3 speculative decoding on CUDA (fp32), with CUDA graphs on and off. The
target's captured hidden states are written inside the graphs: extend graphs for batch-1 verify
steps, decode graphs for steps without drafts, piecewise graphs for prompt chunks. A head trained
to predict the target has as many drafts accepted with graphs as without, greedy tokens equal
transformers', and every entry of the head the prefix cache keeps equals the reference head's.
Skipped without CUDA."""

import pytest
import torch

from eagle3_reference import assert_cached_entries, prompts, target_config, train_head, write_head
from hf_reference import assert_same_greedy, hf_greedy, tiny_model_dirs
from phalanx import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GRAPHS = {"batch_sizes": [1, 2, 4, 8]}
RUNS = {   # name: (LLM arguments, adaptive)
    "eager": ({"cuda_graph_config": None}, False),
    "graphs": ({"cuda_graph_config": GRAPHS}, False),
    "graphs adaptive": ({"cuda_graph_config": GRAPHS}, True),
    # prompt chunks of 16 through piecewise graphs (no extend graphs), drafts off while 2+ decode
    "piecewise": ({"cuda_graph_config": {**GRAPHS, "extend_num_tokens": [], "piecewise_num_tokens": [16]},
                   "max_num_tokens": 16}, False),
}


def test_gpu_eagle3_graphs_accept_what_eager_accepts_and_entries_equal_the_reference(tmp_path_factory):
    from transformers import AutoModelForCausalLM
    path = tiny_model_dirs(lambda name: tmp_path_factory.mktemp(name), {"target4": target_config()}, seed=77)["target4"]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tensors = train_head(hf)
    head = write_head(tmp_path_factory.mktemp("head"), tensors, draft_vocab_size=None)
    ps = prompts(hf.config.vocab_size)
    refs = [hf_greedy(hf, p, 20) for p in ps]
    accepted = {}
    for name, (kw, adaptive) in RUNS.items():
        with LLM(path, skip_tokenizer_init=True, dtype="float32", orchestrator_type="inprocess",
                 kv_cache_config={"tokens_per_block": 16},
                 speculative_config={"decoding_type": "Eagle3", "max_draft_len": 3, "speculative_model_dir": head,
                                     "adaptive": adaptive}, **kw) as llm:
            params = SamplingParams(max_tokens=20, ignore_eos=True)
            # one at a time first (batch-1 verify steps; the 40-token prompt's first chunks hold no
            # speculative row: piecewise graphs where asked), then batched (prefix hits)
            alone = [llm.generate([p], params, use_tqdm=False)[0] for p in ps]
            outs = llm.generate(ps, params, use_tqdm=False)
            s = llm._executor.engine.stats()
            checked = sum(assert_cached_entries(llm, hf, tensors, p + o.outputs[0].token_ids, tol=2e-3)
                          for p, o in zip(ps, outs, strict=True))
        assert checked >= 64, name
        for out in list(outs) + alone:
            ref, gaps = refs[ps.index(out.prompt_token_ids)]
            assert_same_greedy(out.outputs[0].token_ids, ref, gaps, name)
        if name.startswith("graphs"):
            assert s["num_graph_steps"] + s["num_extend_graph_steps"] > 0, name
        if name == "piecewise":
            assert s["num_piecewise_steps"] > 0
        accepted[name] = (s["spec_accepted_drafts"], s["spec_draft_tokens"])
        assert s["spec_accepted_drafts"] > 0.25 * s["spec_draft_tokens"], name
    assert accepted["graphs"] == accepted["eager"]
