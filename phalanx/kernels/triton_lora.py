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
The work grows with T × the rank × (K + N) reads, each token reading its own slices.

Past ``DECODE_ROWS`` tokens (a decode batch of 64, a short prefill), the grouped pair (Punica's
SGMV) takes up to ``GROUPED_ROWS``: the step's tokens sorted by slot and cut into tiles of at
most ``TILE_ROWS`` tokens of one slot (``groups``, on the host, staged with the step's inputs), a
program takes a tile and multiplies it by its slot's A or B once, on the tensor cores:

    shrink  s[k, t, p·R + j] = Σ_{c in K-slice k} x[t, c] · A[(p·S + slot)·R + j, c]   t in the tile
    expand  y[t, n]         += Σ_p (Σ_k s[k, t, p·R + ·]) · B[n, (p·S + slot)·R + ·]

The grid is the most tiles T tokens can make (``max_tiles``: ⌈T / TILE_ROWS⌉ + one a slot), so it
depends on T and the shapes alone, as CUDA graphs need; a tile past the step's own is marked
empty (slot −1) and its program returns. Tokens with no adapter are in no tile. Past
``GROUPED_ROWS`` tokens (long prefills) the dense form runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from phalanx.kernels import pdl
from phalanx.kernels.pdl import release, wait

MAX_ROWS = 32        # the most tokens the decode kernels' buffers hold
# the most tokens a step sends through the decode kernels (more: the grouped kernels); on an H100 a layer's took
# 22 / 34 / 38 / 43 us at 1 / 16 / 24 / 32 tokens, the grouped ones 38 / 36 / 35 at 16 / 24 / 32
DECODE_ROWS = 16
SHRINK_CHUNK = 512   # input columns a shrink program sums (K = 4,096: 8 programs a token and part)
TILE_ROWS = 16       # the most tokens (of one slot) a grouped program takes
GROUPED_ROWS = 512   # the most tokens a step sends through the grouped kernels (more: the dense form)
GROUPED_CHUNK = 1024 # input columns a grouped shrink program sums (its tile's x and A rows: 2 × 32 KB at rank 16)


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


@triton.jit
def _tile(tile_ptr, order_ptr, g, BM: tl.constexpr):
    """Tile g's slot (−1: empty), its tokens and which of its BM rows are live: positions
    [lo, hi) of the step's tokens sorted by slot. Step metadata: read before the PDL wait."""
    slot = tl.load(tile_ptr + 3 * g)
    lo = tl.load(tile_ptr + 3 * g + 1)
    hi = tl.load(tile_ptr + 3 * g + 2)
    i = tl.arange(0, BM)
    live = lo + i < hi   # (an empty tile: lo = hi = 0)
    tok = tl.load(order_ptr + lo + i, mask=live, other=0)
    return slot, tok, live


@triton.jit
def _lora_shrink_grouped_kernel(x_ptr, a_ptr, tile_ptr, order_ptr, s_ptr, stride_x, K, S, CHUNK, ROWS, PW,
                                R: tl.constexpr, RD: tl.constexpr, BM: tl.constexpr, BLOCK_K: tl.constexpr,
                                PREC: tl.constexpr, PDL: tl.constexpr):
    """Program (g, p, k): tile g's tokens, part p, input columns [k·CHUNK, (k+1)·CHUNK)."""
    release(PDL)
    g = tl.program_id(0)
    p = tl.program_id(1)
    k = tl.program_id(2)
    slot, tok, live = _tile(tile_ptr, order_ptr, g, BM)
    wait(PDL)
    if slot >= 0:
        r = tl.arange(0, RD)
        rows = (p * S + slot) * R + r
        acc = tl.zeros([BM, RD], tl.float32)
        for kk in range(0, CHUNK, BLOCK_K):
            offs = kk + tl.arange(0, BLOCK_K)
            cols = k * CHUNK + offs
            cm = (cols < K) & (offs < CHUNK)
            xv = tl.load(x_ptr + tok[:, None] * stride_x + cols[None, :], mask=live[:, None] & cm[None, :], other=0.0)
            a = tl.load(a_ptr + rows[:, None] * K + cols[None, :], mask=(r[:, None] < R) & cm[None, :], other=0.0)
            acc += tl.dot(xv, tl.trans(a), input_precision=PREC)
        tl.store(s_ptr + (k * ROWS + tok[:, None]) * PW + p * R + r[None, :], acc,
                 mask=live[:, None] & (r[None, :] < R))


@triton.jit
def _lora_expand_grouped_kernel(y_ptr, s_ptr, b_ptr, tile_ptr, order_ptr, stride_y, stride_b, N, E1, E2, S, SPLIT,
                                ROWS, PW, R: tl.constexpr, RD: tl.constexpr, P: tl.constexpr, BM: tl.constexpr,
                                BLOCK_N: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr):
    """Program (g, b): tile g's tokens, outputs [b·BLOCK_N, (b+1)·BLOCK_N). Only the parts whose
    rows ([0, E1), [E1, E2), [E2, N)) meet the block are read."""
    release(PDL)
    g = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N
    slot, tok, live = _tile(tile_ptr, order_ptr, g, BM)
    wait(PDL)
    if slot >= 0:
        n = n0 + tl.arange(0, BLOCK_N)
        nm = n < N
        r = tl.arange(0, RD)
        rm = r < R
        acc = tl.zeros([BM, BLOCK_N], tl.float32)
        for p in tl.static_range(P):
            lo = 0 if p == 0 else (E1 if p == 1 else E2)
            hi = E1 if p == 0 else (E2 if p == 1 else N)
            if (n0 < hi) & (n0 + BLOCK_N > lo):
                sp = tl.zeros([BM, RD], tl.float32)
                for k in range(0, SPLIT):
                    sp += tl.load(s_ptr + (k * ROWS + tok[:, None]) * PW + p * R + r[None, :],
                                  mask=live[:, None] & rm[None, :], other=0.0)
                pm = nm & (n >= lo) & (n < hi)
                cols = (p * S + slot) * R + r
                b = tl.load(b_ptr + n[:, None] * stride_b + cols[None, :], mask=pm[:, None] & rm[None, :], other=0.0)
                acc += tl.dot(sp, tl.trans(b.to(tl.float32)), input_precision=PREC)   # (sp kept in float32: TF32)
        m = live[:, None] & nm[None, :]
        y = tl.load(y_ptr + tok[:, None] * stride_y + n[None, :], mask=m, other=0.0)
        tl.store(y_ptr + tok[:, None] * stride_y + n[None, :], (y.to(tl.float32) + acc).to(y.dtype), mask=m)


def splits(K: int) -> int:
    """The shrink's programs a token and part for K input columns."""
    return triton.cdiv(K, SHRINK_CHUNK)


def partials(max_k: int, rank: int, device: torch.device) -> torch.Tensor:
    """The decode shrink's partial sums for projections of at most ``max_k`` input columns and
    three parts: [splits, MAX_ROWS, 3 · rank] float32."""
    return torch.zeros(splits(max_k), MAX_ROWS, 3 * rank, device=device, dtype=torch.float32)


def grouped_partials(max_k: int, rank: int, device: torch.device) -> torch.Tensor:
    """The grouped shrink's: [⌈max_k / GROUPED_CHUNK⌉, GROUPED_ROWS, 3 · rank] float32."""
    return torch.zeros(triton.cdiv(max_k, GROUPED_CHUNK), GROUPED_ROWS, 3 * rank, device=device,
                       dtype=torch.float32)


def max_tiles(T: int, slots: int) -> int:
    """The most tiles of ``TILE_ROWS`` tokens of one slot that T tokens make over ``slots`` slots."""
    return triton.cdiv(T, TILE_ROWS) + min(slots, T)


def groups(token_slots: np.ndarray, slots: int) -> np.ndarray:
    """The grouped kernels' step metadata for tokens ``token_slots`` (−1: none), at most
    ``GROUPED_ROWS`` of them: int32, ``max_tiles(GROUPED_ROWS, slots)`` tiles of (slot, lo, hi)
    (−1, 0, 0: empty), then the tokens in slot order (tile (s, lo, hi) takes the tokens at
    positions [lo, hi) of it). A few numpy calls: it runs on the host every step with LoRA."""
    T = len(token_slots)
    assert T <= GROUPED_ROWS, T
    n = max_tiles(GROUPED_ROWS, slots)
    out = np.zeros(3 * n + T, np.int32)
    out[0:3 * n:3] = -1
    counts = np.bincount(token_slots + 1, minlength=slots + 1).tolist()   # [none, slot 0, slot 1, ...]
    if counts[0] == T:   # no token has an adapter: no tile
        out[3 * n:] = np.arange(T)
        return out
    out[3 * n:] = np.argsort(token_slots, kind="stable")
    tiles: list[int] = []
    pos = counts[0]
    for slot, c in enumerate(counts[1:]):
        for lo in range(pos, pos + c, TILE_ROWS):
            tiles += (slot, lo, min(lo + TILE_ROWS, pos + c))
        pos += c
    out[:len(tiles)] = tiles
    return out


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
    grouped_split: int    # the grouped kernels': K's slices, each's columns, the rank in a dot (≥ 16), tiles
    grouped_chunk: int
    rank_dot: int
    grouped_block_k: int
    grouped_block_n: int
    precision: str        # the dots' input precision ("ieee" for float32 weights: no TF32)


def plan(K: int, parts: int, slots: int, rank: int, bounds: tuple[int, int],
         dtype: torch.dtype = torch.bfloat16) -> LoraPlan:
    """``LoraPlan`` of a projection of K input columns whose slots are of ``dtype``."""
    split = splits(K)
    rank_p2 = triton.next_power_of_2(rank)
    block_k = min(256, triton.next_power_of_2(max(16, 4096 // rank_p2)))
    chunk = triton.cdiv(triton.cdiv(K, split), block_k) * block_k
    block_n = min(128, triton.next_power_of_2(max(16, 4096 // rank_p2)))
    g_split = triton.cdiv(K, GROUPED_CHUNK)
    rank_dot = max(16, rank_p2)
    g_block_k = 128 if rank_dot <= 32 else 64
    g_chunk = triton.cdiv(triton.cdiv(K, g_split), g_block_k) * g_block_k
    return LoraPlan(parts, slots, rank, bounds, split, chunk, rank_p2, block_k, block_n, g_split, g_chunk, rank_dot,
                    g_block_k, 128, "ieee" if dtype == torch.float32 else "tf32")


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


def split_groups(step_groups: torch.Tensor, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A buffer of ``groups`` (on the device) as the grouped kernels read it: (its tile table,
    its tokens in slot order), views taken once (``LoraState`` holds them)."""
    n = 3 * max_tiles(GROUPED_ROWS, slots)
    return step_groups[:n], step_groups[n:]


def lora_add_grouped(y: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                     tiles_order: tuple[torch.Tensor, torch.Tensor],
                     part_sums: torch.Tensor, lp: LoraPlan) -> torch.Tensor:
    """``lora_add`` through the grouped kernels: ``tiles_order`` the step's ``groups`` (on the
    device, for at most ``GROUPED_ROWS`` tokens) as ``split_groups`` gives them, T ≤
    ``GROUPED_ROWS``. Returns y."""
    T, K = x.shape
    N = y.shape[1]
    if T == 0:
        return y
    tiles, order = tiles_order
    rows, width = part_sums.shape[1], part_sums.shape[2]
    launch = pdl.launch(x)
    grid = max_tiles(T, lp.slots)
    _lora_shrink_grouped_kernel[(grid, lp.parts, lp.grouped_split)](
        x, A, tiles, order, part_sums, x.stride(0), K, lp.slots, lp.grouped_chunk, rows, width, R=lp.rank,
        RD=lp.rank_dot, BM=TILE_ROWS, BLOCK_K=lp.grouped_block_k, PREC=lp.precision, **launch)
    _lora_expand_grouped_kernel[(grid, triton.cdiv(N, lp.grouped_block_n))](
        y, part_sums, B, tiles, order, y.stride(0), B.stride(0), N, lp.bounds[0], lp.bounds[1], lp.slots,
        lp.grouped_split, rows, width, R=lp.rank, RD=lp.rank_dot, P=lp.parts, BM=TILE_ROWS,
        BLOCK_N=lp.grouped_block_n, PREC=lp.precision, **launch)
    return y
