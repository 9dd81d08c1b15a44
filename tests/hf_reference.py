"""Tiny random Hugging Face models saved to disk (our HF loader reads them), and a greedy
reference computed by transformers itself."""

from __future__ import annotations

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def _configs():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config
    rope3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
             "original_max_position_embeddings": 64, "rope_theta": 10000.0}
    return {
        "llama": LlamaConfig(**TINY, rope_scaling=rope3, tie_word_embeddings=False),
        "qwen2": Qwen2Config(**TINY, tie_word_embeddings=True),
        "qwen3": Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=False),
        "mistral": MistralConfig(**TINY, sliding_window=16),
    }


def _moe_configs():
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig
    base = dict(TINY, intermediate_size=96)
    return {
        "mixtral": MixtralConfig(**base, num_local_experts=4, num_experts_per_tok=2),
        "qwen3_moe": Qwen3MoeConfig(**base, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                                    norm_topk_prob=True, head_dim=32),
        "qwen2_moe": Qwen2MoeConfig(**base, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                    shared_expert_intermediate_size=40, norm_topk_prob=False),
    }


def tiny_model_dirs(make_dir, configs=None, seed: int = 1234) -> dict[str, str]:
    """name -> directory with config.json + model.safetensors (fp32; the i-th seeded seed + i)."""
    import torch
    from transformers import AutoModelForCausalLM
    out = {}
    for i, (name, cfg) in enumerate((configs or _configs()).items()):
        torch.manual_seed(seed + i)
        cfg.initializer_range = 0.1        # peakier logits: fewer near-ties
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        path = make_dir(name)
        model.save_pretrained(path)
        out[name] = str(path)
    return out


def hf_models_from(dirs: dict[str, str]) -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    return {k: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for k, p in dirs.items()}


TIE_GAP = 1e-4


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation, and the top-1/top-2 logit gap at each step."""
    import torch
    with torch.no_grad():
        return _hf_greedy(model, prompt, max_new_tokens)


def _hf_greedy(model, prompt, max_new_tokens):
    import torch
    ids = torch.tensor([prompt], device=model.device)
    out, gaps = [], []
    past = None
    for _ in range(max_new_tokens):
        res = model(ids if past is None else ids[:, -1:], past_key_values=past, use_cache=True)
        past = res.past_key_values
        logits = res.logits[0, -1]
        top = logits.topk(2).values
        gaps.append(float(top[0] - top[1]))
        tok = int(logits.argmax())
        out.append(tok)
        ids = torch.cat([ids, torch.tensor([[tok]], device=ids.device)], dim=1)
    return out, gaps


def assert_same_greedy(ours: list[int], ref: list[int], gaps: list[float], what: str = "") -> None:
    """Equal token for token; a divergence is tolerated only right at a numerical near-tie."""
    for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
        if a != b:
            assert gaps[i] < TIE_GAP, f"{what}: token {i} differs ({a} vs {b}) with top-2 gap {gaps[i]:.2e}"
            return
    assert len(ours) == len(ref), f"{what}: {len(ours)} tokens vs {len(ref)}"


def assert_adapters_greedy(refs: dict, cases, device: str = "cuda") -> None:
    """Each case (what, prompt, adapter name or None, our tokens, how many were asked) equals
    the greedy tokens of ``refs[name]`` (the base model or its PEFT model), run on ``device``
    and moved back after."""
    on = {k: m.to(device) for k, m in refs.items()}
    try:
        for what, prompt, name, ours, n in cases:
            ref, gaps = hf_greedy(on[name], prompt, n)
            assert_same_greedy(ours, ref, gaps, what)
    finally:
        for m in refs.values():
            m.to("cpu")


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def fp8_round_trip(hf, projections: tuple[str, ...] = PROJECTIONS):
    """A copy of transformers' model with each decoder projection's weight (the modules named
    ``projections``), and each expert's, as ``quantization: fp8`` holds it (e4m3 with a scale per
    output row, dequantized)."""
    import copy

    import torch

    from phalanx.kernels import fp8
    model = copy.deepcopy(hf)
    with torch.no_grad():
        for name, mod in model.named_modules():
            if name.rsplit(".", 1)[-1] in projections:
                q, scale = fp8.quantize_weight(mod.weight)
                mod.weight.copy_(fp8.dequantize(q, scale, mod.weight.dtype))
        for name, p in model.named_parameters():
            if ".experts." in name and p.dim() == 3:     # [E, out, in]: gate_up_proj, down_proj
                E, N, K = p.shape
                q, scale = fp8.quantize_weight(p.reshape(E * N, K))
                p.copy_(fp8.dequantize(q, scale, p.dtype).view(E, N, K))
    return model


def write_fp8_checkpoint(src: str, dst, block, compressed: str | None = None,
                         projections: tuple[str, ...] = PROJECTIONS):
    """``src`` as an FP8 checkpoint: every decoder projection (the modules ``projections`` names)
    e4m3 with a scale per ``block`` tile
    (``weight_scale_inv``, as DeepSeek and Qwen3 ship), or one per tensor (``weight_scale`` and an
    ``input_scale``) when block is None. ``compressed``: as llm-compressor writes it instead
    (quant_method compressed-tensors), with a ``weight_scale`` per "tensor", "channel" ([N, 1]) or
    "block". Returns {name: the full-precision weight it stands for}."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from phalanx.kernels import fp8
    shutil.copytree(src, dst)
    tensors = load_file(f"{dst}/model.safetensors")
    meant = {}
    for name in list(tensors):
        if name.rsplit(".", 2)[-2] not in projections:
            continue
        w = tensors[name].float()
        base = name.removesuffix(".weight")
        if compressed == "channel":
            q, s = fp8.quantize_weight(w)
            tensors[base + ".weight_scale"] = s[:, None]
            meant[name] = fp8.dequantize(q, s, torch.float32)
        elif block is None:
            s = w.abs().max() / fp8.FP8_MAX
            q = (w / s).to(fp8.FP8)
            tensors[base + ".weight_scale"], tensors[base + ".input_scale"] = s.reshape(()), torch.tensor(0.5)
            meant[name] = q.float() * s
        else:
            q, s = fp8.quantize_blocks(w, block)    # blocks at the edges partial where N or K ends inside one
            tensors[base + (".weight_scale" if compressed else ".weight_scale_inv")] = s
            meant[name] = fp8.dequantize_blocks(q, s, block, torch.float32)
        tensors[name] = q
    save_file(tensors, f"{dst}/model.safetensors")
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                  **({"weight_block_size": list(block)} if block else {})}
    if compressed:
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": compressed,
                   **({"block_structure": list(block)} if compressed == "block" else {})}
        acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": compressed != "tensor",
                "strategy": "tensor" if compressed == "tensor" else "token"}
        cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "float-quantized",
                                      "quantization_status": "compressed", "ignore": ["lm_head"],
                                      "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                                                    "input_activations": acts}}}
    (dst / "config.json").write_text(json.dumps(cfg))
    return meant


def write_plain_twin(src: str, dst, meant: dict) -> str:
    """``src`` with the tensors of ``meant`` (what ``write_fp8_checkpoint`` returns) in full
    precision: the model an FP8 checkpoint stands for, for transformers or a full-precision build."""
    import shutil

    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    tensors = load_file(f"{dst}/model.safetensors")
    tensors.update({name: w.contiguous() for name, w in meant.items()})
    save_file(tensors, f"{dst}/model.safetensors")
    return str(dst)


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_lora_adapter(hf, path, r, targets, seed, rslora=False, scale_b=20.0):
    """A PEFT LoRA of ``hf`` with random A and B (B scaled up so that it changes the greedy
    tokens), saved by PEFT to ``path``; returns PEFT's model of it (the reference)."""
    model = peft_policy(hf, r, targets, seed, scale_b, rslora)
    model.save_pretrained(str(path))
    return model


def peft_policy(hf, r, targets, seed, scale_b=20.0, rslora=False):
    """A PEFT model of ``hf`` with a random LoRA, as a trainer holds it (never saved); B scaled
    up so that it changes the greedy tokens."""
    import copy

    import torch
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(seed)
    cfg = LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, init_lora_weights=False, lora_dropout=0.0,
                     use_rslora=rslora)
    model = get_peft_model(copy.deepcopy(hf), cfg)
    scale_lora_b(model, scale_b)
    return model.eval()


def scale_lora_b(model, scale):
    """Every lora_B of a PEFT model scaled in place (a stand-in for a training step)."""
    import torch
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(scale)


def peft_state(model):
    """What a trainer hands over: PEFT's state dict of the adapter (copies) and its config."""
    from peft import get_peft_model_state_dict
    return ({k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()},
            model.peft_config["default"])


def assert_logits_every_step(path: str, hf, prompt: list[int], steps: int, max_num_tokens: int) -> None:
    """Our float32 logits equal transformers' within 1e-4 at prefill and at every decode step of a
    greedy run of ``steps`` tokens over ``prompt``, through the real scheduler (chunks of at most
    ``max_num_tokens``), paged KV pool (8-token blocks) and model runner on the CPU."""
    import torch

    from phalanx.kv_manager import KVCacheManager
    from phalanx.llmapi.sampling_params import SamplingParams
    from phalanx.models.loader import build_model
    from phalanx.models.source import resolve_model
    from phalanx.pyexecutor.kv_pool import KVPool
    from phalanx.pyexecutor.model_runner import ModelRunner
    from phalanx.pyexecutor.request import Request
    from phalanx.pyexecutor.sampler import Sampler
    from phalanx.pyexecutor.scheduler import Scheduler, SchedulerLimits
    cpu = torch.device("cpu")
    source = resolve_model(path)
    cfg = source.config
    model = build_model(source, torch.float32, cpu)
    pool = KVPool(cfg.num_layers, 32, 8, cfg.num_kv_heads, cfg.head_dim, torch.float32, cpu, planes=cfg.kv_planes)
    kv = KVCacheManager(32, 8)
    sched = Scheduler(SchedulerLimits(4, max_num_tokens, 512), kv)
    runner = ModelRunner(model, pool, Sampler(cfg.vocab_size, cpu), cpu)
    req = Request(0, prompt, SamplingParams(max_tokens=steps), max_total_tokens=len(prompt) + steps)
    sched.add_request(req)
    done = 0
    while sched.has_work:
        batch = sched.schedule()
        inputs = runner.prepare(batch)
        logits = runner.forward(batch, inputs)
        token = None
        if inputs.sample_rows:
            with torch.no_grad():
                ref = hf(torch.tensor([req.token_ids])).logits[0, -1]
            torch.testing.assert_close(logits[0], ref, atol=1e-4, rtol=0)
            token = int(ref.argmax())
            done += 1
        sched.update(batch, [token])
    assert done == steps
    kv.check_integrity()


def assert_tp2_greedy(path: str, hf, ps: list[list[int]], what: str) -> None:
    """TP=2 under mpirun (8-token blocks, chunks of 24): greedy tokens of ``ps`` equal
    transformers', and both ranks' pools keep their integrity."""
    from phalanx import LLM, SamplingParams
    with LLM(path, tensor_parallel_size=2, skip_tokenizer_init=True, kv_cache_config={"tokens_per_block": 8},
             max_num_tokens=24) as llm:
        outs = llm.generate(ps, SamplingParams(max_tokens=10, ignore_eos=True), use_tqdm=False)
        for i, (p, out) in enumerate(zip(ps, outs, strict=True)):
            ref, gaps = hf_greedy(hf, p, 10)
            assert_same_greedy(out.outputs[0].token_ids, ref, gaps, f"{what} TP=2 prompt {i}")
        assert llm._executor.check_integrity() == ["ok", "ok"]


def assert_greedy_with_prefix_reuse(path: str, hf, ps: list[list[int]], chunked: bool) -> None:
    """Batched greedy tokens (8-token blocks; chunks of 8 when ``chunked``) equal transformers' in
    two rounds, the second hitting the prefix cache the first left (the last prompt shares all
    but its last token's blocks with the one before)."""
    from phalanx import LLM, SamplingParams
    refs = [hf_greedy(hf, p, 12) for p in ps]
    with LLM(path, skip_tokenizer_init=True, orchestrator_type="inprocess", kv_cache_config={"tokens_per_block": 8},
             max_num_tokens=8 if chunked else 512) as llm:
        for round_ in range(2):
            outs = llm.generate(ps, SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)
            for i, (out, (ref, gaps)) in enumerate(zip(outs, refs, strict=True)):
                assert_same_greedy(out.outputs[0].token_ids, ref, gaps, f"prompt {i} round {round_}")
        assert outs[-1].cached_tokens == len(ps[-1]) - 1
        llm._executor.engine.scheduler.kv.check_integrity()


def gpu_greedy_runs(path: str, hf, ps: list[list[int]], **engine) -> tuple[int, int, int]:
    """On the GPU in float32: each prompt alone and all batched give transformers' greedy tokens
    (16 of them); returns the engine's (decode graph, extend graph, piecewise) step counts."""
    from phalanx import LLM, SamplingParams
    refs = [hf_greedy(hf, p, 16) for p in ps]
    sp = SamplingParams(max_tokens=16, ignore_eos=True)
    with LLM(path, skip_tokenizer_init=True, dtype="float32", orchestrator_type="inprocess",
             kv_cache_config={"tokens_per_block": 16}, **engine) as llm:
        alone = [llm.generate([p], sp, use_tqdm=False)[0] for p in ps]
        batched = llm.generate(ps, sp, use_tqdm=False)
        runner = llm._executor.engine.runner
        steps = (runner.num_graph_steps, runner.num_extend_graph_steps, runner.num_piecewise_steps)
    for i, (a, b, (ref, gaps)) in enumerate(zip(alone, batched, refs, strict=True)):
        assert_same_greedy(a.outputs[0].token_ids, ref, gaps, f"prompt {i} alone")
        assert_same_greedy(b.outputs[0].token_ids, ref, gaps, f"prompt {i} batched")
    return steps


def assert_bf16_top1_agrees(path: str, hf, ps: list[list[int]], at_least: float = 0.9) -> None:
    """In bf16 on the GPU, the likeliest token at each prompt position (prompt_logprobs) is
    transformers' float32 model's at ``at_least`` of the positions."""
    import torch

    from phalanx import LLM, SamplingParams
    with LLM(path, skip_tokenizer_init=True, dtype="bfloat16", orchestrator_type="inprocess",
             kv_cache_config={"tokens_per_block": 16}) as llm:
        outs = llm.generate(ps, SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    agree = total = 0
    for p, o in zip(ps, outs, strict=True):
        with torch.no_grad():
            want = hf(torch.tensor([p], device="cuda")).logits[0, :-1].argmax(-1).tolist()
        for entry, w in zip(o.prompt_logprobs[1:], want, strict=True):
            top = next(t for t, lp in entry.items() if lp.rank == 1)
            agree += top == w
            total += 1
    assert agree >= at_least * total, (agree, total)


def assert_updates_follow(llm, prompt: list[int], a: str, b: str, hf_b) -> list[tuple[str, object]]:
    """An RL trainer's updates of an engine serving checkpoint ``a``: from disk to ``b`` (greedy
    tokens become ``hf_b``'s), back to ``a`` (the tokens before), then from ``hf_b``'s tensors as
    transformers holds them in memory (``hf_b``'s tokens again, weight version "tensors").
    Returns the tensors sent."""
    from phalanx import SamplingParams
    want, gaps = hf_greedy(hf_b, prompt, 8)
    sp = SamplingParams(max_tokens=8, ignore_eos=True)

    def tokens() -> list[int]:
        return llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids
    before = tokens()
    assert llm.update_weights_from_disk(b, weight_version="b") == "b"
    assert_same_greedy(tokens(), want, gaps, "from disk")
    llm.update_weights_from_disk(a)
    assert tokens() == before
    named = list(hf_b.state_dict().items())
    llm.update_weights_from_tensors(named, weight_version="tensors")
    assert_same_greedy(tokens(), want, gaps, "tensors")
    return named
