"""Gemma 3 (``gemma3_text``) against transformers: logits at every step through the scheduler,
paged pool and chunked prefill; batched greedy tokens with prefix reuse and chunking; the same
on the Triton kernels (interpreter here); FP8 weights against transformers' model holding the
same rounded weights; the config's forms and what is refused by name."""

import json

import pytest
import torch

from gemma3_reference import gemma3_config, gemma3_dir
from hf_reference import (
    assert_greedy_with_prefix_reuse,
    assert_logits_every_step,
    assert_same_greedy,
    assert_updates_follow,
    fp8_round_trip,
    hf_greedy,
)
from phalanx import LLM, SamplingParams
from phalanx.kernels import reference
from phalanx.models.config import ModelConfig
from phalanx.models.source import resolve_model


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    from transformers import AutoModelForCausalLM
    path = gemma3_dir(tmp_path_factory.mktemp("gemma3"))
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(0, vocab, (30,), generator=g).tolist()
    out = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (1, 5, 13, 29)]
    return out + [shared + [5, 6, 7], shared + [8]]   # past the 12-token window; 30 shared tokens


def test_config_reads_gemma3_settings(gemma):
    cfg = resolve_model(gemma[0]).config
    assert cfg.model_type == "gemma3_text" and cfg.norm_unit_offset and cfg.qk_norm and cfg.tie_word_embeddings
    assert cfg.hidden_act == "gelu_pytorch_tanh" and cfg.query_pre_attn_scalar == 24.0
    assert cfg.embed_scale == pytest.approx(8.0) and cfg.rope_local_theta == 100.0
    assert cfg.rope_theta == 10000.0 and dict(cfg.rope_scaling) == {"rope_type": "linear", "factor": 2.0}
    assert cfg.sliding_windows == (12, None, 12, None)
    assert ModelConfig.from_wire(cfg.to_wire()) == cfg


def test_config_of_transformers_4_form_reads_the_same(gemma, tmp_path):
    """A config.json as the published checkpoints write it (rope_theta, rope_local_base_freq,
    rope_scaling and sliding_window_pattern instead of rope_parameters and layer_types)."""
    import shutil
    new = resolve_model(gemma[0]).config
    with open(f"{gemma[0]}/config.json") as f:
        raw = json.load(f)
    for key in ("rope_parameters", "layer_types"):
        raw.pop(key, None)
    raw.update(rope_theta=10000.0, rope_local_base_freq=100.0, rope_scaling={"rope_type": "linear", "factor": 2.0},
               sliding_window_pattern=2)
    for name in ("model.safetensors",):
        shutil.copy(f"{gemma[0]}/{name}", tmp_path / name)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    old = resolve_model(str(tmp_path)).config
    assert old == new


def test_config_of_transformers_before_4_53_reads_the_layer_types_from_the_pattern(gemma):
    """transformers 4.51-4.52's Gemma3TextConfig holds no layer_types, only sliding_window_pattern
    (and rope_local_base_freq): every pattern-th layer is full, the others slide."""
    import types
    with open(f"{gemma[0]}/config.json") as f:
        raw = json.load(f)
    for key in ("rope_parameters", "layer_types"):
        raw.pop(key)
    raw.update(rope_theta=10000.0, rope_local_base_freq=100.0, rope_scaling={"rope_type": "linear", "factor": 2.0},
               sliding_window_pattern=3, num_hidden_layers=6)
    cfg = ModelConfig.from_hf(types.SimpleNamespace(**raw))
    assert cfg.sliding_windows == (12, 12, None, 12, 12, None)
    assert cfg.rope_local_theta == 100.0 and cfg.rope_theta == 10000.0
    assert dict(cfg.rope_scaling) == {"rope_type": "linear", "factor": 2.0}


@pytest.mark.parametrize("field,value,named", [
    ("attn_logit_softcapping", 50.0, "attn_logit_softcapping"),
    ("final_logit_softcapping", 30.0, "final_logit_softcapping"),
    ("use_bidirectional_attention", True, "use_bidirectional_attention"),
    ("hidden_activation", "relu", "hidden_activation"),
])
def test_what_this_decoder_does_not_compute_is_refused_by_name(field, value, named):
    with pytest.raises(ValueError, match=named):
        ModelConfig.from_hf(gemma3_config(**{field: value}))


def test_lora_over_gemma3_is_refused_by_name(gemma):
    with pytest.raises(ValueError, match="LoRA adapters on Gemma 3"):
        LLM(gemma[0], skip_tokenizer_init=True, orchestrator_type="inprocess", lora_config={"max_lora_rank": 8})


@pytest.mark.parametrize("max_num_tokens", [8, 512])
def test_logits_match_transformers_every_step(gemma, max_num_tokens):
    path, hf = gemma
    prompt = torch.randint(0, hf.config.vocab_size, (27,), generator=torch.Generator().manual_seed(0)).tolist()
    assert_logits_every_step(path, hf, prompt, 10, max_num_tokens)


@pytest.mark.parametrize("chunked", [True, False])
def test_batched_greedy_equals_transformers_with_prefix_reuse(gemma, chunked):
    path, hf = gemma
    assert_greedy_with_prefix_reuse(path, hf, prompts(hf.config.vocab_size), chunked)


def test_fp8_greedy_equals_transformers_with_the_round_tripped_weights(gemma):
    """``quantization: fp8``: every projection FP8 with a scale per output row, the GELU MLP's
    down projection on plain rows included."""
    path, hf = gemma
    ref = fp8_round_trip(hf)
    ps = prompts(hf.config.vocab_size)[:4]
    with LLM(path, skip_tokenizer_init=True, dtype="float32", quantization="fp8", orchestrator_type="inprocess") as llm:
        outs = llm.generate(ps, SamplingParams(max_tokens=10, ignore_eos=True), use_tqdm=False)
    for i, (p, o) in enumerate(zip(ps, outs, strict=True)):
        want, gaps = hf_greedy(ref, p, 10)
        assert_same_greedy(o.outputs[0].token_ids, want, gaps, f"prompt {i}")


def test_unit_offset_norm_and_gelu_kernels_equal_their_references():
    """The Triton norm with unit offset (with and without the residual add, and quantizing FP8
    rows) and GELU-tanh-and-mul against torch (interpreter on CPU; Gemma's own forms: transformers'
    Gemma3RMSNorm and gelu_pytorch_tanh)."""
    pytest.importorskip("triton")
    from transformers.activations import ACT2FN
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    from phalanx.kernels import fp8, triton_ops
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 48, generator=g).to(dev)
    r = torch.randn(5, 48, generator=g).to(dev)
    w = (0.5 * torch.randn(48, generator=g)).to(dev)
    hf_norm = Gemma3RMSNorm(48, eps=1e-6).to(dev)
    with torch.no_grad():
        hf_norm.weight.copy_(w)
        torch.testing.assert_close(triton_ops.rms_norm(x, w, 1e-6, True), hf_norm(x), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(reference.rms_norm_ref(x, w, 1e-6, True), hf_norm(x), atol=1e-6, rtol=1e-6)
        out, res = triton_ops.fused_add_rms_norm(x, r, w, 1e-6, True)
        torch.testing.assert_close(res, x + r)
        torch.testing.assert_close(out, hf_norm(x + r), atol=1e-5, rtol=1e-5)
        q, scale, res = triton_ops.rms_norm_fp8(x, r, w, 1e-6, fp8.FP8_MAX, fp8.TINY, True)   # = the two apart
        q_apart, scale_apart = triton_ops.quantize_rows_fp8(out, fp8.FP8_MAX, fp8.TINY)
        assert torch.equal(scale, scale_apart) and torch.equal(q.view(torch.uint8), q_apart.view(torch.uint8))
        gu = torch.randn(5, 2 * 40, generator=g).to(dev) * 3
        want = ACT2FN["gelu_pytorch_tanh"](gu[:, :40]) * gu[:, 40:]
        torch.testing.assert_close(triton_ops.gelu_tanh_and_mul(gu), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(reference.gelu_tanh_and_mul_ref(gu), want)


def test_on_the_triton_path_equals_transformers(gemma, monkeypatch):
    """Every op on its Triton kernel (the interpreter here): the norms with unit offset, GELU,
    rotary with two bases, paged attention with windows and the query scale."""
    pytest.importorskip("triton")
    from phalanx.kernels import ops, triton_ops
    monkeypatch.setattr(ops, "FORCE_TRITON", True)
    calls: dict[str, int] = {}
    for name in ("rms_norm", "fused_add_rms_norm", "gelu_tanh_and_mul", "rope_and_write_kv"):
        real = getattr(triton_ops, name)

        def wrapper(*a, _real=real, _name=name, **kw):
            calls[_name] = calls.get(_name, 0) + 1
            return _real(*a, **kw)
        monkeypatch.setattr(triton_ops, name, wrapper)
    path, hf = gemma
    ps = [prompts(hf.config.vocab_size)[4]]   # 33 tokens: past the 12-token window
    refs = [hf_greedy(hf, p, 2) for p in ps]
    with LLM(path, skip_tokenizer_init=True, orchestrator_type="inprocess", kv_cache_config={"tokens_per_block": 16},
             max_num_tokens=64, cuda_graph_config=None) as llm:
        outs = llm.generate(ps, SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    for i, (out, (ref, gaps)) in enumerate(zip(outs, refs, strict=True)):
        assert_same_greedy(out.outputs[0].token_ids, ref, gaps, f"prompt {i}")
    assert all(calls.get(n, 0) > 0 for n in ("rms_norm", "fused_add_rms_norm", "gelu_tanh_and_mul",
                                             "rope_and_write_kv")), calls


def test_text_decoder_of_a_checkpoint_with_a_vision_tower_equals_transformers(tmp_path):
    """``model_type: gemma3`` (Gemma3ForConditionalGeneration, the 4B-27B): its text decoder from
    ``language_model.*``, the vision tower's tensors passed over; greedy tokens of text prompts
    equal transformers' own multimodal model's."""
    from transformers import Gemma3ForConditionalGeneration

    from gemma3_reference import gemma3_vision_dir
    path = gemma3_vision_dir(tmp_path / "gemma3-vision")
    hf = Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    cfg = resolve_model(path).config
    assert cfg.model_type == "gemma3" and cfg.is_gemma3 and cfg.eos_token_ids == (1, 106)
    assert cfg.sliding_windows == (12, None, 12, None) and cfg.rope_local_theta == 100.0
    ps = prompts(256)[2:]
    with LLM(path, skip_tokenizer_init=True, orchestrator_type="inprocess", kv_cache_config={"tokens_per_block": 8},
             max_num_tokens=16) as llm:
        outs = llm.generate(ps, SamplingParams(max_tokens=10, ignore_eos=True), use_tqdm=False)
    for i, (p, out) in enumerate(zip(ps, outs, strict=True)):
        ref, gaps = hf_greedy(hf, p, 10)
        assert_same_greedy(out.outputs[0].token_ids, ref, gaps, f"prompt {i}")


def test_a_checkpoint_with_a_vision_tower_refuses_what_it_cannot_serve():
    from transformers import Gemma3Config
    with pytest.raises(ValueError, match="quantized checkpoint with a vision tower"):
        ModelConfig.from_hf(Gemma3Config(text_config=gemma3_config().to_dict(),
                                         quantization_config={"quant_method": "fp8"}))


def test_weights_of_a_checkpoint_with_a_vision_tower_update_from_disk_and_from_tensors(tmp_path):
    """An RL trainer's update of a ``gemma3`` model: a checkpoint as published (``language_model.*``
    beside the vision tower), and tensors named as transformers holds them in memory
    (``model.language_model.*``, ``model.vision_tower.*``); the vision tower's are passed over."""
    from transformers import Gemma3ForConditionalGeneration

    from gemma3_reference import gemma3_vision_dir
    a = gemma3_vision_dir(tmp_path / "a", seed=6)
    b = gemma3_vision_dir(tmp_path / "b", seed=7)
    hf_b = Gemma3ForConditionalGeneration.from_pretrained(b, dtype=torch.float32).eval()
    p = prompts(256)[3]
    with LLM(a, skip_tokenizer_init=True, orchestrator_type="inprocess") as llm:
        named = assert_updates_follow(llm, p, a, b, hf_b)
        assert any(n.startswith("model.language_model.") for n, _ in named)
        assert any(n.startswith("model.vision_tower.") for n, _ in named)
        # a tensor the model passes over is still checked as one that travels
        for bad, field in ((dict(dtype="bf16", shape=[2]), "dtype"), (dict(dtype="float32", shape="2"), "shape")):
            with pytest.raises(ValueError, match=field):
                llm.update_weights_from_tensors([{"name": "model.vision_tower.x", **bad}])
        assert llm.weight_version == "tensors"
