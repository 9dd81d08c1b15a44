"""Adapters added to the ranks and held (``LLM.add_lora``): from a trainer's tensors (PEFT's state
dict and config, handed over through shared memory on the CPU) and from a directory. Greedy tokens
equal PEFT's model of the adapter; adding again under the same id replaces the weights (an RL
trainer's next policy) and starts the id's prefix cache anew; what cannot be served is refused by
name with nothing changed, and the engine goes on."""

import asyncio

import pytest
import torch

from hf_reference import (
    LORA_TARGETS,
    assert_same_greedy,
    hf_greedy,
    peft_policy,
    save_lora_adapter,
    scale_lora_b,
)
from hf_reference import peft_state as state
from phalanx import LLM, LoRARequest, SamplingParams
from phalanx.llmapi.outputs import RequestError

NEW = 8
SP = SamplingParams(max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_models):
    llm = LLM(tiny_models["llama"], skip_tokenizer_init=True, orchestrator_type="inprocess",
              lora_config={"max_loras": 2, "max_lora_rank": 8, "max_cpu_loras": 2},
              kv_cache_config={"tokens_per_block": 8}, max_num_tokens=64)
    yield llm
    llm.shutdown()


def prompt(n, seed=5):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_an_adapter_added_from_tensors_equals_peft_and_is_replaced_in_place(llm, hf_models):
    """Added from a trainer's tensors, named by id alone: PEFT's tokens, and its prefix cache
    hit on a second request. A training step later, added again under the same id: the new
    PEFT tokens, none of the old weights' cached prefix reused. Removed: refused by name."""
    model = peft_policy(hf_models["llama"], 8, LORA_TARGETS, 31)
    p = prompt(33)
    ref, gaps = hf_greedy(model, p, NEW)
    assert ref != hf_greedy(hf_models["llama"], p, NEW)[0], "an adapter that changes nothing proves nothing"
    tensors, cfg = state(model)
    assert llm.add_lora(LoRARequest("policy", 50), tensors=tensors, peft_config=cfg)
    assert 50 in llm.list_loras()
    for round_ in range(2):
        out = llm.generate(p, SP, lora_request=LoRARequest("policy", 50), use_tqdm=False)
        assert_same_greedy(out.outputs[0].token_ids, ref, gaps, f"added from tensors, round {round_}")
        assert out.cached_tokens == (len(p) - 1 if round_ else 0)

    scale_lora_b(model, -0.5)                          # the trainer's next policy
    ref2, gaps2 = hf_greedy(model, p, NEW)
    assert ref2 != ref
    tensors, cfg = state(model)
    llm.add_lora(LoRARequest("policy", 50), tensors=tensors, peft_config=cfg.to_dict())   # (a dict does too)
    out = llm.generate(p, SP, lora_request=LoRARequest("policy", 50), use_tqdm=False)
    assert_same_greedy(out.outputs[0].token_ids, ref2, gaps2, "replaced under the same id")
    assert out.cached_tokens == 0, "the old weights' KV was reused"
    manager = llm._executor.engine.runner.lora
    assert manager.generation[50] == 2 and manager.stats()["lora_adapters_added"] == 1

    assert llm.remove_lora(50)
    assert 50 not in llm.list_loras()
    with pytest.raises(RequestError, match="no adapter with lora_int_id 50 is added"):
        llm.generate(p, SP, lora_request=LoRARequest("policy", 50), use_tqdm=False)
    base_ref, base_gaps = hf_greedy(hf_models["llama"], p, NEW)
    assert_same_greedy(llm.generate(p, SP, use_tqdm=False).outputs[0].token_ids, base_ref, base_gaps, "after")
    llm._executor.engine.scheduler.kv.check_integrity()


def test_an_added_adapter_stays_held_beside_adapters_read_for_requests(llm, hf_models, tmp_path):
    """An adapter added from a directory is held whatever ``max_cpu_loras`` (2) lets requests'
    adapters keep; requests name it with or without its path, and a request naming its id
    with another directory is refused."""
    hf = hf_models["llama"]
    refs = {n: save_lora_adapter(hf, tmp_path / n, 4, ["q_proj", "v_proj", "up_proj"], 40 + i)
            for i, n in enumerate(("held", "a", "b", "c"))}
    ids = {"held": 60, "a": 61, "b": 62, "c": 63}
    llm.add_lora(LoRARequest("held", 60, str(tmp_path / "held")))
    p = prompt(12, 6)
    for n in ("a", "b", "c"):    # three adapters read for requests: one of them leaves host memory
        llm.generate(p, SP, lora_request=LoRARequest(n, ids[n], str(tmp_path / n)), use_tqdm=False)
    held = llm.list_loras()
    assert 60 in held and len(held & {61, 62, 63}) == 2
    ref, gaps = hf_greedy(refs["held"], p, NEW)
    for r in (LoRARequest("held", 60), LoRARequest("held", 60, str(tmp_path / "held"))):
        assert_same_greedy(llm.generate(p, SP, lora_request=r, use_tqdm=False).outputs[0].token_ids, ref, gaps,
                           f"held, path {r.lora_path!r}")
    with pytest.raises(RequestError, match="was added from another directory"):
        llm.generate(p, SP, lora_request=LoRARequest("held", 60, str(tmp_path / "a")), use_tqdm=False)
    with pytest.raises(RequestError, match="lora_path is empty and no adapter with lora_int_id 64 is added"):
        llm.generate(p, SP, lora_request=LoRARequest("nothing", 64), use_tqdm=False)
    llm.remove_lora(60)


def test_what_cannot_be_added_is_refused_by_name_and_nothing_changes(llm, hf_models):
    hf = hf_models["llama"]
    good, cfg = state(peft_policy(hf, 4, ["q_proj", "o_proj"], 32))
    llm.add_lora(LoRARequest("kept", 70), tensors=good, peft_config=cfg)
    big, big_cfg = state(peft_policy(hf, 16, ["q_proj"], 33))
    key = next(iter(good))
    cases = {
        "max_lora_rank (8)": dict(tensors=big, peft_config=big_cfg),
        "use_dora=True in peft_config": dict(tensors=good, peft_config=dict(cfg.to_dict(), use_dora=True)),
        "is not a LoRA weight": dict(tensors={**good, "model.embed_tokens.lora_A.weight": good[key]},
                                     peft_config=cfg),
        "do not fit the model": dict(tensors={**good, key: good[key][:, :5]}, peft_config=cfg),
        "holds a value that is not finite": dict(tensors={**good, key: good[key] * float("inf")}, peft_config=cfg),
        "need its peft_config": dict(tensors=good),
        "must be a LoRARequest": dict(request=("kept", 70)),
        "names adapter 'kept' already": dict(request=LoRARequest("other", 70), tensors=good, peft_config=cfg),
        "not both": dict(request=LoRARequest("kept", 70, "/somewhere"), tensors=good, peft_config=cfg),
        "give lora_request.lora_path or the adapter's tensors": dict(request=LoRARequest("kept", 70)),
    }
    manager = llm._executor.engine.runner.lora
    before = (manager.generation[70], dict(manager.known), set(manager.added))
    for why, kw in cases.items():
        request = kw.pop("request", LoRARequest("kept", 70))
        with pytest.raises(ValueError) as e:
            llm.add_lora(request, **kw)
        assert why in str(e.value), (why, str(e.value))
    assert (manager.generation[70], dict(manager.known), set(manager.added)) == before
    with pytest.raises(ValueError, match="no adapter with lora_int_id 99 is added"):
        llm.remove_lora(99)
    p = prompt(9, 7)
    ref, gaps = hf_greedy(peft_policy(hf, 4, ["q_proj", "o_proj"], 32), p, NEW)
    assert_same_greedy(llm.generate(p, SP, lora_request=LoRARequest("kept", 70), use_tqdm=False)
                       .outputs[0].token_ids, ref, gaps, "the kept adapter after the refusals")
    llm.remove_lora(70)


def test_an_adapter_in_use_is_not_replaced_and_a_removed_one_stays_for_its_requests(llm, hf_models):
    """While a request runs with an added adapter, adding under its id is refused and removing
    it lets the request finish with it; then it is gone."""
    model = peft_policy(hf_models["llama"], 8, ["k_proj", "down_proj"], 34)
    tensors, cfg = state(model)
    llm.add_lora(LoRARequest("busy", 80), tensors=tensors, peft_config=cfg)
    p = prompt(10, 8)
    n = 24
    ref, gaps = hf_greedy(model, p, n)

    async def run():
        tokens, paused = [], False
        async for out in llm.generate_async(p, SamplingParams(max_tokens=n, ignore_eos=True), streaming=True,
                                            lora_request=LoRARequest("busy", 80)):
            tokens = out.outputs[0].token_ids
            if not paused:     # the request holds the adapter: keep it running, paused, while we try
                paused = True
                await asyncio.to_thread(llm.pause_generation, "keep")
                with pytest.raises(ValueError, match="is in use by 1 requests"):
                    await asyncio.to_thread(llm.add_lora, LoRARequest("busy", 80), tensors, cfg)
                await asyncio.to_thread(llm.remove_lora, 80)
                await asyncio.to_thread(llm.continue_generation)
        return tokens
    assert_same_greedy(asyncio.run(run()), ref, gaps, "finished with the removed adapter")
    manager = llm._executor.engine.runner.lora
    assert 80 not in manager.adapters and not manager.dropping and not manager.users


def test_sleep_gives_the_adapter_slots_back_and_wake_up_writes_them_again(llm, hf_models):
    """An RL trainer colocated with the engine: sleep frees the slots' memory with the weights'
    (the adapters stay in host memory); after wake_up a request with the added adapter and one
    without still give PEFT's and the base model's tokens."""
    from phalanx.models.lora import LoraWeights
    model = peft_policy(hf_models["llama"], 8, LORA_TARGETS, 35)
    tensors, cfg = state(model)
    llm.add_lora(LoRARequest("asleep", 90), tensors=tensors, peft_config=cfg)
    p = prompt(11, 9)
    ref, gaps = hf_greedy(model, p, NEW)
    base, base_gaps = hf_greedy(hf_models["llama"], p, NEW)
    outs = llm.generate([p, p], SP, lora_request=[LoRARequest("asleep", 90), None], use_tqdm=False)
    assert_same_greedy(outs[0].outputs[0].token_ids, ref, gaps, "before sleep")
    slots = [m for m in llm._executor.engine.runner.model.modules() if isinstance(m, LoraWeights)]
    nbytes = sum(m.A.untyped_storage().nbytes() + m.B.untyped_storage().nbytes() for m in slots)
    llm.sleep(level=1)
    assert all(m.A.untyped_storage().nbytes() == m.B.untyped_storage().nbytes() == 0 for m in slots)
    llm.wake_up()
    assert sum(m.A.untyped_storage().nbytes() + m.B.untyped_storage().nbytes() for m in slots) == nbytes
    outs = llm.generate([p, p], SP, lora_request=[LoRARequest("asleep", 90), None], use_tqdm=False)
    assert_same_greedy(outs[0].outputs[0].token_ids, ref, gaps, "after wake_up")
    assert_same_greedy(outs[1].outputs[0].token_ids, base, base_gaps, "no adapter, after wake_up")
    llm.remove_lora(90)


def test_requests_sent_before_remove_lora_finish_with_the_adapter(llm, hf_models):
    """Requests still waiting to be taken in (the loop takes arrivals in as steps admit them) when
    remove_lora comes hold the adapter first, as those running do: all finish with it."""
    model = peft_policy(hf_models["llama"], 4, ["q_proj", "up_proj"], 36)
    tensors, cfg = state(model)
    llm.add_lora(LoRARequest("leaving", 95), tensors=tensors, peft_config=cfg)
    ps = [prompt(40, 20 + i) for i in range(8)]
    llm.pause_generation("keep")
    futures = [llm.generate_async(p, SP, lora_request=LoRARequest("leaving", 95)) for p in ps]
    llm.remove_lora(95)
    llm.continue_generation()
    for p, f in zip(ps, futures, strict=True):
        ref, gaps = hf_greedy(model, p, NEW)
        assert_same_greedy(f.result().outputs[0].token_ids, ref, gaps, "sent before remove_lora")
    assert 95 not in llm.list_loras()


def test_tensors_that_are_not_named_tensors_are_refused_by_name(llm):
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8}
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    for tensors, why in (({}, "tensors is empty"), ({key: [1.0, 2.0]}, "got list for"),
                         (5, "must be a mapping or pairs"), ([("a", torch.zeros(1)), 7], "got int")):
        with pytest.raises(ValueError, match="add_lora: tensors") as e:
            llm.add_lora(LoRARequest("x", 96), tensors=tensors, peft_config=cfg)
        assert why in str(e.value), str(e.value)
    assert 96 not in llm.list_loras()


def test_an_adapter_past_a_float16_model_s_range_is_refused(tiny_models, hf_models):
    """Finite in float32, infinite in float16: refused when added (it would turn every row of a
    step into NaN through the mask), and the engine goes on."""
    model = peft_policy(hf_models["llama"], 4, ["q_proj"], 37, scale_b=1e6)
    tensors, cfg = state(model)
    with LLM(tiny_models["llama"], skip_tokenizer_init=True, orchestrator_type="inprocess", dtype="float16",
             lora_config={"max_loras": 1, "max_lora_rank": 4}, kv_cache_config={"tokens_per_block": 8}) as f16:
        with pytest.raises(ValueError, match="not finite in the model's dtype \\(float16\\)"):
            f16.add_lora(LoRARequest("huge", 1), tensors=tensors, peft_config=cfg)
        assert not f16.list_loras()
        out = f16.generate(prompt(9), SP, use_tqdm=False)
        assert len(out.outputs[0].token_ids) == NEW
