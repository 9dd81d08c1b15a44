"""GPU-only: sleep really gives the device memory back (seen from another process through
cudaMemGetInfo), and after wake_up + a weight update the engine generates exactly what a fresh
engine on the new weights generates — CUDA graphs recaptured, weights from disk or from this
process's CUDA tensors through CUDA IPC. Skipped without CUDA."""

import pytest
import torch

from hf_reference import _configs, tiny_model_dirs
from phalanx import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SP = SamplingParams(max_tokens=16, ignore_eos=True)
KV = {"free_gpu_memory_fraction": 0.3}
GRAPHS = {"batch_sizes": [1, 2, 4, 8]}


def prompts(vocab, n=6):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (int(torch.randint(4, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return tiny_model_dirs(lambda tag: tmp_path_factory.mktemp(f"gpu-rollout-{tag}"),
                           {"a": _configs()["llama"], "b": _configs()["llama"]}, seed=21)


def engine(path):
    return LLM(path, skip_tokenizer_init=True, dtype="bfloat16", kv_cache_config=KV, cuda_graph_config=GRAPHS)


def generate(llm, ps):
    return [o.outputs[0].token_ids for o in llm.generate(ps, SP, use_tqdm=False)]


@pytest.fixture(scope="module")
def fresh_b(checkpoints):
    """What a fresh engine on checkpoint b generates."""
    with engine(checkpoints["b"]) as llm:
        return generate(llm, prompts(256))


def free_bytes():
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_returns_the_memory_and_wake_update_generate_equals_a_fresh_engine(level, checkpoints, fresh_b):
    ps = prompts(256)
    before_start = free_bytes()
    with engine(checkpoints["a"]) as llm:
        used = before_start - free_bytes()
        assert used > 2**30                                  # the KV pool alone is 30% of the GPU
        tokens_a = generate(llm, ps)
        llm.sleep(level)
        returned = free_bytes() - (before_start - used)
        print(f"level {level}: engine {used / 2**30:.2f} GiB, returned {returned / 2**30:.2f} GiB "
              f"({returned / used:.1%})")
        assert returned >= 0.9 * used
        if level == 1:
            llm.wake_up()
            assert free_bytes() <= before_start - 0.9 * used    # the memory is the engine's again
            assert generate(llm, ps) == tokens_a             # same weights, graphs recaptured
            # new weights from this process's CUDA tensors (CUDA IPC, nothing pickled)
            from safetensors.torch import load_file
            state = load_file(f"{checkpoints['b']}/model.safetensors", device="cuda")
            assert llm.update_weights_from_tensors(state.items(), weight_version="ipc") == "ipc"
            del state
        else:
            llm.wake_up(["weights"])
            assert llm.update_weights_from_disk(checkpoints["b"], weight_version="disk") == "disk"
            llm.wake_up(["kv_cache"])
        outs = llm.generate(ps, SP, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == fresh_b
        assert {o.weight_version for o in outs} == {"ipc" if level == 1 else "disk"}
        assert llm.check_integrity() == ["ok"]
