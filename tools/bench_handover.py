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
- ``persistent``: one launch of ``_chain_kernel``, a fixed grid of programs per SM. A row tile is
  [BLOCK_N, all of K] with x in registers, and program p takes tiles p, p + G, ... of each product
  in one loop whose loads are pipelined (``_product``; the first form of this tool walked its tiles
  with their K steps one after another and streamed at half the kernel's rate, thirty-eighth
  round). Before each product, the first included, each program counts itself in (an atomic add,
  release) and spins until all G have (acquire); the ``_prefetch`` form loads its first weight tile of the next product
  between the two, so the load overlaps the wait;
- a single product (P = 1) in each form as well.

Each form's time per product is the slope of its time over P (least squares over the chains,
P = 1 included); less the product's bytes at the read bandwidth of the same run (a sum over
2 GiB), that is what each product costs beyond streaming its weight — mostly its hand-over.
Every program of the persistent kernel must be resident at once (it spins until all have
arrived): its registers are capped at what the programs an SM takes leave each, a form whose
shared memory does not fit is refused (``fit_resident``), and a spin that runs past
``MAX_SPINS`` polls gives up and flags an error, so a wrong grid ends in a message, not a hung
GPU. The chains' outputs are checked against the float32 product of the dequantized weights.

    python tools/bench_handover.py [--phases 2 4 8] [--size 4096] [--programs-per-sm 1 2] [--block-n 4 8]
                                   [--output F]
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from phalanx.kernels import fp8 as f8
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
def _rows(t, N, BLOCK_N: tl.constexpr, PAIRS: tl.constexpr):
    """Weight rows of row tile t: BLOCK_N in a run, or with PAIRS (gate ‖ up, N = 2I rows) BLOCK_N
    // 2 pairs (gate j, up j) interleaved."""
    r = tl.arange(0, BLOCK_N)
    if PAIRS:
        return t * (BLOCK_N // 2) + r // 2 + (r % 2) * (N // 2)
    return t * BLOCK_N + r


@triton.jit
def _load_tile(w_ptr, t, N, k, km, K: tl.constexpr, BLOCK_N: tl.constexpr, PAIRS: tl.constexpr):
    n = _rows(t, N, BLOCK_N, PAIRS)
    return tl.load(w_ptr + n[:, None] * K + k[None, :], mask=km[None, :], other=0.0, eviction_policy="evict_first")


@triton.jit
def _finish_tile(w, x, s_ptr, y_ptr, t, N, BLOCK_N: tl.constexpr, PAIRS: tl.constexpr):
    """Row tile t's sums times the rows' scales, stored (with PAIRS: silu(gate) * up, each rounded
    to y's dtype first, as the engine's kernel rounds them)."""
    n = _rows(t, N, BLOCK_N, PAIRS)
    y = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], 1) * tl.load(s_ptr + n)
    if PAIRS:
        gate, up = tl.split(tl.reshape(y.to(y_ptr.dtype.element_ty), [BLOCK_N // 2, 2]))
        gate = gate.to(tl.float32)      # (silu_mul's product in bf16 is wrong in the CPU interpreter)
        act = gate / (1.0 + tl.exp(-gate)) * up.to(tl.float32)
        tl.store(y_ptr + t * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2), act.to(y_ptr.dtype.element_ty))
    else:
        tl.store(y_ptr + n, y.to(y_ptr.dtype.element_ty))


@triton.jit
def _product(w_ptr, s_ptr, x_ptr, y_ptr, ctr_ptr, err_ptr, pid, G, N, K: tl.constexpr, KP: tl.constexpr,
             BLOCK_N: tl.constexpr, PAIRS: tl.constexpr, STAGES: tl.constexpr, PREFETCH: tl.constexpr):
    """y = x Wᵀ · s (FP8 W [N, K], a scale a row) over this program's row tiles, once every program
    has stored its share of x (the counter). A row tile is [BLOCK_N, all of K] with x [K] held in
    registers (KP: K rounded up to a power of two, masked); program p takes tiles p, p + G, ... in
    one loop whose loads are pipelined STAGES deep. PREFETCH: the first tile is loaded between
    counting in and the wait (weights are never written), so the stream does not stop there."""
    k = tl.arange(0, KP)
    km = k < K
    target = _arrive(ctr_ptr, G)
    if PREFETCH:
        w0 = _load_tile(w_ptr, pid, N, k, km, K, BLOCK_N, PAIRS)
    _wait(ctr_ptr, err_ptr, target)
    x = tl.load(x_ptr + k, mask=km, other=0.0, cache_modifier=".cg")   # written in this launch: from L2
    tiles = N // BLOCK_N
    start = pid
    if PREFETCH:
        _finish_tile(w0, x, s_ptr, y_ptr, pid, N, BLOCK_N, PAIRS)
        start = pid + G
    for t in tl.range(start, tiles, G, num_stages=STAGES):
        _finish_tile(_load_tile(w_ptr, t, N, k, km, K, BLOCK_N, PAIRS), x, s_ptr, y_ptr, t, N, BLOCK_N, PAIRS)


@triton.jit(do_not_specialize=["G"])
def _chain_kernel(buf_ptr, w_ptr, s_ptr, ctr_ptr, err_ptr, G, N: tl.constexpr, PHASES: tl.constexpr,
                  BLOCK_N: tl.constexpr, STAGES: tl.constexpr, PREFETCH: tl.constexpr):
    """buf [PHASES + 1, N]: buf[i + 1] = buf[i] W_iᵀ · s_i for each i (N = K), W [PHASES, N, N] in
    FP8, s [PHASES, N]."""
    pid = tl.program_id(0)
    for i in tl.static_range(PHASES):
        _product(w_ptr + i * N * N, s_ptr + i * N, buf_ptr + i * N, buf_ptr + (i + 1) * N, ctr_ptr, err_ptr, pid, G,
                 N, N, N, BLOCK_N, False, STAGES, PREFETCH)


def fit_resident(kernel, args: tuple, launch: dict, programs: int, warps: int, dev: torch.device) -> dict:
    """Every program of a persistent grid must be resident at once (each spins until all have
    counted in): caps ``launch``'s registers at what the programs an SM takes leave each
    (``maxnreg``), compiles, and refuses (ValueError) a kernel whose shared memory or registers do
    not fit; returns what it takes."""
    props = torch.cuda.get_device_properties(dev)
    per_sm = -(-programs // props.multi_processor_count)
    regs = getattr(props, "regs_per_multiprocessor", 65536)
    shared = getattr(props, "shared_memory_per_multiprocessor", 233472)
    launch["maxnreg"] = min(255, regs // (32 * warps * per_sm)) // 8 * 8
    k = kernel.warmup(*args, grid=(programs,), **launch)
    k._init_handles()
    took = {"regs": k.n_regs, "spills": k.n_spills, "shared": k.metadata.shared, "maxnreg": launch["maxnreg"]}
    if per_sm * (k.metadata.shared + 1024) > shared or per_sm * 32 * warps * -(-k.n_regs // 8) * 8 > regs:
        raise ValueError(f"{per_sm} programs an SM do not fit: {took}")
    return took


class Persistent:
    """One launch of the chain over weight set j: x (buf[0]) in, buf[P] out."""

    def __init__(self, x: torch.Tensor, ws: list[torch.Tensor], ss: list[torch.Tensor], programs: int, prefetch: bool,
                 block_n: int = 8, warps: int = 8, stages: int = 3):
        self.ws, self.ss, self.G = ws, ss, programs
        P, N, _ = ws[0].shape
        if N % block_n or N // block_n < programs or N & (N - 1):
            raise ValueError(f"size {N}: needs a power of two, a multiple of {block_n} with at least {programs} "
                             "row tiles")
        dev = ws[0].device
        self.buf = torch.zeros(P + 1, N, dtype=torch.bfloat16, device=dev)
        self.buf[0] = x
        self.ctr = torch.zeros(1, dtype=torch.int32, device=dev)
        self.err = torch.zeros(1, dtype=torch.int32, device=dev)
        self.launch = {"N": N, "PHASES": P, "BLOCK_N": block_n, "STAGES": stages, "PREFETCH": prefetch,
                       "num_warps": warps, "num_stages": 1}
        self.resources = fit_resident(_chain_kernel, self._args(0), self.launch, programs, warps, dev) \
            if dev.type == "cuda" else {}

    def _args(self, j: int) -> tuple:
        return (self.buf, self.ws[j], self.ss[j], self.ctr, self.err, self.G)

    def __call__(self, j: int) -> torch.Tensor:
        _chain_kernel[(self.G,)](*self._args(j), **self.launch)
        return self.buf[self.ws[j].shape[0]]


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
    ap.add_argument("--block-n", type=int, nargs="+", default=[4, 8], help="rows of a row tile (all of K)")
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
        for per_sm, block_n, prefetch in itertools.product(a.programs_per_sm, a.block_n, (False, True)):
            name = f"persistent_{per_sm}x_{block_n}rows{'_prefetch' if prefetch else ''}"
            try:
                forms[name] = Persistent(x, ws, ss, per_sm * sms, prefetch, block_n=block_n)
            except Exception as e:  # noqa: BLE001 - too few row tiles, a grid that cannot be resident, a compile
                line[name] = {"error": f"{type(e).__name__}: {e}"}
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
                line[name] = {"us": ms * 1e3, "tb_s": P * N * N / (ms * 1e-3) / 1e12, "rel_err": err,
                              **getattr(fn, "resources", {})}
            except Exception as e:  # noqa: BLE001 - a form that does not compile or run is reported
                last = str(e).strip().splitlines()[-1] if str(e).strip() else ""
                line[name] = {"error": f"{type(e).__name__}: {last}"}
        rows.append(line)
        cells = [f"{name} {v['error']}" if "error" in v else
                 f"{name} {v['us']:7.1f} us {v['tb_s']:4.2f} TB/s err {v['rel_err']:.1e}"
                 for name, v in line.items() if isinstance(v, dict)]
        print(f"{P} x {N}x{N} ({line['kernels_plan']}): " + " | ".join(cells), flush=True)
        dump(a.output, sms, rows, {})       # what a run cut off by its time limit has measured
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
    dump(a.output, sms, rows, summary)


def dump(path: str | None, sms: int, rows: list[dict], summary: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "sms": sms, "rows": rows, "summary": summary}, f,
                      indent=1)


if __name__ == "__main__":
    main()
