"""Paged attention kernels alone on a GPU: decode (split-KV) at a batch of sequences of one
context length, and prefill (one prompt over an empty prefix), for each tile config, replayed
from a CUDA graph over a pool whose blocks are scattered as in a long-running server. Decode
reports the KV bytes read per second beside the GPU's read bandwidth measured in the same run
(one kernel streaming 4 GiB, summing it); prefill, the attention FLOP/s; a hit (a few
new tokens over a cached context, the split extend kernel and its merge), microseconds per call
for each query block, key-slice count and tile, the shipped choice marked.

    python tools/bench_attention.py --batch 1 64 256 --context 256 1500 --output attention.json
    python tools/bench_attention.py --batch --extend 1000 2048 --prefill-configs 256,64,8,3 --hit 32:2048 32:0
    python tools/bench_attention.py --kv-dtype fp8 ...      # over an FP8 (e4m3) pool
    python tools/bench_attention.py --kv-dtype fp8 --fp8-dots f16 bf16 ...   # its dots in float16 or bf16
    python tools/bench_attention.py --batch --extend --hit 32:2048 --hit-cold   # KV read from memory

A hit's KV (8.4 MB a layer at 2,048 tokens of Llama-3.1-8B) fits in the H200's L2, so calls
repeated over one pool read it from L2; in a step the other layers' weights have pushed it out.
``--hit-cold`` rotates over copies of the pool larger than L2 together, as the engine reads it.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json

import torch
import triton
import triton.language as tl

from phalanx.kernels import gemv_tuner, triton_attention


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    """Each program sums STEPS consecutive blocks of x: a read of every byte, nothing written
    but one float per program."""
    base = tl.program_id(0).to(tl.int64) * BLOCK * STEPS
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(STEPS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc))


def read_bandwidth(nbytes: int = 4 << 30) -> float:
    """TB/s of one kernel reading ``nbytes`` of bf16 from memory (the ceiling decode attention
    is held to)."""
    x = torch.ones(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    block, steps = 4096, 16
    grid = triton.cdiv(x.numel(), block * steps)
    out = torch.empty(grid, dtype=torch.float32, device="cuda")
    us = _time(lambda: _read_kernel[(grid,)](x, out, x.numel(), BLOCK=block, STEPS=steps, num_warps=8))
    assert out.double().sum().item() == x.numel()
    return nbytes / us / 1e6


def _time(fn) -> float:
    """Microseconds per call, replayed from a CUDA graph (the GEMV tuner's timing)."""
    return gemv_tuner.time_graph(lambda i: fn(), 1) * 1e3


def _time_pools(fn, q: torch.Tensor, pools: list[tuple[torch.Tensor, torch.Tensor]], *args) -> float:
    """Microseconds per call of fn(q, k_cache, v_cache, *args), the calls taking the pools in turn."""
    return gemv_tuner.time_graph(lambda i: fn(q, *pools[i], *args), len(pools)) * 1e3


def _pool(S: int, ctx: int, Hkv: int, D: int, B: int, dtype, gen):
    per = -(-ctx // B)
    nb = S * per + 1
    kc = torch.randn(nb, B, Hkv, D, dtype=dtype, device="cuda")
    vc = torch.randn(nb, B, Hkv, D, dtype=dtype, device="cuda")
    bt = torch.randperm(nb, generator=gen)[:S * per].view(S, per).to(torch.int32).cuda()
    lens = torch.full((S,), ctx, dtype=torch.int32, device="cuda")
    return kc, vc, bt, lens


_SHIPPED_DOTS = triton_attention.FP8_POOL_F16


def _set_dots(dots: str | None) -> None:
    """An FP8 pool's dots in float16 (f16), bf16, or as shipped (None)."""
    triton_attention.FP8_POOL_F16 = _SHIPPED_DOTS if dots is None else dots == "f16"


def _dots_ran(dots: str | None, kv_dtype: str) -> str:
    """The form an FP8 pool's dots took (bf16 over a bf16 pool: the model's own)."""
    if kv_dtype != "fp8":
        return "bf16"
    return dots or ("f16" if _SHIPPED_DOTS else "bf16")


def parse_prefill(text: str) -> tuple[int, int, int, int]:
    rows, n, w, st = (int(x) for x in text.split(","))
    return rows, n, w, st


def parse_config(text: str) -> tuple[int, int, int]:
    n, w, st = (int(x) for x in text.split(","))
    return n, w, st


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="*", default=[1, 64, 256])
    ap.add_argument("--context", type=int, nargs="+", default=[256, 1500])
    ap.add_argument("--configs", type=parse_config, nargs="+", default=[(32, 4, 3), (64, 4, 3), (128, 4, 2),
                                                                        (128, 8, 3)],
                    help="decode: keys per step, warps, stages")
    ap.add_argument("--extend", type=int, nargs="*", default=[1000], help="prefill lengths (one sequence each)")
    ap.add_argument("--prefill-configs", type=parse_prefill, nargs="*", default=[],
                    help="prefill kernel tiles beside the shipped one: rows a program (query tokens x the heads "
                         "of a KV head), keys per step, warps, stages")
    ap.add_argument("--hit", nargs="*", default=[], help="NEW:CACHED new tokens over a cached context (split kernel)")
    ap.add_argument("--split-configs", type=parse_config, nargs="+",
                    default=[(32, 4, 2), (64, 4, 3), (32, 8, 2), (64, 8, 2), (64, 8, 3), (128, 8, 2)],
                    help="split kernel: keys per step, warps, stages")
    ap.add_argument("--hit-splits", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32], help="key slices tried")
    ap.add_argument("--hit-block-m", type=int, nargs="+", default=[16, 32, 64], help="query tokens a program takes")
    ap.add_argument("--hit-cold", action="store_true", help="rotate over pool copies larger than L2 together")
    ap.add_argument("--heads", type=int, nargs=3, default=[32, 8, 128], help="H Hkv D")
    ap.add_argument("--kv-dtype", choices=["bf16", "fp8"], default="bf16", help="the pool's dtype (q is bf16)")
    ap.add_argument("--fp8-dots", nargs="+", choices=["f16", "bf16"], default=None,
                    help="with --kv-dtype fp8, decode and extend: the dtype the pool's keys and values widen to "
                         "for the dots (default: shipped)")
    ap.add_argument("--output", default=None)
    a = ap.parse_args()
    H, Hkv, D = a.heads
    B, dtype = 32, torch.bfloat16
    read_tb_s = read_bandwidth()
    print(f"read bandwidth: {read_tb_s:.2f} TB/s", flush=True)
    gen = torch.Generator().manual_seed(0)
    dot_forms = a.fp8_dots if a.kv_dtype == "fp8" and a.fp8_dots else [None]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for S in a.batch:
        for ctx in a.context:
            kc, vc, bt, lens = _pool(S, ctx, Hkv, D, B, dtype, gen)
            if a.kv_dtype == "fp8":
                kc, vc = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
            q = torch.randn(S, H, D, dtype=dtype, device="cuda")
            auto = triton_attention.num_splits(S, Hkv, 131072, B, sms)
            nbytes = 2 * S * ctx * Hkv * D * kc.element_size()
            slices = sorted({auto, max(1, auto // 4), 4 * auto})
            first = None
            for splits, cfg, dots in itertools.product(slices, a.configs + [None], dot_forms):
                _set_dots(dots)
                call = functools.partial(triton_attention.decode_attention, q, kc, vc, bt, lens, D ** -0.5,
                                         None, splits, cfg)
                got = call().float()
                first = got if first is None else first
                diff = (got - first).abs().max().item()   # against the first form of this point
                us = _time(call)
                shipped = triton_attention.decode_config(kc, splits, S * Hkv * splits / sms)
                rows.append({"kernel": "decode", "batch": S, "context": ctx, "splits": splits,
                             "auto_splits": splits == auto, "config": cfg or shipped,
                             "shipped": cfg is None, "dots": _dots_ran(dots, a.kv_dtype), "us": us,
                             "max_diff_to_first": diff,
                             "tb_s": nbytes / us / 1e6, "of_read": nbytes / us / 1e6 / read_tb_s})
                print(f"decode  S={S:4d} ctx={ctx:6d} splits={splits:3d}{'*' if splits == auto else ' '} "
                      f"cfg={cfg or 'shipped'}{' ' + dots if dots else ''}: {us:8.1f} us  "
                      f"{nbytes / us / 1e6:5.2f} TB/s ({nbytes / us / 1e6 / read_tb_s:.0%} of read)  "
                      f"max diff {diff:.1e}", flush=True)
            _set_dots(None)
            del kc, vc
    for T in a.extend:
        kc, vc, bt, lens = _pool(1, T, Hkv, D, B, dtype, gen)
        if a.kv_dtype == "fp8":
            kc, vc = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
        q = torch.randn(T, H, D, dtype=dtype, device="cuda")
        qs = torch.tensor([0, T], dtype=torch.int32, device="cuda")
        flops = 4 * H * D * T * (T + 1) / 2
        first = None
        for cfg4, dots in itertools.product([None] + a.prefill_configs, dot_forms):
            _set_dots(dots)
            call = functools.partial(triton_attention.prefill_attention, q, kc, vc, bt, qs, lens, T, D ** -0.5,
                                     None, cfg4)
            got = call().float()
            first = got if first is None else first
            diff = (got - first).abs().max().item()   # against the first form of this point
            us = _time(call)
            tile = cfg4 or triton_attention.prefill_config(q.dtype, kc, T)
            rows.append({"kernel": "prefill", "tokens": T, "config": tile, "shipped": cfg4 is None,
                         "dots": _dots_ran(dots, a.kv_dtype), "us": us,
                         "tflop_s": flops / us / 1e6, "max_diff_to_first": diff})
            print(f"prefill T={T:6d} cfg={cfg4 or 'shipped'}{' ' + dots if dots else ''}: {us:8.1f} us  "
                  f"{flops / us / 1e6:6.1f} TFLOP/s  max diff {diff:.1e}", flush=True)
        _set_dots(None)
    for spec in a.hit:
        new, cached = (int(x) for x in spec.split(":"))
        L = new + cached
        kc, vc, bt, lens = _pool(1, L, Hkv, D, B, dtype, gen)
        if a.kv_dtype == "fp8":
            kc, vc = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
        pools = [(kc, vc)]
        if a.hit_cold:   # together at least twice L2
            pools += [tuple(torch.randn(c.shape, device="cuda").to(c.dtype) for c in (kc, vc))
                      for _ in range(min(63, -(-2 * gemv_tuner.L2_BYTES // (2 * kc.nbytes)) - 1))]
        q = torch.randn(new, H, D, dtype=dtype, device="cuda")
        qs = torch.tensor([0, new], dtype=torch.int32, device="cuda")

        auto = triton_attention.extend_splits(new, 1, Hkv, H, sms)
        auto_m = min(triton_attention._split_rows(triton.next_power_of_2(H // Hkv)),
                     max(16, triton.next_power_of_2(new)))
        nbytes = 2 * L * Hkv * D * kc.element_size()
        best = None
        for block_m in a.hit_block_m:
            for splits in a.hit_splits:
                for cfg in a.split_configs:
                    try:
                        us = _time_pools(triton_attention.extend_attention_split, q, pools, bt, qs, lens, new,
                                         D ** -0.5, None, splits, cfg, None, block_m)
                    except Exception as e:   # a tile that does not fit (shared memory, registers)
                        print(f"hit {new}+{cached} block_m={block_m} splits={splits} cfg={cfg}: {type(e).__name__}")
                        continue
                    shipped = splits == auto and cfg == triton_attention.EXTEND_SPLIT_CONFIG and block_m == auto_m
                    rows.append({"kernel": "hit", "new": new, "cached": cached, "block_m": block_m, "splits": splits,
                                 "config": cfg, "us": us, "tb_s": nbytes / us / 1e6, "shipped": shipped,
                                 "cold": a.hit_cold})
                    best = min(best or (us, ""), (us, f"block_m={block_m} splits={splits} cfg={cfg}"))
                    print(f"hit {new}+{cached} block_m={block_m:3d} splits={splits:3d}{'*' if shipped else ' '} "
                          f"cfg={cfg}: {us:7.1f} us  {nbytes / us / 1e6:5.2f} TB/s of KV", flush=True)
        # the prefill kernel (no key slices) for comparison
        us = _time_pools(triton_attention.prefill_attention, q, pools, bt, qs, lens, new, D ** -0.5, None)
        rows.append({"kernel": "hit_prefill_kernel", "new": new, "cached": cached, "us": us})
        print(f"hit {new}+{cached} prefill kernel: {us:7.1f} us", flush=True)
        print(f"hit {new}+{cached}: best {best}", flush=True)
    if a.output:
        with open(a.output, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "heads": a.heads, "kv_dtype": a.kv_dtype,
                       "read_tb_s": read_tb_s, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
