"""GPU-only: LoRA adapters inside CUDA graphs. The token-to-slot mask is written before each
step, outside the graphs, into buffers the graphs read: decode, extend and piecewise graphs of
batches mixing two adapters and none give PEFT's greedy tokens, as the same engine run eagerly."""

import pytest
import torch

from hf_reference import LORA_TARGETS, assert_adapters_greedy, save_lora_adapter
from phalanx import LLM, LoRARequest, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_mixed_adapters_in_cuda_graphs_equal_peft(graphs, tiny_models, hf_models, tmp_path):
    hf = hf_models["llama"]
    refs = {None: hf, "a": save_lora_adapter(hf, tmp_path / "a", 8, LORA_TARGETS, 31),
            "b": save_lora_adapter(hf, tmp_path / "b", 4, ["q_proj", "v_proj", "down_proj"], 32)}
    g = torch.Generator().manual_seed(6)
    # one long shared prefix: later requests hit their own adapter's cache and extend it
    shared = torch.randint(0, 256, (40,), generator=g).tolist()
    ps = [torch.randint(0, 256, (int(n),), generator=g).tolist() for n in torch.randint(1, 50, (9,), generator=g)]
    ps += [shared + [1, 2], shared + [3]]
    batch = [(p, name) for p in ps for name in refs]
    graph_cfg = ({"batch_sizes": [1, 2, 4, 8, 16, 32], "extend_num_tokens": [16, 32, 64], "extend_max_seqs": 4,
                  "piecewise_num_tokens": [64, 128]} if graphs else None)
    ids = {"a": 1, "b": 2}
    with LLM(tiny_models["llama"], skip_tokenizer_init=True, dtype="float32", orchestrator_type="inprocess",
             lora_config={"max_loras": 2, "max_lora_rank": 8}, max_num_tokens=128,
             cuda_graph_config=graph_cfg) as llm:   # (32-token blocks: the Triton attention, which graphs need)
        sps = [SamplingParams(max_tokens=3 + i % 7, ignore_eos=True) for i in range(len(batch))]
        loras = [LoRARequest(n, ids[n], str(tmp_path / n)) if n else None for _, n in batch]
        outs = [llm.generate([p for p, _ in batch], sps, use_tqdm=False, lora_request=loras) for _ in range(2)]
        runner = llm._executor.engine.runner
        if graphs:
            assert runner.num_graph_steps > 0 and runner.num_extend_graph_steps + runner.num_piecewise_steps > 0
    assert_adapters_greedy(refs, [(f"adapter {name} prompt {i} round {round_}", p, name, out.outputs[0].token_ids,
                                   sp.max_tokens) for round_, round_outs in enumerate(outs)
                                  for i, ((p, name), sp, out) in enumerate(zip(batch, sps, round_outs, strict=True))])
