"""LoRA adapters with speculative decoding (CPU, fp32): requests of two adapters and of none,
batched, their verify rows' draft positions through each token's adapter: greedy tokens equal
PEFT's models (so the engine's without speculation), for the NGram proposer and for a draft model
equal to the target (which proposes the base model's tokens: the requests without an adapter
accept drafts, those with one reject where their adapter changes the token). (LoRA's kernels
take a verify step's tokens as any step's: ``tests/gpu/test_gpu_lora_grouped.py`` runs them.)"""

import pytest
import torch

from hf_reference import LORA_TARGETS, assert_same_greedy, hf_greedy, save_lora_adapter
from phalanx import LLM, LoRARequest, SamplingParams

NEW = 10


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_speculative_greedy_with_adapters_equals_peft(proposer, tiny_models, hf_models, tmp_path):
    hf = hf_models["llama"]
    refs = {None: hf, "a": save_lora_adapter(hf, tmp_path / "a", 8, LORA_TARGETS, 81),
            "b": save_lora_adapter(hf, tmp_path / "b", 4, ["k_proj", "o_proj", "up_proj", "down_proj"], 82)}
    ids = {"a": 1, "b": 2}
    g = torch.Generator().manual_seed(4)
    ps = [torch.randint(0, 256, (int(n),), generator=g).tolist() for n in (3, 9, 17)] + [[5, 6, 7, 8] * 6]
    batch = [(p, name) for p in ps for name in refs]
    spec = ({"decoding_type": "NGram", "max_draft_len": 3, "max_matching_ngram_size": 3} if proposer == "ngram"
            else {"decoding_type": "DraftTarget", "max_draft_len": 3, "speculative_model_dir": tiny_models["llama"]})
    with LLM(tiny_models["llama"], skip_tokenizer_init=True, orchestrator_type="inprocess",
             kv_cache_config={"tokens_per_block": 8}, lora_config={"max_loras": 2, "max_lora_rank": 8},
             speculative_config=spec) as llm:
        for round_ in range(2):   # the second round hits each adapter's own prefix cache
            outs = llm.generate([p for p, _ in batch], SamplingParams(max_tokens=NEW, ignore_eos=True),
                                use_tqdm=False,
                                lora_request=[LoRARequest(n, ids[n], str(tmp_path / n)) if n else None
                                              for _, n in batch])
            for (p, name), out in zip(batch, outs, strict=True):
                ref, gaps = hf_greedy(refs[name], p, NEW)
                assert_same_greedy(out.outputs[0].token_ids, ref, gaps, f"{proposer} adapter {name} round {round_}")
        s = llm._executor.engine.stats()
    assert s["spec_verify_rows"] > 0
    if proposer == "draft":   # the base model's drafts: accepted for requests without an adapter, not all for others
        assert 0 < s["spec_accepted_drafts"] < s["spec_draft_tokens"]
