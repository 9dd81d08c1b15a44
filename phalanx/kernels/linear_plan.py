"""Plans: how each projection of the model runs, decided once when the engine is built.

A projection layer holds a frozen ``LinearPlan``. For each bucket of decode rows (``ROW_BUCKETS``:
one row, up to 16, up to 64) the plan names one way to compute x Wᵀ (+ b) — the skinny Triton
kernel with a tile, launched with or without programmatic dependent launch, or cuBLAS — and
keeps the launcher bound to it. Batches of more rows fall in ``MANY_ROW_BUCKETS`` (up to 128, 256,
..., 8,192 and more): bf16 weights take cuBLAS there, FP8 weights cuBLASLt's FP8 GEMM, or either
CUTLASS's GEMM of its type with a tile where that measured faster at the bucket
(kernels/cutlass_gemm.py). Calling the plan is a few comparisons of the row count and one call:
no registry, no per-call decision.

A plan also knows what runs in front of its projection (``Neighbour``), because the tuner times
each candidate with it and some candidates take it in:

    PLAIN  nothing special                     SILU  the input is gate ‖ up; silu(gate) * up is
    NORM   the residual add + RMSNorm kernel         taken first (inside the skinny kernel where
    ATTN   the attention kernels                     that was chosen, else its own kernel)

Behind the short kernels (NORM, ATTN) a one-row skinny kernel loads its first weight tile before
its PDL wait (see kernels/pdl.py: weights are never written by the chain).

Two one-token paths fuse more than a projection, and are chosen per layer the same way:
``QkvRopePlan`` (q/k/v projection + rotary + K/V write in one kernel) and ``GateUpSiluPlan``
(gate ‖ up with silu(gate) * up as its epilogue, then the down projection on the ready input).

A MoE layer holds a ``MoePlan``: the tile of the fused MoE kernels for each bucket of (token,
expert) pairs, chosen the same way (kernels/triton_moe.py ``tune``).

A plan with ``fp8`` runs a projection whose weight is FP8 with a scale per output channel
(kernels/fp8.py): its launches take the scale, the skinny kernels apply it in their epilogue and
"cublas" is cuBLASLt's FP8 GEMM (``fp8.linear``: activations quantized per row) instead of
F.linear; up to 64 rows may also take the Triton FP8 GEMM (``Plan("triton", BlockGemmTile)``,
kernels/fp8_block_gemm.py), split over K. With ``block`` as well the weight has a scale per (rows, cols) block
(``fp8.Fp8BlockWeight``): the skinny kernels scale each block's sums as they add them, and
every other bucket runs the block GEMM (``Plan("triton", BlockGemmTile)``,
kernels/fp8_block_gemm.py) or, for 128 x 128 blocks where the GPU has it and it measured faster,
cuBLASLt's block-scaled GEMM (``CUBLAS_BLOCK``, ``fp8.block_scaled_mm``).

Where no tuner ran (on a CPU, or with the Triton kernels unavailable) every plan is the
reference: cuBLAS/BLAS for every bucket (``fp8.linear`` for FP8 weights), the default MoE
tiles. A float32 model on a CPU takes ``CPU_BLAS`` instead (set by ``loader.build_model``): the
same product as (W xᵀ)ᵀ, which the CPU's BLAS runs up to 3× faster than x Wᵀ for few rows (a
49,152 × 576 output layer against 6 rows: 46 → 14 ms on a two-core x86 machine). A bf16 or fp16
model on a CPU without native bf16 arithmetic takes it from ``CPU_HALF_FROM_ROWS`` rows on: the
product in float32, rounded to the weight's dtype once. The CPU's own bf16 GEMM there takes time in
step with the rows (3,072 × 576 against 64 rows: 22 ms, against 4.4 ms in float32), while the
float32 product pays a conversion of the weight each call, which only few rows do not repay.

This module imports no Triton; launchers are imported when a tuned plan is built (a CUTLASS
tile's library is loaded then: the tuner built it; binding a plan never compiles).
"""

from __future__ import annotations

import bisect
import enum
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F

from phalanx.kernels import ops
from phalanx.kernels.attention_ref import UNIT_KV_SCALE, KvScale
from phalanx.kernels.cutlass_gemm import Tile as CutlassTile

ROW_BUCKETS = (1, 16, 64)      # a plan is tuned for each, at its upper bound
MANY_ROW_BUCKETS = (128, 256, 512, 1024, 2048, 4096, 8192)   # above ROW_BUCKETS; the last takes any more
_BOUNDS = ROW_BUCKETS + MANY_ROW_BUCKETS[:-1]


class Neighbour(str, enum.Enum):
    """The kernel in front of a projection (what the tuner times it with)."""

    PLAIN = "plain"
    SILU = "silu"
    NORM = "norm"
    ATTN = "attn"


PRELOAD_BEHIND = frozenset({Neighbour.NORM, Neighbour.ATTN})


class OneRowTile(NamedTuple):
    """Tile of the one-row kernel: [BLOCK_N, BLOCK_K] weight tiles, warps, pipeline stages, and
    ``fold``: the products of each K step are summed ``fold`` neighbours at a time into a
    [BLOCK_N, BLOCK_K // fold] float32 accumulator (1: one lane per product). A narrower
    accumulator takes fewer registers, so more programs stay resident and more weight bytes are
    in flight: what FP8 weights need, whose tiles hold twice the elements per byte."""

    block_n: int
    block_k: int
    warps: int
    stages: int
    fold: int = 1


class RowsTile(NamedTuple):
    """Tile of the padded-rows (tensor-core) kernel, and the number of K slices."""

    block_n: int
    block_k: int
    warps: int
    stages: int
    splits: int = 1


class BlockGemmTile(NamedTuple):
    """Tile of the FP8 GEMM of kernels/fp8_block_gemm.py: output rows and columns per program (a
    K step is one block's columns, or 128 for a weight scaled per row), warps, pipeline stages,
    slices of K (more than one for 2–64 rows only)."""

    block_m: int
    block_n: int
    warps: int
    stages: int
    splits: int = 1


class Plan(NamedTuple):
    """One way to run a projection for one bucket of rows."""

    kernel: str            # "cublas", "cublas-block", "gemv", "cutlass" (many rows), "triton" (the FP8 GEMM), "cpu"
    tile: OneRowTile | RowsTile | CutlassTile | BlockGemmTile | None = None
    pdl: bool = False

    def __str__(self) -> str:
        return self.kernel if self.tile is None else f"{self.kernel}{tuple(self.tile)}{'+pdl' if self.pdl else ''}"


CUBLAS = Plan("cublas")
CPU_BLAS = Plan("cpu")
BLOCK_GEMM_TILE = BlockGemmTile(64, 128, 4, 3)
BLOCK_GEMM = Plan("triton", BLOCK_GEMM_TILE)   # a block-scaled FP8 weight's untuned plan
CUBLAS_BLOCK = Plan("cublas-block")   # cuBLASLt's block-scaled FP8 GEMM (128 x 128 blocks; fp8.block_scaled_mm)
CPU_HALF_FROM_ROWS = 17    # a bf16/fp16 weight on a CPU without native bf16: the CPU plan from 17 rows
Launch = Callable[..., torch.Tensor]   # (x, weight, bias) -> y; FP8 plans: (x, weight, bias, scale)


def bucket_index(rows: int) -> int:
    """Index of the bucket a batch of ``rows`` runs as: ROW_BUCKETS, then MANY_ROW_BUCKETS."""
    return bisect.bisect_left(_BOUNDS, rows)


def bucket(rows: int) -> int:
    """The upper bound of the bucket of ``rows`` (what a plan for it was tuned at)."""
    return ROW_BUCKETS[bucket_index(rows)]


def run_fp8(neighbour: Neighbour, gemm: Callable[..., torch.Tensor] | None = None,
            block: tuple[int, int] | None = None) -> Launch:
    """``fp8.linear``, after silu(gate) * up behind SILU (quantized by the same kernel:
    ``fp8.silu_linear``), multiplying with ``gemm`` (cuBLASLt's FP8 GEMM where None); ``block``:
    the weight's scales are per block (``gemm`` is then one that takes them: the Triton block GEMM
    or cuBLASLt's block-scaled one)."""
    from phalanx.kernels import fp8 as f8
    run = f8.silu_linear if neighbour is Neighbour.SILU else f8.linear
    if block is not None:
        if gemm is None:
            raise ValueError("a block-scaled FP8 weight multiplies many rows with a block-scaled GEMM only")
        return functools.partial(run, gemm=gemm, block=block)
    return run if gemm is None else functools.partial(run, gemm=gemm)


def run_cublas(neighbour: Neighbour, fp8: bool = False) -> Launch:
    """F.linear (cuBLAS on a GPU), or for FP8 weights ``run_fp8`` on cuBLASLt, after
    silu(gate) * up behind SILU."""
    return run_fp8(neighbour) if fp8 else _behind(neighbour, F.linear)


def run_block_gemm(neighbour: Neighbour, tile: BlockGemmTile, block: tuple[int, int] | None) -> Launch:
    """``run_fp8`` of an FP8 weight scaled per ``block`` (or per row, with None) on the Triton
    FP8 GEMM with ``tile``."""
    from phalanx.kernels import fp8_block_gemm
    return run_fp8(neighbour, fp8_block_gemm.rows_gemm(tile, block), block)


def _behind(neighbour: Neighbour, linear: Launch) -> Launch:
    """``linear``, after silu(gate) * up behind SILU."""
    if neighbour is not Neighbour.SILU:
        return linear

    def run(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        return linear(ops.silu_and_mul(x), w, b)
    return run


def cpu_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] Wᵀ (+ b) as (W xᵀ)ᵀ on a CPU (``CPU_BLAS``): in float32, and for a bf16/fp16
    weight rounded to its dtype once, the bias added first."""
    rows = x.reshape(-1, x.shape[-1])
    y = torch.mm(w.float(), rows.float().t()).t()      # (.float() of a float32 tensor is itself)
    if b is not None:
        y = y + b.float()
    return y.to(w.dtype).contiguous().view(*x.shape[:-1], w.shape[0])


def cutlass_linear(gemm: Callable[..., torch.Tensor], x: torch.Tensor, w: torch.Tensor,
                   b: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] Wᵀ (+ b) through a bf16 CUTLASS tile's GEMM."""
    y = gemm(x.contiguous(), None, w, None)
    return y if b is None else y.add_(b)


def _cpu_from(first: int) -> tuple[Plan, ...]:
    """Every bucket's plan (ROW_BUCKETS, then MANY_ROW_BUCKETS): F.linear below bucket
    ``first``, the CPU plan from it on."""
    n = len(ROW_BUCKETS) + len(MANY_ROW_BUCKETS)
    return (CUBLAS,) * first + (CPU_BLAS,) * (n - first)


def launcher(plan: Plan, neighbour: Neighbour, fp8: bool = False, block: tuple[int, int] | None = None) -> Launch:
    """The call that runs ``plan`` for a projection behind ``neighbour`` (whose weight is FP8,
    taking its scale as a fourth argument, with ``fp8``; scaled per ``block`` where given)."""
    if plan.kernel == "cpu":
        return _behind(neighbour, cpu_linear)
    if plan == CUBLAS_BLOCK:
        from phalanx.kernels import fp8 as f8
        if block is None or not fp8 or tuple(block) != f8.CUBLAS_BLOCK_SHAPE:
            raise ValueError(f"cuBLASLt's block-scaled GEMM takes FP8 weights scaled per "
                             f"{f8.CUBLAS_BLOCK_SHAPE[0]} x {f8.CUBLAS_BLOCK_SHAPE[1]} block only, not {block}")
        return run_fp8(neighbour, f8.block_scaled_mm, block)
    if isinstance(plan.tile, BlockGemmTile) or (block is not None and plan.kernel == "cublas"):
        if not fp8:
            raise ValueError("the FP8 GEMM (kernels/fp8_block_gemm.py) takes FP8 weights only")
        return run_block_gemm(neighbour, plan.tile if isinstance(plan.tile, BlockGemmTile) else BLOCK_GEMM_TILE,
                              block)
    if plan.kernel == "cublas" or plan.tile is None:
        return run_cublas(neighbour, fp8)
    if isinstance(plan.tile, CutlassTile):
        from phalanx.kernels import cutlass_gemm
        if fp8:
            return run_fp8(neighbour, cutlass_gemm.kernel(plan.tile))
        return _behind(neighbour, functools.partial(cutlass_linear, cutlass_gemm.kernel(plan.tile)))
    from phalanx.kernels import gemv
    tile = plan.tile
    silu = neighbour is Neighbour.SILU
    preload = neighbour in PRELOAD_BEHIND and isinstance(tile, OneRowTile)

    def run(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
            scale: torch.Tensor | None = None) -> torch.Tensor:
        return gemv.gemv(x, w, b, tile, silu=silu, pdl=plan.pdl, preload=preload, scale=scale, block=block)
    return run


@dataclass(frozen=True)
class LinearPlan:
    """The plan of one projection: a ``Plan`` per row bucket (``plans``, ROW_BUCKETS) and per
    bucket of many rows (``many``, MANY_ROW_BUCKETS), behind its ``neighbour``."""

    neighbour: Neighbour = Neighbour.PLAIN
    plans: tuple[Plan, ...] = (CUBLAS,) * len(ROW_BUCKETS)
    fp8: bool = False                   # the weight is FP8 with a scale per output channel
    many: tuple[Plan, ...] = (CUBLAS,) * len(MANY_ROW_BUCKETS)
    launches: tuple[Launch, ...] = field(default=(), repr=False, compare=False)
    block: tuple[int, int] | None = None   # ... or with ``fp8``, per (rows, cols) block

    def __post_init__(self) -> None:
        if len(self.plans) != len(ROW_BUCKETS):
            raise ValueError(f"a LinearPlan needs one plan per row bucket {ROW_BUCKETS}, got {len(self.plans)}")
        if len(self.many) != len(MANY_ROW_BUCKETS):
            raise ValueError(f"a LinearPlan needs one plan per bucket of many rows {MANY_ROW_BUCKETS}, "
                             f"got {len(self.many)}")
        if self.block is not None:
            self._check_block()
        else:
            dtype = "fp8" if self.fp8 else "bf16"
            if any(p.kernel not in ("cublas", "cutlass", "cpu")
                   or (p.kernel == "cutlass" and not (isinstance(p.tile, CutlassTile) and p.tile.dtype == dtype))
                   for p in self.many):
                raise ValueError(f"many rows take cuBLAS, a CUTLASS tile of the weight's type ({dtype}), or the "
                                 f"CPU's BLAS: {self.many}")
        buckets = self.plans + self.many
        if CPU_BLAS in buckets and (self.fp8 or buckets != _cpu_from(buckets.index(CPU_BLAS))):
            raise ValueError("the CPU plan takes a full-precision weight's buckets from one on (F.linear below it)")
        if not self.launches:   # bound once, in bucket order
            launches = tuple(launcher(p, self.neighbour, self.fp8, self.block) for p in self.plans + self.many)
            object.__setattr__(self, "launches", launches)

    def _check_block(self) -> None:
        """A block-scaled FP8 weight has no row-scaled cuBLASLt or CUTLASS GEMM: its buckets take the
        skinny kernels, the block GEMM (what "cublas", the untuned default, becomes here), or
        cuBLASLt's block-scaled GEMM where the tuner found it faster."""
        if not self.fp8:
            raise ValueError("a LinearPlan with blocks is an FP8 weight's")
        plans, many = (tuple(BLOCK_GEMM if p == CUBLAS else p for p in ps) for ps in (self.plans, self.many))
        whole = [isinstance(p.tile, BlockGemmTile) and p.tile.splits == 1 or p == CUBLAS_BLOCK for p in many]
        if not all(whole) or any(
                not (p.kernel == "gemv" or isinstance(p.tile, BlockGemmTile) or p == CUBLAS_BLOCK) for p in plans):
            raise ValueError(f"a block-scaled FP8 weight takes the skinny kernels, the block GEMM or cuBLASLt's "
                             f"block-scaled GEMM, split over K up to 64 rows only: {plans + many}")
        object.__setattr__(self, "plans", plans)
        object.__setattr__(self, "many", many)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 scale: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] (gate ‖ up [M, 2K] behind SILU) -> x Wᵀ (+ b) [M, N]; ``scale``: the FP8
        weight's scales (plans with ``fp8``)."""
        if scale is None:
            return self.launches[bucket_index(x.shape[0])](x, weight, bias)
        return self.launches[bucket_index(x.shape[0])](x, weight, bias, scale)

    @classmethod
    def cpu(cls, neighbour: Neighbour, from_rows: int = 1) -> LinearPlan:
        """The CPU's BLAS as (W xᵀ)ᵀ for the buckets of ``from_rows`` rows and more (every one for
        a float32 weight on a CPU; ``CPU_HALF_FROM_ROWS`` for a bf16/fp16 one), F.linear below."""
        buckets = _cpu_from(bucket_index(from_rows))
        return cls(neighbour, buckets[:len(ROW_BUCKETS)], False, buckets[len(ROW_BUCKETS):])

    @property
    def is_reference(self) -> bool:
        return all(p.kernel in ("cublas", "cpu") or p == BLOCK_GEMM for p in self.plans + self.many)

    def one_row(self) -> Plan:
        return self.plans[0]

    def __str__(self) -> str:
        buckets = zip(ROW_BUCKETS + MANY_ROW_BUCKETS, self.plans + self.many, strict=True)
        kind = (f" fp8 {self.block[0]}x{self.block[1]}" if self.block else " fp8") if self.fp8 else ""
        return f"{self.neighbour.value}{kind}: " + ", ".join(f"≤{n} rows {p}" for n, p in buckets)


@dataclass(frozen=True)
class QkvRopePlan:
    """One token's q/k/v projection with rotary and the K/V write as its epilogue, one kernel."""

    tile: OneRowTile
    pdl: bool
    block: tuple[int, int] | None = None   # an FP8 weight's scales are per block

    def __call__(self, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, positions: torch.Tensor,
                 cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 num_heads: int, num_kv_heads: int, head_dim: int, scale: torch.Tensor | None = None,
                 kv_scale: KvScale = UNIT_KV_SCALE) -> torch.Tensor:
        """h [1, K] (normed) -> the rotated q [1, H, D]; k and v are written to their slot.
        ``scale``: an FP8 weight's scales; ``kv_scale``: an FP8 pool's K and V scales."""
        from phalanx.kernels import gemv
        return gemv.qkv_rope(h, weight, bias, positions, cos_sin, k_cache, v_cache, slot_mapping, num_heads,
                             num_kv_heads, head_dim, self.tile, self.pdl, scale, self.block, kv_scale)

    @staticmethod
    def fits(tile: OneRowTile, head_dim: int) -> bool:
        """A program must hold whole rotary pairs of one head."""
        return head_dim % 2 == 0 and tile.block_n % 2 == 0 and head_dim % tile.block_n == 0


@dataclass(frozen=True)
class GateUpSiluPlan:
    """One token through an MLP: gate ‖ up with silu(gate) * up as its epilogue, then the down
    projection on that ready input with ``down`` (a one-row plan behind PLAIN). ``fp8``: both
    weights are FP8 and their calls take the scales."""

    tile: OneRowTile
    pdl: bool
    down: Plan
    fp8: bool = False
    block: tuple[int, int] | None = None   # both FP8 weights' scales are per block

    def __post_init__(self) -> None:
        object.__setattr__(self, "_down", launcher(self.down, Neighbour.PLAIN, self.fp8, self.block))

    def gate_up_silu(self, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     scale: torch.Tensor | None = None) -> torch.Tensor:
        """h [1, K] (normed) -> silu(gate) * up [1, I]."""
        from phalanx.kernels import gemv
        return gemv.gate_up_silu(h, weight, bias, self.tile, self.pdl, scale, self.block)

    def down_proj(self, act: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        if scale is None:
            return self._down(act, weight, None)   # type: ignore[attr-defined]
        return self._down(act, weight, None, scale)   # type: ignore[attr-defined]


class MoeTile(NamedTuple):
    """Tile of the fused MoE kernels: rows of (token, expert) pairs per block, output columns and
    K per step, warps, pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int


PAIR_BUCKETS = (64, 512, 4096)   # (token, expert) pairs of a step: a MoePlan has a tile for each, and one beyond


def pair_bucket_index(pairs: int) -> int:
    return next((i for i, b in enumerate(PAIR_BUCKETS) if pairs <= b), len(PAIR_BUCKETS))


@dataclass(frozen=True)
class MoeOneRows:
    """The few-token form of the fused MoE (``triton_moe.fused_moe_rows``): each (token, expert)
    pair multiplied as one row, with no placing of pairs into blocks, and a token's experts summed
    inside the down kernel. ``gate_up`` and ``down``: the one-row tiles of its two kernels (a
    gate ‖ up tile's rows are gate and up rows interleaved); ``max_tokens``: the largest step it
    runs, the point up to which the tuner timed it faster than the blocked form."""

    gate_up: OneRowTile
    down: OneRowTile
    max_tokens: int


@dataclass(frozen=True)
class MoePlan:
    """The fused MoE kernels' tile for each bucket of pairs (PAIR_BUCKETS, then larger), and the
    few-token form where it is faster (None: the blocked form at every size)."""

    tiles: tuple[MoeTile, ...] = (MoeTile(16, 64, 64, 4, 3), MoeTile(16, 64, 64, 4, 3), MoeTile(64, 64, 64, 4, 3),
                                  MoeTile(64, 64, 64, 4, 3))
    rows: MoeOneRows | None = None

    def tile(self, pairs: int) -> MoeTile:
        return self.tiles[pair_bucket_index(pairs)]

    def one_rows(self, tokens: int) -> MoeOneRows | None:
        """The few-token form's tiles where a step of ``tokens`` takes it."""
        return self.rows if self.rows is not None and tokens <= self.rows.max_tokens else None
