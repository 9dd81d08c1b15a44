"""The fused MoE kernels alone on a GPU at one MoE layer's shape (Qwen3-30B-A3B by default: 128
experts of 2048 -> 768, top 8): bf16 experts, FP8 experts widened for the dots (W8A16) and FP8
experts multiplied in FP8 with the activations quantized per row (W8A8), for steps of T tokens
with uniformly random routing; each at the best of the tiles the tuner tries for the step's
bucket of pairs, replayed from a CUDA graph. Reports microseconds and the expert bytes read per
second (every expert a step routes to is read once).

    python tools/bench_moe.py --tokens 8 64 256 1024 4096 --output moe.json
"""

from __future__ import annotations

import argparse
import functools
import json

import torch

from phalanx.kernels import fp8, gemv_tuner, triton_moe
from phalanx.kernels.linear_plan import MoePlan, pair_bucket_index


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[8, 64, 256, 1024, 4096])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--output", default=None)
    a = ap.parse_args()
    E, k, H, I = a.experts, a.top_k, a.hidden, a.intermediate  # noqa: E741 (I: intermediate size)
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    w13 = torch.randn(E, 2 * I, H, device=dev, generator=g, dtype=torch.bfloat16) / H ** 0.5
    w2 = torch.randn(E, H, I, device=dev, generator=g, dtype=torch.bfloat16) / I ** 0.5
    q13, s13 = fp8.quantize_weight(w13.reshape(-1, H))
    q2, s2 = fp8.quantize_weight(w2.reshape(-1, I))
    q13, q2, s13, s2 = q13.view(w13.shape), q2.view(w2.shape), s13.view(E, 2 * I), s2.view(E, H)
    variants = {"bf16": (w13, w2, None, None, False), "fp8_w8a16": (q13, q2, s13, s2, False),
                "fp8_w8a8": (q13, q2, s13, s2, True)}
    rows = []
    for T in a.tokens:
        x = torch.randn(T, H, device=dev, generator=g, dtype=torch.bfloat16)
        ids = torch.rand(T, E, device=dev, generator=g).topk(k, dim=-1).indices
        weights = torch.rand(T, k, device=dev, generator=g)
        touched = int(torch.unique(ids).numel())
        bucket = pair_bucket_index(T * k)
        line = []
        for name, (a13, a2, sc13, sc2, a8) in variants.items():
            nbytes = touched * (a13[0].numel() + a2[0].numel()) * a13.element_size()
            best = None
            for tile in triton_moe.candidates(a13.dtype)[bucket]:
                plan = MoePlan((tile,) * 4)
                run = functools.partial(triton_moe.fused_moe, x, ids, weights, a13, a2, 0, plan, sc13, sc2, a8)
                try:
                    us = gemv_tuner.time_graph(lambda i, run=run: run(), 1) * 1e3
                except Exception as e:   # a tile the compiler rejects
                    print(f"T={T} {name} {tile}: {type(e).__name__}", flush=True)
                    continue
                if best is None or us < best[0]:
                    best = (us, tuple(tile))
            if best is None:
                continue
            rows.append({"tokens": T, "pairs": T * k, "variant": name, "us": best[0], "tile": best[1],
                         "experts_read": touched, "tb_s": nbytes / best[0] / 1e6})
            line.append(f"{name} {best[0]:8.1f} us ({nbytes / best[0] / 1e6:4.2f} TB/s, tile {best[1]})")
        print(f"T={T:5d} ({T * k} pairs, {touched} experts): " + " | ".join(line), flush=True)
    if a.output:
        with open(a.output, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "shape": vars(a), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
