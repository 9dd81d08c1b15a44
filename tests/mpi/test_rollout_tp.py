"""The RL hand-off under mpirun with TP=2 (gloo on CPU): every rank takes its shard of new
weights from disk, from a trainer process's group and from this process's tensors (shared
memory), at the same iteration; greedy tokens equal transformers on the new weights."""

import multiprocessing as mp

import pytest
import torch

from hf_reference import _configs, assert_same_greedy, hf_greedy, hf_models_from, tiny_model_dirs
from phalanx import LLM, SamplingParams
from serve_helpers import free_port

pytestmark = pytest.mark.mpi

PROMPTS = [list(range(5, 45)), [7, 3, 9]]
SP = SamplingParams(max_tokens=8, ignore_eos=True)


def _trainer(port, state_dir, results):
    try:
        from transformers import AutoModelForCausalLM

        from phalanx.llmapi.weight_transfer import TrainerGroup
        model = AutoModelForCausalLM.from_pretrained(state_dir, dtype=torch.float32)
        group = TrainerGroup("127.0.0.1", port, world_size=3, backend="gloo", timeout=120)
        group.send(list(model.state_dict().items()), bucket_bytes=100_000)
        results.put("sent")
    except Exception as e:
        results.put(repr(e))


def check(llm, hf, what):
    outs = llm.generate(PROMPTS, SP, use_tqdm=False)
    for p, out in zip(PROMPTS, outs, strict=True):
        ref, gaps = hf_greedy(hf, p, 8)
        assert_same_greedy(out.outputs[0].token_ids, ref, gaps, what)
    return outs


def test_tp2_updates_from_disk_a_trainer_group_and_shared_tensors(tmp_path):
    dirs = tiny_model_dirs(lambda tag: tmp_path / tag, {"a": _configs()["qwen3"], "b": _configs()["qwen3"]}, seed=21)
    hf = hf_models_from(dirs)
    with LLM(dirs["a"], tensor_parallel_size=2, skip_tokenizer_init=True, mpi_private_network=False,
             kv_cache_config={"tokens_per_block": 8}) as llm:
        check(llm, hf["a"], "TP=2 before")
        llm.update_weights_from_disk(dirs["b"], weight_version="b")
        outs = check(llm, hf["b"], "TP=2 after an update from disk")
        assert all(o.weight_version == "b" and o.cached_tokens == 0 for o in outs)
        port = free_port()
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        proc = ctx.Process(target=_trainer, args=(port, dirs["a"], results), daemon=True)
        proc.start()
        try:
            llm.init_weights_update_group("127.0.0.1", port, rank_offset=1, world_size=3, timeout=120)
            state = hf["a"].state_dict()
            llm.update_weights_from_distributed(list(state), ["float32"] * len(state),
                                                [list(t.shape) for t in state.values()], bucket_bytes=100_000)
            assert results.get(timeout=60) == "sent"
        finally:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
        outs = check(llm, hf["a"], "TP=2 from the trainer's group")
        assert all(o.weight_version == "2" for o in outs)
        assert llm.update_weights_from_tensors(hf["b"].state_dict().items(), weight_version="shm") == "shm"
        outs = check(llm, hf["b"], "TP=2 from this process's tensors")
        assert all(o.weight_version == "shm" for o in outs)
        assert llm.check_integrity() == ["ok", "ok"]


def test_a_trainer_group_is_refused_only_where_the_ranks_are_really_private(tiny_models, monkeypatch):
    with LLM(tiny_models["llama"], skip_tokenizer_init=True) as llm:         # private by default
        assert llm._executor.private_network
        with pytest.raises(ValueError, match="private network namespace"):
            llm.init_weights_update_group("127.0.0.1", free_port(), 1, 2, timeout=1)
    monkeypatch.setenv("PHALANX_MPI_NETNS", "0")                             # asked for, not used
    with LLM(tiny_models["llama"], skip_tokenizer_init=True) as llm:
        assert not llm._executor.private_network
        with pytest.raises(RuntimeError):                                     # tried: nobody listens there
            llm.init_weights_update_group("127.0.0.1", free_port(), 1, 2, timeout=1)
