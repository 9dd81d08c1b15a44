"""LoRA adapters per request against PEFT's own model of each adapter (the same tiny Llama, the
adapter made and saved by PEFT): greedy tokens equal, with requests of several adapters and of
none in one batch, more adapters than slots, each adapter's prefix cache its own, and adapters
that cannot be served refused alone."""

import json

import pytest
import torch

from hf_reference import LORA_TARGETS, assert_same_greedy, hf_greedy, save_lora_adapter
from phalanx import LLM, LoRARequest, SamplingParams
from phalanx.llmapi.outputs import RequestError

NEW = 8


@pytest.fixture(scope="module")
def adapters(hf_models, tmp_path_factory):
    """name -> (path, PEFT model): three adapters of the tiny Llama (None: the base model)."""
    hf = hf_models["llama"]
    root = tmp_path_factory.mktemp("lora")
    out = {None: (None, hf)}
    made = (("all8", 8, LORA_TARGETS, 1, False), ("qv4", 4, ["q_proj", "v_proj", "down_proj"], 2, True),
            ("mlp2", 2, ["gate_proj", "up_proj"], 3, False))
    for name, r, targets, seed, rs in made:
        out[name] = (str(root / name), save_lora_adapter(hf, root / name, r, targets, seed, rs))
    return out


@pytest.fixture(scope="module")
def llm(tiny_models):
    llm = LLM(tiny_models["llama"], skip_tokenizer_init=True, orchestrator_type="inprocess",
              lora_config={"max_loras": 2, "max_lora_rank": 8, "max_cpu_loras": 3},
              kv_cache_config={"tokens_per_block": 8}, max_num_tokens=64)
    yield llm
    llm.shutdown()


def prompts(n_each=(5, 17, 33)):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in n_each]


def lora(adapters, name, lid=None):
    if name is None:
        return None
    return LoRARequest(name, lid or {"all8": 1, "qv4": 2, "mlp2": 3}[name], adapters[name][0])


def test_requests_of_several_adapters_and_none_in_one_batch_equal_peft(llm, adapters):
    """Three prompts, each with no adapter and with each of three adapters, in one generate call
    on two slots: every output is PEFT's greedy continuation of its adapter. Twice: the second
    time each request finds its own adapter's prefix in the cache, and only its own."""
    names = [None, "all8", "qv4", "mlp2"]
    ps = prompts()
    batch = [(p, n) for p in ps for n in names]
    refs = [hf_greedy(adapters[n][1], p, NEW) for p, n in batch]
    assert len({tuple(r[0]) for r in refs}) == len(batch), "an adapter that changes nothing proves nothing"
    manager = llm._executor.engine.runner.lora
    loads = manager.num_loads
    for round_ in range(2):
        outs = llm.generate([p for p, _ in batch], SamplingParams(max_tokens=NEW, ignore_eos=True), use_tqdm=False,
                            lora_request=[lora(adapters, n) for _, n in batch])
        for (p, n), out, (ref, gaps) in zip(batch, outs, refs, strict=True):
            assert_same_greedy(out.outputs[0].token_ids, ref, gaps, f"adapter {n} prompt of {len(p)} round {round_}")
            # round 0: no request reuses another adapter's KV (the adapters that waited for a slot came
            # after the others had cached the same prompt); round 1: each its own, all but the last token
            assert out.cached_tokens == (len(p) - 1 if round_ else 0), (n, len(p), out.cached_tokens)
    assert manager.num_loads - loads == 3          # each adapter read from disk once (max_cpu_loras keeps 3)
    assert manager.num_slot_writes >= 3            # three adapters through two slots
    stats = llm._executor.engine.stats()
    assert stats["lora_slots_used"] == stats["lora_slots_total"] == 2 and stats["lora_adapters_held"] == 3
    llm._executor.engine.scheduler.kv.check_integrity()


def test_streamed_request_with_an_adapter(llm, adapters):
    import asyncio

    p = prompts((9,))[0]
    ref, gaps = hf_greedy(adapters["qv4"][1], p, NEW)

    async def run():
        tokens = []
        async for out in llm.generate_async(p, SamplingParams(max_tokens=NEW, ignore_eos=True), streaming=True,
                                            lora_request=lora(adapters, "qv4")):
            tokens = out.outputs[0].token_ids
        return tokens
    assert_same_greedy(asyncio.run(run()), ref, gaps, "streamed")


def test_an_adapter_that_cannot_be_served_fails_alone(llm, adapters, hf_models, tmp_path):
    """Refused on the ranks with the field and the limit named; a good request sent with them
    completes as it does alone."""
    hf = hf_models["llama"]
    save_lora_adapter(hf, tmp_path / "r16", 16, ["q_proj"], 4)
    save_lora_adapter(hf, tmp_path / "dora", 2, ["q_proj"], 5)
    cfg = json.loads((tmp_path / "dora" / "adapter_config.json").read_text())
    (tmp_path / "dora" / "adapter_config.json").write_text(json.dumps(dict(cfg, use_dora=True)))
    p = prompts((7,))[0]
    ref, gaps = hf_greedy(adapters["all8"][1], p, NEW)
    sp = SamplingParams(max_tokens=NEW, ignore_eos=True)
    bad = {"max_lora_rank (8)": LoRARequest("r16", 16, str(tmp_path / "r16")),
           "use_dora": LoRARequest("dora", 17, str(tmp_path / "dora")),
           "adapter_config.json not found": LoRARequest("nowhere", 18, str(tmp_path / "missing")),
           "lora_int_id 1 names adapter 'all8' already": LoRARequest("other", 1, str(tmp_path / "r16"))}
    good = llm.generate_async(p, sp, lora_request=lora(adapters, "all8"))   # first: id 1 is all8's
    futs = [llm.generate_async(p, sp, lora_request=r) for r in bad.values()]
    for (why, _), f in zip(bad.items(), futs, strict=True):
        with pytest.raises(RequestError, match="lora_request") as e:
            f.result()
        assert why in str(e.value), str(e.value)
    assert_same_greedy(good.result().outputs[0].token_ids, ref, gaps, "beside the refused ones")
    manager = llm._executor.engine.runner.lora
    assert not manager.of_request and not manager.users     # the refused ones hold nothing


def test_lora_request_is_refused_where_the_engine_serves_no_adapters(tiny_models, adapters):
    llm = LLM(tiny_models["llama"], skip_tokenizer_init=True, orchestrator_type="inprocess")
    try:
        with pytest.raises(ValueError, match="lora_request: this LLM serves no LoRA adapters"):
            llm.generate([1, 2, 3], SamplingParams(max_tokens=2), lora_request=lora(adapters, "all8"))
    finally:
        llm.shutdown()
    with pytest.raises(ValueError, match="lora_int_id must be an integer from 1"):
        LoRARequest("x", 0, "/a")


def test_a_mixture_of_experts_takes_adapters_on_attention(tiny_moe_models, hf_moe_models, adapters, tmp_path):
    """Qwen3-MoE: an adapter of q/k/v/o equals PEFT's model; one of the MLP projections is
    refused by name (the experts take none)."""
    hf = hf_moe_models["qwen3_moe"]
    ref = save_lora_adapter(hf, tmp_path / "attn", 4, ["q_proj", "k_proj", "v_proj", "o_proj"], 5)
    ps = prompts((6, 30))
    with LLM(tiny_moe_models["qwen3_moe"], skip_tokenizer_init=True, orchestrator_type="inprocess",
             enable_lora=True) as llm:
        outs = llm.generate(ps, SamplingParams(max_tokens=NEW, ignore_eos=True), use_tqdm=False,
                            lora_request=LoRARequest("attn", 1, str(tmp_path / "attn")))
        for p, out in zip(ps, outs, strict=True):
            want, gaps = hf_greedy(ref, p, NEW)
            assert want != hf_greedy(hf, p, NEW)[0]
            assert_same_greedy(out.outputs[0].token_ids, want, gaps, f"MoE adapter, prompt of {len(p)}")
        with pytest.raises(RequestError, match="layer 0's MLP is a mixture of experts"):
            llm.generate(ps[0], SamplingParams(max_tokens=2), lora_request=lora(adapters, "all8", 2))


def test_fp8_weights_with_an_adapter_equal_peft_over_the_round_tripped_weights(tiny_models, hf_models, adapters):
    """quantization: fp8 with LoRA: the base projections in FP8 (each rank's rows quantized as
    they load), the adapter beside them in the activation dtype: PEFT's model of the same adapter
    over the FP8 round trip of the weights gives the same greedy tokens."""
    from peft import PeftModel

    from hf_reference import fp8_round_trip
    ref = PeftModel.from_pretrained(fp8_round_trip(hf_models["llama"]), adapters["all8"][0]).eval()
    ps = prompts((4, 21))
    with LLM(tiny_models["llama"], skip_tokenizer_init=True, orchestrator_type="inprocess", quantization="fp8",
             lora_config={"max_lora_rank": 8}) as llm:
        outs = llm.generate(ps, SamplingParams(max_tokens=NEW, ignore_eos=True), use_tqdm=False,
                            lora_request=lora(adapters, "all8"))
    for p, out in zip(ps, outs, strict=True):
        want, gaps = hf_greedy(ref, p, NEW)
        assert_same_greedy(out.outputs[0].token_ids, want, gaps, f"FP8 + adapter, prompt of {len(p)}")


def test_an_id_names_one_adapter_for_the_engine_s_life_and_holds_are_counted_per_request(llm, adapters, hf_models,
                                                                                           tmp_path):
    """An adapter's id keys its prefix cache, so an id is never given to another adapter, even
    once the first has left host memory; a second registration under a request id that holds an
    adapter is refused without touching the first's hold."""
    manager = llm._executor.engine.runner.lora
    p = prompts((5,))[0]
    sp = SamplingParams(max_tokens=2, ignore_eos=True)
    llm.generate(p, sp, lora_request=lora(adapters, "all8"))
    for i in range(4):   # four other adapters through a host cache of three: all8 (id 1) leaves it
        save_lora_adapter(hf_models["llama"], tmp_path / f"x{i}", 2, ["q_proj"], 40 + i)
        llm.generate(p, sp, lora_request=LoRARequest(f"x{i}", 100 + i, str(tmp_path / f"x{i}")))
    assert 1 not in manager.adapters
    with pytest.raises(RequestError, match="lora_int_id 1 names adapter 'all8' already"):
        llm.generate(p, sp, lora_request=LoRARequest("x0", 1, str(tmp_path / "x0")))
    assert llm.generate(p, sp, lora_request=lora(adapters, "all8")).outputs[0].token_ids   # still its own
    rid = 10**9
    manager.register(rid, ["x1", 101, str(tmp_path / "x1")])
    with pytest.raises(ValueError, match=f"request id {rid} is already running"):
        manager.register(rid, ["x2", 102, str(tmp_path / "x2")])
    assert manager.users.get(101) == 1 and 102 not in manager.users
    manager.release(rid)
    assert not manager.users and not manager.of_request
    # a request refused when it is made (here its length limit) holds no adapter afterwards
    from phalanx.executor.messages import GenerationRequest
    bad = GenerationRequest(rid + 1, [1, 2, 3], SamplingParams(max_tokens=2).to_dict(), max_total_tokens=-1,
                            lora=["x1", 101, str(tmp_path / "x1")])
    with pytest.raises(ValueError, match="max_total_tokens"):
        llm._executor.engine._make_request(bad)
    assert not manager.users and not manager.of_request
