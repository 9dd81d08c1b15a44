"""Every plan the GEMV tuner tries, timed for the projections of a Llama-3.1-8B-shaped layer at
each row bucket: GB/s of weight read (the tuner keeps only the fastest; this shows them all).

    python tools/bench_gemv.py --rows 1 16 64 --output gemv.json
    python tools/bench_gemv.py --rows 1 --preload both   # behind the norm / attention: with and without

``--preload off`` times every one-row plan without loading its first weight tile before the PDL
wait (what the engine does behind a norm or the attention, ``linear_plan.PRELOAD_BEHIND``).
"""

from __future__ import annotations

import argparse
import json

import torch

from phalanx.kernels import gemv, gemv_tuner, linear_plan
from phalanx.kernels.linear_plan import ROW_BUCKETS, Neighbour

SHAPES = [(6144, 4096, "norm"), (4096, 4096, "attn"), (28672, 4096, "norm"), (4096, 14336, "silu"),
          (128256, 4096, "plain")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=list(ROW_BUCKETS))
    ap.add_argument("--preload", choices=["on", "off", "both"], default="on")
    ap.add_argument("--rows-tiles", nargs="+", default=None, metavar="N,K,WARPS,STAGES",
                    help="padded-rows tiles to try instead of gemv.ROWS_TILES (each whole and split over K)")
    ap.add_argument("--output", default=None)
    a = ap.parse_args()
    if a.rows_tiles:
        gemv.ROWS_TILES = [linear_plan.RowsTile(*map(int, t.split(","))) for t in a.rows_tiles]
    behind = linear_plan.PRELOAD_BEHIND
    modes = {"on": [True], "off": [False], "both": [True, False]}[a.preload]
    rows_out = []
    for N, K, kind in SHAPES:
        w = torch.randn(N, K, dtype=torch.bfloat16, device="cuda")
        nbytes = w.numel() * w.element_size()
        ws = gemv_tuner.weight_copies(w)
        for M in a.rows:
            x = torch.randn(M, 2 * K if kind == "silu" else K, dtype=w.dtype, device="cuda")
            r = torch.randn(M, K, dtype=w.dtype, device="cuda")
            g = torch.ones(K, dtype=w.dtype, device="cuda")
            for preload in modes:
                linear_plan.PRELOAD_BEHIND = behind if preload else frozenset()   # read by each launcher built
                for plan, fn in gemv_tuner.candidates(Neighbour(kind), x, r, g, ws):
                    try:
                        ms = gemv_tuner.time_graph(fn, len(ws))
                    except Exception as e:  # a config the compiler rejects (the tuner skips it too)
                        print(f"{N:6d}x{K:5d} {kind:5s} rows={M:3d} {plan}: rejected ({type(e).__name__})", flush=True)
                        continue
                    pre = preload and Neighbour(kind) in behind and isinstance(plan.tile, linear_plan.OneRowTile)
                    rows_out.append({"N": N, "K": K, "kind": kind, "rows": M, "plan": str(plan), "preload": pre,
                                     "ms": ms, "gb_s": nbytes / ms / 1e6})
                    print(f"{N:6d}x{K:5d} {kind:5s} rows={M:3d} {str(plan) + (' pre' if pre else ''):38s} "
                          f"{ms * 1e3:8.1f} us {nbytes / ms / 1e6:7.0f} GB/s", flush=True)
            linear_plan.PRELOAD_BEHIND = behind
        del ws, w
    if a.output:
        with open(a.output, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
