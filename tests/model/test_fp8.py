"""``quantization: fp8`` on the CPU (the reference path): the engine's greedy tokens equal
transformers' on the same checkpoint with every decoder projection replaced by its FP8
round trip (quantized per output channel, dequantized); weight updates re-quantize; the FP8
helpers; the kernels' FP8 epilogue against the reference in the Triton interpreter lives in
tests/kernels."""

import copy

import pytest
import torch

from hf_reference import assert_same_greedy, hf_greedy, tiny_model_dirs
from phalanx import LLM, SamplingParams
from phalanx.kernels import fp8

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def fp8_round_trip(hf):
    """transformers' model with each decoder projection's weight as FP8 would hold it."""
    model = copy.deepcopy(hf)
    with torch.no_grad():
        for name, mod in model.named_modules():
            if name.rsplit(".", 1)[-1] in PROJECTIONS:
                q, scale = fp8.quantize_weight(mod.weight)
                mod.weight.copy_(fp8.dequantize(q, scale, mod.weight.dtype))
    return model


def prompts(vocab, n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(2, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_fp8_greedy_equals_transformers_with_the_round_tripped_weights(kind, tiny_models, hf_models):
    ref = fp8_round_trip(hf_models[kind])
    ps = prompts(ref.config.vocab_size)
    with LLM(tiny_models[kind], skip_tokenizer_init=True, dtype="float32", quantization="fp8",
             orchestrator_type="inprocess") as llm:
        outs = llm.generate(ps, SamplingParams(max_tokens=10, ignore_eos=True), use_tqdm=False)
    differ = 0
    for i, (p, o) in enumerate(zip(ps, outs, strict=True)):
        want, gaps = hf_greedy(ref, p, 10)
        assert_same_greedy(o.outputs[0].token_ids, want, gaps, f"{kind} prompt {i}")
        differ += o.outputs[0].token_ids != hf_greedy(hf_models[kind], p, 10)[0]
    assert differ < len(ps)   # and the FP8 model stays close to the original: most greedy paths are its own


def test_fp8_weight_updates_requantize(tiny_models, tmp_path):
    other = tiny_model_dirs(lambda name: tmp_path / name, seed=99)["llama"]
    ps = prompts(256, n=4, seed=3)
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    with LLM(other, skip_tokenizer_init=True, dtype="float32", quantization="fp8",
             orchestrator_type="inprocess") as fresh:
        want = [o.outputs[0].token_ids for o in fresh.generate(ps, sp, use_tqdm=False)]
    with LLM(tiny_models["llama"], skip_tokenizer_init=True, dtype="float32", quantization="fp8",
             orchestrator_type="inprocess") as llm:
        before = [o.outputs[0].token_ids for o in llm.generate(ps, sp, use_tqdm=False)]
        llm.update_weights_from_disk(other)
        after = [o.outputs[0].token_ids for o in llm.generate(ps, sp, use_tqdm=False)]
    assert after == want and before != want


def test_quantization_is_refused_by_name_when_unknown(tiny_models):
    with pytest.raises(ValueError, match="quantization"):
        LLM(tiny_models["llama"], skip_tokenizer_init=True, quantization="int4", orchestrator_type="inprocess")


def test_fp8_helpers_round_trip_within_e4m3_precision():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 96, generator=g) * torch.logspace(-3, 1, 64)[:, None]   # rows of very different sizes
    q, scale = fp8.quantize_weight(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (64,)
    assert (q.float().abs().amax(dim=1) == fp8.FP8_MAX).all()     # each row's largest value maps to 448
    back = fp8.dequantize(q, scale, torch.float32)
    assert ((back - w).abs() <= w.abs().amax(dim=1, keepdim=True) * 2 ** -4).all()   # 3 mantissa bits
    assert torch.equal(fp8.quantize_weight(back)[0].view(torch.uint8), q.view(torch.uint8))   # exact twice
    x = torch.randn(5, 96, generator=g)
    torch.testing.assert_close(fp8.linear(x, q, None, scale), x @ back.T)
    zero_q, zero_scale = fp8.quantize_weight(torch.zeros(3, 16))
    assert torch.isfinite(fp8.dequantize(zero_q, zero_scale, torch.float32)).all()


def test_a_quantized_checkpoint_is_refused_by_name(tiny_models, tmp_path):
    import json
    import shutil
    d = tmp_path / "fp8-ckpt"
    shutil.copytree(tiny_models["llama"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="quantization_config.*'fp8'"):
        LLM(str(d), skip_tokenizer_init=True, orchestrator_type="inprocess")
