"""An adapter handed over in memory (``adapter_from_tensors``) is read as the same adapter saved
as a PEFT directory; PEFT's newer settings that change what the weights mean are refused, from a
directory and from memory alike; a ``peft.LoraConfig`` travels as plain values."""

import json

import pytest
import torch
from safetensors.torch import save_file

from phalanx.models.lora import adapter_from_tensors, module_shapes, plain_peft_config, read_adapter

SHAPES = module_shapes(num_heads=4, num_kv_heads=2, head_dim=16, hidden=64, intermediate=128)
LIMITS = dict(num_layers=2, shapes=SHAPES, max_rank=8, targets=("q_proj", "v_proj", "down_proj"))


def tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer, block, module in ((0, "self_attn", "q_proj"), (1, "mlp", "down_proj")):
        fan_in, fan_out = SHAPES[module]
        key = f"base_model.model.model.layers.{layer}.{block}.{module}.lora_"
        out[key + "A.weight"] = torch.randn(4, fan_in, generator=g)
        out[key + "B.weight"] = torch.randn(fan_out, 4, generator=g)
    return out


def config(**kw):
    return {"peft_type": "LORA", "r": 4, "lora_alpha": 12, "use_rslora": False, **kw}


def test_in_memory_equals_the_same_adapter_read_from_its_directory(tmp_path):
    t = tensors()
    (tmp_path / "adapter_config.json").write_text(json.dumps(config()))
    save_file(t, str(tmp_path / "adapter_model.safetensors"))
    disk = read_adapter("t", str(tmp_path), **LIMITS)
    mem = adapter_from_tensors("t", config(), t, **LIMITS)
    assert mem.path == "" and disk.path == str(tmp_path.resolve()) and mem.rank == disk.rank == 4
    assert mem.weights.keys() == disk.weights.keys() == {(0, "q_proj"), (1, "down_proj")}
    for k in mem.weights:
        assert all(torch.equal(a, b) for a, b in zip(mem.weights[k], disk.weights[k], strict=True))
    before = t[next(iter(t))].clone()
    t[next(iter(t))].mul_(2)       # the caller's tensors change after: the adapter keeps its copy
    assert torch.equal(mem.weights[(0, "q_proj")][0], before)


@pytest.mark.parametrize("setting,value", [
    ("alora_invocation_tokens", [1, 2]), ("target_parameters", ["mlp.experts.gate_up_proj"]),
    ("arrow_config", {"top_k": 2}), ("use_bdlora", True), ("velora_config", {"a": 1}),
])
def test_newer_settings_that_change_the_forward_are_refused(tmp_path, setting, value):
    with pytest.raises(ValueError, match=f"{setting}=.* in peft_config is not supported"):
        adapter_from_tensors("t", config(**{setting: value}), tensors(), **LIMITS)
    (tmp_path / "adapter_config.json").write_text(json.dumps(config(**{setting: value})))
    save_file(tensors(), str(tmp_path / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match=f"{setting}=.* in adapter_config.json is not supported"):
        read_adapter("t", str(tmp_path), **LIMITS)


def test_what_is_handed_over_must_be_tensors_of_peft_names():
    t = tensors()
    key = next(iter(t))
    for bad, why in (({**t, key: t[key].tolist()}, "is a list, not a tensor"),
                     ({**t, "lm_head.lora_A.weight": t[key]}, "is not a LoRA weight"),
                     ({k: v for k, v in t.items() if "lora_B" not in k or "down" in k}, "lora_B missing"),
                     ([1, 2], "must be a mapping")):
        with pytest.raises(ValueError, match="lora_request 't'") as e:
            adapter_from_tensors("t", config(), bad, **LIMITS)
        assert why in str(e.value)
    with pytest.raises(ValueError, match="peft_config must be a mapping"):
        adapter_from_tensors("t", ["r", 4], t, **LIMITS)


def test_a_peft_lora_config_travels_as_plain_values():
    from peft import LoraConfig
    plain = plain_peft_config(LoraConfig(r=4, lora_alpha=12, target_modules=["v_proj", "q_proj"]))
    assert plain["peft_type"] == "LORA" and plain["target_modules"] == ["q_proj", "v_proj"]
    assert json.loads(json.dumps(plain)) == plain     # nothing but JSON's values (msgpack carries them)
    adapter = adapter_from_tensors("t", plain, tensors(), **LIMITS)
    assert torch.allclose(adapter.weights[(0, "q_proj")][1], tensors()[
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"] * 3.0)   # alpha / r
    with pytest.raises(ValueError, match="peft_config must be a peft.LoraConfig or a dict"):
        plain_peft_config("r=4")


@pytest.mark.parametrize("init", ["pissa", "pissa_niter_4", "olora", "corda", "loftq", "lora_ga"])
def test_an_adapter_trained_against_a_rewritten_base_is_refused(init):
    """PiSSA, OLoRA, CorDA, LoftQ and LoRA-GA rewrite the base weights at initialization: the
    adapter holds only against those (until PEFT converts it on saving), so it is refused."""
    with pytest.raises(ValueError, match=f"init_lora_weights='{init}' in peft_config is not supported"):
        adapter_from_tensors("t", config(init_lora_weights=init), tensors(), **LIMITS)
    for fine in (True, False, "gaussian", "eva"):
        adapter_from_tensors("t", config(init_lora_weights=fine), tensors(), **LIMITS)
