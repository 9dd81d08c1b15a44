"""Teacher-forced closeness of FP8 to bf16 on the bundled SmolLM2-135M-Instruct: shared by
the FP8 accuracy tests on the CPU (tests/model) and on the GPU (tests/gpu)."""

import torch

from phalanx.kv_manager import KVCacheManager
from phalanx.llmapi.sampling_params import SamplingParams
from phalanx.llmapi.tokenizer import load_tokenizer
from phalanx.models.loader import build_model
from phalanx.models.source import bundled_model_path, resolve_model
from phalanx.pyexecutor.kv_pool import KVPool
from phalanx.pyexecutor.model_runner import ModelRunner
from phalanx.pyexecutor.request import Request
from phalanx.pyexecutor.sampler import Sampler
from phalanx.pyexecutor.scheduler import Scheduler, SchedulerLimits

CPU = torch.device("cpu")
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "Explain in one sentence what a CPU does.",
    "Tell me a short story about a cat.",
    "Write two sentences about the moon.",
]
NEW_TOKENS = 32


def continue_or_force(model, cfg, kv_dtype, prompts, forced=None, device=CPU):
    """Run ``prompts`` through the engine's scheduler and runner: greedy for NEW_TOKENS tokens,
    or with ``forced`` continuations fed instead. Returns (tokens, logits [n, vocab] float32) per
    prompt, the logits of every continuation position."""
    pool = KVPool(cfg.num_layers, 64, 32, cfg.num_kv_heads, cfg.head_dim, kv_dtype, device)
    sched = Scheduler(SchedulerLimits(8, 4096, 2048), KVCacheManager(64, 32))
    runner = ModelRunner(model, pool, Sampler(cfg.vocab_size, device), device)
    for i, p in enumerate(prompts):
        sched.add_request(Request(i, list(p), SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True),
                                  max_total_tokens=len(p) + NEW_TOKENS))
    tokens: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    logits: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(prompts))}
    while sched.has_work:
        batch = sched.schedule()
        inputs = runner.prepare(batch)
        with torch.no_grad():
            out = runner.forward(batch, inputs).float()
        sampled: list[int | None] = [None] * len(batch.requests)
        for j, row in enumerate(inputs.sample_rows):
            rid = batch.requests[row].request_id
            n = len(tokens[rid])
            t = forced[rid][n] if forced is not None else int(out[j].argmax())
            tokens[rid].append(t)
            logits[rid].append(out[j])
            sampled[row] = t
        sched.update(batch, sampled)
    return [(tokens[i], torch.stack(logits[i])) for i in range(len(prompts))]


def smollm2_prompts():
    """(the bundled model's source, the six chat prompts as token ids)."""
    source = resolve_model(bundled_model_path())
    tok = load_tokenizer(source)
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    return source, prompts


def measure(source, prompts, weights: str, kv: str, teacher, device=CPU, prepare=None):
    """(top-1 agreement, mean KL) of a model with ``weights`` over a ``kv`` pool against the
    teacher's logits; ``prepare`` (the GPU's kernel tuning) runs on the model first."""
    model = build_model(source, torch.bfloat16, device, fp8=weights == "fp8")
    if prepare is not None:
        prepare(model)
    kv_dtype = torch.float8_e4m3fn if kv == "fp8" else torch.bfloat16
    got = continue_or_force(model, source.config, kv_dtype, prompts, [t for t, _ in teacher], device)
    ref = torch.cat([lg for _, lg in teacher]).float().cpu()
    ours = torch.cat([lg for _, lg in got]).float().cpu()
    top1 = (ref.argmax(-1) == ours.argmax(-1)).float().mean().item()
    kl = (ref.log_softmax(-1).exp() * (ref.log_softmax(-1) - ours.log_softmax(-1))).sum(-1).mean().item()
    return top1, kl
