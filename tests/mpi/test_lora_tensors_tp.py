"""An adapter added from a trainer's tensors under TP=2 (mpirun, gloo on CPU): both ranks map the
same shared-memory segment and take their own rows or columns, as from a directory. Greedy tokens
equal PEFT's, before and after the adapter is replaced under its id; an adapter that one rank
cannot take is refused on both, and the engine goes on."""

import pytest
import torch

from hf_reference import LORA_TARGETS, assert_same_greedy, hf_greedy, peft_policy, peft_state, scale_lora_b
from phalanx import LLM, LoRARequest, SamplingParams

pytestmark = pytest.mark.mpi


def test_tp2_an_adapter_added_from_tensors_and_replaced_equals_peft(tiny_models, hf_models):
    hf = hf_models["llama"]
    model = peft_policy(hf, 8, LORA_TARGETS, 41)
    g = torch.Generator().manual_seed(4)
    ps = [torch.randint(0, hf.config.vocab_size, (n,), generator=g).tolist() for n in (3, 19)]
    sp = SamplingParams(max_tokens=10, ignore_eos=True)
    with LLM(tiny_models["llama"], tensor_parallel_size=2, skip_tokenizer_init=True, max_num_tokens=24,
             kv_cache_config={"tokens_per_block": 8}, lora_config={"max_loras": 2, "max_lora_rank": 8}) as llm:
        for version in range(2):
            if version:
                scale_lora_b(model, -0.5)
            tensors, cfg = peft_state(model)
            llm.add_lora(LoRARequest("policy", 9), tensors=tensors, peft_config=cfg)
            outs = llm.generate(ps, sp, use_tqdm=False, lora_request=LoRARequest("policy", 9))
            for p, out in zip(ps, outs, strict=True):
                ref, gaps = hf_greedy(model, p, 10)
                assert_same_greedy(out.outputs[0].token_ids, ref, gaps, f"TP=2 version {version} prompt of {len(p)}")
        with pytest.raises(ValueError, match="max_lora_rank"):
            big, big_cfg = peft_state(peft_policy(hf, 16, ["q_proj"], 42))
            llm.add_lora(LoRARequest("big", 10), tensors=big, peft_config=big_cfg)
        assert llm.list_loras() == {9}
        ref, gaps = hf_greedy(hf, ps[0], 10)
        assert_same_greedy(llm.generate(ps[0], sp, use_tqdm=False).outputs[0].token_ids, ref, gaps, "base after")
        assert llm._executor.check_integrity() == ["ok", "ok"]
