"""The custom all-reduce (one-shot, two-shot) against NCCL on two GPUs: µs per call for message
sizes from 8 KB to 8 MB, each timed as a CUDA graph of ``--calls`` all-reduces replayed
``--replays`` times (what decode does). The numbers to set AllReduceConfig's cut-overs from.

    python tools/bench_allreduce.py --dtype bfloat16 --output allreduce.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch

from phalanx.distributed.custom_allreduce import NO_MULTICAST

WORLD = 2
SIZES = [8 << 10 << i for i in range(11)]                  # 8 KB .. 8 MB


def _graph_us(fn, calls: int, replays: int) -> float:
    """µs per call of ``fn`` captured ``calls`` times in one graph, replayed ``replays`` times."""
    import torch.distributed as dist
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (calls * replays)


def _methods(car, x: torch.Tensor) -> dict:
    import torch.distributed as dist

    from phalanx.distributed.custom_allreduce import ONE_SHOT, TWO_SHOT
    out = torch.empty_like(x)
    return {"one_shot": lambda: car.all_reduce(x, out=out, kind=ONE_SHOT),
            "two_shot": lambda: car.all_reduce(x, out=out, kind=TWO_SHOT),
            "nccl": lambda: dist.all_reduce(out)}


def _worker(rank: int, a: argparse.Namespace, init: str) -> None:
    os.environ.update(NO_MULTICAST)
    import torch.distributed as dist

    from phalanx.distributed.custom_allreduce import AllReduceConfig, CustomAllReduce, exchange_over
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init}", rank=rank, world_size=WORLD,
                            device_id=torch.device("cuda", rank))
    config = AllReduceConfig(max_bytes=max(a.sizes), chunk_bytes=a.chunk_bytes, max_programs=a.max_programs)
    car = CustomAllReduce(rank, WORLD, f"cuda:{rank}", exchange_over(), config)
    dtype = getattr(torch, a.dtype)
    rows = []
    for size in a.sizes:
        x = torch.randn(size // dtype.itemsize, device="cuda").to(dtype) * 1e-3
        row = {"bytes": size}
        for name, fn in _methods(car, x).items():
            fn()                                           # compile / set up the communicator
            torch.cuda.synchronize()
            row[name] = _graph_us(fn, a.calls, a.replays)
        rows.append(row)
        if rank == 0:
            print(f"{size >> 10:6d} KB  one-shot {row['one_shot']:7.1f} us  two-shot {row['two_shot']:7.1f} us  "
                  f"nccl {row['nccl']:7.1f} us", flush=True)
    dist.barrier()
    car.close()
    if rank == 0 and a.output:
        with open(a.output, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "dtype": a.dtype, "world": WORLD,
                       "calls_per_graph": a.calls, "chunk_bytes": a.chunk_bytes,
                       "max_programs": a.max_programs, "rows": rows}, f, indent=1)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=SIZES, help="message sizes in bytes")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--calls", type=int, default=20, help="all-reduces captured in one graph")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--chunk-bytes", type=int, default=4096)
    ap.add_argument("--max-programs", type=int, default=128)
    ap.add_argument("--output", default=None)
    a = ap.parse_args()
    if torch.cuda.device_count() < WORLD:
        raise SystemExit(f"needs {WORLD} GPUs")
    os.environ.update(NO_MULTICAST)                          # inherited by the spawned ranks
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(_worker, args=(a, os.path.join(d, "init")), nprocs=WORLD, start_method="spawn")


if __name__ == "__main__":
    main()
