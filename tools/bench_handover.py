"""What a hand-over between two dependent one-row products costs, in kernels and in one persistent
kernel.

At batch 1 a decode step is a chain of short kernels, each waiting for the one before; #19's 90 %
of the FP8 roofline leaves under 1 µs for each hand-over, and today each costs ~2 µs
(docs/gpu_notes.md, thirty-seventh round). One persistent kernel per layer or per step is the
design left: every program streams its weight tiles, and waits for the previous product through
a counter in memory instead of at a kernel boundary, with its next weight tile already loaded.
This measures whether that hand-over is cheaper before anything of the kind goes into the engine.

A chain of P products y_{i+1} = y_i W_iᵀ · scale_i, with N = K (the o projection's 4,096 × 4,096
by default), FP8 weights with a scale per output channel, one bf16 row; each weight set is one of
several copies, together larger than L2. Timed from CUDA graphs:

- ``kernels``: P launches of the engine's one-row kernel with the tile and PDL the tuner picks for
  the shape (``gemv_tuner.tune_one``), as a step runs them;
- ``persistent``: one launch of ``_chain_kernel``, a fixed grid of programs per SM, each taking
  every G-th row tile of each product; between products each program counts itself in (an atomic
  add, release) and spins until all G have (acquire); the ``_prefetch`` form loads its first
  weight tile of the next product between the two, so the load overlaps the wait;
- a single product (P = 1) in each form as well.

Each form's time per product is the slope of its time over P (least squares over the chains,
P = 1 included); less the product's bytes at the read bandwidth of the same run (a sum over
2 GiB), that is what each product costs beyond streaming its weight — mostly its hand-over.
Every program of the persistent kernel must be resident at once (it spins until all have
arrived), so its grid is at most what fits; a spin that runs past ``MAX_SPINS`` polls gives up
and flags an error, so a wrong grid ends in a message, not a hung GPU. The chains' outputs are
checked against the float32 product of the dequantized weights.

    python tools/bench_handover.py [--phases 2 4 8] [--size 4096] [--programs-per-sm 1 2] [--output F]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from phalanx.kernels import fp8 as f8
from phalanx.kernels.gemv import _store_one_row
from phalanx.kernels.gemv_tuner import time_eager, time_graph, tune_one
from phalanx.kernels.linear_plan import Neighbour, launcher

MAX_SPINS = tl.constexpr(1 << 20)   # polls of the counter before a program gives up: a grid not all resident


@triton.jit
def _arrive(ctr_ptr, G):
    """Count this program in; returns the count at which all G of its round have. The counter only
    grows: a program's arrival number tells which round of G it belongs to, so no reset is needed
    between launches or graph replays."""
    tl.debug_barrier()                                   # every thread's stores are issued first
    old = tl.atomic_add(ctr_ptr, 1, sem="release")
    return (old // G + 1) * G


@triton.jit
def _wait(ctr_ptr, err_ptr, target):
    """Spin until the counter reaches ``target`` (every program of the round has arrived); after
    MAX_SPINS polls give up and flag an error."""
    cur = tl.atomic_add(ctr_ptr, 0, sem="acquire")
    spins = 0
    while (cur < target) & (spins < MAX_SPINS):
        cur = tl.atomic_add(ctr_ptr, 0, sem="acquire")
        spins += 1
    if cur < target:
        tl.store(err_ptr, 1)
    tl.debug_barrier()


@triton.jit
def _fma(acc, w, x_ptr, k, FOLD: tl.constexpr):
    """acc + a weight tile times x[k], the products summed FOLD at a time (as the engine's one-row
    kernel does); x read from L2: other programs wrote it in this launch."""
    x = tl.load(x_ptr + k, cache_modifier=".cg")
    p = w.to(tl.float32) * x.to(tl.float32)[None, :]
    return acc + tl.sum(tl.reshape(p, [p.shape[0], p.shape[1] // FOLD, FOLD]), 2)


@triton.jit
def _tile(w_ptr, x_ptr, n, K, k_start, acc, BLOCK_K: tl.constexpr, FOLD: tl.constexpr):
    """acc + the products of weight rows n with x over K from k_start."""
    for k0 in range(k_start, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        acc = _fma(acc, tl.load(w_ptr + n[:, None] * K + k[None, :], eviction_policy="evict_first"), x_ptr, k, FOLD)
    return acc


@triton.jit
def _chain_kernel(buf_ptr, w_ptr, s_ptr, ctr_ptr, err_ptr, N, G, PHASES: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, FOLD: tl.constexpr, PREFETCH: tl.constexpr):
    """buf [PHASES + 1, N]: buf[i + 1] = buf[i] W_iᵀ · s_i for each i (N = K), W [PHASES, N, N] in
    FP8, s [PHASES, N]; program p takes row tiles p, p + G, ... of each product."""
    pid = tl.program_id(0)
    tiles = tl.cdiv(N, BLOCK_N)
    K = N
    target = 0
    for i in tl.static_range(PHASES):
        x_ptr = buf_ptr + i * N
        y_ptr = buf_ptr + (i + 1) * N
        w_i = w_ptr + i * N * K
        n = pid * BLOCK_N + tl.arange(0, BLOCK_N)      # this program's first tile (pid < tiles: the grid is small)
        acc = tl.zeros([BLOCK_N, BLOCK_K // FOLD], tl.float32)
        if i > 0:       # the previous product's stores counted in before this product's weight loads
            target = _arrive(ctr_ptr, G)
        if PREFETCH:    # the first weight tile in registers before the wait: weights are never written
            k = tl.arange(0, BLOCK_K)
            w0 = tl.load(w_i + n[:, None] * K + k[None, :], eviction_policy="evict_first")
        if i > 0:
            _wait(ctr_ptr, err_ptr, target)
        if PREFETCH:
            acc = _tile(w_i, x_ptr, n, K, BLOCK_K, _fma(acc, w0, x_ptr, tl.arange(0, BLOCK_K), FOLD), BLOCK_K, FOLD)
        else:
            acc = _tile(w_i, x_ptr, n, K, 0, acc, BLOCK_K, FOLD)
        _store_one_row(y_ptr, s_ptr, s_ptr + i * N, n, n < N, tl.sum(acc, 1), False, True)
        for t in range(pid + G, tiles, G):
            n = t * BLOCK_N + tl.arange(0, BLOCK_N)
            acc = _tile(w_i, x_ptr, n, K, 0, tl.zeros([BLOCK_N, BLOCK_K // FOLD], tl.float32), BLOCK_K, FOLD)
            _store_one_row(y_ptr, s_ptr, s_ptr + i * N, n, n < N, tl.sum(acc, 1), False, True)


class Persistent:
    """One launch of the chain over weight set j: x (buf[0]) in, buf[P] out."""

    def __init__(self, x: torch.Tensor, ws: list[torch.Tensor], ss: list[torch.Tensor], programs: int, prefetch: bool,
                 block_n: int = 8, block_k: int = 2048, fold: int = 16, warps: int = 4, stages: int = 3):
        self.ws, self.ss, self.G, self.prefetch = ws, ss, programs, prefetch
        P, N, _ = ws[0].shape
        self.buf = torch.zeros(P + 1, N, dtype=torch.bfloat16, device=ws[0].device)
        self.buf[0] = x
        self.ctr = torch.zeros(1, dtype=torch.int32, device=ws[0].device)
        self.err = torch.zeros(1, dtype=torch.int32, device=ws[0].device)
        self.launch = {"BLOCK_N": block_n, "BLOCK_K": block_k, "FOLD": fold, "num_warps": warps, "num_stages": stages}
        if N % block_n or N % block_k or triton.cdiv(N, block_n) < programs:
            raise ValueError(f"size {N}: needs multiples of {block_n} and {block_k} and at least {programs} row tiles")

    def __call__(self, j: int) -> torch.Tensor:
        P, N, _ = self.ws[j].shape
        _chain_kernel[(self.G,)](self.buf, self.ws[j], self.ss[j], self.ctr, self.err, N, self.G, PHASES=P,
                                 PREFETCH=self.prefetch, **self.launch)
        return self.buf[P]


def read_bandwidth(dev: torch.device, nbytes: int = 2 << 30) -> float:
    """Bytes a second that a sum over ``nbytes`` reads."""
    big = torch.ones(nbytes // 4, dtype=torch.float32, device=dev)
    ms = time_eager(big.sum, reps=5, warmup=1)
    del big
    return nbytes / (ms * 1e-3)


def slope(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of time over P."""
    n = len(points)
    mp = sum(p for p, _ in points) / n
    mt = sum(t for _, t in points) / n
    return sum((p - mp) * (t - mt) for p, t in points) / sum((p - mp) ** 2 for p, _ in points)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phases", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--size", type=int, default=4096, help="N = K of each product")
    ap.add_argument("--programs-per-sm", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--output", default=None)
    a = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    N = a.size
    x = torch.randn(N, device=dev, dtype=torch.bfloat16)
    rows = []
    for P in sorted(set(a.phases) | {1}):
        copies = max(2, -(-(256 << 20) // (P * N * N)))       # together larger than L2
        ws, ss = [], []
        for _ in range(copies):
            q, s = zip(*(f8.quantize_weight(torch.randn(N, N, device=dev) * N ** -0.5) for _ in range(P)), strict=True)
            ws.append(torch.stack(q))
            ss.append(torch.stack(s))
        # the engine's one-row kernel for this shape, as the tuner picks it, P launches a chain
        plan, _ = tune_one(ws[0][0], Neighbour.PLAIN, 1, fp8=True, act_dtype=torch.bfloat16)
        run = launcher(plan, Neighbour.PLAIN, fp8=True)

        def kernels(j: int, P: int = P, ws: list = ws, ss: list = ss, run=run) -> torch.Tensor:
            y = x[None, :]
            for i in range(P):
                y = run(y, ws[j][i], None, ss[j][i])
            return y[0]

        # the float32 chain of the dequantized weights, rounded to bf16 between products as both forms do
        ref = x.float()
        for i in range(P):
            ref = (ref @ (ws[0][i].float() * ss[0][i][:, None]).t()).to(torch.bfloat16).float()
        line: dict = {"phases": P, "size": N, "bytes": P * N * N, "kernels_plan": str(plan)}
        forms: dict[str, Callable[[int], torch.Tensor]] = {"kernels": kernels}
        for per_sm in a.programs_per_sm:
            for prefetch in (False, True):
                name = f"persistent_{per_sm}x{'_prefetch' if prefetch else ''}"
                try:
                    forms[name] = Persistent(x, ws, ss, per_sm * sms, prefetch)
                except ValueError as e:   # more programs than row tiles
                    line[name] = {"error": str(e)}
        for name, fn in forms.items():
            try:
                y = fn(0).float()
                torch.cuda.synchronize()
                if isinstance(fn, Persistent) and fn.err.item():
                    line[name] = {"error": "a program gave up waiting: the grid was not resident at once"}
                    continue
                err = float((y - ref).norm() / ref.norm())
                ms = time_graph(fn, copies)
                if isinstance(fn, Persistent) and fn.err.item():
                    line[name] = {"error": "a program gave up waiting while timed: the grid was not resident at once"}
                    continue
                line[name] = {"us": ms * 1e3, "tb_s": P * N * N / (ms * 1e-3) / 1e12, "rel_err": err}
            except Exception as e:  # noqa: BLE001 - a form that does not compile or run is reported
                line[name] = {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e) else ''}"}
        rows.append(line)
    for r in rows:
        cells = [f"{name} {v['error']}" if "error" in v else
                 f"{name} {v['us']:7.1f} us {v['tb_s']:4.2f} TB/s err {v['rel_err']:.1e}"
                 for name, v in r.items() if isinstance(v, dict)]
        print(f"{r['phases']} x {N}x{N} ({r['kernels_plan']}): " + " | ".join(cells), flush=True)
    bw = read_bandwidth(dev)
    stream_us = N * N / bw * 1e6
    summary = {"read_tb_s": bw / 1e12, "stream_us_per_product": stream_us}
    print(f"read bandwidth {bw / 1e12:.2f} TB/s: one product streams in {stream_us:.2f} us")
    for name in [k for k, v in rows[0].items() if isinstance(v, dict)]:
        points = [(r["phases"], r[name]["us"]) for r in rows if "us" in r.get(name, {})]
        if len(points) < 2:
            continue
        per = slope(points)
        summary[name] = {"us_per_product": per, "beyond_streaming_us": per - stream_us}
        print(f"  {name:28s} {per:6.2f} us a product, {per - stream_us:+5.2f} us beyond streaming its weight")
    if a.output:
        with open(a.output, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "sms": sms, "rows": rows, "summary": summary}, f,
                      indent=1)


if __name__ == "__main__":
    main()
