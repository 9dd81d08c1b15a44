"""The custom all-reduce on GPUs: two spawned processes, on two GPUs, or both on cuda:0 (CUDA IPC
works between the processes of one GPU, which time-slices their spinning kernels: slower, the same
code). Gloo carries the handle exchange and the cross-rank comparisons (NCCL refuses two ranks on
one GPU). Every rank makes every rank's inputs from seeds and checks its own output: the sums bit for
bit against the fixed-order reference, in float32 and bfloat16 alike (the sum is cast once, rounding
to nearest even, as the reference does); the fused norm's residual bit for bit and its output within
TOL, and the same bits on both ranks. Eager and replayed from CUDA graphs with changing inputs."""

from __future__ import annotations

import json
import os
import traceback

import pytest
import torch

from phalanx.distributed.custom_allreduce import NO_MULTICAST

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

WORLD = 2
SIZES = [4096, 1000, 3 * 4096, 64 * 1024, 256 * 1024 + 8, 1 << 20]    # elements: 8 KB .. 2 MB in bf16
NORM_SHAPES = [(1, 4096), (3, 4096), (40, 2048), (2, 8192), (5, 1000), (200, 4096),
               (2, 16384)]                             # the last: too wide to fuse, norm after the sum
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}    # normed output: rstd in another summation order
DTYPES = [torch.float32, torch.bfloat16]


def inputs(seed: int, n: int, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g).to(dtype) for _ in range(WORLD)]


class Checks:
    """One rank's checks; failures are collected, not raised, so both ranks keep making the same calls."""

    def __init__(self, car, rank: int):
        self.car, self.rank, self.dev, self.fails = car, rank, car.device, []

    def expect(self, what: str, got: torch.Tensor, ref: torch.Tensor, tol: float = 0.0) -> None:
        got = got.cpu()
        if tol == 0.0 and not torch.equal(got, ref):
            self.fails.append(f"{what}: {(got.float() - ref.float()).abs().max().item()} off")
        elif tol and not torch.allclose(got.float(), ref.float(), atol=tol, rtol=tol):
            self.fails.append(f"{what}: {(got.float() - ref.float()).abs().max().item()} off (tol {tol})")

    def same_on_ranks(self, what: str, t: torch.Tensor) -> None:
        import torch.distributed as dist
        mine = t.cpu().contiguous().view(torch.uint8).flatten()
        every = [torch.empty_like(mine) for _ in range(WORLD)]
        dist.all_gather(every, mine)
        if not all(torch.equal(every[0], e) for e in every):
            self.fails.append(f"{what}: ranks differ")

    def eager(self) -> None:
        from phalanx.distributed.custom_allreduce import ONE_SHOT, TWO_SHOT, all_reduce, all_reduce_ref
        for dtype in DTYPES:
            for seed, n in enumerate(SIZES):
                xs = inputs(seed, n, dtype)
                ref = all_reduce_ref(xs)
                x = xs[self.rank].to(self.dev)
                for kind in (None, ONE_SHOT, TWO_SHOT):
                    self.expect(f"{kind} {dtype} n={n}", self.car.all_reduce(x, kind=kind), ref)
                self.expect(f"dispatch {dtype} n={n}", all_reduce(x, self.car), ref)
                self.expect(f"input kept {dtype} n={n}", x, xs[self.rank])
                y = x.clone()
                self.expect(f"in place {dtype} n={n}", self.car.all_reduce(y, out=y), ref)

    def back_to_back(self, calls: int = 60) -> None:
        """Many calls of both kinds with no host sync between them; the epoch counts every call."""
        from phalanx.distributed.custom_allreduce import ONE_SHOT, TWO_SHOT, all_reduce_ref
        xs = inputs(7, 5000, torch.float32)
        x, ref = xs[self.rank].to(self.dev), all_reduce_ref(xs)
        before = int(self.car.peers.counter[0])
        outs = [self.car.all_reduce(x, kind=(ONE_SHOT, TWO_SHOT)[i % 2]) for i in range(calls)]
        for i, out in enumerate(outs):
            self.expect(f"back-to-back call {i}", out, ref)
        if int(self.car.peers.counter[0]) != before + calls:
            self.fails.append("counter did not advance once a call")

    def graph(self) -> None:
        from phalanx.distributed.custom_allreduce import ONE_SHOT, TWO_SHOT, all_reduce_ref
        n, dtype = 3 * 4096, torch.bfloat16
        x = torch.zeros(n, dtype=dtype, device=self.dev)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y1 = self.car.all_reduce(x, kind=ONE_SHOT)
            y2 = self.car.all_reduce(x, kind=TWO_SHOT)
            y3 = self.car.all_reduce(y1)
        for step in range(4):
            xs = inputs(100 + step, n, dtype)
            x.copy_(xs[self.rank])
            g.replay()
            ref = all_reduce_ref(xs)
            self.expect(f"graph one-shot replay {step}", y1, ref)
            self.expect(f"graph two-shot replay {step}", y2, ref)
            self.expect(f"graph chained replay {step}", y3, all_reduce_ref([ref] * WORLD))

    def norm_case(self, seed: int, T: int, H: int, dtype: torch.dtype):
        from phalanx.distributed.custom_allreduce import all_reduce_add_rms_norm_ref
        xs = [x.view(T, H) for x in inputs(seed, T * H, dtype)]
        g = torch.Generator().manual_seed(seed + 1000)
        residual, weight = torch.randn(T, H, generator=g).to(dtype), torch.randn(H, generator=g).to(dtype)
        ref = all_reduce_add_rms_norm_ref(xs, residual, weight, 1e-6)
        return xs[self.rank].to(self.dev), residual.to(self.dev), weight.to(self.dev), ref

    def norm(self) -> None:
        from phalanx.distributed.custom_allreduce import all_reduce_add_rms_norm
        for dtype in DTYPES:
            for seed, (T, H) in enumerate(NORM_SHAPES):
                x, r, w, (ref_out, ref_res) = self.norm_case(seed, T, H, dtype)
                out, res = all_reduce_add_rms_norm(x, r, w, 1e-6, self.car)
                what = f"norm {dtype} {T}x{H}"
                self.expect(what + " residual", res, ref_res)
                self.expect(what + " out", out, ref_out, TOL[dtype])
                self.same_on_ranks(what + " out", out)

    def norm_graph(self) -> None:
        dtype, T, H = torch.bfloat16, 4, 4096
        x, r, w, _ = self.norm_case(0, T, H, dtype)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out, res = self.car.all_reduce_add_rms_norm(x, r, w, 1e-6)
        for step in range(3):
            xn, rn, wn, (ref_out, ref_res) = self.norm_case(50 + step, T, H, dtype)
            for static, new in ((x, xn), (r, rn), (w, wn)):
                static.copy_(new)
            g.replay()
            self.expect(f"graph norm replay {step} residual", res, ref_res)
            self.expect(f"graph norm replay {step} out", out, ref_out, TOL[dtype])
            self.same_on_ranks(f"graph norm replay {step} out", out)


def _worker(rank: int, devices: list[int], tmp: str) -> None:
    os.environ.update(NO_MULTICAST)
    result: dict = {"fails": []}
    try:
        import torch.distributed as dist

        from phalanx.distributed.custom_allreduce import CustomAllReduce, exchange_over
        torch.cuda.set_device(devices[rank])
        dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=rank, world_size=WORLD)
        car = CustomAllReduce(rank, WORLD, f"cuda:{devices[rank]}", exchange_over())
        checks = Checks(car, rank)
        for step in (checks.eager, checks.back_to_back, checks.graph, checks.norm, checks.norm_graph):
            step()
            torch.cuda.synchronize()
        dist.barrier()
        car.close()
        result["fails"] = checks.fails
    except Exception:
        result["fails"].append(traceback.format_exc())
    with open(f"{tmp}/rank{rank}.json", "w") as f:
        json.dump(result, f)


def _cuda_python() -> bool:
    try:
        from cuda.bindings import runtime  # noqa: F401
    except ImportError:
        try:
            from cuda import cudart  # noqa: F401
        except ImportError:
            return False
    return True


@pytest.mark.parametrize("gpus", [1, 2])
def test_two_ranks(gpus, tmp_path, monkeypatch):
    if not _cuda_python():
        pytest.skip("needs cuda-python")
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs")
    import torch.multiprocessing as mp
    for k, v in NO_MULTICAST.items():
        monkeypatch.setenv(k, v)
    devices = [0, 1] if gpus == 2 else [0, 0]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, devices, str(tmp_path))) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=150)
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
    assert not hung, "a rank hung"
    for r in range(WORLD):
        with open(tmp_path / f"rank{r}.json") as f:
            fails = json.load(f)["fails"]
        assert not fails, f"rank {r}: " + "\n".join(fails[:20])
