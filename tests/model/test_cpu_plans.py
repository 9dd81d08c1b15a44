"""A float32 model on a CPU runs its projections as (W xᵀ)ᵀ (``LinearPlan.cpu``): the same
products as F.linear, set once when the model is built, and only there."""

import pytest
import torch
import torch.nn.functional as F

from phalanx.kernels import ops
from phalanx.kernels.linear_plan import CPU_BLAS, CUBLAS, MANY_ROW_BUCKETS, ROW_BUCKETS, LinearPlan, Neighbour
from phalanx.models.layers import Projection
from phalanx.models.loader import build_model
from phalanx.models.source import resolve_model


@pytest.mark.parametrize("rows", [1, 6, 64, 300])
@pytest.mark.parametrize("neighbour", [Neighbour.PLAIN, Neighbour.SILU])
@pytest.mark.parametrize("bias", [False, True])
def test_the_cpu_plan_equals_f_linear(rows, neighbour, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 40, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    x = torch.randn(rows, 80 if neighbour is Neighbour.SILU else 40, generator=g)
    y = LinearPlan.cpu(neighbour)(x, w, b)
    want = F.linear(ops.silu_and_mul(x) if neighbour is Neighbour.SILU else x, w, b)
    assert y.shape == want.shape and y.is_contiguous()
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)


def test_the_cpu_plan_takes_rows_of_any_rank():
    g = torch.Generator().manual_seed(3)
    w, b, x = torch.randn(24, 8, generator=g), torch.randn(24, generator=g), torch.randn(2, 3, 8, generator=g)
    torch.testing.assert_close(LinearPlan.cpu(Neighbour.PLAIN)(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_the_cpu_plan_takes_every_bucket_of_a_full_precision_weight_only():
    plan = LinearPlan.cpu(Neighbour.NORM)
    assert plan.plans == (CPU_BLAS,) * len(ROW_BUCKETS) and plan.many == (CPU_BLAS,) * len(MANY_ROW_BUCKETS)
    assert plan.is_reference
    with pytest.raises(ValueError, match="CPU plan"):
        LinearPlan(Neighbour.PLAIN, (CPU_BLAS, CUBLAS, CUBLAS))
    with pytest.raises(ValueError, match="CPU plan"):
        LinearPlan(Neighbour.PLAIN, (CPU_BLAS,) * len(ROW_BUCKETS), True, (CPU_BLAS,) * len(MANY_ROW_BUCKETS))


@pytest.mark.parametrize("dtype,fp8", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)])
def test_only_float32_weights_on_a_cpu_take_it(tiny_models, dtype, fp8):
    """bf16 stays on F.linear (the other orientation is slower there), FP8 weights on their
    reference (an FP8 model's float32 output layer takes the CPU plan); the float32 model's
    logits equal those of the same model on F.linear."""
    source = resolve_model(tiny_models["qwen2"])
    model = build_model(source, dtype, torch.device("cpu"), fp8=fp8)
    plans = [m.plan for m in model.modules() if isinstance(m, Projection)]
    assert len({p.fp8 for p in plans}) == (2 if fp8 else 1)
    assert all((p == LinearPlan.cpu(p.neighbour)) == (dtype == torch.float32 and not p.fp8) for p in plans)
    if dtype == torch.float32 and not fp8:
        from phalanx.kernels.metadata import AttentionMetadata
        from phalanx.pyexecutor.kv_pool import KVPool
        cfg = source.config
        n = 20
        pool = KVPool(cfg.num_layers, 3, 16, cfg.num_kv_heads, cfg.head_dim, dtype, torch.device("cpu"))
        meta = AttentionMetadata.one_prompt(n, 16)
        ids = torch.arange(n) * 7 % cfg.vocab_size
        with torch.no_grad():
            ours = model.compute_logits(model(ids, torch.arange(n), meta, pool.tensor))
            for m in model.modules():
                if isinstance(m, Projection):
                    m.plan = LinearPlan(m.plan.neighbour)
            ref = model.compute_logits(model(ids, torch.arange(n), meta, pool.tensor))
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
