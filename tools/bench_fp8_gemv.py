"""One-row and few-row products with FP8 (e4m3) weights: the shipped kernels against variants
that widen e4m3 differently or multiply on the tensor cores, for the projections of a
Llama-3.1-8B layer. GB/s of weight read (the e4m3 or bf16 weights; the FP8 scales, 0.1 % more,
not counted), L2 defeated by weight copies, CUDA-graph timing.

    python tools/bench_fp8_gemv.py --output fp8_gemv.json
    python tools/bench_fp8_gemv.py --loops         # folded accumulators, persistent loops, a layer's chain
    python tools/bench_fp8_gemv.py --fold bf16 fp8  # the shipped tiles with products folded or not
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
import triton
import triton.language as tl

from phalanx.kernels import fp8, gemv, pdl, triton_ops
from phalanx.kernels.gemv_tuner import time_graph, weight_copies
from phalanx.kernels.linear_plan import OneRowTile, RowsTile
from phalanx.kernels.pdl import release, wait

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


@triton.jit
def _programs_tiles(N, tiles_per_prog, BLOCK_N: tl.constexpr):
    """The row tiles [t_lo, t_hi) a persistent program takes."""
    t_lo = tl.program_id(0) * tiles_per_prog
    return t_lo, tl.minimum(t_lo + tiles_per_prog, tl.cdiv(N, BLOCK_N))


@triton.jit
def _flat_step(x_ptr, w_ptr, s_wn, N, K, it, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_STEPS: tl.constexpr):
    """Step ``it`` of a flat loop over (tile, K step): the weight rows n, their mask, the K step,
    and the tile's float32 products [BLOCK_N, BLOCK_K]."""
    kk = it % K_STEPS
    n = (it // K_STEPS) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = kk * BLOCK_K + tl.arange(0, BLOCK_K)
    nm = n < N
    km = k < K
    w = tl.load(w_ptr + n[:, None] * s_wn + k[None, :], mask=nm[:, None] & km[None, :], other=0.0,
                eviction_policy="evict_first")
    x = tl.load(x_ptr + k, mask=km, other=0.0).to(tl.float32)
    return n, nm, kk, w.to(tl.float32) * x[None, :]


@triton.jit
def _persistent_kernel(x_ptr, w_ptr, s_ptr, y_ptr, N, K, s_wn, tiles_per_prog, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, K_STEPS: tl.constexpr, PRE: tl.constexpr, PDL: tl.constexpr):
    """One row, persistent: program p takes row tiles [p * tiles_per_prog, ...) one after another in
    one flat loop over (tile, K step), storing at each tile's last step (a branch)."""
    t_lo, t_hi = _programs_tiles(N, tiles_per_prog, BLOCK_N)
    release(PDL)
    if PRE:
        n0 = t_lo * BLOCK_N + tl.arange(0, BLOCK_N)
        k0 = tl.arange(0, BLOCK_K)
        tl.load(w_ptr + n0[:, None] * s_wn + k0[None, :], mask=(n0 < N)[:, None] & (k0 < K)[None, :], other=0.0,
                eviction_policy="evict_last")
    wait(PDL)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for it in range(t_lo * K_STEPS, t_hi * K_STEPS):
        n, nm, kk, p = _flat_step(x_ptr, w_ptr, s_wn, N, K, it, BLOCK_N, BLOCK_K, K_STEPS)
        acc += p
        if kk == K_STEPS - 1:
            y = tl.sum(acc, 1) * tl.load(s_ptr + n, mask=nm, other=0.0)
            tl.store(y_ptr + n, y.to(y_ptr.dtype.element_ty), mask=nm)
            acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)


@triton.jit
def _flat_kernel(x_ptr, w_ptr, s_ptr, y_ptr, N, K, s_wn, tiles_per_prog, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, K_STEPS: tl.constexpr):
    """Persistent with no branch in the loop (so that it pipelines): a [BLOCK_N] accumulator
    summed every K step, stored under a mask at a tile's last step and cleared by a select."""
    t_lo, t_hi = _programs_tiles(N, tiles_per_prog, BLOCK_N)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for it in range(t_lo * K_STEPS, t_hi * K_STEPS):
        n, nm, kk, p = _flat_step(x_ptr, w_ptr, s_wn, N, K, it, BLOCK_N, BLOCK_K, K_STEPS)
        acc += tl.sum(p, 1)
        last = (n * 0 + kk) == K_STEPS - 1
        tl.store(y_ptr + n, (acc * tl.load(s_ptr + n, mask=nm & last, other=0.0)).to(y_ptr.dtype.element_ty),
                 mask=nm & last)
        acc = tl.where(last, 0.0, acc)


def _persistent_launch(kernel, bn: int, bk: int, warps: int, stages: int, per_sm: int,
                       use_pdl: bool | None = None, **extra):
    """A launcher of a persistent kernel: per_sm programs an SM, each taking whole row tiles;
    ``use_pdl``: the kernel takes a PDL flag."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def run(x, w, s):
        N, K = w.shape
        y = torch.empty(1, N, dtype=x.dtype, device=x.device)
        tiles = triton.cdiv(N, bn)
        per = triton.cdiv(tiles, sms * per_sm)
        launch = pdl.launch(x, use_pdl) if use_pdl is not None else {}
        kernel[(triton.cdiv(tiles, per),)](x, w, s, y, N, K, w.stride(0), per, BLOCK_N=bn, BLOCK_K=bk,
                                           K_STEPS=triton.cdiv(K, bk), num_warps=warps, num_stages=stages, **extra,
                                           **launch)
        return y
    return run


def flat(bn: int, bk: int, warps: int, stages: int, per_sm: int):
    return _persistent_launch(_flat_kernel, bn, bk, warps, stages, per_sm)


def persistent(bn: int, bk: int, warps: int, stages: int, per_sm: int, use_pdl: bool = False, pre: bool = False):
    return _persistent_launch(_persistent_kernel, bn, bk, warps, stages, per_sm, use_pdl, PRE=pre)


FLAT = [(bn, bk, w, st, p) for bn, bk, w in [(8, 1024, 4), (16, 1024, 8), (16, 512, 4)] for st in (3, 5)
        for p in (2, 4, 8)]


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


OLD_FP8_TILES = [OneRowTile(8, 1024, 4, 4), OneRowTile(16, 1024, 4, 3), OneRowTile(8, 2048, 4, 3),
                 OneRowTile(16, 2048, 8, 2), OneRowTile(32, 512, 4, 4)]   # the FP8 tiles before ``fold``
PERSISTENT = [(bn, bk, 4, st, p) for bn in (4, 8, 16) for bk in (512, 1024) for st in (3, 5) for p in (1, 2, 4)
              if bn * bk <= 8192]


def loops_section(out: list) -> None:
    """How a one-row program walks its weights: the shipped kernel (FP8 tiles with products folded,
    ``OneRowTile.fold``, and without), persistent programs (a flat loop over (tile, K step) with a
    branch, or without one), each projection alone (no PDL, as above); then a layer's chain of
    projections with PDL and preloads as a step runs them, for the shipped tiles folded or not."""
    torch.manual_seed(0)
    best: dict[tuple, dict[str, tuple]] = {}
    weights = {}
    for N, K in SHAPES:
        wb = torch.randn(N, K, dtype=torch.bfloat16, device="cuda") / 64
        q, s = fp8.quantize_weight(wb)
        weights[(N, K)] = (q, s)
        x = torch.randn(1, K, dtype=torch.bfloat16, device="cuda")
        ref = x.float() @ (q.float() * s[:, None]).t()
        ws = weight_copies(q)
        variants = {("unfolded", t): shipped(t) for t in OLD_FP8_TILES}
        variants.update({("folded", t): shipped(t) for t in gemv.ONE_ROW_TILES_FP8})
        variants.update({("flat", c): flat(*c) for c in FLAT})
        variants.update({("persistent", c): persistent(*c) for c in PERSISTENT})
        for (fam, cfg), fn in variants.items():
            try:
                err = ((fn(x, q, s).float() - ref).norm() / ref.norm()).item()
                ms = time_graph(functools.partial(_call, fn, x, ws, s), len(ws))
            except Exception as e:
                print(f"{N}x{K} {fam} {cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            nbytes = q.numel()
            out.append({"N": N, "K": K, "variant": f"{fam} {cfg}", "us": ms * 1e3, "gb_s": nbytes / ms / 1e6,
                        "rel_err": err})
            print(f"{N:6d}x{K:5d} {fam:10s} {str(cfg):28s} {ms * 1e3:7.1f} us {nbytes / ms / 1e6:6.0f} GB/s "
                  f"err {err:.2e}", flush=True)
            if ms < best.setdefault((N, K), {}).get(fam, (None, 1e9))[1]:
                best[(N, K)][fam] = (cfg, ms)
        del ws
    # the chain: norm, q/k/v, o, norm, gate_up, down (no attention, no fused epilogues), 4 layer copies
    H = 4096
    x = torch.randn(1, H, dtype=torch.bfloat16, device="cuda")
    r = torch.randn(1, H, dtype=torch.bfloat16, device="cuda")
    g = torch.ones(H, dtype=torch.bfloat16, device="cuda")
    shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
    layers = [[(q.clone(), s) for q, s in (weights[sh] for sh in shapes)] for _ in range(4)]
    for mix in ("unfolded", "folded", "best"):
        fns = []
        for i, sh in enumerate(shapes):
            fam = mix
            if mix == "best":
                fam = min(best[sh], key=lambda f: best[sh][f][1])
            cfg = best[sh][fam][0]
            pre = i != 3          # behind the norm, the attention, the norm; not behind gate_up
            fns.append(functools.partial(_chain_gemv, fam, cfg, pre))

        def layer(i: int, fns=fns) -> None:
            w = layers[i]
            h = triton_ops.fused_add_rms_norm(x, r, g, 1e-6)[0]
            fns[0](h, *w[0])
            a = fns[1](x, *w[1])
            h = triton_ops.fused_add_rms_norm(a, r, g, 1e-6)[0]
            gu = fns[2](h, *w[2])
            fns[3](gu[:, :14336], *w[3])
        ms = time_graph(layer, len(layers))
        desc = [mix if mix != "best" else min(best[sh], key=lambda f: best[sh][f][1]) for sh in shapes]
        print(f"chain {mix:10s} {'/'.join(desc)} {ms * 1e3:7.1f} us a layer "
              f"({sum(q.numel() for q, _ in layers[0]) / ms / 1e6:6.0f} GB/s)", flush=True)
        out.append({"chain": mix, "us": ms * 1e3})


MORE_FP8_TILES = [OneRowTile(4, 2048, 4, 4, 16), OneRowTile(8, 4096, 4, 2, 16), OneRowTile(8, 2048, 4, 4, 16),
                  OneRowTile(8, 2048, 4, 3, 32), OneRowTile(8, 2048, 8, 3, 16), OneRowTile(16, 2048, 8, 4, 16),
                  OneRowTile(4, 4096, 4, 3, 16), OneRowTile(8, 1024, 4, 6, 16), OneRowTile(8, 2048, 4, 3, 64),
                  OneRowTile(4, 2048, 4, 5, 32), OneRowTile(2, 4096, 4, 4, 16), OneRowTile(8, 2048, 4, 3, 8)]


def fold_section(out: list, dtypes: list[str]) -> None:
    """The shipped one-row kernel with its products folded into a narrower accumulator
    (``OneRowTile.fold``) or not: bf16 weights with the bf16 tiles, FP8 weights with the FP8 tiles."""
    torch.manual_seed(0)
    for N, K in SHAPES:
        wb = torch.randn(N, K, dtype=torch.bfloat16, device="cuda") / 64
        q, s = fp8.quantize_weight(wb)
        x = torch.randn(1, K, dtype=torch.bfloat16, device="cuda")
        cases = [("bf16", t._replace(fold=f), wb, None) for t in gemv.ONE_ROW_TILES for f in (1, 8, 16)
                 if "bf16" in dtypes]
        cases += [("fp8", t._replace(fold=f), q, s) for t in OLD_FP8_TILES + gemv.ONE_ROW_TILES_FP8 for f in (1, 16)
                  if "fp8" in dtypes]
        cases += [("fp8", t, q, s) for t in MORE_FP8_TILES if "fp8+" in dtypes]
        for dt, tile, w, sc in cases:
            ws = weight_copies(w)
            want = x.float() @ (w.float() if sc is None else q.float() * s[:, None]).t()
            fn = shipped(tile)
            err = ((fn(x, w, sc).float() - want).norm() / want.norm()).item()
            ms = time_graph(functools.partial(_call, fn, x, ws, sc), len(ws))
            nbytes = w.numel() * w.element_size()
            out.append({"N": N, "K": K, "variant": f"{dt} {tuple(tile)}", "us": ms * 1e3, "gb_s": nbytes / ms / 1e6,
                        "rel_err": err})
            print(f"{N:6d}x{K:5d} {dt:5s} {str(tuple(tile)):24s} {ms * 1e3:7.1f} us {nbytes / ms / 1e6:6.0f} GB/s "
                  f"err {err:.2e}", flush=True)
            del ws


def _chain_gemv(fam: str, cfg: tuple, pre: bool, x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    if fam in ("unfolded", "folded"):
        return gemv.gemv(x, q, None, cfg, pdl=True, preload=pre, scale=s)
    if fam == "flat":
        return flat(*cfg)(x, q, s)
    return persistent(*cfg, use_pdl=True, pre=pre)(x, q, s)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--output", default=None)
    ap.add_argument("--loops", action="store_true", help="folded, flat and persistent one-row loops; a layer's chain")
    ap.add_argument("--fold", nargs="*", choices=["bf16", "fp8", "fp8+"],
                    help="the shipped one-row kernel, products folded or not (fp8+: more FP8 tiles)")
    a = ap.parse_args()
    out = []
    if a.loops or a.fold is not None:
        if a.loops:
            loops_section(out)
        else:
            fold_section(out, a.fold or ["bf16", "fp8"])
        if a.output:
            with open(a.output, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(0), "rows": out}, f, indent=1)
        return
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
