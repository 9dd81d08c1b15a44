"""The custom all-reduce kernels against their torch references, ranks simulated in one process.

Each rank's buffer is a tensor of this process (host memory in the Triton interpreter, which follows
the kernels' int64-to-pointer bitcasts there too; device memory on a GPU). The ranks do not run at
once here, so one rank's kernel runs with what its peers would have done already in place: their
staging areas filled, their flags for this rank set to the epoch (two-shot: the slices they own in
this rank's gather area too). Then the barriers pass, and the test checks the output bit for bit,
and what the kernel left for its peers (its staging area, its slice in their gather areas, their
flags) and for its next call (the counter).
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

pytest.importorskip("triton")

from phalanx.distributed import custom_allreduce as car  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CHUNK = 64                      # bytes a program moves per step: 16 fp32 / 32 bf16 elements
MAX_PROGRAMS = 3                # so that programs loop over several chunks
TOL = {torch.float32: 2e-4, torch.bfloat16: 3e-2}      # normed output (rstd summation order)


def assert_same_sum(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Bit for bit. The interpreter casts float32 to bfloat16 by truncation where a GPU rounds to
    nearest even, so there bfloat16 may be one unit in the last place off."""
    if out.dtype == torch.float32 or out.is_cuda:
        assert torch.equal(out, ref)
    else:
        torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -7, atol=0)


class SimRanks:
    """``world`` rank buffers in host memory and what a rank's kernel is launched with."""

    def __init__(self, world: int, max_bytes: int = 4096):
        self.layout = car.Layout(world, MAX_PROGRAMS, max_bytes)
        self.bufs = [torch.zeros(self.layout.total_bytes, dtype=torch.uint8, device=DEV) for _ in range(world)]
        self.ptrs = torch.tensor([b.data_ptr() for b in self.bufs], dtype=torch.int64, device=DEV)

    def area(self, rank: int, offset: int, dtype: torch.dtype, n: int) -> torch.Tensor:
        size = torch.empty((), dtype=dtype).element_size()
        return self.bufs[rank][offset:offset + n * size].view(dtype)

    def flags(self, rank: int) -> torch.Tensor:
        return self.bufs[rank][:self.layout.flag_bytes].view(torch.int64)

    def peers(self, rank: int, epoch: int) -> car.Peers:
        return car.Peers(self.ptrs, torch.tensor([epoch - 1, 0], device=DEV), rank, self.layout)

    def others(self, rank: int) -> list[int]:
        return [p for p in range(self.layout.world) if p != rank]

    def peers_arrived(self, rank: int, epoch: int, barriers: int = 1) -> None:
        """Every peer has passed ``barriers`` barriers of ``epoch`` towards ``rank``, in every program."""
        for b in range(barriers):
            for j in range(MAX_PROGRAMS):
                for p in self.others(rank):
                    self.flags(rank)[self.layout.flag(b, j, p) // 8] = epoch

    def assert_signalled(self, rank: int, epoch: int, programs: int, barriers: int = 1) -> None:
        for p in self.others(rank):
            for b in range(barriers):
                got = [int(self.flags(p)[self.layout.flag(b, j, rank) // 8]) for j in range(MAX_PROGRAMS)]
                assert got == [epoch] * programs + [0] * (MAX_PROGRAMS - programs), (p, b)


def inputs(world: int, n: int, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g).to(DEV, dtype) for _ in range(world)]


def programs(units: int) -> int:
    return min(units, MAX_PROGRAMS)


RANKS = [(2, 0), (2, 1), (3, 1), (3, 2)]
CASES = [(torch.float32, 1), (torch.bfloat16, 2), (torch.bfloat16, 5)]      # (dtype, epoch): both slots


@pytest.mark.parametrize("world,rank", RANKS)
@pytest.mark.parametrize("dtype,epoch", CASES)
@pytest.mark.parametrize("n", [1, 37, 130])
def test_one_shot(world, rank, dtype, epoch, n):
    sim = SimRanks(world)
    xs = inputs(world, n, dtype)
    for p in sim.others(rank):
        sim.area(p, sim.layout.staging(epoch), dtype, n).copy_(xs[p])
    sim.peers_arrived(rank, epoch)
    peers = sim.peers(rank, epoch)
    out = car.one_shot(xs[rank], peers, CHUNK)
    assert_same_sum(out, car.all_reduce_ref(xs))             # the fixed order: bit for bit
    assert torch.equal(sim.area(rank, sim.layout.staging(epoch), dtype, n), xs[rank])
    assert not sim.area(rank, sim.layout.staging(epoch + 1), dtype, n).any()      # the other slot
    sim.assert_signalled(rank, epoch, programs(-(-n * xs[0].element_size() // CHUNK)))
    assert peers.counter.tolist() == [epoch, 0]


@pytest.mark.parametrize("world,rank", RANKS)
@pytest.mark.parametrize("dtype,epoch", CASES)
@pytest.mark.parametrize("n", [1, 37, 300])
def test_two_shot(world, rank, dtype, epoch, n):
    sim = SimRanks(world)
    xs = inputs(world, n, dtype)
    ref = car.all_reduce_ref(xs)
    per = car.two_shot_slice(n, world)
    piece = lambda t, q: t[q * per:(q + 1) * per]  # noqa: E731
    for p in sim.others(rank):
        sim.area(p, sim.layout.staging(epoch), dtype, n).copy_(xs[p])
        piece(sim.area(rank, sim.layout.gather(epoch), dtype, n), p).copy_(piece(ref, p))
    sim.peers_arrived(rank, epoch, barriers=2)
    peers = sim.peers(rank, epoch)
    out = car.two_shot(xs[rank], peers, CHUNK)
    assert_same_sum(out, ref)
    for p in sim.others(rank):                               # this rank's slice, scattered
        assert torch.equal(piece(sim.area(p, sim.layout.gather(epoch), dtype, n), rank), piece(out, rank))
    sim.assert_signalled(rank, epoch, programs(-(-per * xs[0].element_size() // CHUNK)), barriers=2)
    assert peers.counter.tolist() == [epoch, 0]


@pytest.mark.parametrize("world,rank", RANKS)
@pytest.mark.parametrize("dtype,epoch", CASES[:2])
@pytest.mark.parametrize("T,H", [(1, 64), (5, 48)])
def test_one_shot_add_rms_norm(world, rank, dtype, epoch, T, H):
    sim = SimRanks(world)
    xs = [x.view(T, H) for x in inputs(world, T * H, dtype)]
    g = torch.Generator().manual_seed(1)
    residual = torch.randn(T, H, generator=g).to(DEV, dtype)
    weight = torch.randn(H, generator=g).to(DEV, dtype)
    for p in sim.others(rank):
        sim.area(p, sim.layout.staging(epoch), dtype, T * H).copy_(xs[p].flatten())
    sim.peers_arrived(rank, epoch)
    peers = sim.peers(rank, epoch)
    out, res = car.one_shot_add_rms_norm(xs[rank], residual, weight, 1e-6, peers)
    ref_out, ref_res = car.all_reduce_add_rms_norm_ref(xs, residual, weight, 1e-6)
    if dtype == torch.float32 or res.is_cuda:
        assert torch.equal(res, ref_res)
    torch.testing.assert_close(res.float(), ref_res.float(), atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(out.float(), ref_out.float(), atol=TOL[dtype], rtol=TOL[dtype])
    sim.assert_signalled(rank, epoch, programs(T))
    assert peers.counter.tolist() == [epoch, 0]


@pytest.mark.parametrize("kernel", [car.one_shot, car.two_shot])
def test_in_place(kernel):
    sim = SimRanks(2)
    xs = inputs(2, 100, torch.float32)
    ref = car.all_reduce_ref(xs)
    per = car.two_shot_slice(100, 2)
    sim.area(1, sim.layout.staging(1), torch.float32, 100).copy_(xs[1])
    sim.area(0, sim.layout.gather(1), torch.float32, 100)[per:].copy_(ref[per:])
    sim.peers_arrived(0, 1, barriers=2)
    x = xs[0].clone()
    assert kernel(x, sim.peers(0, 1), CHUNK, out=x) is x
    assert torch.equal(x, ref)


def test_layout_areas_do_not_overlap():
    L = car.Layout(world=8, max_programs=64, max_bytes=1000)
    assert L.flag(1, 63, 7) + 8 <= L.flag_bytes <= L.staging(0)
    assert L.staging(0) + L.slot_bytes <= L.gather(0) < L.staging(1) < L.gather(1)
    assert L.gather(1) + L.slot_bytes == L.total_bytes
    assert all(off % 256 == 0 for off in (L.staging(0), L.gather(0), L.staging(1), L.gather(1)))


def test_config_cut_overs():
    assert car.AllReduceConfig().one_shot_limit(2) == 8 << 20
    assert car.AllReduceConfig().one_shot_limit(4) == 512 << 10
    assert car.AllReduceConfig().one_shot_limit(8) == 256 << 10
    assert car.AllReduceConfig(max_bytes=1 << 16).one_shot_limit(4) == 1 << 16
    assert car.AllReduceConfig(one_shot_max_bytes=1 << 10).one_shot_limit(2) == 1 << 10
    with pytest.raises(ValueError):
        car.AllReduceConfig(chunk_bytes=3000)


def no_exchange(payload: bytes) -> list[bytes]:
    raise AssertionError("a disabled all-reduce must not exchange handles")


@pytest.mark.parametrize("how", ["config", "env", "one rank"])
def test_switched_off(how, monkeypatch):
    if how == "env":
        monkeypatch.setenv(car.ENV_SWITCH, "0")
    config = car.AllReduceConfig(enabled=how != "config")
    c = car.CustomAllReduce(0, 1 if how == "one rank" else 2, "cpu", no_exchange, config)
    assert not c.enabled and not c.supports(torch.zeros(8))
    c.close()


def _gloo_worker(rank: int, init: str, results: str) -> None:
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    try:
        got = car.exchange_over()(bytes([rank]) * (rank + 3))
        x = torch.full((4,), float(rank + 1))
        y = car.all_reduce(x, None, None)                    # no custom all-reduce: the group's
        with open(os.path.join(results, f"{rank}.txt"), "w") as f:
            f.write(f"{[list(b) for b in got]} {y.tolist()}")
    finally:
        dist.destroy_process_group()


def test_exchange_and_fallback_over_gloo():
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(_gloo_worker, args=(os.path.join(d, "init"), d), nprocs=2, start_method="spawn")
        for r in range(2):
            with open(os.path.join(d, f"{r}.txt")) as f:
                assert f.read() == "[[0, 0, 0], [1, 1, 1, 1]] [3.0, 3.0, 3.0, 3.0]"
