"""LoRA's kernels for steps of few tokens (decode): each token multiplies by its own adapter's
slot only (Punica's BGMV), where the dense form (``models/lora.LoraWeights.dense``, the
reference) multiplies every slot and masks. With A [P·S·R, K] and B [N, P·S·R] laid out as
``models/lora.py`` describes (P parts, S slots, rank R):

    shrink  s[k, t, p·R + j] = Σ_{c in K-slice k} x[t, c] · A[(p·S + slot_t)·R + j, c]     (float32)
    expand  y[t, n]         += Σ_p Σ_j (Σ_k s[k, t, p·R + j]) · B[n, (p·S + slot_t)·R + j]

Two launches a projection, where the dense form takes three; a token with no adapter (slot −1)
costs a load and nothing more, so a step whose tokens have none is nearly free. The grids
depend on T and the shapes alone (CUDA graphs capture them); each token's slot comes from the
step's buffer (``LoraState.token_slots``), the shrink's partial sums go to a buffer of the state
(``LoraState.partials``), at most ``MAX_ROWS`` tokens. Both kernels release and wait as
``kernels/pdl.py`` says: the slots are step metadata, A and B weights, x and y activations.
The work grows with T × the rank × (K + N) reads, each token reading its own slices: past
``MAX_ROWS`` tokens the dense form's two GEMMs are cheaper.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from phalanx.kernels import pdl
from phalanx.kernels.pdl import release, wait

MAX_ROWS = 32        # the most tokens a step sends through these kernels (more: the dense form)
SHRINK_CHUNK = 512   # input columns a shrink program sums (K = 4,096: 8 programs a token and part)


@triton.jit
def _lora_shrink_kernel(x_ptr, a_ptr, slot_ptr, s_ptr, stride_x, K, S, CHUNK, ROWS, PW,
                        R: tl.constexpr, RP: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """Program (t, p, k): token t's part p over input columns [k·CHUNK, (k+1)·CHUNK)."""
    release(PDL)
    t = tl.program_id(0)
    p = tl.program_id(1)
    k = tl.program_id(2)
    slot = tl.load(slot_ptr + t)
    wait(PDL)
    if slot >= 0:
        r = tl.arange(0, RP)
        rows = (p * S + slot) * R + r
        acc = tl.zeros([RP], tl.float32)
        for kk in range(0, CHUNK, BLOCK_K):
            offs = kk + tl.arange(0, BLOCK_K)
            cols = k * CHUNK + offs
            cm = (cols < K) & (offs < CHUNK)
            xv = tl.load(x_ptr + t * stride_x + cols, mask=cm, other=0.0).to(tl.float32)
            a = tl.load(a_ptr + rows[:, None] * K + cols[None, :], mask=(r[:, None] < R) & cm[None, :], other=0.0)
            acc += tl.sum(a.to(tl.float32) * xv[None, :], axis=1)
        tl.store(s_ptr + (k * ROWS + t) * PW + p * R + r, acc, mask=r < R)


@triton.jit
def _lora_expand_kernel(y_ptr, s_ptr, b_ptr, slot_ptr, stride_y, stride_b, N, E1, E2, S, SPLIT, ROWS, PW,
                        R: tl.constexpr, RP: tl.constexpr, P: tl.constexpr, SPLIT_P: tl.constexpr,
                        BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    """Program (t, b): token t's outputs [b·BLOCK_N, (b+1)·BLOCK_N); part p's rows are
    [0, E1), [E1, E2), [E2, N) and read only part p's columns of the token's slot (its other
    columns are zero: masked loads of them fetch nothing)."""
    release(PDL)
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slot_ptr + t)
    wait(PDL)
    if slot >= 0:
        nm = n < N
        r = tl.arange(0, RP)
        rm = r < R
        ks = tl.arange(0, SPLIT_P)
        acc = tl.zeros([BLOCK_N], tl.float32)
        for p in tl.static_range(P):
            lo = 0 if p == 0 else (E1 if p == 1 else E2)
            hi = E1 if p == 0 else (E2 if p == 1 else N)
            pm = nm & (n >= lo) & (n < hi)
            part = tl.load(s_ptr + (ks[:, None] * ROWS + t) * PW + p * R + r[None, :],
                           mask=(ks[:, None] < SPLIT) & rm[None, :], other=0.0)
            sp = tl.sum(part, axis=0)
            cols = (p * S + slot) * R + r
            b = tl.load(b_ptr + n[:, None] * stride_b + cols[None, :], mask=pm[:, None] & rm[None, :], other=0.0)
            acc += tl.sum(b.to(tl.float32) * sp[None, :], axis=1)
        y = tl.load(y_ptr + t * stride_y + n, mask=nm, other=0.0)
        tl.store(y_ptr + t * stride_y + n, (y.to(tl.float32) + acc).to(y.dtype), mask=nm)


def splits(K: int) -> int:
    """The shrink's programs a token and part for K input columns."""
    return triton.cdiv(K, SHRINK_CHUNK)


def partials(max_k: int, rank: int, device: torch.device) -> torch.Tensor:
    """The shrink's partial sums for projections of at most ``max_k`` input columns and three
    parts: [splits, MAX_ROWS, 3 · rank] float32."""
    return torch.zeros(splits(max_k), MAX_ROWS, 3 * rank, device=device, dtype=torch.float32)


@dataclass(frozen=True)
class LoraPlan:
    """One projection's launch settings, decided at build (``plan``): its parts, slots and rank,
    where parts 1 and 2 of its outputs start (``bounds``; N where there are fewer parts), the
    shrink's programs a token and part and the columns each sums, and the tiles."""

    parts: int
    slots: int
    rank: int
    bounds: tuple[int, int]
    split: int
    chunk: int
    rank_p2: int
    block_k: int
    block_n: int


def plan(K: int, parts: int, slots: int, rank: int, bounds: tuple[int, int]) -> LoraPlan:
    """``LoraPlan`` of a projection of K input columns."""
    split = splits(K)
    rank_p2 = triton.next_power_of_2(rank)
    block_k = min(256, triton.next_power_of_2(max(16, 4096 // rank_p2)))
    chunk = triton.cdiv(triton.cdiv(K, split), block_k) * block_k
    block_n = min(128, triton.next_power_of_2(max(16, 4096 // rank_p2)))
    return LoraPlan(parts, slots, rank, bounds, split, chunk, rank_p2, block_k, block_n)


def lora_add(y: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, token_slots: torch.Tensor,
             part_sums: torch.Tensor, lp: LoraPlan) -> torch.Tensor:
    """y [T, N] += each token's adapter (``token_slots[t]``, −1: none) of x [T, K], in place;
    T ≤ ``MAX_ROWS``; ``lp`` the projection's ``plan``. Returns y."""
    T, K = x.shape
    N = y.shape[1]
    if T == 0:
        return y
    rows, width = part_sums.shape[1], part_sums.shape[2]
    launch = pdl.launch(x)
    _lora_shrink_kernel[(T, lp.parts, lp.split)](x, A, token_slots, part_sums, x.stride(0), K, lp.slots, lp.chunk,
                                                 rows, width, R=lp.rank, RP=lp.rank_p2, BLOCK_K=lp.block_k, **launch)
    _lora_expand_kernel[(T, triton.cdiv(N, lp.block_n))](
        y, part_sums, B, token_slots, y.stride(0), B.stride(0), N, lp.bounds[0], lp.bounds[1], lp.slots, lp.split,
        rows, width, R=lp.rank, RP=lp.rank_p2, P=lp.parts, SPLIT_P=triton.next_power_of_2(lp.split),
        BLOCK_N=lp.block_n, **launch)
    return y
