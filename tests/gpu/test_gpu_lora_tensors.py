"""GPU-only: an adapter added from a trainer's CUDA tensors (PEFT's state dict on the GPU, opened
by the rank through CUDA IPC, the engine in its own process), replaced under its id, and its slots
given back by sleep: greedy tokens equal PEFT's on the GPU each time."""

import pytest
import torch

from hf_reference import LORA_TARGETS, assert_same_greedy, hf_greedy, peft_policy, peft_state, scale_lora_b
from phalanx import LLM, LoRARequest, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_an_adapter_from_cuda_tensors_equals_peft_before_and_after_a_replacement_and_a_sleep(tiny_models, hf_models):
    model = peft_policy(hf_models["llama"], 8, LORA_TARGETS, 61).to("cuda")
    g = torch.Generator().manual_seed(7)
    ps = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 37)]
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    try:
        with LLM(tiny_models["llama"], skip_tokenizer_init=True, dtype="float32",
                 lora_config={"max_loras": 2, "max_lora_rank": 8}) as llm:
            for round_ in range(3):
                if round_ == 1:
                    scale_lora_b(model, -0.5)         # the trainer's next policy, under the same id
                if round_ < 2:
                    tensors, cfg = peft_state(model)
                    assert all(t.is_cuda for t in tensors.values())
                    llm.add_lora(LoRARequest("policy", 3), tensors=tensors, peft_config=cfg)
                else:
                    llm.sleep(level=1)
                    llm.wake_up()
                outs = llm.generate(ps, sp, use_tqdm=False, lora_request=LoRARequest("policy", 3))
                for p, out in zip(ps, outs, strict=True):
                    ref, gaps = hf_greedy(model, p, 8)
                    assert_same_greedy(out.outputs[0].token_ids, ref, gaps, f"round {round_}, prompt of {len(p)}")
    finally:
        model.to("cpu")
