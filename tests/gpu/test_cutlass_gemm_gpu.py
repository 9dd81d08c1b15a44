"""GPU-only: CUTLASS's GEMMs (kernels/cutlass_gemm.py) — FP8 against the float32 product of the
same FP8 values and against cuBLASLt's, bf16 against float32 and F.linear — eagerly and inside a
CUDA graph; engines whose many-row plans are CUTLASS tiles (FP8, bf16) against the same engines on
cuBLAS(Lt). Skipped without an sm_90 GPU, nvcc or the nvidia-cutlass package."""

import dataclasses

import pytest
import torch

from phalanx import LLM, SamplingParams
from phalanx.kernels import cutlass_gemm, fp8
from phalanx.kernels.linear_plan import CUBLAS, MANY_ROW_BUCKETS, Plan


def _why() -> str | None:
    if not torch.cuda.is_available():
        return "needs CUDA"
    return cutlass_gemm.why_unavailable(torch.device("cuda"))


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_why() is not None, reason=str(_why()))]


def _operands(M, N, K, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, K, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", generator=g, dtype=torch.bfloat16) * K ** -0.5
    rows = fp8.quantize_rows(x)
    q, scale = fp8.quantize_weight(w)
    exact = (rows.q.float() * rows.scale) @ (q.float() * scale[:, None]).t()
    return rows, q, scale, exact


def _rel(y, exact):
    return float((y.float() - exact).norm() / exact.norm())


@pytest.mark.parametrize("tile", cutlass_gemm.TILES, ids=lambda t: t.name)
def test_a_tile_first_launched_inside_a_cuda_graph_gives_what_it_gives_eagerly(tile):
    rows, q, scale, _ = _operands(512, 1024, 512, seed=1)
    run = cutlass_gemm.kernel(tile)     # the first test of the file: the tile's first launch is captured
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(rows.q, rows.scale, q, scale)
    graph.replay()
    torch.testing.assert_close(out, run(rows.q, rows.scale, q, scale), rtol=0, atol=0)
    before = out.clone()
    rows.q.copy_(fp8.quantize_rows(torch.randn(512, 512, device="cuda", dtype=torch.bfloat16)).q)
    graph.replay()
    assert not torch.equal(out, before)       # the graph read the new rows
    assert torch.equal(out, run(rows.q, rows.scale, q, scale))


@pytest.mark.parametrize("tile", cutlass_gemm.TILES, ids=lambda t: t.name)
@pytest.mark.parametrize("M,N,K", [(65, 256, 128), (300, 6144, 4096), (2048, 4096, 14336), (77, 80, 48)])
def test_each_tile_gives_the_product_of_the_fp8_values_as_cublaslt_does(tile, M, N, K):
    rows, q, scale, exact = _operands(M, N, K)
    y = cutlass_gemm.kernel(tile)(rows.q, rows.scale, q, scale)
    ref = fp8.scaled_mm(rows.q, rows.scale, q, scale)
    assert y.shape == (M, N) and y.dtype == torch.bfloat16
    # bf16 output (2^-9) and Hopper's fast FP8 accumulation: both GEMMs within ~3e-3 of float32
    assert _rel(y, exact) < 6e-3 and _rel(ref, exact) < 6e-3, (_rel(y, exact), _rel(ref, exact))
    assert _rel(y, ref.float()) < 6e-3


@pytest.mark.parametrize("tile", cutlass_gemm.TILES_BF16, ids=lambda t: t.name)
def test_a_bf16_tile_in_a_cuda_graph_gives_what_it_gives_eagerly(tile):
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(512, 512, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(1024, 512, device="cuda", generator=g, dtype=torch.bfloat16)
    run = cutlass_gemm.kernel(tile)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(x, None, w, None)
    graph.replay()
    torch.testing.assert_close(out, run(x, None, w, None), rtol=0, atol=0)
    x.copy_(torch.randn(512, 512, device="cuda", generator=g, dtype=torch.bfloat16))
    graph.replay()
    assert torch.equal(out, run(x, None, w, None))


@pytest.mark.parametrize("tile", cutlass_gemm.TILES_BF16, ids=lambda t: t.name)
@pytest.mark.parametrize("M,N,K", [(65, 256, 128), (448, 28672, 4096), (2048, 4096, 14336), (77, 80, 48)])
def test_each_bf16_tile_gives_the_product_as_cublas_does(tile, M, N, K):
    g = torch.Generator(device="cuda").manual_seed(M)
    x = torch.randn(M, K, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", generator=g, dtype=torch.bfloat16) * K ** -0.5
    exact = x.float() @ w.float().t()
    y = cutlass_gemm.kernel(tile)(x, None, w, None)
    ref = torch.nn.functional.linear(x, w)
    assert y.shape == (M, N) and y.dtype == torch.bfloat16
    # float32 accumulation, bf16 output (2^-9 relative): both within rounding of float32
    assert _rel(y, exact) < 4e-3 and _rel(ref, exact) < 4e-3, (_rel(y, exact), _rel(ref, exact))
    with pytest.raises(ValueError, match="contiguous"):
        cutlass_gemm.kernel(tile)(x.t(), None, w, None)


def _tokens_on_a_tile_agree_with_cublas(llm, projections, tile, monkeypatch) -> None:
    """Greedy tokens of six prompts of 70–155 tokens (prompt steps of many rows) with every
    projection's many-row plans set to ``tile``, then to cuBLAS(Lt), in one engine: every
    projection of every prompt step runs on the tile (its products counted), none on cuBLAS(Lt)'s
    plans, and the two give the same tokens up to near ties."""
    g = torch.Generator().manual_seed(11)
    ps = [torch.randint(0, 256, (70 + 17 * i,), generator=g).tolist() for i in range(6)]
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    calls, out = [], {}
    real = cutlass_gemm.Kernel.__call__

    def counted(self, *args):
        calls.append(self.tile)
        return real(self, *args)
    monkeypatch.setattr(cutlass_gemm.Kernel, "__call__", counted)
    for name, many in (("cutlass", (Plan("cutlass", tile),) * len(MANY_ROW_BUCKETS)),
                       ("cublas", (CUBLAS,) * len(MANY_ROW_BUCKETS))):
        for m in projections:
            m.plan = dataclasses.replace(m.plan, many=many, launches=())
        out[name] = [o.outputs[0].token_ids for o in llm.generate(ps, sp, use_tqdm=False)]
        if name == "cutlass":
            assert len(calls) >= len(projections) and set(calls) == {tile}
            n = len(calls)
    assert len(calls) == n
    first = sum(a[0] == b[0] for a, b in zip(out["cutlass"], out["cublas"], strict=True))
    same = sum(a == b for a, b in zip(out["cutlass"], out["cublas"], strict=True))
    assert first >= 5 and same >= 4, (first, same, out)


def test_an_engine_on_cutlass_plans_gives_the_tokens_of_cublaslt_plans(tiny_models, monkeypatch):
    """bf16 activations, FP8 weights: the tokens on an FP8 CUTLASS tile and on cuBLASLt."""
    from phalanx.models.layers import Projection
    with LLM(tiny_models["llama"], skip_tokenizer_init=True, dtype="bfloat16", quantization="fp8",
             orchestrator_type="inprocess", cuda_graph_config=None,
             kv_cache_config={"enable_block_reuse": False}) as llm:
        model = llm._executor.engine.runner.model
        projections = [m for m in model.modules() if isinstance(m, Projection) and m.weight_scale is not None]
        assert projections and all(len(m.plan.many) == len(MANY_ROW_BUCKETS) for m in projections)
        _tokens_on_a_tile_agree_with_cublas(llm, projections, cutlass_gemm.TILES[1], monkeypatch)


def test_a_bf16_engine_on_cutlass_plans_gives_the_tokens_of_cublas_plans(tiny_models, monkeypatch):
    """A bf16 model: the tokens on a bf16 CUTLASS tile and on cuBLAS."""
    from phalanx.models.layers import ParallelLMHead, Projection
    with LLM(tiny_models["llama"], skip_tokenizer_init=True, dtype="bfloat16", orchestrator_type="inprocess",
             cuda_graph_config=None, kv_cache_config={"enable_block_reuse": False}) as llm:
        model = llm._executor.engine.runner.model
        # the output layer multiplies only the rows that sample: never many in a prompt step
        projections = [m for m in model.modules() if isinstance(m, Projection) and not isinstance(m, ParallelLMHead)
                       and cutlass_gemm.fits(*m.weight.shape)]
        assert projections and all(m.weight.dtype == torch.bfloat16 for m in projections)
        _tokens_on_a_tile_agree_with_cublas(llm, projections, cutlass_gemm.TILES_BF16[1], monkeypatch)
