"""Reading a PEFT LoRA directory: what it means is served, and what phalanx would serve
differently is refused with the file, the setting or the tensor named."""

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from phalanx.models.lora import module_shapes, read_adapter

SHAPES = module_shapes(num_heads=4, num_kv_heads=2, head_dim=16, hidden=64, intermediate=128)
KEY = "base_model.model.model.layers.{}.{}.{}.lora_{}.weight"


def write(path, tensors, **config):
    path.mkdir(parents=True, exist_ok=True)
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "bias": "none",
           "use_dora": False, "modules_to_save": None, **config}
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        save_file(tensors, str(path / "adapter_model.safetensors"))
    return str(path)


def pair(layer, module, r=4, block="self_attn"):
    fan_in, fan_out = SHAPES[module]
    g = torch.Generator().manual_seed(layer * 10 + len(module))
    return {KEY.format(layer, block, module, "A"): torch.randn(r, fan_in, generator=g),
            KEY.format(layer, block, module, "B"): torch.randn(fan_out, r, generator=g)}


def read(path, max_rank=8, targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")):
    return read_adapter("t", path, num_layers=2, shapes=SHAPES, max_rank=max_rank, targets=targets)


def test_the_scale_is_folded_into_b(tmp_path):
    t = {**pair(0, "q_proj"), **pair(1, "down_proj", block="mlp")}
    a = read(write(tmp_path / "plain", t))
    assert a.rank == 4 and set(a.weights) == {(0, "q_proj"), (1, "down_proj")}
    A, B = a.weights[(0, "q_proj")]
    assert torch.equal(A, t[KEY.format(0, "self_attn", "q_proj", "A")])
    assert torch.allclose(B, t[KEY.format(0, "self_attn", "q_proj", "B")] * 2.0)       # alpha / r
    rs = read(write(tmp_path / "rslora", t, use_rslora=True))
    assert torch.allclose(rs.weights[(0, "q_proj")][1], t[KEY.format(0, "self_attn", "q_proj", "B")] * 8 / math.sqrt(4))


@pytest.mark.parametrize("config,why", [
    ({"use_dora": True}, "use_dora=True"),
    ({"bias": "all"}, "bias='all'"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"rank_pattern": {"q_proj": 2}}, "rank_pattern"),
    ({"peft_type": "IA3"}, "peft_type 'IA3'"),
    ({"r": 16}, "max_lora_rank (8)"),
    ({"lora_alpha": float("inf")}, "lora_alpha"),
])
def test_settings_that_change_what_the_weights_mean_are_refused(tmp_path, config, why):
    with pytest.raises(ValueError, match="lora_request 't'") as e:
        read(write(tmp_path, pair(0, "q_proj"), **config))
    assert why in str(e.value)


def test_tensors_that_do_not_fit_are_refused(tmp_path):
    cases = {
        "embed": ({"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 256)}, "not a LoRA weight"),
        "lm_head": ({"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)}, "not a LoRA weight"),
        "layer": (pair(2, "q_proj"), "the model has 2 layers"),
        "shape": (pair(0, "q_proj", r=3), "do not fit the model"),
        "half": ({KEY.format(0, "self_attn", "q_proj", "A"): torch.zeros(4, 64)}, "lora_B missing"),
        "nan": ({**pair(0, "q_proj"), KEY.format(0, "self_attn", "q_proj", "A"): torch.full((4, 64), float("nan"))},
                "not finite"),
    }
    for name, (tensors, why) in cases.items():
        with pytest.raises(ValueError, match=why):
            read(write(tmp_path / name, tensors))
    with pytest.raises(ValueError, match="down_proj takes no adapter on this engine"):
        read(write(tmp_path / "target", pair(0, "down_proj", block="mlp")), targets=("q_proj",))


def test_files_that_are_missing_or_pickled_are_refused(tmp_path):
    with pytest.raises(ValueError, match="adapter_config.json not found"):
        read(str(tmp_path / "nowhere"))
    path = write(tmp_path / "bin", None)
    (tmp_path / "bin" / "adapter_model.bin").write_bytes(b"\x80\x04not loaded")
    with pytest.raises(ValueError, match="adapter_model.bin is a pickle and is not loaded"):
        read(path)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "adapter_config.json").write_text("{")
    with pytest.raises(ValueError, match="not readable JSON"):
        read(str(tmp_path / "bad"))


def test_the_server_checks_an_adapter_as_the_ranks_read_it(tmp_path):
    """``phalanx serve`` reads --lora_modules' adapters (and loaded ones) before serving them:
    the engine's rank limit, no MLP adapter on a mixture of experts' sparse layers (its dense
    ones take them), and any failure as a ValueError."""
    from types import SimpleNamespace

    from phalanx.config import LoraConfig
    from phalanx.serve.lora_routes import check_adapter
    cfg = SimpleNamespace(num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64, intermediate_size=128,
                          num_layers=2, is_moe=False, mlp_only_layers=(1,), decoder_sparse_step=1)
    llm = SimpleNamespace(source=SimpleNamespace(config=cfg), args=SimpleNamespace(lora=LoraConfig(max_lora_rank=8)))
    mlp = write(tmp_path / "mlp", pair(0, "down_proj", block="mlp"))
    check_adapter(llm, "mlp", mlp)
    moe = SimpleNamespace(source=SimpleNamespace(config=SimpleNamespace(**{**vars(cfg), "is_moe": True})),
                          args=llm.args)
    with pytest.raises(ValueError, match="layer 0's MLP is a mixture of experts"):
        check_adapter(moe, "mlp", mlp)
    check_adapter(moe, "dense", write(tmp_path / "dense", pair(1, "down_proj", block="mlp")))   # mlp_only_layers
    with pytest.raises(ValueError, match="could not be read"):   # whatever a directory holds: a ValueError
        check_adapter(llm, "huge", write(tmp_path / "huge", pair(0, "q_proj"), lora_alpha=10**400))
    with pytest.raises(ValueError, match=r"max_lora_rank \(2\)"):
        check_adapter(SimpleNamespace(source=llm.source, args=SimpleNamespace(lora=LoraConfig(max_lora_rank=2))),
                      "mlp", mlp)
