"""The RL hand-off on one rank (CPU): weight updates from disk, from shared tensors and through
a trainer's gloo group equal transformers on the new weights; versions on every output; no
prefix computed with old weights is served; pause modes; sleep and wake up."""

import multiprocessing as mp
import time

import pytest
import torch

from hf_reference import _configs, assert_same_greedy, hf_greedy, hf_models_from, tiny_model_dirs
from phalanx import LLM, SamplingParams
from serve_helpers import free_port

PROMPT = list(range(5, 45))
SP = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Two tiny Llama checkpoints of one architecture (a, b) and their transformers models."""
    dirs = tiny_model_dirs(lambda tag: tmp_path_factory.mktemp(f"rollout-{tag}"),
                           {"a": _configs()["llama"], "b": _configs()["llama"]}, seed=11)
    return dirs, hf_models_from(dirs)


@pytest.fixture
def llm(checkpoints):
    dirs, _ = checkpoints
    with LLM(dirs["a"], skip_tokenizer_init=True, orchestrator_type="inprocess",
             kv_cache_config={"tokens_per_block": 8}) as engine:
        yield engine


def greedy(llm, prompt=PROMPT, sp=SP):
    return llm.generate(prompt, sp, use_tqdm=False)


def check_equals(out, hf, prompt=PROMPT, n=8, what=""):
    ref, gaps = hf_greedy(hf, prompt, n)
    assert_same_greedy(out.outputs[0].token_ids, ref, gaps, what)


def test_update_from_disk_reads_the_files_the_index_names(llm, checkpoints, tmp_path):
    """A checkpoint directory holding another .safetensors file beside those its index names
    (Mistral's repositories ship consolidated.safetensors): the update reads what the index
    names, as a load does, and serves those weights."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file
    dirs, hf = checkpoints
    shutil.copytree(dirs["b"], tmp_path / "b")
    names = load_file(f"{tmp_path}/b/model.safetensors")
    (tmp_path / "b" / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {n: "model.safetensors" for n in names}}))
    save_file({"layers.0.attention.wq.weight": torch.zeros(2, 2)}, f"{tmp_path}/b/consolidated.safetensors")
    llm.update_weights_from_disk(str(tmp_path / "b"))
    check_equals(greedy(llm), hf["b"], what="after an update from an indexed checkpoint")


def test_update_from_disk_serves_the_new_weights_with_their_version(llm, checkpoints):
    dirs, hf = checkpoints
    first = greedy(llm)
    check_equals(first, hf["a"], what="before")
    assert first.weight_version == "0" and first.outputs[0].weight_versions == [(0, "0")]
    assert greedy(llm).cached_tokens > 0                       # the prompt is cached now
    assert llm.update_weights_from_disk(dirs["b"]) == "1"       # a counter without a given version
    after = greedy(llm)
    check_equals(after, hf["b"], what="after an update from disk")
    assert after.cached_tokens == 0                             # KV of the old weights is not served
    assert after.weight_version == "1" and llm.weight_version == "1"
    assert llm.update_weights_from_disk(dirs["a"], weight_version="step-7") == "step-7"
    again = greedy(llm)
    check_equals(again, hf["a"], what="back to a")
    assert again.outputs[0].weight_versions == [(0, "step-7")]
    llm.check_integrity()


def test_update_from_tensors_whole_and_partial(llm, checkpoints):
    _, hf = checkpoints
    llm.update_weights_from_tensors(list(hf["b"].state_dict().items()), weight_version="b")
    check_equals(greedy(llm), hf["b"], what="from shared tensors")
    # a partial update: a's tensors of layer 1 only -> a model that is neither a nor b
    part = [(k, v) for k, v in hf["a"].state_dict().items() if ".layers.1." in k]
    llm.update_weights_from_tensors(part)
    mixed = {**hf["b"].state_dict(), **dict(part)}
    ref = type(hf["b"])(hf["b"].config).eval()
    ref.load_state_dict(mixed)
    check_equals(greedy(llm), ref, what="partial update")


@pytest.mark.parametrize("specs, field", [
    ([{"name": "model.layers.9.mlp.up_proj.weight", "dtype": "float32", "shape": [128, 64]}], "not a weight"),
    ([{"name": "model.layers.0.mlp.up_proj.weight", "dtype": "float32", "shape": [64, 128]}], "does not match"),
    ([{"name": "model.layers.0.mlp.up_proj.weight", "dtype": "int8", "shape": [128, 64]}], "dtype"),
    ([], "empty"),
])
def test_a_refused_update_changes_no_weight(llm, checkpoints, specs, field):
    _, hf = checkpoints
    before = greedy(llm).outputs[0].token_ids
    with pytest.raises(ValueError, match=field):
        llm.update_weights_from_tensors(specs)
    with pytest.raises(ValueError, match="not the same architecture|path"):
        llm.update_weights_from_disk("/nonexistent/checkpoint")
    assert greedy(llm).outputs[0].token_ids == before
    assert llm.weight_version == "0"


def test_a_checkpoint_missing_tensors_is_refused_and_a_dict_of_tensors_is_taken(llm, checkpoints, tmp_path):
    """An update from disk is the whole model: a checkpoint that lacks tensors (a half-written
    save) is refused by name before anything loads. Tensors may come as a {name: tensor} dict."""
    import shutil

    from safetensors.torch import load_file, save_file
    dirs, hf = checkpoints
    before = greedy(llm).outputs[0].token_ids
    version = llm.weight_version
    shutil.copytree(dirs["b"], tmp_path / "half")
    tensors = load_file(f"{tmp_path}/half/model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, f"{tmp_path}/half/model.safetensors")
    with pytest.raises(ValueError, match="lacks 1 of the model's tensors, e.g. model.layers.1.mlp.down_proj.weight"):
        llm.update_weights_from_disk(str(tmp_path / "half"))
    assert greedy(llm).outputs[0].token_ids == before and llm.weight_version == version
    llm.update_weights_from_tensors(dict(hf["b"].state_dict()), weight_version="dict")
    check_equals(greedy(llm), hf["b"], what="from a dict of tensors")


def test_a_request_aborted_before_its_first_token_reports_the_weights_serving(llm):
    """A request that ends without a token (aborted while it waited) still says which weights
    were serving, as every other output does."""
    llm.pause_generation("keep")          # nothing new starts
    try:
        waiting = llm.generate_async(PROMPT, SP)
        time.sleep(0.2)
        waiting.abort()
        out = waiting.result(timeout=30)
    finally:
        llm.continue_generation()
    assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "abort"
    assert out.weight_version == llm.weight_version != ""


def test_bad_tensors_are_refused_before_they_travel(llm):
    with pytest.raises(ValueError, match="tensor 'model.norm.weight': dtype torch.int64 cannot travel"):
        llm.update_weights_from_tensors([("model.norm.weight", torch.zeros(64, dtype=torch.int64))])
    with pytest.raises(ValueError, match="empty"):
        llm.update_weights_from_tensors([])


def _stream_until(fut, n):
    it = iter(fut)
    for out in it:
        if len(out.outputs[0].token_ids) >= n:
            return it
    raise AssertionError("the request ended early")


def test_pause_abort_returns_partial_tokens_and_a_resend_goes_on(llm, checkpoints):
    _, hf = checkpoints
    long = SamplingParams(max_tokens=400, ignore_eos=True)
    fut = llm.generate_async(PROMPT, long, streaming=True)
    _stream_until(fut, 3)
    llm.pause_generation("abort")
    out = fut.result(timeout=30)
    got = out.outputs[0].token_ids
    assert out.outputs[0].finish_reason == "abort" and 3 <= len(got) < 400
    waiting = llm.generate_async(PROMPT, SP)          # arrives while paused: waits
    time.sleep(0.3)
    assert not waiting.done
    llm.continue_generation()
    check_equals(waiting.result(timeout=30), hf["a"], what="after continue")
    resent = llm.generate(PROMPT + got, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    ref, gaps = hf_greedy(hf["a"], PROMPT, len(got) + 4)
    assert_same_greedy(got + resent.outputs[0].token_ids, ref, gaps, "aborted then resent")


def test_pause_keep_then_update_spans_two_versions(llm, checkpoints):
    dirs, _ = checkpoints
    # long enough that it cannot end between the third token seen and the pause, however slow the test's thread
    fut = llm.generate_async(PROMPT, SamplingParams(max_tokens=400, ignore_eos=True), streaming=True)
    it = _stream_until(fut, 3)
    llm.pause_generation("keep")
    n = len(fut.outputs[0].token_ids)
    time.sleep(0.3)
    assert not fut.done
    llm.update_weights_from_disk(dirs["b"], weight_version="b")
    llm.continue_generation()
    for _ in it:
        pass
    spans = fut.outputs[0].weight_versions
    assert [v for _, v in spans] == ["0", "b"] and spans[0][0] == 0 and spans[1][0] >= n
    assert len(fut.outputs[0].token_ids) == 400 and fut.weight_version == "b"


def test_pause_wait_lets_running_finish_and_holds_new(llm):
    running = llm.generate_async(PROMPT, SamplingParams(max_tokens=30, ignore_eos=True))
    while not running.done and not llm.stats()[0]["num_running"]:
        time.sleep(0.005)
    llm.pause_generation("wait")              # returns once the running request is done
    assert running.done and len(running.result().outputs[0].token_ids) == 30
    held = llm.generate_async(PROMPT, SP)
    time.sleep(0.3)
    assert not held.done
    llm.continue_generation()
    assert len(held.result(timeout=30).outputs[0].token_ids) == 8


def _storages(llm):
    runner = llm._executor.engine.runner
    return [p.untyped_storage().nbytes() for p in runner.model.parameters()], \
        runner.kv_pool.tensor.untyped_storage().nbytes()


def test_sleep_releases_memory_and_wake_up_serves_the_same(llm, checkpoints):
    dirs, hf = checkpoints
    before = greedy(llm).outputs[0].token_ids
    weights, kv = _storages(llm)
    assert all(weights) and kv
    keep = llm.generate_async(PROMPT, SamplingParams(max_tokens=200, ignore_eos=True), streaming=True)
    _stream_until(keep, 1)
    llm.pause_generation("keep")
    with pytest.raises(ValueError, match="unfinished"):
        llm.sleep(1)
    llm.pause_generation("abort")
    llm.continue_generation()
    llm.sleep(1)
    assert llm.is_sleeping()
    weights, kv = _storages(llm)
    assert not any(weights) and kv == 0                          # every byte given back
    asleep = llm.generate_async(PROMPT, SP)
    time.sleep(0.2)
    assert not asleep.done                                       # waits for wake_up
    llm.wake_up()
    assert not llm.is_sleeping()
    assert asleep.result(timeout=30).outputs[0].token_ids == before
    # level 2: the weights are dropped; wake them, load new ones, then the KV cache
    llm.sleep(2)
    llm.wake_up(["weights"])
    assert llm.is_sleeping()
    llm.update_weights_from_disk(dirs["b"], weight_version="b")
    llm.wake_up(["kv_cache"])
    assert not llm._executor.engine.runner.kv_pool.tensor.any()  # zeroed, as an FP8 pool's kernels need
    check_equals(greedy(llm), hf["b"], what="sleep(2) + update")
    for level in (3, True):     # a bool is not a level
        with pytest.raises(ValueError, match="level"):
            llm.sleep(level)
    with pytest.raises(ValueError, match="tags"):
        llm.wake_up(["gpu"])
    llm.check_integrity()


def _trainer(port, state_dir, bucket_bytes, bad, results):
    """Another process: rank 0 of the weight-update group, sending checkpoint b."""
    try:
        from transformers import AutoModelForCausalLM

        from phalanx.llmapi.weight_transfer import TrainerGroup
        model = AutoModelForCausalLM.from_pretrained(state_dir, dtype=torch.float32)
        group = TrainerGroup("127.0.0.1", port, world_size=2, backend="gloo", timeout=120)
        named = list(model.state_dict().items())
        for _ in range(2 if bad else 0):
            try:
                group.send([(named[0][0], torch.zeros(3, 3))], bucket_bytes)
            except ValueError as e:
                results.put(("refused", str(e)))
        group.send(named, bucket_bytes)
        results.put(("sent", len(named)))
    except Exception as e:   # reported to the test
        results.put(("error", repr(e)))


def test_weights_from_a_trainer_process_over_gloo(llm, checkpoints):
    dirs, hf = checkpoints
    port = free_port()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    bucket = 50_000                                              # several buckets for a ~0.3 MB model
    proc = ctx.Process(target=_trainer, args=(port, dirs["b"], bucket, True, results), daemon=True)
    proc.start()
    try:
        llm.init_weights_update_group("127.0.0.1", port, rank_offset=1, world_size=2, timeout=120)
        state = hf["b"].state_dict()
        first = next(iter(state))
        with pytest.raises(ValueError, match="does not match"):   # refused: the trainer learns why
            llm.update_weights_from_distributed([first], ["float32"], [[3, 3]], bucket_bytes=bucket)
        assert results.get(timeout=60)[0] == "refused"
        with pytest.raises(ValueError, match="same length"):      # lists that do not pair up: the same
            llm.update_weights_from_distributed({first: 0}.keys(), ["float32"], [])   # any iterable
        verdict = results.get(timeout=60)
        assert verdict[0] == "refused" and "same length" in verdict[1], verdict
        assert greedy(llm).weight_version == "0"
        names = list(state)
        version = llm.update_weights_from_distributed(
            names, ["float32"] * len(names), [list(t.shape) for t in state.values()], weight_version="from-trainer",
            bucket_bytes=bucket)
        assert version == "from-trainer"
        assert results.get(timeout=60) == ("sent", len(names))
        out = greedy(llm)
        check_equals(out, hf["b"], what="from the trainer's group")
        assert out.weight_version == "from-trainer"
        llm.destroy_weights_update_group()
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def test_sleep_mode_reserves_the_host_buffer_at_start_up(checkpoints):
    dirs, hf = checkpoints
    with LLM(dirs["a"], skip_tokenizer_init=True, orchestrator_type="inprocess", enable_sleep_mode=True) as llm:
        rollout = llm._executor.engine.rollout
        buffer = rollout._host_buffer
        weights = sum(p.numel() * p.element_size() for p in llm._executor.engine.runner.model.parameters())
        assert buffer is not None and buffer.numel() >= weights
        assert llm.engine_info.startup["sleep_host_buffer_s"] >= 0
        before = greedy(llm).outputs[0].token_ids
        llm.sleep(1)
        assert rollout._host_buffer is buffer                    # the same buffer, not a new one
        llm.wake_up()
        assert greedy(llm).outputs[0].token_ids == before


def test_a_sleep_that_cannot_pin_host_memory_releases_nothing(llm, monkeypatch):
    before = greedy(llm).outputs[0].token_ids
    rollout = llm._executor.engine.rollout

    def no_memory():
        raise MemoryError("cannot pin host memory")
    monkeypatch.setattr(rollout, "reserve_host_buffer", no_memory)
    with pytest.raises(RuntimeError, match="cannot pin"):
        llm.sleep(1)
    assert not llm.is_sleeping()
    weights, kv = _storages(llm)
    assert all(weights) and kv                                   # nothing was given back
    assert greedy(llm).outputs[0].token_ids == before


def test_graph_sizes_are_only_those_captured():
    """After a capture that failed part-way (a wake_up short of memory), steps that have no
    graph run eagerly instead of failing."""
    from phalanx.pyexecutor.cuda_graph import CudaGraphRunner
    runner = CudaGraphRunner(None, None, [1, 2, 4], 8, 16, 128, 0, True, torch.device("cpu"),  # type: ignore[arg-type]
                             extend_sizes=[16, 32], extend_max_seqs=2)
    assert runner.graph_size(3) is None and runner.extend_size(10, 1) is None
    runner.graphs[4] = object()
    runner.extend_graphs[32] = object()
    assert runner.graph_size(3) == 4 and runner.graph_size(1) == 4 and runner.graph_size(5) is None
    assert runner.extend_size(10, 1) == 32 and runner.extend_size(10, 3) is None and runner.extend_size(33, 1) is None


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_moe_updates_from_a_trainers_tensors_as_transformers_5_holds_them(kind, tiny_moe_models, tmp_path):
    """A trainer's ``state_dict()`` of a mixture of experts in transformers 5: each layer's experts
    fused ([E, 2I, H] gate ‖ up, [E, H, I] down) and Mixtral's router under ``mlp.gate``, not its
    checkpoint's ``block_sparse_moe.gate``: taken, and the tokens follow the new weights."""
    from transformers import AutoModelForCausalLM

    from hf_reference import _moe_configs, assert_updates_follow
    b = tiny_model_dirs(lambda name: tmp_path / name, {kind: _moe_configs()[kind]}, seed=77)[kind]
    hf_b = AutoModelForCausalLM.from_pretrained(b, dtype=torch.float32).eval()
    with LLM(tiny_moe_models[kind], skip_tokenizer_init=True, orchestrator_type="inprocess") as llm:
        named = dict(assert_updates_follow(llm, [5, 9, 14, 3, 27, 8], tiny_moe_models[kind], b, hf_b))
    assert "model.layers.0.mlp.experts.gate_up_proj" in named and "model.layers.0.mlp.gate.weight" in named
