"""What LoRA adds to a projection, by form and by the step's tokens: the dense form (x Aᵀ, the
token-to-slot mask, y + s Bᵀ: three kernels whatever the tokens) against the decode kernels of
``kernels/triton_lora.py`` (each token its own slot: two kernels, up to ``MAX_ROWS`` tokens) and
its grouped kernels (the tokens in tiles of one slot: two kernels, up to ``GROUPED_ROWS``), every
token with an adapter or none with one. Llama-3.1-8B's projections, ``--slots`` slots of rank ``--rank``, bf16, replayed
from CUDA graphs over copies of the slots larger than L2 (a step's 32 layers do not fit in it).

    python tools/bench_lora.py [--rows 1 2 4 8 16 32 64 128 256 512] [--slots 4] [--rank 16] [--output f.json]
    python tools/bench_lora.py --check    # the forms agree (any device; tiny shapes on a CPU)

Prints µs per projection for each form and a layer's sum (q/k/v, o, gate ‖ up, down).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import numpy as np
import torch

from phalanx.kernels import triton_lora

# (K, each part's output rows) of Llama-3.1-8B's adapted projections
SHAPES = {"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)), "gate_up": (4096, (14336, 14336)),
          "down": (14336, (4096,))}
TINY = {"qkv": (96, (64, 32, 32)), "o": (64, (96,)), "gate_up": (96, (128, 128)), "down": (600, (96,))}


def dense(y: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``models/lora.LoraWeights.dense``'s three kernels."""
    s = torch.matmul(x, A.t())
    s.mul_(mask)
    return torch.addmm(y, s, B.t())


def inputs(K: int, sizes: tuple[int, ...], T: int, slots: int, rank: int, adapters: bool, dev: torch.device,
           dtype: torch.dtype) -> dict:
    """A projection's slots as ``LoraWeights`` holds them (part p's rows of B hold values only in
    part p's columns), its x and y, and each token's slot (round robin, or none)."""
    g = torch.Generator().manual_seed(T * 7 + K)
    parts, N = len(sizes), sum(sizes)
    A = torch.randn(parts * slots * rank, K, generator=g) / K ** 0.5
    B = torch.zeros(N, parts * slots * rank)
    starts = [sum(sizes[:p]) for p in range(parts)]
    for p in range(parts):
        c = p * slots * rank
        B[starts[p]:starts[p] + sizes[p], c:c + slots * rank] = torch.randn(sizes[p], slots * rank, generator=g) * 0.1
    ts = np.array([t % slots if adapters else -1 for t in range(T)], np.int64)
    token_slots = torch.from_numpy(ts).to(dev, torch.int32)
    slot_of_col = (torch.arange(slots * rank, device=dev) // rank).repeat(parts)
    mask = (token_slots[:, None].long() == slot_of_col[None, :]).to(dtype)
    groups = triton_lora.split_groups(torch.from_numpy(triton_lora.groups(ts, slots)).to(dev), slots) \
        if T <= triton_lora.GROUPED_ROWS else None
    return {"x": torch.randn(T, K, generator=g).to(dev, dtype), "y": torch.randn(T, N, generator=g).to(dev, dtype),
            "A": A.to(dev, dtype), "B": B.to(dev, dtype), "slots": token_slots, "mask": mask, "groups": groups,
            "sums": triton_lora.partials(K, rank, dev),
            "grouped_sums": triton_lora.grouped_partials(K, rank, dev), "parts": parts,
            "bounds": ((starts + [N, N])[1], (starts + [N, N, N])[2])}


def timed(form: str, i: dict, slots: int, rank: int) -> Callable[[int], object]:
    """fn(c): one call of the form over the c-th copy of the slots."""
    if form == "dense":
        return lambda c: dense(i["y"], i["x"], i["As"][c], i["Bs"][c], i["mask"])
    lp = triton_lora.plan(i["x"].shape[1], i["parts"], slots, rank, i["bounds"], i["x"].dtype)
    if form.startswith("grouped"):
        return lambda c: triton_lora.lora_add_grouped(i["y"], i["x"], i["As"][c], i["Bs"][c], i["groups"],
                                                      i["grouped_sums"], lp)
    return lambda c: triton_lora.lora_add(i["y"], i["x"], i["As"][c], i["Bs"][c], i["slots"], i["sums"], lp)


def run_form(form: str, i: dict, K: int, out: torch.Tensor) -> torch.Tensor:
    """One call of a kernel form on a copy of y (``check``), with 4 slots of rank 8."""
    lp = triton_lora.plan(K, i["parts"], 4, 8, i["bounds"], i["x"].dtype)
    if form == "grouped":
        return triton_lora.lora_add_grouped(out, i["x"], i["A"], i["B"], i["groups"], i["grouped_sums"], lp)
    return triton_lora.lora_add(out, i["x"], i["A"], i["B"], i["slots"], i["sums"], lp)


def check(dev: torch.device) -> None:
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    for name, (K, sizes) in (SHAPES if dev.type == "cuda" else TINY).items():
        for form, T in (("kernels", 1), ("kernels", 5), ("grouped", 5), ("grouped", 37)):
            i = inputs(K, sizes, T, 4, 8, True, dev, dtype)
            ref = dense(i["y"].float(), i["x"].float(), i["A"].float(), i["B"].float(), i["mask"].float())
            out = run_form(form, i, K, i["y"].clone())
            err = ((out.float() - ref).norm() / ref.norm()).item()
            assert err < (1e-2 if dtype != torch.float32 else 1e-5), (name, form, T, err)
            print(f"{name} {form} T={T}: relative error {err:.1e}")
    print("ok")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512])
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--output", default=None)
    a = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if a.check:
        check(dev)
        return
    from phalanx.kernels.gemv_tuner import time_graph, weight_copies
    out: dict = {"slots": a.slots, "rank": a.rank, "gpu": torch.cuda.get_device_name(), "us": {}}
    forms = (("dense", True), ("kernels", True), ("kernels_none", False), ("grouped", True), ("grouped_none", False))
    print(f"{'rows':>4} {'projection':>10} " + " ".join(f"{f:>12}" for f, _ in forms))
    for T in a.rows:
        layer = {f: 0.0 for f, _ in forms}
        for name, (K, sizes) in SHAPES.items():
            row = {}
            for form, adapters in forms:
                if (form.startswith("kernels") and T > triton_lora.MAX_ROWS
                        or form.startswith("grouped") and T > triton_lora.GROUPED_ROWS):
                    continue
                i = inputs(K, sizes, T, a.slots, a.rank, adapters, dev, torch.bfloat16)
                i["As"], i["Bs"] = weight_copies(i["A"]), weight_copies(i["B"])
                copies = min(len(i["As"]), len(i["Bs"]))
                fn = timed(form, i, a.slots, a.rank)
                row[form] = 1e3 * time_graph(fn, copies)
                layer[form] += row[form]
            out["us"][f"{T}/{name}"] = row
            print(f"{T:>4} {name:>10} " + " ".join(f"{row.get(f, float('nan')):>12.2f}" for f, _ in forms))
        out["us"][f"{T}/layer"] = layer
        print(f"{T:>4} {'layer':>10} " + " ".join(f"{layer[f] or float('nan'):>12.2f}" for f, _ in forms))
    if a.output:
        with open(a.output, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
