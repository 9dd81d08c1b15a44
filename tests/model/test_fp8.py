"""``quantization: fp8`` on the CPU (the reference path): the engine's greedy tokens equal
transformers' on the same checkpoint with every decoder projection replaced by its FP8
round trip (quantized per output channel, dequantized); weight updates re-quantize; the FP8
helpers; the kernels' FP8 epilogue against the reference in the Triton interpreter lives in
tests/kernels."""

import copy

import pytest
import torch

from hf_reference import (
    assert_same_greedy,
    fp8_round_trip,
    hf_greedy,
    tiny_model_dirs,
    write_fp8_checkpoint,
    write_plain_twin,
)
from phalanx import LLM, SamplingParams
from phalanx.kernels import cutlass_gemm, fp8


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


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe"])
def test_fp8_experts_greedy_equals_transformers_with_the_round_tripped_weights(kind, tiny_moe_models, hf_moe_models):
    """MoE models: the experts too, a scale per (expert, output row), through the fused MoE path."""
    plain = hf_moe_models[kind]
    ref = fp8_round_trip(plain)
    ps = prompts(ref.config.vocab_size, n=4, seed=2)
    with LLM(tiny_moe_models[kind], skip_tokenizer_init=True, dtype="float32", quantization="fp8",
             orchestrator_type="inprocess") as llm:
        outs = llm.generate(ps, SamplingParams(max_tokens=8, ignore_eos=True, prompt_logprobs=0), use_tqdm=False)
    off_plain = 0.0
    for i, (p, o) in enumerate(zip(ps, outs, strict=True)):
        want, gaps = hf_greedy(ref, p, 8)
        assert_same_greedy(o.outputs[0].token_ids, want, gaps, f"{kind} prompt {i}")
        ours = torch.tensor([lp[t].logprob for lp, t in zip(o.prompt_logprobs[1:], p[1:], strict=True)])
        with torch.no_grad():
            for model, tol in ((ref, 1e-4), (plain, None)):
                theirs = model(torch.tensor([p])).logits[0, :-1].log_softmax(-1).gather(1, torch.tensor(p[1:])[:, None])
                if tol is not None:
                    torch.testing.assert_close(ours, theirs[:, 0], atol=tol, rtol=0)
                else:
                    off_plain = max(off_plain, (ours - theirs[:, 0]).abs().max().item())
    assert off_plain > 1e-3      # the experts really are FP8: the unquantized model is measurably elsewhere


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


def test_block_scaled_fp8_weight_updates_quantize_by_block(tiny_models, tmp_path):
    """A model served from a block-scaled FP8 checkpoint, updated with another model's
    full-precision weights, quantizes them a block at a time: it then gives the tokens of an
    engine started from that model's block-scaled checkpoint."""
    other = tiny_model_dirs(lambda name: tmp_path / name, seed=99)["llama"]
    write_fp8_checkpoint(other, tmp_path / "other8", (16, 32))
    write_fp8_checkpoint(tiny_models["llama"], tmp_path / "mine8", (16, 32))
    ps = prompts(256, n=4, seed=3)
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    with LLM(str(tmp_path / "other8"), skip_tokenizer_init=True, dtype="float32",
             orchestrator_type="inprocess") as fresh:
        want = [o.outputs[0].token_ids for o in fresh.generate(ps, sp, use_tqdm=False)]
    with LLM(str(tmp_path / "mine8"), skip_tokenizer_init=True, dtype="float32",
             orchestrator_type="inprocess") as llm:
        before = [o.outputs[0].token_ids for o in llm.generate(ps, sp, use_tqdm=False)]
        llm.update_weights_from_disk(other)
        after = [o.outputs[0].token_ids for o in llm.generate(ps, sp, use_tqdm=False)]
    assert after == want and before != want


@pytest.mark.parametrize("kind", ["llama", "moe"])
def test_fp8_weights_are_built_fp8_and_quantized_as_they_load(kind, tiny_models, tiny_moe_models):
    """quantization: fp8 builds every projection (the output layer excepted) and the experts in
    e4m3 before anything loads — the model is never held in full precision — and each loaded
    row gets exactly what quantizing the full-precision model row by row gives."""
    from phalanx.models.layers import ParallelLMHead, Projection, fp8_weights
    from phalanx.models.loader import build_model, model_class
    from phalanx.models.source import resolve_model
    source = resolve_model(tiny_moe_models["qwen3_moe"] if kind == "moe" else tiny_models["llama"])
    with torch.device("cpu"), fp8_weights():
        empty = model_class(source.config)(source.config, None)
    quantized = [m.weight for m in empty.modules() if isinstance(m, Projection) and not isinstance(m, ParallelLMHead)]
    quantized += [p for n, p in empty.named_parameters() if n.endswith(("w13", "w2"))]
    assert quantized and all(p.dtype == fp8.FP8 for p in quantized)
    assert all(p.dtype != fp8.FP8 for n, p in empty.named_parameters() if "embed" in n or "norm" in n)
    full = build_model(source, torch.float32, torch.device("cpu"), load_format="dummy", seed=5)
    ours = build_model(source, torch.float32, torch.device("cpu"), load_format="dummy", seed=5, fp8=True)
    got, want = dict(ours.named_parameters()), dict(full.named_parameters())
    checked = 0
    for name, w in want.items():
        if got[name].dtype == fp8.FP8:
            experts = name.endswith(("w13", "w2"))
            scale = got[name + "_scale"] if experts else got[name.removesuffix("weight") + "weight_scale"]
            rows = w.reshape(-1, w.shape[-1])
            q, s = fp8.quantize_weight(rows)
            assert torch.equal(got[name].reshape(-1, w.shape[-1]).view(torch.uint8), q.view(torch.uint8)), name
            assert torch.equal(scale.reshape(-1), s), name
            checked += 1
        else:
            assert torch.equal(got[name], w), name
    assert checked == len(quantized)
    stray = "model.layers.0.mlp.down_proj.weight_scale"      # scales come with their weights, never by name
    with pytest.raises(ValueError, match="has no place"):
        ours.load_weights([(stray, torch.ones(1))], partial=True)


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


def test_a_cpu_weight_keeps_its_dequantized_copy_until_it_or_its_scale_is_written():
    """The CPU reference dequantizes a weight once, not every call, and never serves a stale copy."""
    g = torch.Generator().manual_seed(1)
    q, scale = fp8.quantize_weight(torch.randn(32, 48, generator=g))
    x = torch.randn(3, 48, generator=g, dtype=torch.bfloat16)

    def expect() -> torch.Tensor:
        return torch.nn.functional.linear(x, fp8.dequantize(q, scale, x.dtype))

    assert torch.equal(fp8.reference(x, q, None, scale), expect())
    kept = q._phalanx_dequantized[1]
    assert torch.equal(fp8.reference(x, q, None, scale), expect()) and q._phalanx_dequantized[1] is kept
    new_q, new_scale = fp8.quantize_weight(torch.randn(32, 48, generator=g))
    with torch.inference_mode():            # as a weight update writes: in place, without autograd
        q.copy_(new_q)
    assert torch.equal(fp8.reference(x, q, None, scale), expect())
    scale.copy_(new_scale)
    assert torch.equal(fp8.reference(x, q, None, scale), expect())
    x32 = x.float()
    assert torch.equal(fp8.reference(x32, q, None, scale), x32 @ fp8.dequantize(q, scale, torch.float32).T)


@pytest.mark.parametrize("block,compressed", [((16, 32), None), (None, None), (None, "tensor"),
                                              (None, "channel"), ((16, 32), "block")])
def test_an_fp8_checkpoint_serves_what_it_stores(block, compressed, tiny_models, hf_models, tmp_path, caplog):
    """FP8 checkpoints with a scale per tensor or per row (quant_method fp8, compressed-tensors
    "tensor" and "channel") or per block (quant_method fp8 with weight_block_size,
    compressed-tensors "block") are served with their own bytes and scales: the tokens of
    transformers holding the weights the checkpoint stands for; a weight update from the same
    checkpoint changes nothing."""
    meant = write_fp8_checkpoint(tiny_models["llama"], tmp_path / "ckpt", block, compressed)
    ref = copy.deepcopy(hf_models["llama"])
    with torch.no_grad():
        params = dict(ref.named_parameters())
        for name, w in meant.items():
            params[name].copy_(w)
    ps = prompts(ref.config.vocab_size, n=4, seed=5)
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    with LLM(str(tmp_path / "ckpt"), skip_tokenizer_init=True, dtype="float32",
             orchestrator_type="inprocess") as llm:
        outs = llm.generate(ps, sp, use_tqdm=False)
        llm.update_weights_from_disk(str(tmp_path / "ckpt"))
        again = llm.generate(ps, sp, use_tqdm=False)
    if block is None and compressed != "channel":   # input_scale tensors: said, not silently dropped
        assert any("scales not used" in r.getMessage() for r in caplog.records)
    for i, (p, o, o2) in enumerate(zip(ps, outs, again, strict=True)):
        want, gaps = hf_greedy(ref, p, 8)
        assert_same_greedy(o.outputs[0].token_ids, want, gaps, f"prompt {i}")
        assert o2.outputs[0].token_ids == o.outputs[0].token_ids


def test_block_scaled_fp8_experts_serve_what_the_checkpoint_stores(tiny_moe_models, tmp_path):
    """A block-scaled Qwen3-MoE FP8 checkpoint on one rank: the experts and projections keep
    their blocks (the experts' 48 intermediate columns end inside a block of 32) and the tokens
    are transformers' holding the weights the checkpoint stands for."""
    from phalanx.models.layers import Projection
    from phalanx.models.loader import build_model
    from phalanx.models.moe import SparseMoE
    from phalanx.models.source import resolve_model
    meant = write_fp8_checkpoint(tiny_moe_models["qwen3_moe"], tmp_path / "ckpt", (16, 32))
    model = build_model(resolve_model(str(tmp_path / "ckpt")), torch.float32, torch.device("cpu"), fp8=True)
    moes = [m for m in model.modules() if isinstance(m, SparseMoE)]
    assert moes and all(m.fp8_block == (16, 32) and m.w13_scale.shape == (8, 6, 2) for m in moes)
    assert all(m.fp8_block == (16, 32) for m in model.modules() if isinstance(m, Projection) and m.plan.fp8)
    from transformers import AutoModelForCausalLM
    plain = write_plain_twin(tiny_moe_models["qwen3_moe"], tmp_path / "plain", meant)
    ref = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32).eval()
    ps = prompts(ref.config.vocab_size, n=3, seed=9)
    with LLM(str(tmp_path / "ckpt"), skip_tokenizer_init=True, dtype="float32",
             orchestrator_type="inprocess") as llm:
        outs = llm.generate(ps, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    for i, (p, o) in enumerate(zip(ps, outs, strict=True)):
        want, gaps = hf_greedy(ref, p, 8)
        assert_same_greedy(o.outputs[0].token_ids, want, gaps, f"prompt {i}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("compressed,block", [(None, None), ("channel", None), (None, (16, 32))])
@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_an_fp8_checkpoint_is_stored_as_it_is(kind, compressed, block, dtype, tiny_models, tiny_moe_models,
                                              tmp_path, caplog):
    """An FP8 checkpoint with a scale per tensor (quant_method fp8), per row (compressed-tensors
    "channel") or per block (weight_block_size) keeps its e4m3 bytes and scales in the engine's
    FP8 projections and experts, on every rank of a split: each row holds exactly the weight the
    checkpoint stands for (quantizing the dequantized weight again, in the model's dtype, would
    round it a second time). Block-scaled layers keep a scale per block where the rank's rows
    and columns fall on whole blocks; the Qwen3-MoE experts split over two ranks (24 of 48
    intermediate rows each, blocks of 16) do not, and keep a scale per row, rounded again."""


    from phalanx.models.loader import build_model
    from phalanx.models.parallel import TPGroup
    from phalanx.models.source import resolve_model
    src = tiny_moe_models[kind] if kind == "qwen3_moe" else tiny_models[kind]
    meant = write_fp8_checkpoint(src, tmp_path / "fp8", block, compressed)
    plain = write_plain_twin(src, tmp_path / "plain", meant)   # the reference's placement on each rank
    cpu = torch.device("cpu")
    for rank in (0, 1):
        tp = TPGroup(rank=rank, size=2)
        ours = build_model(resolve_model(str(tmp_path / "fp8")), dtype, cpu, tp, fp8=True)
        full = build_model(resolve_model(str(plain)), torch.float32, cpu, tp)
        got, want = dict(ours.named_parameters()), dict(full.named_parameters())
        modules = dict(ours.named_modules())
        checked = kept_blocks = 0
        for name, w in want.items():
            if got[name].dtype != fp8.FP8:
                assert torch.equal(got[name], w.to(dtype)), name
                continue
            experts = name.endswith(("w13", "w2"))
            owner = modules[name.rsplit(".", 1)[0]]
            scale = got[name + "_scale"] if experts else got[name.removesuffix("weight") + "weight_scale"]
            K = w.shape[-1]
            if owner.fp8_block is not None:
                assert owner.fp8_block == block and not experts, name
                back = torch.cat([fp8.dequantize_blocks(q_, s_, block, torch.float32)
                                  for q_, s_ in zip(got[name].reshape(-1, *w.shape[-2:]),
                                                    scale.reshape(-1, *scale.shape[-2:]), strict=True)])
                kept_blocks += 1
            else:
                back = fp8.dequantize(got[name].reshape(-1, K), scale.reshape(-1), torch.float32)
            if block is not None and owner.fp8_block is None:   # split inside a block: a scale a row
                assert experts, name
                # within e4m3's rounding of each row: a step is 1/16 of a value, 2^-9 of the scale below 2^-6
                torch.testing.assert_close(back, w.reshape(-1, K), atol=scale.max().item() * 2 ** -9, rtol=2 ** -4)
            else:
                assert torch.equal(back, w.reshape(-1, K).reshape(back.shape)), (rank, name)
            checked += 1
        assert checked == 4 * ours.config.num_layers   # q‖k‖v, o, and gate‖up and down (or the experts) a layer
        if block is not None:
            assert kept_blocks == checked - (2 * ours.config.num_layers if kind == "qwen3_moe" else 0)
            said = [r.getMessage() for r in caplog.records if "split inside a block" in r.getMessage()]
            assert bool(said) == (kind == "qwen3_moe"), said      # the layers rounded again are said
            caplog.clear()


INT4_GROUP = {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}


FP8_W = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "channel"}


def ct(groups, **top):
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": groups, **top}


@pytest.mark.parametrize("qc,block", [
    (ct({"g": {"weights": FP8_W}}), ()),
    (ct({"g": {"weights": {**FP8_W, "type": "FLOAT", "strategy": None}}}, format="naive-quantized"), ()),
    (ct({"a": {"weights": FP8_W, "format": "float-quantized"},
         "b": {"weights": {**FP8_W, "strategy": "block", "block_structure": "128x128"}, "format": "naive-quantized"}},
        format="mixed-precision"), (128, 128)),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, (128, 128)),
    ({"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_scheme": {"num_bits": 8, "type": "float"}}, ()),
    ({"quant_method": "modelopt", "quantization": {"quant_algo": "fp8_per_channel_per_token",
                                                   "kv_cache_quant_algo": "FP8"}}, ()),
    (ct({}, kv_cache_scheme={"num_bits": 8, "type": "float", "symmetric": True}), None),   # the KV cache alone
])
def test_fp8_checkpoint_configs_that_are_read(qc, block):
    """The quantization_config forms an FP8 checkpoint comes in: -> the block shape of its scales."""
    from phalanx.models.config import _fp8_checkpoint
    assert _fp8_checkpoint(qc) == block


@pytest.mark.parametrize("qc,match", [
    (ct({"g": {"weights": FP8_W}}, sparsity_config={"format": "sparse-24"}), "sparsity_config"),
    (ct({"g": {"weights": FP8_W}}, quantization_status="frozen"), "quantization_status 'frozen'"),
    (ct({"g": {"weights": {**FP8_W, "dynamic": True}}}), "weights.dynamic"),
    (ct({"g": {"weights": {**FP8_W, "symmetric": False}}}), "weights.symmetric"),
    (ct({"g": {"weights": FP8_W, "input_activations": {"num_bits": 8, "type": "int"}}}), "input_activations"),
    (ct({"a": {"weights": {**FP8_W, "strategy": "block", "block_structure": [128, 128]}},
         "b": {"weights": {**FP8_W, "strategy": "block", "block_structure": [64, 64]}}}), "one block shape"),
    (ct({"g": {"weights": FP8_W}}, format="mixed-precision"), "format 'mixed-precision'"),
    (ct({"g": {"weights": {**FP8_W, "strategy": "block", "block_structure": [True, 128]}}}), "block_structure"),
])
def test_compressed_tensors_schemes_other_than_fp8_weights_are_refused_by_name(qc, match):
    from phalanx.models.config import _fp8_checkpoint
    with pytest.raises(ValueError, match=match):
        _fp8_checkpoint(qc)


@pytest.mark.parametrize("qc,match", [
    ({"quant_method": "awq", "bits": 4}, "quant_method 'awq'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": INT4_GROUP}},
     "format 'pack-quantized'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": INT4_GROUP}},
     r"config_groups.g.weights must be 8-bit floats"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128}}}},
     "strategy 'group'"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "quant_algo 'NVFP4'"),
    ({"quant_method": "modelopt", "quantization": {"quant_algo": "FP8_PB_WO"}}, "quant_algo 'FP8_PB_WO'"),
    ({"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": "NVFP4"},
     "kv_cache_quant_algo 'NVFP4'"),
    (ct({"g": {"weights": FP8_W}}, kv_cache_scheme={"num_bits": 8, "type": "int", "symmetric": True}),
     "kv_cache_scheme .* not supported"),
    (ct({"g": {"weights": FP8_W}}, kv_cache_scheme={"num_bits": 8, "type": "float", "symmetric": False}),
     "kv_cache_scheme.symmetric must be true"),
])
def test_other_quantized_checkpoints_are_refused_by_name(qc, match, tiny_models, tmp_path):
    import json
    import shutil
    d = tmp_path / "other"
    shutil.copytree(tiny_models["llama"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = qc
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match):
        LLM(str(d), skip_tokenizer_init=True, orchestrator_type="inprocess")


def test_an_fp8_kv_pool_holds_more_tokens_and_keeps_the_greedy_tokens_close(tiny_models):
    """kv_cache_config dtype fp8 (e4m3, scale 1): the same pool bytes hold four times the blocks
    of float32 KV, and greedy decoding mostly agrees with it (K and V rounded to 3 mantissa bits)."""
    ps = prompts(256, n=8, seed=6)
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    out, blocks = {}, {}
    for kv in ("auto", "fp8"):
        with LLM(tiny_models["llama"], skip_tokenizer_init=True, dtype="float32", orchestrator_type="inprocess",
                 kv_cache_config={"dtype": kv, "max_gpu_total_bytes": 8 << 20}) as llm:
            out[kv] = [o.outputs[0].token_ids for o in llm.generate(ps, sp, use_tqdm=False)]
            blocks[kv] = llm.engine_info.num_kv_blocks
    assert blocks["fp8"] == 4 * blocks["auto"]
    first = sum(a[0] == b[0] for a, b in zip(out["auto"], out["fp8"], strict=True))
    same = sum(a == b for a, b in zip(out["auto"], out["fp8"], strict=True))
    assert first >= 7 and same >= 4, (first, same)


def test_a_broken_fp8_checkpoint_is_refused_before_any_weight_changes(tiny_models, tmp_path):
    """A weight update from an FP8 checkpoint whose scales do not pair up (or do not fit) is
    refused by name before a single tensor is copied: the served tokens stay the same."""
    from safetensors.torch import load_file, save_file
    write_fp8_checkpoint(tiny_models["llama"], tmp_path / "ckpt", (16, 32))
    f = tmp_path / "ckpt" / "model.safetensors"
    tensors = load_file(f)
    del tensors["model.layers.1.mlp.down_proj.weight_scale_inv"]
    save_file(tensors, f)
    ps = prompts(256, n=3, seed=8)
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    with LLM(tiny_models["llama"], skip_tokenizer_init=True, dtype="float32", quantization="fp8",
             orchestrator_type="inprocess") as llm:
        before = [o.outputs[0].token_ids for o in llm.generate(ps, sp, use_tqdm=False)]
        with pytest.raises(Exception, match="down_proj has a weight without its scale"):
            llm.update_weights_from_disk(str(tmp_path / "ckpt"))
        after = [o.outputs[0].token_ids for o in llm.generate(ps, sp, use_tqdm=False)]
    assert after == before
    # a first load is refused the same way, from the headers, before a tensor is read
    from phalanx.models import loader
    from phalanx.models.source import resolve_model
    read = []
    real = loader.iter_hf_weights

    def reading(path):
        for item in real(path):
            read.append(item[0])
            yield item
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loader, "iter_hf_weights", reading)
        with pytest.raises(ValueError, match="down_proj has a weight without its scale"):
            list(loader.checkpoint_weights(resolve_model(str(tmp_path / "ckpt")), torch.float32))
    assert read == []


def test_a_norm_in_front_of_an_fp8_projection_hands_over_rows_quantized_per_row(tiny_models, monkeypatch):
    """A norm whose projection multiplies FP8 rows (``fp8_rows_above``, set by the engine on a GPU)
    quantizes the batches of more rows itself: the rows and scales of quantizing its output, the
    residual unchanged, and the projection takes them as they are; fewer rows stay in the model's
    dtype for the skinny kernels. On the CPU no projection takes FP8 rows, so the engine sets none."""
    from phalanx.kernels import ops
    from phalanx.models.loader import build_model
    from phalanx.models.parallel import TPGroup
    from phalanx.models.source import resolve_model
    source = resolve_model(tiny_models["llama"])
    model = build_model(source, torch.float32, torch.device("cpu"), load_format="dummy", seed=3, fp8=True)
    layer = model.model.decoder_layers[0]
    layer.prepare_fp8_rows(torch.bfloat16)
    assert layer.input_layernorm.fp8_rows_above is None and layer.post_attention_layernorm.fp8_rows_above is None
    norm, mlp = layer.post_attention_layernorm, layer.mlp
    g = torch.Generator().manual_seed(9)
    H = source.config.hidden_size
    x, res = torch.randn(9, H, generator=g), torch.randn(9, H, generator=g)
    norm.fp8_rows_above = 4
    rows, new_res = norm(x, res)
    h, want_res = ops.fused_add_rms_norm(x, res, norm.weight, norm.eps)
    want = fp8.quantize_rows_reference(h)
    assert isinstance(rows, fp8.Fp8Rows) and rows.dtype == torch.float32 and rows.shape == (9, H)
    assert torch.equal(rows.q.view(torch.uint8), want.q.view(torch.uint8)) and torch.equal(rows.scale, want.scale)
    assert torch.equal(new_res, want_res)
    gu = mlp.gate_up_proj
    torch.testing.assert_close(gu(rows), fp8.reference(want.dequantize(), gu.weight, gu.bias, gu.weight_scale))
    torch.testing.assert_close(mlp(rows), mlp(want.dequantize()))
    over_ranks, over_res = norm(x, res, TPGroup())      # a deferred row-parallel output, one rank here
    assert torch.equal(over_ranks.q.view(torch.uint8), want.q.view(torch.uint8)) and torch.equal(over_res, want_res)
    few, few_res = norm(x[:4], res[:4])
    assert isinstance(few, torch.Tensor) and torch.equal(few, h[:4]) and torch.equal(few_res, want_res[:4])
    alone = layer.input_layernorm
    alone.fp8_rows_above = 4
    first = alone(x)                                        # the first layer's norm: no residual
    assert isinstance(first, fp8.Fp8Rows)
    assert torch.equal(first.q.view(torch.uint8),
                       fp8.quantize_rows_reference(ops.rms_norm(x, alone.weight, alone.eps)).q.view(torch.uint8))
    # where the projections do take FP8 rows (a GPU with the row-wise FP8 GEMM), the engine sets
    # both norms to hand over above the skinny buckets and runs each such form once, shapes and all
    monkeypatch.setattr(fp8, "takes_fp8_rows", lambda q, dtype, block=None: True)
    for other in model.model.decoder_layers:
        other.prepare_fp8_rows(torch.float32)
        assert other.input_layernorm.fp8_rows_above == 64 and other.post_attention_layernorm.fp8_rows_above == 64


def test_many_row_plans_bucket_batches_and_take_cutlass_tiles_of_the_weights_type(monkeypatch):
    """Batches above the skinny buckets fall in MANY_ROW_BUCKETS (the last takes every larger
    batch); a many-row plan is cuBLAS, or a CUTLASS tile of the weight's type (FP8 or bf16). Binding a plan
    loads the tile's library and never builds it (no library on a CPU: a stand-in that records
    its calls takes its place, and the CPU's reference path never calls it)."""
    from phalanx.kernels.linear_plan import CUBLAS, MANY_ROW_BUCKETS, LinearPlan, Neighbour, Plan, bucket_index
    monkeypatch.setenv("PHALANX_CACHE_DIR", "/nonexistent-phalanx-cache")
    if cutlass_gemm.headers() and cutlass_gemm.nvcc():
        with pytest.raises(RuntimeError, match="is not built"):
            cutlass_gemm.kernel.__wrapped__(cutlass_gemm.TILES[0])
    calls = []
    monkeypatch.setattr(cutlass_gemm, "kernel", lambda tile: lambda *a: calls.append(tile))
    assert [bucket_index(r) for r in (1, 2, 16, 17, 64, 65, 128, 129, 256, 257, 2048, 2049, 8192, 8193, 10 ** 6)] == \
        [0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 7, 8, 9, 9, 9]
    tile = cutlass_gemm.TILES[0]
    many = (CUBLAS, Plan("cutlass", tile)) + (CUBLAS,) * (len(MANY_ROW_BUCKETS) - 2)
    plan = LinearPlan(Neighbour.PLAIN, fp8=True, many=many)
    assert len(plan.launches) == 3 + len(MANY_ROW_BUCKETS) and not plan.is_reference
    assert f"≤{MANY_ROW_BUCKETS[1]} rows cutlass" in str(plan)
    with pytest.raises(ValueError, match=r"a CUTLASS tile of the weight's type \(bf16\)"):
        LinearPlan(Neighbour.PLAIN, fp8=False, many=many)        # an FP8 tile for a bf16 weight
    bf16_many = (CUBLAS, Plan("cutlass", cutlass_gemm.TILES_BF16[0])) + (CUBLAS,) * (len(MANY_ROW_BUCKETS) - 2)
    with pytest.raises(ValueError, match=r"a CUTLASS tile of the weight's type \(fp8\)"):
        LinearPlan(Neighbour.PLAIN, fp8=True, many=bf16_many)
    bf16_plan = LinearPlan(Neighbour.PLAIN, fp8=False, many=bf16_many)
    assert f"≤{MANY_ROW_BUCKETS[1]} rows cutlass(64, 128, 64, 1, 1, True, 'bf16')" in str(bf16_plan)
    with pytest.raises(ValueError, match="bucket of many rows"):
        LinearPlan(Neighbour.PLAIN, fp8=True, many=(CUBLAS,))
    # on a CPU the FP8 projection runs the reference whatever GEMM its plan names
    x, w = torch.randn(200, 32), torch.randn(48, 32)   # the bucket of 256 rows: the CUTLASS plan
    q, scale = fp8.quantize_weight(w)
    torch.testing.assert_close(plan(x, q, None, scale), fp8.reference(x, q, None, scale))
    assert calls == []
    # a bf16 plan's CUTLASS bucket calls the tile's GEMM (a, None, w, None), the bias added after
    got = []
    monkeypatch.setattr(cutlass_gemm, "kernel",
                        lambda tile: lambda a, sa, b, sb: got.append((tile, sa, sb)) or a @ b.t())
    bf16_plan = LinearPlan(Neighbour.PLAIN, fp8=False, many=bf16_many)
    xb, wb, bb = torch.randn(200, 32), torch.randn(48, 32), torch.randn(48)
    torch.testing.assert_close(bf16_plan(xb, wb, bb), torch.nn.functional.linear(xb, wb, bb))
    assert got == [(cutlass_gemm.TILES_BF16[0], None, None)]
    bf16_plan(xb[:100], wb)                                  # 100 rows: the first bucket, cuBLAS
    assert len(got) == 1


def test_cublas_block_scaled_plans_take_block_scaled_weights_only():
    """cuBLASLt's block-scaled GEMM (``CUBLAS_BLOCK``) may be the plan of any bucket of a weight
    scaled per block, and of no other weight's; on a CPU the projection runs the reference (on a
    Hopper GPU cuBLASLt, eagerly and in a CUDA graph: tests/kernels)."""
    from phalanx.kernels.linear_plan import (
        BLOCK_GEMM_TILE,
        CUBLAS_BLOCK,
        MANY_ROW_BUCKETS,
        ROW_BUCKETS,
        LinearPlan,
        Neighbour,
        Plan,
        launcher,
    )
    plans, many = (CUBLAS_BLOCK,) * len(ROW_BUCKETS), (CUBLAS_BLOCK,) * len(MANY_ROW_BUCKETS)
    plan = LinearPlan(Neighbour.SILU, plans, True, many, block=(128, 128))
    assert "≤1 rows cublas-block" in str(plan) and not plan.is_reference
    x, w = torch.randn(70, 2 * 160), torch.randn(200, 160)
    q, scale = fp8.quantize_blocks(w, (128, 128))
    act = torch.nn.functional.silu(x[:, :160]) * x[:, 160:]
    for rows in (1, 70):
        torch.testing.assert_close(plan(x[:rows], q, None, scale),
                                   fp8.reference(act[:rows], q, None, scale, (128, 128)))
    with pytest.raises(ValueError, match="many rows take cuBLAS"):
        LinearPlan(Neighbour.PLAIN, fp8=True, many=many)                    # a weight scaled per row
    for fp8_weight, block in ((False, (128, 128)), (True, (16, 32))):    # a full-precision one; other blocks
        with pytest.raises(ValueError, match="128 x 128 block only"):
            launcher(CUBLAS_BLOCK, Neighbour.PLAIN, fp8=fp8_weight, block=block)
    with pytest.raises(ValueError, match="block-scaled FP8 weight takes"):   # K split: up to 64 rows only
        LinearPlan(Neighbour.PLAIN, plans, True, (Plan("triton", BLOCK_GEMM_TILE._replace(splits=2)),) + many[1:],
                   block=(128, 128))


def test_many_row_buckets_are_timed_across_their_rows():
    """Each many-row bucket is timed at rows inside it, ascending, multiples of 8, its bound last;
    the small ones at four points (cuBLAS's pick at one row count can be far off its neighbours')."""
    from phalanx.kernels.gemv_tuner import SAMPLED_UP_TO, many_bucket_samples
    from phalanx.kernels.linear_plan import MANY_ROW_BUCKETS, ROW_BUCKETS, bucket_index
    for i, bound in enumerate(MANY_ROW_BUCKETS):
        points = many_bucket_samples(i)
        assert points[-1] == bound and list(points) == sorted(set(points))
        assert all(p % 8 == 0 and bucket_index(p) == len(ROW_BUCKETS) + i for p in points)
        assert len(points) == (4 if bound <= SAMPLED_UP_TO else 1)
    assert many_bucket_samples(MANY_ROW_BUCKETS.index(512)) == (320, 384, 448, 512)


def test_cutlass_tiles_are_named_apart_and_unavailable_off_a_gpu():
    from phalanx.kernels import gemv_tuner
    from phalanx.kernels.linear_plan import CUBLAS, MANY_ROW_BUCKETS
    tiles = cutlass_gemm.TILES + cutlass_gemm.TILES_BF16
    names = [t.name for t in tiles]
    assert len(set(names)) == len(names)
    for t in tiles:
        assert f"-DPHALANX_NAME={t.name}" in t.defines() and (t.pingpong or t.m >= 128)  # cooperative: M ≥ 128
        assert f"-DPHALANX_BF16={int(t.dtype == 'bf16')}" in t.defines() and t.name.startswith(t.dtype)
        assert t.k * (1 if t.dtype == "fp8" else 2) == 128     # a K tile of 128 bytes: one TMA swizzle atom
    assert cutlass_gemm.why_unavailable(torch.device("cpu")) == "not a CUDA device"
    q, _ = fp8.quantize_weight(torch.randn(64, 32))
    assert gemv_tuner.tune_many(q, torch.bfloat16) == (CUBLAS,) * len(MANY_ROW_BUCKETS)
    w = torch.randn(64, 32, dtype=torch.bfloat16)
    assert gemv_tuner.tune_many(w, torch.bfloat16, fp8=False) == (CUBLAS,) * len(MANY_ROW_BUCKETS)


@pytest.mark.skipif(not (cutlass_gemm.headers() and cutlass_gemm.nvcc()),
                    reason="needs nvcc and the nvidia-cutlass package")
def test_cutlass_libraries_are_keyed_by_what_goes_into_them(tmp_path, monkeypatch):
    monkeypatch.setenv("PHALANX_CACHE_DIR", str(tmp_path))
    a, b = (cutlass_gemm.library_path(t) for t in cutlass_gemm.TILES[:2])
    assert a != b and a.parent == b.parent == tmp_path / "cutlass"
    same_shape_bf16 = cutlass_gemm.TILES[0]._replace(dtype="bf16")
    assert cutlass_gemm.library_path(same_shape_bf16) not in (a, b)
    assert a == cutlass_gemm.library_path(cutlass_gemm.TILES[0])
    monkeypatch.setattr(cutlass_gemm, "FLAGS", cutlass_gemm.FLAGS + ("-lineinfo",))
    assert cutlass_gemm.library_path(cutlass_gemm.TILES[0]) != a


def test_modules_an_fp8_checkpoint_keeps_in_full_precision_are_refused_not_rounded(tiny_models, tmp_path):
    """A module an FP8 checkpoint lists as kept in full precision (``modules_to_not_convert``,
    ``ignored_layers``, compressed-tensors' ``ignore``, by name, last part or "re:" pattern)
    that this engine would serve in FP8 is refused by name: quantizing it would round a weight
    the checkpoint kept exact. Listed modules the engine keeps in full precision anyway
    (lm_head) load."""
    import json

    from phalanx.models.loader import build_model
    from phalanx.models.source import resolve_model
    write_fp8_checkpoint(tiny_models["llama"], tmp_path / "ckpt", (16, 32))
    path = tmp_path / "ckpt" / "config.json"
    cfg = json.loads(path.read_text())
    cpu = torch.device("cpu")
    for key, listed, refused in [("modules_to_not_convert", ["lm_head"], None),
                                 ("ignored_layers", ["model.layers.1.self_attn.o_proj"], "o_proj"),
                                 ("modules_to_not_convert", ["down_proj"], "down_proj"),
                                 ("modules_to_not_convert", ["re:.*layers\\.0\\.mlp.*"], "layers.0.mlp"),
                                 ("exclude_modules", ["lm_head", "model.layers.1.mlp.*"], "layers.1.mlp")]:
        path.write_text(json.dumps({**cfg, "quantization_config": {**cfg["quantization_config"], key: listed}}))
        source = resolve_model(str(tmp_path / "ckpt"))
        assert len(source.config.fp8_unquantized) == len(listed)
        if refused is None:
            build_model(source, torch.float32, cpu, fp8=True)
            continue
        with pytest.raises(ValueError, match=f"quantization_config lists .* keeps .*{refused}.* refused"):
            build_model(source, torch.float32, cpu, fp8=True)
    path.write_text(json.dumps({**cfg, "quantization_config": {**cfg["quantization_config"],
                                                                "modules_to_not_convert": "lm_head"}}))
    assert resolve_model(str(tmp_path / "ckpt")).config.fp8_unquantized == ("lm_head",)
    path.write_text(json.dumps({**cfg, "quantization_config": {**cfg["quantization_config"], "ignore": [3]}}))
    with pytest.raises(ValueError, match="quantization_config.ignore must be a list of module names"):
        resolve_model(str(tmp_path / "ckpt"))


def test_fp8_checkpoint_scales_that_are_not_finite_and_weights_that_are_not_matrices_are_refused_by_name():
    from phalanx.models.loader import fp8_checkpoint_weights
    q = torch.zeros(32, 64).to(fp8.FP8)
    for scale in (torch.full((2, 2), float("nan")), torch.tensor([float("inf")]), torch.ones(2, 2, dtype=torch.int32)):
        with pytest.raises(ValueError, match="FP8 checkpoint: model.layers.0.mlp.up_proj's scale must be finite"):
            list(fp8_checkpoint_weights(iter([("model.layers.0.mlp.up_proj.weight", q),
                                              ("model.layers.0.mlp.up_proj.weight_scale_inv", scale)]),
                                        (16, 32), torch.float32))
    from phalanx.models.loader import check_fp8_checkpoint
    with pytest.raises(ValueError, match="experts.gate_up_proj.weight has 3 dimensions"):   # from the headers too
        check_fp8_checkpoint([{"name": "model.layers.0.mlp.experts.gate_up_proj.weight", "dtype": "F8_E4M3",
                               "shape": [1, 32, 64]},
                              {"name": "model.layers.0.mlp.experts.gate_up_proj.weight_scale_inv", "dtype": "F32",
                               "shape": [1, 2, 2]}], (16, 32))
    with pytest.raises(ValueError, match="experts.gate_up_proj.weight has 3 dimensions"):
        list(fp8_checkpoint_weights(iter([("model.layers.0.mlp.experts.gate_up_proj.weight", q[None]),
                                          ("model.layers.0.mlp.experts.gate_up_proj.weight_scale_inv",
                                           torch.ones(1, 2, 2))]), (16, 32), torch.float32))


_KV_LAYOUTS = {   # how checkpoints name a layer's KV cache scales (after model.layers.N.self_attn.)
    "self": lambda s: {"k_scale": torch.tensor([s], dtype=torch.bfloat16), "v_scale": torch.tensor([s]),
                       "k_zero_point": torch.zeros(1, dtype=torch.float8_e4m3fn),   # zero: dropped
                       "v_zero_point": torch.zeros(1, dtype=torch.bfloat16)},
    "proj": lambda s: {"k_proj.k_scale": torch.tensor(s), "v_proj.v_scale": torch.tensor(s)},
    "kv": lambda s: {"kv_scale": torch.tensor(s)},
    "output": lambda s: {"k_proj.output_scale": torch.tensor([s]), "v_proj.output_scale": torch.tensor([s])},
    "head": lambda s: {"k_scale": torch.tensor([s / 2, s]).view(2, 1, 1), "v_scale": torch.tensor([s, s / 4])},
}


def _kv_scaled_twin(src, dst, layouts, scale=1024.0):
    """The FP8 checkpoint ``src`` as the same model with K and V ``scale`` times larger: k/v_proj's
    weight scales times ``scale``, q_proj's and o_proj's divided by it (q·k and o(attention) are
    unchanged; powers of two, so exactly), and layer i's KV cache scales ``scale`` in
    ``layouts[i]`` (None: none)."""
    import shutil

    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    t = load_file(f"{dst}/model.safetensors")
    for name in list(t):
        if name.endswith(".weight_scale"):
            proj = name.split(".")[-2]
            t[name] = t[name] * scale if proj in ("k_proj", "v_proj") else (
                t[name] / scale if proj in ("q_proj", "o_proj") else t[name])
    for i, layout in enumerate(layouts):
        if layout is not None:
            t.update({f"model.layers.{i}.self_attn.{n}": v for n, v in _KV_LAYOUTS[layout](scale).items()})
    save_file(t, f"{dst}/model.safetensors")
    return str(dst)


@pytest.mark.parametrize("layouts", [("self", "proj"), ("kv", "output"), ("head", "self")])
def test_an_fp8_checkpoints_kv_cache_scales_are_what_an_fp8_pool_stores_k_and_v_with(layouts, tiny_models,
                                                                                     tmp_path, caplog):
    """A checkpoint whose K and V are 1,024 times those of another (the same model: its q and o
    weights scaled back) and whose KV cache scales say so, in each layout checkpoints name them
    (llm-compressor's, ModelOpt's, the older kv_scale and projection output scales, one per KV
    head): an FP8 pool stores with the scales exactly what the other's pool stores without them,
    and the greedy tokens are the same. Without the scales its K and V saturate e4m3 and the
    tokens differ; a pool of the model's dtype leaves the scales unused, and says so."""
    write_fp8_checkpoint(tiny_models["llama"], tmp_path / "base", None)
    scaled = _kv_scaled_twin(tmp_path / "base", tmp_path / "scaled", layouts)
    ps = prompts(256, n=6, seed=11)
    sp = SamplingParams(max_tokens=8, ignore_eos=True)

    def run(path, kv="fp8"):
        with LLM(path, skip_tokenizer_init=True, dtype="float32", orchestrator_type="inprocess",
                 kv_cache_config={"dtype": kv, "max_gpu_total_bytes": 8 << 20}) as llm:
            return [o.outputs[0].token_ids for o in llm.generate(ps, sp, use_tqdm=False)]
    want = run(str(tmp_path / "base"))
    assert run(scaled) == want
    if layouts[0] == "self":
        unscaled = _kv_scaled_twin(tmp_path / "base", tmp_path / "unscaled", (None, None))
        assert run(unscaled) != want
        caplog.clear()
        with caplog.at_level("INFO", logger="phalanx"):
            assert run(scaled, "auto") == run(str(tmp_path / "base"), "auto")
        assert any("KV cache scales (2 layers) are not used" in r.getMessage() for r in caplog.records)
        caplog.clear()     # an update from a checkpoint without scales keeps the pool's, and says so
        with LLM(scaled, skip_tokenizer_init=True, dtype="float32", orchestrator_type="inprocess",
                 kv_cache_config={"dtype": "fp8", "max_gpu_total_bytes": 8 << 20}) as llm:
            llm.update_weights_from_disk(unscaled)
        assert any("brings no KV cache scales" in r.getMessage() for r in caplog.records)


def test_kv_cache_scales_and_zero_points_that_do_not_fit_are_refused_by_name(tiny_models, tmp_path):
    """A scale that is not positive, one of a count that is neither one nor one a KV head, and a
    zero point that is not zero (an asymmetric KV cache): refused, naming the tensor."""
    from safetensors.torch import load_file, save_file
    write_fp8_checkpoint(tiny_models["llama"], tmp_path / "ckpt", None)
    t = load_file(f"{tmp_path}/ckpt/model.safetensors")
    t["model.layers.1.self_attn.v_scale"] = torch.tensor(0.0)
    save_file(t, f"{tmp_path}/ckpt/model.safetensors")
    with pytest.raises(ValueError, match=r"model.layers.1.self_attn.v_scale'.*positive and finite"):
        LLM(str(tmp_path / "ckpt"), skip_tokenizer_init=True, orchestrator_type="inprocess")
    t["model.layers.1.self_attn.v_scale"] = torch.tensor([2.0, 2.0, 2.0])      # 2 KV heads
    save_file(t, f"{tmp_path}/ckpt/model.safetensors")
    with pytest.raises(ValueError, match=r"v_scale'.*one per KV head \(2\), got shape \(3,\)"):
        LLM(str(tmp_path / "ckpt"), skip_tokenizer_init=True, orchestrator_type="inprocess")
    t["model.layers.1.self_attn.v_scale"] = torch.tensor(2.0)
    t["model.layers.0.self_attn.k_zero_point"] = torch.tensor([3.0])
    save_file(t, f"{tmp_path}/ckpt/model.safetensors")
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.k_zero_point'.*not 0 .*not supported"):
        LLM(str(tmp_path / "ckpt"), skip_tokenizer_init=True, orchestrator_type="inprocess")


@pytest.mark.parametrize("where", ["config.json", "hf_quant_config.json"])
def test_a_modelopt_fp8_checkpoint_serves_what_it_stores(where, tiny_models, tmp_path):
    """A ModelOpt FP8 export (per-tensor weight scales, static input scales, KV cache scales on
    k_proj/v_proj), described in config.json's quantization_config (newer exports) or only in
    hf_quant_config.json (older ones): the tokens of the same tensors as an ``fp8`` checkpoint,
    its KV cache scales taken by an FP8 pool; its KV cache calibrated for FP8, ``dtype: auto``
    stores it in FP8 (as an explicit fp8 does: the same blocks and tokens)."""
    import json
    write_fp8_checkpoint(tiny_models["llama"], tmp_path / "base", None)
    fp8_twin = _kv_scaled_twin(tmp_path / "base", tmp_path / "fp8", ("proj", "proj"))
    mo = _kv_scaled_twin(tmp_path / "base", tmp_path / "modelopt", ("proj", "proj"))
    cfg_path = tmp_path / "modelopt" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    described = {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8", "exclude_modules": ["lm_head"]}
    if where == "config.json":
        cfg["quantization_config"] = {"quant_method": "modelopt", **described}
    else:
        del cfg["quantization_config"]
        (tmp_path / "modelopt" / "hf_quant_config.json").write_text(json.dumps(
            {"producer": {"name": "modelopt", "version": "0.40"}, "quantization": described}))
    cfg_path.write_text(json.dumps(cfg))
    if where == "hf_quant_config.json":
        good = (tmp_path / "modelopt" / "hf_quant_config.json").read_text()
        (tmp_path / "modelopt" / "hf_quant_config.json").write_text(good[:-3])
        with pytest.raises(ValueError, match="hf_quant_config.json: not JSON"):
            LLM(mo, skip_tokenizer_init=True, orchestrator_type="inprocess")
        (tmp_path / "modelopt" / "hf_quant_config.json").write_text(good)
    ps = prompts(256, n=5, seed=12)
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    outs, blocks = [], []
    for path, kv in ((fp8_twin, "fp8"), (mo, "fp8"), (mo, "auto"), (fp8_twin, "auto")):
        named = {"quantization": "modelopt"} if path == mo and kv == "fp8" else {}    # as vLLM users pass it
        with LLM(path, skip_tokenizer_init=True, dtype="float32", orchestrator_type="inprocess",
                 kv_cache_config={"dtype": kv, "max_gpu_total_bytes": 8 << 20}, **named) as llm:
            outs.append([o.outputs[0].token_ids for o in llm.generate(ps, sp, use_tqdm=False)])
            blocks.append(llm.engine_info.num_kv_blocks)
    assert outs[0] == outs[1] == outs[2] and blocks[0] == blocks[1] == blocks[2]
    assert blocks[3] == blocks[0] // 4     # no KV scheme: auto is the model's dtype (float32 here)
    with pytest.raises(ValueError, match="quantization 'modelopt' names the checkpoint's own method, but its "
                                         "quantization_config.quant_method is 'fp8'"):
        LLM(fp8_twin, skip_tokenizer_init=True, orchestrator_type="inprocess", quantization="modelopt")


def test_modelopt_lists_of_full_precision_modules_take_wildcards_under_either_key():
    import re

    from phalanx.models.config import _fp8_unquantized
    for key in ("ignore", "exclude_modules"):
        listed = _fp8_unquantized({"quant_method": "modelopt", "quant_algo": "FP8", key: ["lm_head", "*.1.mlp*"]})
        assert listed[0] == "lm_head" and listed[1].startswith("re:")
        assert re.fullmatch(listed[1][3:], "model.layers.1.mlp.down_proj")
        assert not re.fullmatch(listed[1][3:], "model.layers.0.mlp.down_proj")
    assert _fp8_unquantized({"quant_method": "fp8", "ignored_layers": ["a*"]}) == ("a*",)   # names, as vLLM's fp8


def test_a_checkpoint_whose_kv_cache_alone_is_calibrated_stores_it_in_fp8_with_its_scales(tiny_models, tmp_path):
    """A full-precision ModelOpt export with only its KV cache quantized (``quant_algo`` null,
    ``kv_cache_quant_algo`` FP8, hf_quant_config.json): a plain checkpoint whose ``dtype: auto``
    pool is FP8 and takes its K/V scales. Its K and V are 1,024 times another's (q and o scaled
    back): the other's FP8-pool tokens, which its pool without the scales would not give."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from phalanx.models.config import _fp8_checkpoint
    assert _fp8_checkpoint({"quant_method": "modelopt", "quant_algo": None, "kv_cache_quant_algo": "FP8"}) is None
    d = tmp_path / "kv_only"
    shutil.copytree(tiny_models["llama"], d)
    t = load_file(f"{d}/model.safetensors")
    for name in list(t):
        proj = name.split(".")[-2]
        if proj in ("k_proj", "v_proj"):
            t[name] = t[name] * 1024
        elif proj in ("q_proj", "o_proj"):
            t[name] = t[name] / 1024
    for i in range(2):
        t[f"model.layers.{i}.self_attn.k_proj.k_scale"] = torch.tensor(1024.0)
        t[f"model.layers.{i}.self_attn.v_proj.v_scale"] = torch.tensor(1024.0)
    save_file(t, f"{d}/model.safetensors")
    (d / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": None, "kv_cache_quant_algo": "FP8"}}))
    ps = prompts(256, n=6, seed=13)
    sp = SamplingParams(max_tokens=8, ignore_eos=True)

    def run(path, kv):
        with LLM(str(path), skip_tokenizer_init=True, dtype="float32", orchestrator_type="inprocess",
                 kv_cache_config={"dtype": kv, "max_gpu_total_bytes": 8 << 20}) as llm:
            return [o.outputs[0].token_ids for o in llm.generate(ps, sp, use_tqdm=False)], llm.engine_info.num_kv_blocks
    want, fp8_blocks = run(tiny_models["llama"], "fp8")
    assert run(d, "auto") == (want, fp8_blocks)
    (d / "hf_quant_config.json").unlink()
    for i in range(2):
        del t[f"model.layers.{i}.self_attn.k_proj.k_scale"], t[f"model.layers.{i}.self_attn.v_proj.v_scale"]
    save_file(t, f"{d}/model.safetensors")
    assert run(d, "fp8")[0] != want
