"""One-row and few-row products with FP8 (e4m3) weights: the shipped kernels against variants
that widen e4m3 differently or multiply on the tensor cores, for the projections of a
Llama-3.1-8B layer. GB/s of weight read (the e4m3 or bf16 weights; the FP8 scales, 0.1 % more,
not counted), L2 defeated by weight copies, CUDA-graph timing.

    python tools/bench_fp8_gemv.py --output fp8_gemv.json
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
import triton
import triton.language as tl

from phalanx.kernels import fp8, gemv
from phalanx.kernels.gemv_tuner import time_graph, weight_copies
from phalanx.kernels.linear_plan import RowsTile

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


@triton.jit
def _widen(w, MODE: tl.constexpr):
    """e4m3 [..] -> float32. MODE 0: Triton's cast; 1: through float16; 2: the bits of an e4m3
    placed in a float16's (exact up to a factor 2^8, applied by the caller); 3: no widening
    (the load alone: the bytes summed as integers)."""
    if MODE == 0:
        return w.to(tl.float32)
    if MODE == 1:
        return w.to(tl.float16).to(tl.float32)
    if MODE == 2:
        b = w.to(tl.uint8, bitcast=True).to(tl.int16)
        h = ((b & 0x7F) << 7) | ((b & 0x80) << 8)
        return h.to(tl.float16, bitcast=True).to(tl.float32)
    return w.to(tl.uint8, bitcast=True).to(tl.float32)


@triton.jit
def _one_row_kernel(x_ptr, w_ptr, s_ptr, y_ptr, N, K, s_wn, MODE: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < N
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        km = k < K
        w = tl.load(w_ptr + n[:, None] * s_wn + k[None, :], mask=nm[:, None] & km[None, :], other=0.0,
                    eviction_policy="evict_first")
        x = tl.load(x_ptr + k, mask=km, other=0.0).to(tl.float32)
        acc += _widen(w, MODE) * x[None, :]
    y = tl.sum(acc, 1) * tl.load(s_ptr + n, mask=nm, other=0.0)
    if MODE == 2:
        y *= 256.0
    tl.store(y_ptr + n, y.to(y_ptr.dtype.element_ty), mask=nm)


@triton.jit
def _dot_kernel(x_ptr, w_ptr, s_ptr, y_ptr, N, K, k_per_split, s_wn, SWAP: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, SPLIT: tl.constexpr):
    """One row on the tensor cores: each [BLOCK_K] tile of x quantized to e4m3 with its own scale
    (padded to 16 rows), an FP8 dot with the weight tile, the product scaled back per tile.
    SWAP: W is the dot's left operand (y^T = W x^T). SPLIT: K slices added atomically (y float32, zeroed)."""
    pid = tl.program_id(0)
    sk = tl.program_id(1)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < N
    m = tl.arange(0, 16)
    k_lo = sk * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros([BLOCK_N, 16], tl.float32) if SWAP else tl.zeros([16, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        km = k < k_hi
        w = tl.load(w_ptr + n[:, None] * s_wn + k[None, :], mask=nm[:, None] & km[None, :], other=0.0,
                    eviction_policy="evict_first")
        x = tl.load(x_ptr + k, mask=km, other=0.0).to(tl.float32)
        s = tl.maximum(tl.max(tl.abs(x), 0), 1e-12) / 448.0
        x16 = tl.where(m[:, None] == 0, x[None, :] / s, 0.0).to(tl.float8e4nv)
        if SWAP:
            acc += tl.dot(w, tl.trans(x16)) * s
        else:
            acc += tl.dot(x16, tl.trans(w)) * s
    y = tl.sum(acc, 1) if SWAP else tl.sum(acc, 0)
    y *= tl.load(s_ptr + n, mask=nm, other=0.0)
    if SPLIT:
        tl.atomic_add(y_ptr + n, y, mask=nm, sem="relaxed")
    else:
        tl.store(y_ptr + n, y.to(y_ptr.dtype.element_ty), mask=nm)


def one_row(mode: int, bn: int, bk: int, warps: int, stages: int):
    def run(x, w, s):
        N, K = w.shape
        y = torch.empty(1, N, dtype=x.dtype, device=x.device)
        _one_row_kernel[(triton.cdiv(N, bn),)](x, w, s, y, N, K, w.stride(0), MODE=mode, BLOCK_N=bn, BLOCK_K=bk,
                                              num_warps=warps, num_stages=stages)
        return y
    return run


def dot(swap: bool, bn: int, bk: int, splits: int, warps: int, stages: int):
    def run(x, w, s):
        N, K = w.shape
        k_per = triton.cdiv(triton.cdiv(K, splits), bk) * bk
        sp = triton.cdiv(K, k_per)
        y = torch.zeros(1, N, dtype=torch.float32, device=x.device) if sp > 1 else \
            torch.empty(1, N, dtype=x.dtype, device=x.device)
        _dot_kernel[(triton.cdiv(N, bn), sp)](x, w, s, y, N, K, k_per, w.stride(0), SWAP=swap, BLOCK_N=bn,
                                             BLOCK_K=bk, SPLIT=sp > 1, num_warps=warps, num_stages=stages)
        return y
    return run


def _call(fn, x, ws, scale, i):
    return fn(x, ws[i], scale)


def shipped(tile):
    def run(x, w, s):
        return gemv.gemv(x, w, None, tile, scale=s)
    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--output", default=None)
    a = ap.parse_args()
    out = []
    torch.manual_seed(0)
    for N, K in SHAPES:
        wb = torch.randn(N, K, dtype=torch.bfloat16, device="cuda") / 64
        q, s = fp8.quantize_weight(wb)
        x = torch.randn(1, K, dtype=torch.bfloat16, device="cuda")
        ref = (x.float() @ (q.float() * s[:, None]).t())
        variants = {f"bf16 {t}": (shipped(t), wb, None) for t in gemv.ONE_ROW_TILES}
        variants.update({f"fp8 shipped {t}": (shipped(t), q, s) for t in gemv.ONE_ROW_TILES_FP8})
        rows = ([RowsTile(16, 256, 4, 4, sp) for sp in (1, 2, 4, 8)] + [RowsTile(32, 256, 4, 4, sp) for sp in (1, 4)]
                + [RowsTile(16, 512, 4, 3, sp) for sp in (1, 4)])
        variants.update({f"fp8 rows {t}": (shipped(t), q, s) for t in rows})
        for mode in range(4):
            for bn, bk, warps, stages in [(8, 1024, 4, 4), (16, 512, 4, 4), (16, 1024, 8, 3), (32, 512, 8, 3),
                                          (4, 2048, 4, 3)]:
                variants[f"fp8 widen{mode} {(bn, bk, warps, stages)}"] = (one_row(mode, bn, bk, warps, stages), q, s)
        for swap in (False, True):
            for bn, bk, sp, warps, stages in [(16, 256, 1, 4, 4), (16, 512, 1, 4, 3), (32, 256, 1, 4, 4),
                                              (64, 256, 1, 4, 4), (64, 256, 4, 4, 4), (16, 256, 4, 4, 4),
                                              (32, 512, 2, 4, 3), (64, 512, 2, 4, 3), (128, 256, 4, 4, 4)]:
                if not swap and bn > 32:
                    continue
                variants[f"fp8 dot swap={swap} {(bn, bk, sp, warps, stages)}"] = \
                    (dot(swap, bn, bk, sp, warps, stages), q, s)
        for name, (fn, w, sc) in variants.items():
            ws = weight_copies(w)
            try:
                y = fn(x, w, sc).float()
                want = ref if sc is not None else x.float() @ wb.float().t()
                err = ((y - want).norm() / want.norm()).item()
                ms = time_graph(functools.partial(_call, fn, x, ws, sc), len(ws))
            except Exception as e:   # a config that does not compile here
                print(f"{N}x{K} {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                del ws
                continue
            nbytes = w.numel() * w.element_size()
            out.append({"N": N, "K": K, "variant": name, "us": ms * 1e3, "gb_s": nbytes / ms / 1e6, "rel_err": err})
            print(f"{N:6d}x{K:5d} {name:48s} {ms * 1e3:7.1f} us {nbytes / ms / 1e6:6.0f} GB/s err {err:.2e}",
                  flush=True)
            del ws
    if a.output:
        with open(a.output, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "rows": out}, f, indent=1)


if __name__ == "__main__":
    main()
