"""Skinny matmul y = x Wᵀ (+ b) for decode batches of a few rows, and the per-shape choice
between it and cuBLAS.

At batch 1 a decode step is a stream of weight reads; the kernel walks W in [BLOCK_N, BLOCK_K]
tiles with wide loads and a pipelined K loop (rows of x padded to 16 for tensor-core dots). Which
of a few tile configurations — or cuBLAS — is fastest depends on (N, K) and the GPU, so it is
measured once per weight shape (``tune``) before CUDA graphs are captured, and looked up after.
The torch reference is ``torch.nn.functional.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

MAX_ROWS = 4
CONFIGS = [  # (BLOCK_N, BLOCK_K, num_warps, num_stages)
    (16, 512, 4, 3), (32, 256, 4, 4), (64, 256, 8, 3), (128, 128, 8, 3),
]


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, s_xm, s_wn, s_ym,
                 HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr,
                 SILU: tl.constexpr):
    """SILU: x holds gate ‖ up ([M, 2K]) and the kernel multiplies silu(gate) * up on the fly."""
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, 16)
    nm = n < N
    mm = m < M
    acc = tl.zeros([16, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        km = k < K
        w = tl.load(w_ptr + n[:, None] * s_wn + k[None, :], mask=nm[:, None] & km[None, :], other=0.0)
        xm = mm[:, None] & km[None, :]
        x = tl.load(x_ptr + m[:, None] * s_xm + k[None, :], mask=xm, other=0.0)
        if SILU:
            u = tl.load(x_ptr + m[:, None] * s_xm + K + k[None, :], mask=xm, other=0.0)
            g = x.to(tl.float32)
            x = (g / (1.0 + tl.exp(-g))).to(u.dtype) * u
        acc += tl.dot(x.to(w.dtype), tl.trans(w), input_precision=PREC)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=nm, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + m[:, None] * s_ym + n[None, :], acc.to(y_ptr.dtype.element_ty), mask=mm[:, None] & nm[None, :])


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: tuple[int, int, int, int] = CONFIGS[1], silu: bool = False) -> torch.Tensor:
    """x [M, K] (M <= 16), weight [N, K] -> [M, N]. With ``silu``, x is [M, 2K] = gate ‖ up and
    the product is silu(gate) * up times Wᵀ."""
    M = x.shape[0]
    N, K = weight.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    bn, bk, warps, stages = config
    _gemv_kernel[(triton.cdiv(N, bn),)](
        x, weight, bias if bias is not None else weight, y, M, N, K, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=bn, BLOCK_K=bk,
        PREC="ieee" if x.dtype == torch.float32 else "tf32", SILU=silu, num_warps=warps, num_stages=stages)
    return y


# (N, K, dtype) -> a CONFIGS entry, or None for cuBLAS
_CHOICE: dict[tuple[int, int, torch.dtype], tuple[int, int, int, int] | None] = {}


def choice(weight: torch.Tensor) -> tuple[int, int, int, int] | None:
    return _CHOICE.get((weight.shape[0], weight.shape[1], weight.dtype))


def _time(fn, reps: int = 20) -> float:
    """Milliseconds per call, replayed from a CUDA graph (as decode runs), so launch overhead
    does not hide the kernel's own speed."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / (3 * reps)


def tune(weights: list[torch.Tensor], rows: int = 1) -> dict[str, float]:
    """Measure cuBLAS and each tile config on every distinct weight shape at ``rows`` rows;
    remember the fastest. Returns the bandwidth each shape reaches (GB/s), for the log."""
    report: dict[str, float] = {}
    for w in weights:
        key = (w.shape[0], w.shape[1], w.dtype)
        if key in _CHOICE or w.dim() != 2 or not w.is_cuda:
            continue
        x = torch.randn(rows, w.shape[1], dtype=w.dtype, device=w.device)
        best, best_ms = None, _time(lambda: F.linear(x, w))
        for cfg in CONFIGS:
            try:
                ms = _time(lambda cfg=cfg: gemv(x, w, None, cfg))
            except Exception:  # a config the compiler rejects on this GPU
                continue
            if ms < best_ms:
                best, best_ms = cfg, ms
        _CHOICE[key] = best
        report[f"{w.shape[0]}x{w.shape[1]}:{'cublas' if best is None else best}"] = \
            w.numel() * w.element_size() / best_ms / 1e6
    return report


def silu_and_mul_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up times Wᵀ in one kernel for small batches; None when not applicable."""
    if x.dim() == 2 and x.shape[0] <= MAX_ROWS:
        cfg = choice(weight)
        if cfg is not None:
            return gemv(x, weight, None, cfg, silu=True)
    return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear, or the tuned skinny kernel for decode batches of at most MAX_ROWS rows."""
    if x.dim() == 2 and x.shape[0] <= MAX_ROWS:
        cfg = choice(weight)
        if cfg is not None:
            return gemv(x, weight, bias, cfg)
    return F.linear(x, weight, bias)
