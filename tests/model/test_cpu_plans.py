"""A float32 model on a CPU runs its projections as (W xᵀ)ᵀ (``LinearPlan.cpu``), and a bf16
one does so in float32 from ``CPU_HALF_FROM_ROWS`` rows on where the CPU has no native bf16: the
same products as F.linear, set once when the model is built, and only there."""

import pytest
import torch
import torch.nn.functional as F

from phalanx.kernels import ops
from phalanx.kernels.linear_plan import (
    CPU_BLAS,
    CPU_HALF_FROM_ROWS,
    CUBLAS,
    MANY_ROW_BUCKETS,
    ROW_BUCKETS,
    LinearPlan,
    Neighbour,
    bucket_index,
)
from phalanx.models.layers import Projection
from phalanx.models.loader import build_model, native_half_cpu
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


@pytest.mark.parametrize("rows", [1, 16, 17, 300])
@pytest.mark.parametrize("neighbour", [Neighbour.PLAIN, Neighbour.SILU])
@pytest.mark.parametrize("bias", [False, True])
def test_the_half_cpu_plan_equals_f_linear_in_bf16(rows, neighbour, bias):
    """F.linear up to 16 rows, the float32 product rounded to bf16 from 17: within bf16's
    rounding of the same float32 sums."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 40, generator=g).bfloat16()
    b = torch.randn(96, generator=g).bfloat16() if bias else None
    x = torch.randn(rows, 80 if neighbour is Neighbour.SILU else 40, generator=g).bfloat16()
    plan = LinearPlan.cpu(neighbour, CPU_HALF_FROM_ROWS)
    y = plan(x, w, b)
    want = F.linear(ops.silu_and_mul(x) if neighbour is Neighbour.SILU else x, w, b)
    assert y.dtype == torch.bfloat16 and y.shape == want.shape and y.is_contiguous()
    torch.testing.assert_close(y.float(), want.float(), rtol=2e-2, atol=2e-2)
    assert (plan.plans + plan.many)[bucket_index(rows)] == (CPU_BLAS if rows >= CPU_HALF_FROM_ROWS else CUBLAS)


def test_the_cpu_plan_takes_rows_of_any_rank():
    g = torch.Generator().manual_seed(3)
    w, b, x = torch.randn(24, 8, generator=g), torch.randn(24, generator=g), torch.randn(2, 3, 8, generator=g)
    torch.testing.assert_close(LinearPlan.cpu(Neighbour.PLAIN)(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_the_cpu_plan_takes_a_full_precision_weights_buckets_from_one_on():
    plan = LinearPlan.cpu(Neighbour.NORM)
    assert plan.plans == (CPU_BLAS,) * len(ROW_BUCKETS) and plan.many == (CPU_BLAS,) * len(MANY_ROW_BUCKETS)
    assert plan.is_reference
    half = LinearPlan.cpu(Neighbour.NORM, CPU_HALF_FROM_ROWS)
    assert half.plans == (CUBLAS, CUBLAS, CPU_BLAS) and half.many == (CPU_BLAS,) * len(MANY_ROW_BUCKETS)
    with pytest.raises(ValueError, match="CPU plan"):
        LinearPlan(Neighbour.PLAIN, (CPU_BLAS, CUBLAS, CUBLAS))
    with pytest.raises(ValueError, match="CPU plan"):
        LinearPlan(Neighbour.PLAIN, (CUBLAS, CPU_BLAS, CPU_BLAS), False, (CUBLAS,) * len(MANY_ROW_BUCKETS))
    with pytest.raises(ValueError, match="CPU plan"):
        LinearPlan(Neighbour.PLAIN, (CPU_BLAS,) * len(ROW_BUCKETS), True, (CPU_BLAS,) * len(MANY_ROW_BUCKETS))


@pytest.mark.parametrize("dtype,fp8", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)])
def test_full_precision_weights_on_a_cpu_take_it(tiny_models, dtype, fp8):
    """float32 weights in every bucket, bf16 ones from CPU_HALF_FROM_ROWS rows (where the CPU
    has no native bf16), FP8 weights stay on their reference (an FP8 model's float32 output
    layer takes the CPU plan); the model's logits over a 20-token prompt equal those of the
    same model on F.linear (bf16: within its rounding)."""
    source = resolve_model(tiny_models["qwen2"])
    model = build_model(source, dtype, torch.device("cpu"), fp8=fp8)
    plans = [m.plan for m in model.modules() if isinstance(m, Projection)]
    assert len({p.fp8 for p in plans}) == (2 if fp8 else 1)
    from_rows = 1 if dtype == torch.float32 else CPU_HALF_FROM_ROWS
    takes = not (dtype == torch.bfloat16 and native_half_cpu())
    assert all((p == LinearPlan.cpu(p.neighbour, from_rows)) == (takes and not p.fp8) for p in plans)
    if not fp8:
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
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(ours.float(), ref.float(), rtol=tol, atol=tol)
