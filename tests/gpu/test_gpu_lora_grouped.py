"""GPU-only: LoRA's grouped kernels inside CUDA graphs. A decode graph of 64 rows replays steps
of 48 to fewer rows (its padding in no tile) mixing two adapters and none, extend and piecewise
graphs take prompts of up to 128 tokens: PEFT's greedy tokens. The 64-row graph holds the
grouped kernels (more rows than ``triton_lora.MAX_ROWS``, at most ``GROUPED_ROWS``)."""

import pytest
import torch

from hf_reference import LORA_TARGETS, assert_adapters_greedy, save_lora_adapter
from phalanx import LLM, LoRARequest, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_wide_decode_graphs_with_mixed_adapters_equal_peft(tiny_models, hf_models, tmp_path):
    from phalanx.kernels import triton_lora
    hf = hf_models["llama"]
    refs = {None: hf, "a": save_lora_adapter(hf, tmp_path / "a", 8, LORA_TARGETS, 41),
            "b": save_lora_adapter(hf, tmp_path / "b", 4, ["k_proj", "o_proj", "gate_proj", "down_proj"], 42)}
    g = torch.Generator().manual_seed(8)
    ps = [torch.randint(0, 256, (int(n),), generator=g).tolist() for n in torch.randint(1, 40, (16,), generator=g)]
    batch = [(p, name) for p in ps for name in refs]   # 48 requests
    ids = {"a": 1, "b": 2}
    graph_cfg = {"batch_sizes": [1, 8, 16, 32, 64], "extend_num_tokens": [32, 64], "extend_max_seqs": 4,
                 "piecewise_num_tokens": [64, 128]}
    with LLM(tiny_models["llama"], skip_tokenizer_init=True, dtype="float32", orchestrator_type="inprocess",
             lora_config={"max_loras": 2, "max_lora_rank": 8}, max_num_tokens=128,
             cuda_graph_config=graph_cfg) as llm:
        state = llm._executor.engine.runner.model.lora
        assert state.kernel_rows < 64 <= state.grouped_rows == triton_lora.GROUPED_ROWS
        sps = [SamplingParams(max_tokens=2 + i % 9, ignore_eos=True) for i in range(len(batch))]
        loras = [LoRARequest(n, ids[n], str(tmp_path / n)) if n else None for _, n in batch]
        outs = llm.generate([p for p, _ in batch], sps, use_tqdm=False, lora_request=loras)
        assert llm._executor.engine.runner.num_graph_steps > 0
    assert_adapters_greedy(refs, [(f"adapter {name} prompt {i}", p, name, out.outputs[0].token_ids, sp.max_tokens)
                                  for i, ((p, name), sp, out) in enumerate(zip(batch, sps, outs, strict=True))])


def test_speculative_verify_steps_with_adapters_in_graphs_equal_peft(tiny_models, hf_models, tmp_path):
    """Speculative decoding with a draft equal to the target, adapters on some requests: the
    verify steps (k + 1 tokens a row, through LoRA's kernels inside the graphs) give PEFT's
    greedy tokens."""
    hf = hf_models["llama"]
    refs = {None: hf, "a": save_lora_adapter(hf, tmp_path / "a", 8, LORA_TARGETS, 43)}
    g = torch.Generator().manual_seed(9)
    ps = [torch.randint(0, 256, (int(n),), generator=g).tolist() for n in torch.randint(1, 30, (12,), generator=g)]
    batch = [(p, name) for p in ps for name in refs]
    spec = {"decoding_type": "DraftTarget", "max_draft_len": 3, "speculative_model_dir": tiny_models["llama"]}
    with LLM(tiny_models["llama"], skip_tokenizer_init=True, dtype="float32", orchestrator_type="inprocess",
             lora_config={"max_loras": 1, "max_lora_rank": 8}, max_num_tokens=128, speculative_config=spec,
             cuda_graph_config={"batch_sizes": [1, 8, 16, 32]}) as llm:
        sps = [SamplingParams(max_tokens=4 + i % 6, ignore_eos=True) for i in range(len(batch))]
        outs = llm.generate([p for p, _ in batch], sps, use_tqdm=False,
                            lora_request=[LoRARequest(n, 1, str(tmp_path / n)) if n else None for _, n in batch])
        assert llm._executor.engine.stats()["spec_accepted_drafts"] > 0
    assert_adapters_greedy(refs, [(f"adapter {name} prompt {i}", p, name, out.outputs[0].token_ids, sp.max_tokens)
                                  for i, ((p, name), sp, out) in enumerate(zip(batch, sps, outs, strict=True))])
