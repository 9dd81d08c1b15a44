"""Paged attention kernels alone on a GPU: decode (split-KV) at a batch of sequences of one
context length, and extend (prefill of new tokens over an empty prefix), for each key-tile
config, replayed from a CUDA graph over a pool whose blocks are scattered as in a long-running
server. Decode reports the KV bytes read per second; extend, the attention FLOP/s.

    python tools/bench_attention.py --batch 1 64 256 --context 256 1500 --output attention.json
"""

from __future__ import annotations

import argparse
import functools
import json

import torch

from phalanx.kernels import gemv_tuner, triton_attention


def _time(fn) -> float:
    """Microseconds per call, replayed from a CUDA graph (the GEMV tuner's timing)."""
    return gemv_tuner.time_graph(lambda i: fn(), 1) * 1e3


def _pool(S: int, ctx: int, Hkv: int, D: int, B: int, dtype, gen):
    per = -(-ctx // B)
    nb = S * per + 1
    kc = torch.randn(nb, B, Hkv, D, dtype=dtype, device="cuda")
    vc = torch.randn(nb, B, Hkv, D, dtype=dtype, device="cuda")
    bt = torch.randperm(nb, generator=gen)[:S * per].view(S, per).to(torch.int32).cuda()
    lens = torch.full((S,), ctx, dtype=torch.int32, device="cuda")
    return kc, vc, bt, lens


def parse_config(text: str) -> tuple[int, int, int]:
    n, w, st = (int(x) for x in text.split(","))
    return n, w, st


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--context", type=int, nargs="+", default=[256, 1500])
    ap.add_argument("--configs", type=parse_config, nargs="+", default=[(32, 4, 3), (64, 4, 3), (128, 4, 2),
                                                                        (128, 8, 3)],
                    help="keys per step, warps, stages")
    ap.add_argument("--extend", type=int, nargs="*", default=[1000], help="prefill lengths (one sequence each)")
    ap.add_argument("--heads", type=int, nargs=3, default=[32, 8, 128], help="H Hkv D")
    ap.add_argument("--output", default=None)
    a = ap.parse_args()
    H, Hkv, D = a.heads
    B, dtype = 32, torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for S in a.batch:
        for ctx in a.context:
            kc, vc, bt, lens = _pool(S, ctx, Hkv, D, B, dtype, gen)
            q = torch.randn(S, H, D, dtype=dtype, device="cuda")
            auto = triton_attention.num_splits(S, Hkv, 131072, B, sms)
            nbytes = 2 * S * ctx * Hkv * D * kc.element_size()
            for splits in sorted({auto, max(1, auto // 4), 4 * auto}):
                for cfg in a.configs:
                    us = _time(functools.partial(triton_attention.decode_attention, q, kc, vc, bt, lens, D ** -0.5,
                                                 None, splits, cfg))
                    rows.append({"kernel": "decode", "batch": S, "context": ctx, "splits": splits,
                                 "auto_splits": splits == auto, "config": cfg, "us": us,
                                 "tb_s": nbytes / us / 1e6})
                    print(f"decode  S={S:4d} ctx={ctx:6d} splits={splits:3d}{'*' if splits == auto else ' '} "
                          f"cfg={cfg}: {us:8.1f} us  {nbytes / us / 1e6:5.2f} TB/s", flush=True)
            del kc, vc
    for T in a.extend:
        kc, vc, bt, lens = _pool(1, T, Hkv, D, B, dtype, gen)
        q = torch.randn(T, H, D, dtype=dtype, device="cuda")
        qs = torch.tensor([0, T], dtype=torch.int32, device="cuda")
        flops = 4 * H * D * T * (T + 1) / 2
        for cfg in a.configs:
            us = _time(functools.partial(triton_attention.extend_attention, q, kc, vc, bt, qs, lens, T, D ** -0.5,
                                         None, config=cfg))
            rows.append({"kernel": "extend", "tokens": T, "config": cfg, "us": us, "tflop_s": flops / us / 1e6})
            print(f"extend  T={T:6d} cfg={cfg}: {us:8.1f} us  {flops / us / 1e6:6.1f} TFLOP/s", flush=True)
    if a.output:
        with open(a.output, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "heads": a.heads, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
