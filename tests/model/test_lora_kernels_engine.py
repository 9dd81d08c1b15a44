"""The engine with LoRA's decode kernels on (``PHALANX_LORA_KERNELS=1``: on the CPU they run in
Triton's interpreter; a GPU takes them by default): requests of several adapters and of none in one
batch equal PEFT's greedy tokens, the prompts through the dense form, each decode step through the
kernels."""

import pytest
import torch

from hf_reference import LORA_TARGETS, assert_same_greedy, hf_greedy, save_lora_adapter
from phalanx import LLM, LoRARequest, SamplingParams

pytest.importorskip("triton")


def test_decode_steps_through_the_kernels_equal_peft(tiny_models, hf_models, tmp_path, monkeypatch):
    monkeypatch.setenv("PHALANX_LORA_KERNELS", "1")
    hf = hf_models["llama"]
    refs = {None: hf, "all": save_lora_adapter(hf, tmp_path / "all", 8, LORA_TARGETS, 51),
            "some": save_lora_adapter(hf, tmp_path / "some", 4, ["v_proj", "o_proj", "gate_proj", "down_proj"], 52)}
    ids = {"all": 1, "some": 2}
    g = torch.Generator().manual_seed(9)
    batch = [(torch.randint(0, 256, (n,), generator=g).tolist(), name) for n in (4, 13) for name in refs]
    with LLM(tiny_models["llama"], skip_tokenizer_init=True, orchestrator_type="inprocess", max_num_tokens=64,
             kv_cache_config={"tokens_per_block": 8}, lora_config={"max_loras": 2, "max_lora_rank": 8}) as llm:
        state = llm._executor.engine.runner.model.lora
        assert state.kernels and state.kernel_rows >= len(batch)
        outs = llm.generate([p for p, _ in batch], SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False,
                            lora_request=[LoRARequest(n, ids[n], str(tmp_path / n)) if n else None for _, n in batch])
    for (p, name), out in zip(batch, outs, strict=True):
        ref, gaps = hf_greedy(refs[name], p, 6)
        assert_same_greedy(out.outputs[0].token_ids, ref, gaps, f"adapter {name} prompt of {len(p)}")
