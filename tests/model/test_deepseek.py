"""DeepSeek-V2 and V3 against transformers: logits at every step through the scheduler, paged
pool and chunked prefill (latent attention absorbed, YaRN, DeepSeek's routing and shared
experts); batched greedy with prefix reuse; FP8 weights; the Triton kernels (interpreter here);
the config's forms and what is refused by name. TP=2 and attention DP: tests/mpi/test_tp.py and
tests/adp/test_moe_adp.py."""

import json

import pytest
import torch

from deepseek_reference import deepseek_dir, deepseek_v2_config, deepseek_v3_config
from hf_reference import (
    PROJECTIONS,
    assert_greedy_with_prefix_reuse,
    assert_logits_every_step,
    assert_same_greedy,
    assert_updates_follow,
    fp8_round_trip,
    hf_greedy,
)
from phalanx import LLM, SamplingParams
from phalanx.models.config import ModelConfig
from phalanx.models.source import resolve_model

MLA_PROJECTIONS = (*PROJECTIONS, "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa")   # kv_b_proj stays exact


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    from transformers import AutoModelForCausalLM
    path = deepseek_dir(tmp_path_factory.mktemp("dsv3"), version=3)
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def v2(tmp_path_factory):
    from transformers import AutoModelForCausalLM
    path = deepseek_dir(tmp_path_factory.mktemp("dsv2"), version=2, seed=8)
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(0, vocab, (30,), generator=g).tolist()
    out = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (1, 5, 13, 29)]
    return out + [shared + [5, 6, 7], shared + [8]]


def test_config_reads_deepseek_v3(v3):
    cfg = resolve_model(v3[0]).config
    assert cfg.is_mla and cfg.is_moe and (cfg.num_kv_heads, cfg.head_dim) == (1, 32 + 8)   # one latent head
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == \
        (48, 32, 16, 8, 24)
    assert cfg.rotary_dim == 8 and cfg.rope_interleave
    assert (cfg.scoring_func, cfg.topk_method, cfg.n_group, cfg.topk_group) == ("sigmoid", "noaux_tc", 4, 2)
    assert cfg.norm_topk_prob and cfg.routed_scaling_factor == 2.5 and cfg.n_shared_experts == 1
    assert cfg.mlp_only_layers == (0,) and cfg.num_experts == 8 and cfg.num_experts_per_tok == 3
    rope = cfg.rope
    assert rope["rope_type"] == "yarn" and rope["factor"] == 4.0 and rope["original_max_position_embeddings"] == 128
    assert ModelConfig.from_wire(cfg.to_wire()) == cfg
    # the pool's bytes a token: one latent of 40 a layer (one plane, both K and V), not 2 x 4 heads x 40
    assert cfg.kv_planes == 1 and cfg.kv_bytes_per_token(2) == 3 * 40 * 2


def test_config_reads_deepseek_v2_lite_form(v2):
    cfg = resolve_model(v2[0]).config
    assert cfg.q_lora_rank == 0 and cfg.scoring_func == "softmax" and cfg.topk_method == "greedy"
    assert not cfg.norm_topk_prob and cfg.n_shared_experts == 2 and cfg.routed_scaling_factor == 1.5
    assert cfg.rope_interleave and cfg.rope["rope_type"] == "yarn" and cfg.rope["mscale_all_dim"] == 0.707


@pytest.mark.parametrize("change,message", [
    ({"topk_method": "noaux_tc"}, "topk_method 'noaux_tc' is not supported"),
    ({"topk_method": "group_limited_greedy", "n_group": 3, "topk_group": 1}, "n_group 3 must divide"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 1, "num_experts_per_tok": 3},
     "num_experts_per_tok 3 exceeds the experts of topk_group 1 groups"),
])
def test_v2_settings_it_does_not_compute_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf(deepseek_v2_config(**change))


def test_v3_odd_rope_width_refused():
    cfg = deepseek_v3_config()
    object.__setattr__(cfg, "qk_rope_head_dim", 7)   # (transformers' own validation refuses it at construction)
    with pytest.raises(ValueError, match="qk_rope_head_dim"):
        ModelConfig.from_hf(cfg)


@pytest.mark.parametrize("max_num_tokens", [8, 512])
def test_v3_logits_match_transformers_every_step(v3, max_num_tokens):
    path, hf = v3
    prompt = torch.randint(0, 256, (27,), generator=torch.Generator().manual_seed(0)).tolist()
    assert_logits_every_step(path, hf, prompt, 10, max_num_tokens)


def test_v2_logits_match_transformers_every_step(v2):
    path, hf = v2
    prompt = torch.randint(0, 256, (27,), generator=torch.Generator().manual_seed(1)).tolist()
    assert_logits_every_step(path, hf, prompt, 10, 8)


def test_v2_group_limited_routing_matches_transformers(tmp_path):
    """V2's routing within the best groups (groups' best scores; the others' experts scored 0)."""
    from transformers import AutoModelForCausalLM
    path = deepseek_dir(tmp_path / "dsv2g", version=2, seed=9, topk_method="group_limited_greedy", n_group=4,
                        topk_group=2, num_experts_per_tok=3)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert resolve_model(path).config.topk_method == "group_limited_greedy"
    prompt = torch.randint(0, 256, (21,), generator=torch.Generator().manual_seed(2)).tolist()
    assert_logits_every_step(path, hf, prompt, 6, 512)


@pytest.mark.parametrize("chunked", [True, False])
def test_v3_batched_greedy_equals_transformers_with_prefix_reuse(v3, chunked):
    assert_greedy_with_prefix_reuse(*v3, prompts(256), chunked)


def test_v3_fp8_greedy_equals_transformers_with_the_round_tripped_weights(v3):
    """``quantization: fp8``: the latent and q projections, o, the dense MLP, the experts and the
    shared expert FP8 with a scale per output row; kv_b_proj (absorbed per head) stays exact."""
    path, hf = v3
    ref = fp8_round_trip(hf, MLA_PROJECTIONS)
    ps = prompts(256)[:4]
    with LLM(path, skip_tokenizer_init=True, dtype="float32", quantization="fp8", orchestrator_type="inprocess") as llm:
        outs = llm.generate(ps, SamplingParams(max_tokens=10, ignore_eos=True), use_tqdm=False)
    for i, (p, o) in enumerate(zip(ps, outs, strict=True)):
        want, gaps = hf_greedy(ref, p, 10)
        assert_same_greedy(o.outputs[0].token_ids, want, gaps, f"prompt {i}")


def test_v3_on_the_triton_path_equals_transformers(v3, monkeypatch):
    """The norms, the routing, the fused MoE, the latent rows' kernel and the latent decode and
    extend (latent rows 40 wide) on their Triton kernels (the interpreter here)."""
    pytest.importorskip("triton")
    from phalanx.kernels import ops, triton_mla, triton_moe
    monkeypatch.setattr(ops, "FORCE_TRITON", True)
    calls = {"rows": 0, "decode": 0, "prompt": 0, "route": 0, "route_product": 0}

    def counted(name, real):
        def call(*a, **kw):
            calls[name] += 1
            return real(*a, **kw)
        return call
    monkeypatch.setattr(triton_mla, "latent_rope_and_write", counted("rows", triton_mla.latent_rope_and_write))
    monkeypatch.setattr(triton_mla, "latent_decode", counted("decode", triton_mla.latent_decode))
    monkeypatch.setattr(triton_mla, "latent_extend", counted("prompt", triton_mla.latent_extend))
    monkeypatch.setattr(triton_moe, "grouped_topk", counted("route", triton_moe.grouped_topk))
    monkeypatch.setattr(triton_moe, "route", counted("route_product", triton_moe.route))   # decode: with the product
    path, hf = v3
    ps = [prompts(256)[4]]
    refs = [hf_greedy(hf, p, 3) for p in ps]
    with LLM(path, skip_tokenizer_init=True, orchestrator_type="inprocess", kv_cache_config={"tokens_per_block": 16},
             max_num_tokens=64, cuda_graph_config=None) as llm:
        outs = llm.generate(ps, SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    for i, (out, (ref, gaps)) in enumerate(zip(outs, refs, strict=True)):
        assert_same_greedy(out.outputs[0].token_ids, ref, gaps, f"prompt {i}")
    layers = 3
    assert calls["prompt"] >= layers and calls["decode"] == 2 * layers and calls["rows"] == calls["prompt"] + 6
    assert calls["route"] >= layers - 1 and calls["route_product"] == 2 * (layers - 1)   # the first layer is dense


def test_multi_token_prediction_layer_is_passed_over(v3, tmp_path):
    """V3's checkpoints carry a layer past num_hidden_layers (multi-token prediction), which
    transformers does not load either: its tensors are passed over, and the model is unchanged."""
    import shutil

    from safetensors.torch import load_file, save_file
    path, hf = v3
    tensors = load_file(f"{path}/model.safetensors")
    extra = {k.replace("model.layers.2.", "model.layers.3."): v.clone() for k, v in tensors.items()
             if k.startswith("model.layers.2.")}
    extra["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)   # the prediction layer's own tensors
    extra["model.layers.3.enorm.weight"] = torch.ones(64)
    save_file({**tensors, **extra}, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(f"{path}/config.json", tmp_path / "config.json")
    p = prompts(256)[3]
    ref, gaps = hf_greedy(hf, p, 6)
    with LLM(str(tmp_path), skip_tokenizer_init=True, orchestrator_type="inprocess") as llm:
        out = llm.generate([p], SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    assert_same_greedy(out.outputs[0].token_ids, ref, gaps)


def test_lora_and_fp8_kv_cache_are_refused(v3):
    with pytest.raises(ValueError, match="LoRA adapters on DeepSeek"):
        LLM(v3[0], skip_tokenizer_init=True, orchestrator_type="inprocess", lora_config={"max_lora_rank": 8})
    with pytest.raises(ValueError, match="kv_cache_config.dtype: fp8 is not supported with DeepSeek"):
        LLM(v3[0], skip_tokenizer_init=True, orchestrator_type="inprocess", kv_cache_config={"dtype": "fp8"})


def test_config_of_an_older_checkpoint_reads_the_same(v3, tmp_path):
    """config.json as DeepSeek's releases write it (``rope_scaling`` with ``type``, remote-code
    fields transformers ignores: topk_method, scoring_func, moe_layer_freq)."""
    import shutil
    new = resolve_model(v3[0]).config
    with open(f"{v3[0]}/config.json") as f:
        raw = json.load(f)
    params = raw.pop("rope_parameters", None) or raw.pop("rope_scaling")
    raw["rope_theta"] = params.pop("rope_theta", 10000.0)
    params.pop("rope_type", None)
    params["type"] = "yarn"
    raw.update(rope_scaling=params, topk_method="noaux_tc", scoring_func="sigmoid", moe_layer_freq=1)
    shutil.copy(f"{v3[0]}/model.safetensors", tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert resolve_model(str(tmp_path)).config == new


def test_weights_update_from_disk_and_from_a_trainers_tensors(tmp_path):
    """An RL trainer's update: a checkpoint on disk, then tensors named as transformers 5 holds
    them in memory (each layer's experts fused, [E, 2I, H] and [E, H, I]); greedy tokens follow
    the new weights each time, and a fused tensor of the wrong shape is refused by name."""
    from transformers import AutoModelForCausalLM
    a = deepseek_dir(tmp_path / "a", seed=11)
    b = deepseek_dir(tmp_path / "b", seed=12)
    hf_b = AutoModelForCausalLM.from_pretrained(b, dtype=torch.float32).eval()
    with LLM(a, skip_tokenizer_init=True, orchestrator_type="inprocess") as llm:
        named = assert_updates_follow(llm, prompts(256)[3], a, b, hf_b)
        assert "model.layers.1.mlp.experts.gate_up_proj" in dict(named)   # (sent fused)
        with pytest.raises(ValueError, match="experts.down_proj.*does not match"):
            llm.update_weights_from_tensors([("model.layers.1.mlp.experts.down_proj", torch.zeros(8, 64, 31))])
        assert llm.weight_version == "tensors"


def test_a_block_scaled_fp8_checkpoint_serves_what_it_stores(v3, tmp_path):
    """DeepSeek's FP8 checkpoints are block-scaled (``weight_scale_inv``), kv_b_proj included: it is
    dequantized as it loads (absorbed per head, in full precision), every other projection and the
    experts keep their blocks; the tokens are transformers' holding the weights the checkpoint
    stands for."""
    from transformers import AutoModelForCausalLM

    from hf_reference import write_fp8_checkpoint, write_plain_twin
    meant = write_fp8_checkpoint(v3[0], tmp_path / "ckpt", (16, 32), projections=(*MLA_PROJECTIONS, "kv_b_proj"))
    assert any(".kv_b_proj." in n for n in meant) and any(".experts." in n for n in meant)
    ref = AutoModelForCausalLM.from_pretrained(write_plain_twin(v3[0], tmp_path / "plain", meant),
                                               dtype=torch.float32).eval()
    ps = prompts(256)[:4]
    with LLM(str(tmp_path / "ckpt"), skip_tokenizer_init=True, dtype="float32", orchestrator_type="inprocess") as llm:
        outs = llm.generate(ps, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
        model = llm._executor.engine.runner.model
        attn = model.model.decoder_layers[1].self_attn
        assert attn.q_b_proj.fp8_block == (16, 32) and model.model.decoder_layers[1].mlp.fp8_block == (16, 32)
        assert attn.kv_b_proj.weight.dtype == torch.float32
    for i, (p, o) in enumerate(zip(ps, outs, strict=True)):
        want, gaps = hf_greedy(ref, p, 8)
        assert_same_greedy(o.outputs[0].token_ids, want, gaps, f"prompt {i}")


def test_decode_roofline_counts_the_experts_a_token_reads(v3):
    """The bytes a one-token step reads (``stats``' weight_bytes_per_step, the decode bench's
    roofline): every weight but the embedding table, and of the experts top_k of E."""
    import math
    cfg = resolve_model(v3[0]).config
    with LLM(v3[0], skip_tokenizer_init=True, orchestrator_type="inprocess") as llm:
        got = json.loads(llm.control("stats").per_rank[0])["weight_bytes_per_step"]
        shapes = llm._executor.engine.runner.model.checkpoint_shapes()
    share = cfg.num_experts_per_tok / cfg.num_experts
    want = 4 * sum(math.prod(s) * (share if ".experts." in n else 1.0) for n, s in shapes.items()
                   if "embed_tokens" not in n)
    assert got == int(want) and share < 1


def test_latent_attention_takes_the_kernels_whatever_its_heads(tmp_path):
    """The latent kernels take any head count a rank holds (V3's 128 under attention DP; the
    general kernels stop at 16 of its 576-wide heads), so the engine keeps CUDA graphs there;
    blocks under 16 tokens still take the reference."""
    from phalanx.kernels import ops, triton_attention
    from phalanx.models.loader import build_model
    from phalanx.models.parallel import TPGroup
    from phalanx.models.source import resolve_model
    deepseek_v3_config(num_attention_heads=32, num_key_value_heads=32, kv_lora_rank=512,
                       qk_rope_head_dim=64).save_pretrained(tmp_path)     # the releases' latent width
    model = build_model(resolve_model(str(tmp_path)), torch.float32, torch.device("cpu"), TPGroup(), "dummy", 0)
    attn = model.model.decoder_layers[0].self_attn
    assert attn.heads.num_heads == 32 and attn.head_dim == 576
    assert not triton_attention.supports_layout(16, 32, 1, False, 576)
    assert ops.triton_attention_everywhere(model, 16) and not ops.triton_attention_everywhere(model, 8)


def test_kimi_k2_is_read_as_deepseek_v3_without_its_remote_code(v3, tmp_path):
    """Kimi K2 ships DeepSeek-V3's architecture under ``model_type: kimi_k2`` with a config class of
    its own (``auto_map``, remote code): it is read as DeepSeek-V3's config from config.json, none
    of its code run, and serves the same tokens as the V3 checkpoint it is; another architecture
    under that name is refused."""
    import shutil
    path, hf = v3
    kimi = tmp_path / "kimi"
    shutil.copytree(path, kimi)
    with open(kimi / "config.json") as f:
        cfg = json.load(f)
    cfg.update(model_type="kimi_k2", auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config"})
    with open(kimi / "config.json", "w") as f:
        json.dump(cfg, f)
    assert resolve_model(str(kimi)).config == resolve_model(path).config
    ps = prompts(256)[:3]
    with LLM(str(kimi), skip_tokenizer_init=True, orchestrator_type="inprocess") as llm:
        outs = llm.generate(ps, SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
    for i, (p, o) in enumerate(zip(ps, outs, strict=True)):
        want, gaps = hf_greedy(hf, p, 6)
        assert_same_greedy(o.outputs[0].token_ids, want, gaps, f"prompt {i}")
    cfg["architectures"] = ["KimiLinearForCausalLM"]
    with open(kimi / "config.json", "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="architectures"):
        resolve_model(str(kimi))
