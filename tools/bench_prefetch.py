"""What an L2 prefetch during an idle gap buys the projection behind it.

At batch 1 the norms and the decode attention leave the HBM idle for a few microseconds between
projections. A bulk L2 prefetch (``cp.async.bulk.prefetch.L2``, sm_90) of the next weight's first
bytes, forked onto a side stream when the gap begins, should let them arrive during the gap. This
measures it. (In an engine step it lost: docs/gpu_notes.md, eighteenth round; not shipped.)

Per weight shape of Llama-3.1-8B (bf16 and FP8), replayed from a CUDA graph over weight copies
larger than L2: a gap (a sleeping kernel of ~G µs, as the norm or the attention leaves the HBM
idle) then the one-row GEMV; the same over one weight (from L2 where it fits); and the same with
a prefetch of the weight's first MB forked onto a side stream at the start of the gap. Prints µs
per (gap + GEMV) and the saving.

    python tools/bench_prefetch.py [--gaps 0 2.5 5.5] [--mb 4 8 16 32] [--chunks 4 16 64]
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
import triton
import triton.language as tl

from phalanx.kernels import gemv
from phalanx.kernels.fp8 import quantize_weight
from phalanx.kernels.gemv_tuner import time_graph, weight_copies
from phalanx.kernels.linear_plan import OneRowTile

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
TILES = {"bf16": OneRowTile(8, 512, 4, 4), "fp8": OneRowTile(8, 2048, 4, 3, 16)}
LANES = 32              # one warp a program, a chunk a lane


@triton.jit
def _l2_prefetch_kernel(ptr, nbytes, CHUNK: tl.constexpr, LANES: tl.constexpr):
    """Each lane asks L2 for one CHUNK of bytes [ptr, ptr + nbytes) (the last one shorter) and
    exits; the copy runs on in the memory system."""
    off = (tl.program_id(0) * LANES + tl.arange(0, LANES)).to(tl.int64) * CHUNK
    size = tl.minimum(tl.maximum(nbytes - off, 0), CHUNK).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptr + off, size], dtype=tl.int32, is_pure=False, pack=1)


def _cycles(us: float) -> int:
    return int(us * torch.cuda.get_device_properties(0).clock_rate / 1e3)   # clock_rate in kHz


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gaps", type=float, nargs="+", default=[0.0, 2.5, 5.5])
    ap.add_argument("--mb", type=float, nargs="+", default=[4, 8, 16, 32])
    ap.add_argument("--chunks", type=int, nargs="+", default=[16], help="KB per prefetch instruction")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--output", default=None)
    a = ap.parse_args()
    dev = torch.device("cuda")
    side = torch.cuda.Stream(dev)
    rows = []
    for dt in ("bf16", "fp8"):
        for name in a.shapes:
            N, K = SHAPES[name]
            w = torch.randn(N, K, dtype=torch.bfloat16, device=dev)
            s = None
            if dt == "fp8":
                w, s = quantize_weight(w)
            ws = weight_copies(w)
            x = torch.randn(1, K, dtype=torch.bfloat16, device=dev)
            nbytes = w.numel() * w.element_size()

            def step(i: int, gap: int, span: tuple[torch.Tensor, int] | None = None, chunk: int = 0, ws=ws, x=x, dt=dt,
                     s=s) -> None:
                if span is not None:
                    data, n = span
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        _l2_prefetch_kernel[(triton.cdiv(n, chunk * LANES),)](data, n, CHUNK=chunk, LANES=LANES,
                                                                              num_warps=1)
                if gap:
                    torch.cuda._sleep(gap)
                gemv.gemv(x, ws[i], None, TILES[dt], scale=s)
                if span is not None:
                    torch.cuda.current_stream().wait_stream(side)

            for g in a.gaps:
                cyc = _cycles(g)
                base = time_graph(functools.partial(step, gap=cyc), len(ws)) * 1e3
                hot = time_graph(functools.partial(step, gap=cyc), 1) * 1e3   # one copy: from L2 where it fits
                row = {"dtype": dt, "shape": name, "mb": nbytes / 2**20, "gap_us": g, "base_us": base,
                       "l2_hot_us": hot, "with": {}}
                for chunk_kb in a.chunks:
                    for mb in a.mb:
                        spans = [(c.reshape(-1).view(torch.uint8), min(int(mb * 2**20), nbytes) // 16 * 16)
                                 for c in ws]

                        def pf(i: int, spans=spans, cyc=cyc, chunk=chunk_kb << 10) -> None:
                            step(i, cyc, spans[i], chunk)
                        us = time_graph(pf, len(ws)) * 1e3
                        row["with"][f"{mb:g}MB/{chunk_kb}K"] = us
                best = min(row["with"].items(), key=lambda kv: kv[1])
                print(f"{dt:4s} {name:8s} ({row['mb']:.1f} MB) gap {g:4.1f} us: {base:6.1f} us "
                      f"(the same weight every call: {hot:6.1f}); with prefetch "
                      + " ".join(f"{k} {v:.1f}" for k, v in row["with"].items())
                      + f"  (best {best[0]}: {base - best[1]:+.1f} us saved)", flush=True)
                rows.append(row)
    if a.output:
        with open(a.output, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
