"""The fused MoE kernels alone on a GPU at one MoE layer's shape (Qwen3-30B-A3B by default: 128
experts of 2048 -> 768, top 8): bf16 experts, FP8 experts widened for the dots (W8A16) and FP8
experts multiplied in FP8 with the activations quantized per row (W8A8), for steps of T tokens
with uniformly random routing; each at the best of the tiles the tuner tries for the step's
bucket of pairs, replayed from a CUDA graph. Reports microseconds and the expert bytes read per
second (every expert a step routes to is read once).

    python tools/bench_moe.py --tokens 8 64 256 1024 4096 --output moe.json

``--few``: the few-token form (``triton_moe.fused_moe_rows``, each pair one row) against the
blocked form as the tuner plans it, at 1, 2, 4, 8 and 16 tokens, for bf16 experts and FP8 experts
scaled per row and per 128 x 128 block, each timing over eight routings so that the experts come
from memory: the tuner's own timings (``triton_moe.time_rows``), every size reported.

    python tools/bench_moe.py --few --experts 64 --top-k 6 --intermediate 1408 --output few.json
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
    ap.add_argument("--few", action="store_true", help="the few-token form against the blocked form")
    a = ap.parse_args()
    E, k, H, I = a.experts, a.top_k, a.hidden, a.intermediate  # noqa: E741 (I: intermediate size)
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    w13 = torch.randn(E, 2 * I, H, device=dev, generator=g, dtype=torch.bfloat16) / H ** 0.5
    w2 = torch.randn(E, H, I, device=dev, generator=g, dtype=torch.bfloat16) / I ** 0.5
    if a.few:
        few(a, w13, w2)
        return
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


def few(a: argparse.Namespace, w13: torch.Tensor, w2: torch.Tensor) -> None:
    E, k, H, I = a.experts, a.top_k, a.hidden, a.intermediate  # noqa: E741 (I: intermediate size)
    q13, s13 = fp8.quantize_weight(w13.reshape(-1, H))
    q2, s2 = fp8.quantize_weight(w2.reshape(-1, I))
    block = (128, 128)
    b13 = [fp8.quantize_blocks(w13[e].float(), block) for e in range(E)]
    b2 = [fp8.quantize_blocks(w2[e].float(), block) for e in range(E)]
    variants = {"bf16": (w13, w2, None, None, None),
                "fp8_row": (q13.view(w13.shape), q2.view(w2.shape), s13.view(E, 2 * I), s2.view(E, H), None),
                "fp8_block": (torch.stack([q for q, _ in b13]), torch.stack([q for q, _ in b2]),
                              torch.stack([s for _, s in b13]), torch.stack([s for _, s in b2]), block)}
    out = []
    for name, (a13, a2, sc13, sc2, blk) in variants.items():
        plan = triton_moe.tune(a13, a2, k, E, 0, sc13, sc2, torch.bfloat16, blk)
        rows, times = triton_moe.time_rows(a13, a2, k, E, 0, MoePlan(plan.tiles), sc13, sc2, torch.bfloat16, blk,
                                           sizes=(1, 2, 4, 8, 16), past_loss=True)
        tiles = None if rows is None else (tuple(rows.gate_up), tuple(rows.down))
        for T, rows_ms, blocked_ms in times:
            out.append({"variant": name, "tokens": T, "few_us": rows_ms * 1e3, "blocked_us": blocked_ms * 1e3,
                        "speedup": blocked_ms / rows_ms, "few_tiles": tiles})
            print(f"{name:9s} T={T:3d}: few-token {rows_ms * 1e3:7.1f} us, blocked {blocked_ms * 1e3:7.1f} us "
                  f"({blocked_ms / rows_ms:4.2f}x)  tiles {tiles}", flush=True)
        print(f"{name:9s} tuned plan: {plan.rows}", flush=True)
    if a.output:
        with open(a.output, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "shape": vars(a), "few": out}, f, indent=1)


if __name__ == "__main__":
    main()
