"""FP8 (e4m3) weights: quantization, the reference, and the dense path for many rows.

``quantization: fp8`` quantizes each projection of the decoder layers as its checkpoint rows load
(the model is built with FP8 weights: models/layers.fp8_weights): every
output channel (row of W) gets a float32 scale = max |W[n]| / 448, and W is stored as e4m3
(half the bytes of bf16). A projection then computes x Wᵀ as (x · q[n]) · scale[n]:

- few rows (the decode buckets of ``linear_plan``): the skinny kernels of ``gemv`` read the e4m3
  weights, widen them in registers and apply the scale in their epilogue (weights in FP8,
  activations as they are: W8A16, no activation rounding);
- more rows: ``linear`` — each activation row is quantized to e4m3 with its own scale (dynamic,
  per token) and ``torch._scaled_mm`` (cuBLASLt's FP8 GEMM, row-wise scales) multiplies (W8A8),
  with Hopper's fast FP8 accumulation (``FAST_ACCUM``). The kernel in front quantizes where it
  can, so that the rows make one trip through memory in e4m3 instead of two in bf16 and one
  more kernel: an RMSNorm in front hands over ``Fp8Rows`` (``RMSNorm.fp8_rows_above``, set at
  build time where ``takes_fp8_rows``), the down projection's SiLU-and-mul quantizes in the
  same kernel (``silu_linear``).

A block-scaled FP8 checkpoint (``weight_block_size``, DeepSeek and Qwen3 FP8: ``Fp8BlockWeight``)
keeps a scale per (rows, cols) block where a layer's split allows (``layers.fp8_weights``): the
skinny kernels scale each block's folded sums as they add them, and many rows take the block
GEMM (kernels/fp8_block_gemm.py, Triton: cuBLASLt's row-wise FP8 GEMM has no block form) or,
for 128 x 128 blocks where the GPU has it and the tuner found it faster, cuBLASLt's
block-scaled GEMM (``block_scaled_mm``), on rows quantized per row as above.

The reference (and the path on a CPU, or where a shape or dtype does not suit ``_scaled_mm``) is
the bf16 projection of the dequantized weight, q · scale, so the whole engine runs and is
tested on a CPU. MoE experts take the same per-row scales in the fused MoE kernels
(``triton_moe``); embeddings, the output layer, norms and the router stay in the model's dtype.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)     # 448
TINY = 1e-12                             # the scale of an all-zero row or channel


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> (q [N, K] e4m3, scale [N] float32) with W ≈ q · scale[:, None]."""
    w32 = w.float()
    scale = (w32.abs().amax(dim=1) / FP8_MAX).clamp(min=TINY)
    q = (w32 / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


class Fp8Weight(NamedTuple):
    """A checkpoint's e4m3 weight whose scale is one per tensor or one per row, as a scale per
    row: W = q · scale[:, None], q [N, K] e4m3, scale [N] float32. An FP8 projection or expert
    stores these bytes and scales as they are (``weight_rows``), where quantizing the
    dequantized weight again would round it a second time."""
    q: torch.Tensor
    scale: torch.Tensor

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.q, self.scale, dtype)


Block = tuple[int, int]   # (rows, cols) of W that share one scale


class Fp8BlockWeight(NamedTuple):
    """A checkpoint's e4m3 weight with one scale per ``block`` = (rows, cols) tile, as DeepSeek's
    and Qwen3's FP8 checkpoints ship (``weight_block_size``): W[n, k] = q[n, k] · scale[n // rows,
    k // cols], q [N, K] e4m3, scale [⌈N / rows⌉, ⌈K / cols⌉] float32. A block-scaled FP8
    projection or expert stores these bytes and scales as they are (``Projection._load_fp8_blocks``,
    ``SparseMoE._load_expert_blocks``)."""
    q: torch.Tensor
    scale: torch.Tensor
    block: Block

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_blocks(self.q, self.scale, self.block, dtype)


def weight_rows(w: torch.Tensor | Fp8Weight, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale per row) of checkpoint rows on ``device``: an ``Fp8Weight``'s own, exactly, or a
    full-precision tensor quantized (``quantize_weight``; a block-scaled weight reaches a layer
    scaled per row dequantized, before its rows are placed)."""
    if isinstance(w, Fp8Weight):
        return w.q.to(device), w.scale.to(device, torch.float32)
    return quantize_weight(w.to(device))


def quantize_blocks(w: torch.Tensor, block: Block) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> (q [N, K] e4m3, scale [⌈N / rows⌉, ⌈K / cols⌉] float32), one scale per block:
    its amax / 448 (a partial block at the edge takes the amax of what it holds)."""
    r, c = block
    N, K = w.shape
    Nb, Kb = -(-N // r), -(-K // c)
    padded = F.pad(w.float(), (0, Kb * c - K, 0, Nb * r - N))
    scale = (padded.abs().reshape(Nb, r, Kb, c).amax(dim=(1, 3)) / FP8_MAX).clamp(min=TINY)
    q = (w.float() / expand_blocks(scale, block, N, K)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def expand_blocks(scale: torch.Tensor, block: Block, N: int, K: int) -> torch.Tensor:
    """A block scale [⌈N / rows⌉, ⌈K / cols⌉] as one per element [N, K]."""
    r, c = block
    return scale.repeat_interleave(r, 0)[:N].repeat_interleave(c, 1)[:, :K]


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, block: Block, dtype: torch.dtype) -> torch.Tensor:
    """q [N, K] e4m3, scale per block -> W [N, K] in ``dtype``."""
    return (q.float() * expand_blocks(scale.float(), block, *q.shape)).to(dtype)


def dequantize_any(q: torch.Tensor, scale: torch.Tensor, block: Block | None, dtype: torch.dtype) -> torch.Tensor:
    """``dequantize`` (a scale per row: ``block`` None) or ``dequantize_blocks``."""
    return dequantize(q, scale, dtype) if block is None else dequantize_blocks(q, scale, block, dtype)


def blocks_fit(block: tuple[int, ...] | None) -> bool:
    """Whether the kernels take a weight of these blocks as it is: powers of two, rows from 16
    and columns from 32 to 128 (the one-row kernels fold 16 products before they scale them; a K
    step of the many-row GEMM is one block's columns, and an FP8 tensor-core dot takes 32; wider
    steps would not fit its tiles in shared memory)."""
    return (block is not None and len(block) == 2 and all(b & (b - 1) == 0 for b in block)
            and block[0] >= 16 and 32 <= block[1] <= 128)


class Fp8Rows(NamedTuple):
    """Activations quantized per row: x ≈ q · scale, q [M, K] e4m3, scale [M, 1] float32;
    ``dtype``: what x was computed in, and what a product of the rows gives."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self) -> torch.Tensor:
        return (self.q.float() * self.scale).to(self.dtype)


def quantize_rows(x: torch.Tensor) -> Fp8Rows:
    """x [M, K] -> rows in e4m3 with one float32 scale per row (token). On a GPU one Triton kernel
    (``triton_ops.quantize_rows_fp8``: eight torch kernels cost ~20 µs a projection)."""
    if x.is_cuda:
        q, scale = _triton_ops().quantize_rows_fp8(x, FP8_MAX, TINY)
        return Fp8Rows(q, scale, x.dtype)
    return quantize_rows_reference(x)


@functools.cache
def _triton_ops():   # imported once, on the first GPU call (this module imports no Triton)
    from phalanx.kernels import triton_ops
    return triton_ops


def quantize_rows_reference(x: torch.Tensor) -> Fp8Rows:
    x32 = x.float()
    scale = (x32.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=TINY)
    return Fp8Rows((x32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale, x.dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q [N, K] e4m3, scale [N] -> W [N, K] in ``dtype``."""
    return (q.float() * scale[:, None]).to(dtype)


def reference(x: torch.Tensor, q: torch.Tensor, bias: torch.Tensor | None, scale: torch.Tensor,
              block: Block | None = None) -> torch.Tensor:
    """x [M, K] -> x (q · scale)ᵀ (+ b): the projection of the dequantized weight (a scale per
    row, or per ``block``)."""
    w = dequantize_any(q, scale, block, x.dtype) if q.is_cuda else _kept_dequantized(q, scale, x.dtype, block)
    return F.linear(x, w, bias)


def _kept_dequantized(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                      block: Block | None = None) -> torch.Tensor:
    """``dequantize`` of a CPU weight, kept on the weight until it or its scale is written (their
    version counters and addresses) or the dtype changes: a CPU runs FP8 through this reference,
    and converting e4m3 to float in every projection of every step took a third of an FP8
    forward's time there (the FP8 accuracy test: 26 of 86 s). The same values as ``dequantize``
    each call; it costs a copy of the weight in ``dtype``, kept through a sleep (a CPU's FP8 path
    is for testing the engine, not for its memory). A write through ``.data`` has a version
    counter of its own and goes unseen: the FP8 projections' loader (``Projection._load_fp8``)
    writes through the parameters (the experts' loader need not: their reference, ``experts_ref``,
    dequantizes each call)."""
    if q.is_inference() or scale.is_inference():   # no version counters to tell a write
        return dequantize_any(q, scale, block, dtype)
    key = (q.data_ptr(), q._version, scale.data_ptr(), scale._version, dtype, block)
    kept = getattr(q, "_phalanx_dequantized", None)
    if kept is None or kept[0] != key:
        with torch.inference_mode(False):   # a plain tensor, whatever mode the first call ran in
            kept = (key, dequantize_any(q, scale, block, dtype))
        q._phalanx_dequantized = kept   # type: ignore[attr-defined]
    return kept[1]


# Hopper's FP8 tensor cores accumulate in a narrower format unless the GEMM promotes the sums to
# float32 every few K steps; ``use_fast_accum`` skips the promotion. H200, 8,192 rows of Llama-3.1-8B's
# projections (tools/bench_gemm.py, docs/results/gpu19_gemm.txt): 1,273–1,359 TFLOP/s with the
# promotion, 1,479–1,513 without; the error against float32 of the same FP8 values goes from
# 1.7e-3 to 2.1e-3 (3.3e-3 for K = 14,336), well below the ~5 % the FP8 rounding of the weights
# and activations itself costs. 2048/128 offline, FP8: 2,003 -> 2,744 out tok/s in one run.
FAST_ACCUM = True

MIN_CAPABILITY = (8, 9)    # e4m3 in Triton and in cuBLASLt: Ada, Hopper and later


def supported(device: torch.device) -> bool:
    """Whether FP8 runs on ``device`` (a CPU runs the reference)."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= MIN_CAPABILITY


def check_device(device: torch.device, field: str) -> None:
    """Refuse FP8 (``field``) on a GPU without it, naming the field and the limit; probe the
    FP8 GEMM once (``rowwise_scaled_mm``) so that no call inside a CUDA graph capture has to."""
    if device.type != "cuda":
        return
    if not supported(device):
        cap = torch.cuda.get_device_capability(device)
        raise ValueError(f"{field}: fp8 needs a GPU of compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} "
                         f"or more; this one has {cap[0]}.{cap[1]}")
    rowwise_scaled_mm(torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device()))


@functools.cache
def rowwise_scaled_mm(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` with a scale per row and per column runs on this GPU (tried
    once: some builds and GPUs have no row-wise kernel); where not, ``linear`` takes the reference."""
    a = torch.ones(16, 16, device=device).to(FP8)
    ones = torch.ones(16, 1, device=device)
    try:
        torch._scaled_mm(a, a.t(), scale_a=ones, scale_b=ones.t(), out_dtype=torch.bfloat16, use_fast_accum=FAST_ACCUM)
        torch.cuda.synchronize(device)
        return True
    except RuntimeError:
        return False


def takes_fp8_rows(q: torch.Tensor, act_dtype: torch.dtype, block: Block | None = None) -> bool:
    """Whether an FP8 GEMM takes the many-row products of this FP8 weight with activations in
    ``act_dtype``: bf16 (row-wise scales give bf16 only) and, for cuBLASLt's (a scale per row), K
    and N multiples of 16 on a GPU whose row-wise FP8 GEMM ran (``check_device``); a weight scaled
    per ``block`` (``fp8_block_gemm``, Triton) on any GPU with Triton. Then the kernel in front
    may quantize the rows."""
    if not (q.is_cuda and q.dtype == FP8 and act_dtype == torch.bfloat16):
        return False
    if block is not None:
        return block_gemm_runs(q.device, (block[0], block[1]))
    return q.shape[0] % 16 == 0 and q.shape[1] % 16 == 0 and rowwise_scaled_mm(q.device)


@functools.cache
def block_gemm_runs(device: torch.device, block: Block) -> bool:
    """Whether the block GEMM (kernels/fp8_block_gemm.py) runs on this GPU for these blocks (tried
    once, on its untuned tile, at start-up: where not, a block-scaled weight's many rows take the
    reference)."""
    from phalanx.kernels import ops
    if not ops.triton_available():
        return False
    from phalanx.kernels import fp8_block_gemm
    rows = torch.ones(16, 2 * block[1], device=device).to(FP8)
    try:
        fp8_block_gemm.gemm(rows, torch.ones(16, 1, device=device), rows, torch.ones(1, 2, device=device), block)
        torch.cuda.synchronize(device)
        return True
    except Exception:  # noqa: BLE001 - the compiler or the GPU refused it: the reference serves
        return False


CUBLAS_BLOCK_SHAPE = (128, 128)   # the weight blocks cuBLASLt's block-scaled FP8 GEMM takes


def block_scaled_mm_fits(q: torch.Tensor, block: Block | None) -> bool:
    """Whether cuBLASLt's block-scaled FP8 GEMM (``block_scaled_mm``) takes this weight: scaled
    per 128 x 128 block, N a multiple of 128 and K of 512 (its scale rows are read in fours), on a
    GPU where the probe gave the reference's product (``blockwise_scaled_mm``)."""
    return (block is not None and tuple(block) == CUBLAS_BLOCK_SHAPE and q.is_cuda and q.shape[0] % 128 == 0
            and q.shape[1] % 512 == 0 and blockwise_scaled_mm(q.device))


@functools.cache
def blockwise_scaled_mm(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm``'s block-scaled form runs on this GPU and gives the product of
    the dequantized operands (tried once, with a scale of its own for every block: cuBLASLt has it
    from CUDA 12.9 on Hopper; other GPUs and builds refuse it)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    w = torch.randn(256, 1024, generator=g) * torch.logspace(-2, 1, 256)[:, None]
    x = torch.randn(6, 1024, generator=g)
    q, scale = (t.to(device) for t in quantize_blocks(w, CUBLAS_BLOCK_SHAPE))
    rows = quantize_rows_reference(x.to(device))
    try:
        y = block_scaled_mm(rows.q, rows.scale, q, scale).float()
        torch.cuda.synchronize(device)
    except Exception:  # noqa: BLE001 - a build or GPU without the block-scaled form
        return False
    ref = reference(rows.dequantize().float(), q, None, scale, CUBLAS_BLOCK_SHAPE)
    return bool(((y - ref).abs() <= 0.02 * ref.abs() + 1e-3 * ref.abs().max()).all())


def block_scaled_mm(rows_q: torch.Tensor, rows_scale: torch.Tensor, q: torch.Tensor,
                    scale: torch.Tensor) -> torch.Tensor:
    """cuBLASLt's block-scaled FP8 GEMM (DeepSeek's recipe) of rows scaled per row against a weight
    scaled per 128 x 128 block -> bf16 [M, N]. It takes the rows' scales per 128 columns, laid out
    M-major over a multiple of 4 rows: each row's one scale is repeated over its column blocks, and
    the rows are padded to a multiple of 4 where they are not."""
    M, K = rows_q.shape
    pad = -M % 4
    if pad:
        rows_q = torch.cat([rows_q.view(torch.uint8), rows_q.new_zeros(pad, K, dtype=torch.uint8)]).view(FP8)
        rows_scale = torch.cat([rows_scale.reshape(-1), rows_scale.new_ones(pad)])
    scale_a = rows_scale.reshape(1, M + pad).expand(scale.shape[1], M + pad).contiguous().t()
    y = torch._scaled_mm(rows_q, q.t(), scale_a=scale_a, scale_b=scale.t(), out_dtype=torch.bfloat16)
    return y[:M] if pad else y


def scaled_mm_fits(x: torch.Tensor, q: torch.Tensor, block: Block | None = None) -> bool:
    """Whether an FP8 GEMM takes this product (``takes_fp8_rows`` for x's dtype)."""
    return x.is_cuda and takes_fp8_rows(q, x.dtype, block)


# A GEMM of FP8 rows: (rows q [M, K] e4m3, their scales [M, 1], weight q [N, K] e4m3, its scales [N])
# -> bf16 [M, N]; ``scaled_mm`` (cuBLASLt), or a CUTLASS tile's kernel (kernels/cutlass_gemm.py)
RowsGemm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def scaled_mm(rows_q: torch.Tensor, rows_scale: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """cuBLASLt's FP8 GEMM with a scale per row of x and per row of W, fast accumulation."""
    return torch._scaled_mm(rows_q, q.t(), scale_a=rows_scale, scale_b=scale[None, :], out_dtype=torch.bfloat16,
                            use_fast_accum=FAST_ACCUM)


def linear(x: torch.Tensor | Fp8Rows, q: torch.Tensor, bias: torch.Tensor | None, scale: torch.Tensor,
           gemm: RowsGemm = scaled_mm, block: Block | None = None) -> torch.Tensor:
    """x [M, K] -> x Wᵀ (+ b) for any number of rows: activations quantized per row (unless they
    come so, as ``Fp8Rows``) and ``gemm`` (cuBLASLt by default; a CUTLASS tile where the tuner chose
    one; for a weight scaled per ``block``, the block GEMM, ``fp8_block_gemm``) where its
    conditions hold (``scaled_mm_fits``; the tuner offers CUTLASS only there), else the reference
    (of the rows as they came)."""
    if isinstance(x, Fp8Rows):
        if not (x.q.is_cuda and takes_fp8_rows(q, x.dtype, block)):
            return reference(x.dequantize(), q, bias, scale, block)
        rows = x
    elif scaled_mm_fits(x, q, block):
        rows = quantize_rows(x if x.stride(-1) == 1 else x.contiguous())
    else:
        return reference(x, q, bias, scale, block)
    y = gemm(rows.q, rows.scale, q, scale)
    return y if bias is None else y + bias


def silu_linear(x: torch.Tensor, q: torch.Tensor, bias: torch.Tensor | None, scale: torch.Tensor,
                gemm: RowsGemm = scaled_mm, block: Block | None = None) -> torch.Tensor:
    """x [M, 2I] (gate ‖ up) -> silu(gate) * up · Wᵀ (+ b): where the FP8 GEMM takes the product,
    silu(gate) * up is quantized per row by the same kernel (``triton_ops.silu_and_mul_fp8``)."""
    from phalanx.kernels import ops
    if not (scaled_mm_fits(x, q, block) and ops.triton_available()
            and x.shape[1] // 2 <= _triton_ops().SILU_FP8_MAX_ROW):
        return linear(ops.silu_and_mul(x), q, bias, scale, gemm, block)
    rows, rows_scale = _triton_ops().silu_and_mul_fp8(x, FP8_MAX, TINY)
    return linear(Fp8Rows(rows, rows_scale, x.dtype), q, bias, scale, gemm, block)
