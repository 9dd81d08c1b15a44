"""How far FP8 moves the bundled SmolLM2-135M-Instruct (GGUF, Q4_1 dequantized) from itself in
bf16: six chat prompts, each continued 32 tokens greedily by the bf16 model, then the same
tokens teacher-forced through the FP8 model (and through bf16 weights over an FP8 KV pool, and
both together). At every continuation position: whether the top token agrees, and the KL
divergence KL(bf16 || FP8) of the next-token distributions. Through the real scheduler, paged
pool and runner; the projections on the CPU run the FP8 reference (e4m3 weights with a scale
per output row, dequantized; activations not rounded, as the decode kernels do on a GPU). On a
GPU, steps of more than 64 rows (the prompts here) also round each activation row to e4m3:
tests/gpu/test_fp8_accuracy_gpu.py measures that path with thresholds of its own.

Measured (192 positions, bf16 on a CPU without native bf16, whose prompt steps multiply in
float32 rounded to bf16: ``LinearPlan.cpu``): FP8 weights top-1 91.1 %, mean KL 0.0166; FP8 KV
top-1 94.3 %, mean KL 0.0089; both 89.6 %, mean KL 0.0246 (with bf16's own CPU GEMM throughout,
when the thresholds were set: 90.6 % / 0.0175, 93.2 % / 0.0099, 87.5 % / 0.0259). For scale: the same
model in float32 against bf16 agrees on 98.4 % (mean KL 0.0011), and weights rounded to two
mantissa bits (e5m2 values, a scale per row) give a mean KL of 0.072 — over the weights'
threshold below."""

import pytest
import torch

from fp8_accuracy import CPU, NEW_TOKENS, continue_or_force, measure, smollm2_prompts
from phalanx.models.loader import build_model

# (top-1 agreement at least, mean KL at most) per configuration
THRESHOLDS = {"fp8 weights": (0.85, 0.03), "fp8 kv": (0.88, 0.02), "fp8 weights + kv": (0.82, 0.045)}


@pytest.fixture(scope="module")
def smollm2():
    return smollm2_prompts()


def test_fp8_weights_and_kv_stay_close_to_bf16_on_the_bundled_model(smollm2):
    source, prompts = smollm2
    teacher = continue_or_force(build_model(source, torch.bfloat16, CPU), source.config, torch.bfloat16, prompts)
    assert all(len(t) == NEW_TOKENS for t, _ in teacher)
    report = {}
    for name, weights, kv in (("fp8 weights", "fp8", "auto"), ("fp8 kv", "bf16", "fp8"),
                              ("fp8 weights + kv", "fp8", "fp8")):
        report[name] = measure(source, prompts, weights, kv, teacher)
    print({k: f"top-1 {a:.1%}, mean KL {b:.4f}" for k, (a, b) in report.items()})
    for name, (top1, kl) in report.items():
        min_top1, max_kl = THRESHOLDS[name]
        assert top1 >= min_top1 and kl <= max_kl, (name, top1, kl)
        assert kl > 0          # the FP8 run really is another model
