"""What ranks exchange outside the model: byte broadcasts and gathers over MPI (no pickle),
the per-iteration decision digest, and torch.distributed start-up (gloo on CPU, NCCL on GPU).

Idle ranks wait in a non-blocking broadcast polled with short sleeps, so an idle job does not
spin every core (Open MPI's blocking collectives busy-wait).
"""

from __future__ import annotations

import os
import socket
import time
from array import array
from typing import Any


class RankDivergenceError(RuntimeError):
    """Ranks made different scheduling decisions: serving would be silently wrong."""


class Dist:
    """mpi4py helpers over ``comm`` (COMM_WORLD by default)."""

    def __init__(self, comm: Any = None) -> None:
        from mpi4py import MPI
        self.MPI = MPI
        self.comm = comm or MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()

    def dup(self) -> Dist:
        """The same ranks over a communicator of their own (collective): its exchanges never
        match, nor wait behind, those on this one."""
        return Dist(self.comm.Dup())

    def _wait(self, req: Any) -> None:
        while not req.Test():
            time.sleep(0.0005)

    def bcast_bytes(self, data: bytes | None, idle: bool = False) -> bytes:
        """Rank 0's ``data`` on every rank. ``idle`` ranks poll instead of spinning."""
        n = array("q", [len(data) if self.rank == 0 and data is not None else 0])
        if idle:
            self._wait(self.comm.Ibcast([n, self.MPI.INT64_T], root=0))
        else:
            self.comm.Bcast([n, self.MPI.INT64_T], root=0)
        if n[0] == 0:
            return b""
        buf = bytearray(data or b"") if self.rank == 0 else bytearray(n[0])
        self.comm.Bcast([buf, self.MPI.BYTE], root=0)
        return bytes(buf)

    def allgather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data``, in rank order, on every rank."""
        lengths = array("q", [0] * self.size)
        self.comm.Allgather([array("q", [len(data)]), self.MPI.INT64_T], [lengths, self.MPI.INT64_T])
        offsets = [sum(lengths[:i]) for i in range(self.size)]
        out = bytearray(sum(lengths))
        self.comm.Allgatherv([bytearray(data), self.MPI.BYTE], [out, list(lengths), offsets, self.MPI.BYTE])
        return [bytes(out[o:o + n]) for o, n in zip(offsets, lengths, strict=True)]

    def check_digest(self, digest: bytes, iteration: int) -> None:
        """Raise RankDivergenceError naming the ranks whose decision differs from rank 0's."""
        digests = self.allgather_bytes(digest)
        bad = [r for r, d in enumerate(digests) if d != digests[0]]
        if bad:
            raise RankDivergenceError(
                f"scheduler divergence at iteration {iteration}: rank(s) {bad} disagree with rank 0 "
                f"({', '.join(f'rank {r}: {d.hex()[:12]}' for r, d in enumerate(digests))})")

    def barrier(self) -> None:
        self._wait(self.comm.Ibarrier())

    def abort(self, code: int = 1) -> None:
        self.comm.Abort(code)

    def hostnames(self) -> list[str]:
        return [h.decode() for h in self.allgather_bytes(socket.gethostname().encode())]


def init_torch_distributed(dist: Dist, device_type: str, rendezvous_dir: str | None) -> Any:
    """Start torch.distributed over all ranks; returns the (world) process group.

    One host: a FileStore in the job's private directory and loopback interfaces, so nothing
    listens beyond this machine. Several hosts: a TCP store on rank 0's address.
    """
    import torch.distributed as td
    if td.is_initialized():
        return td.group.WORLD
    backend = "nccl" if device_type == "cuda" else "gloo"
    hosts = dist.hostnames()
    if len(set(hosts)) == 1 and rendezvous_dir:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", _loopback_name())
        os.environ.setdefault("NCCL_SOCKET_IFNAME", _loopback_name())
        init = f"file://{rendezvous_dir}/torch-store"
    else:
        addr = dist.bcast_bytes(_rank0_address().encode() if dist.rank == 0 else None).decode()
        init = f"tcp://{addr}"
    td.init_process_group(backend, init_method=init, rank=dist.rank, world_size=dist.size)
    return td.group.WORLD


def _loopback_name() -> str:
    try:
        for _, name in socket.if_nameindex():
            if name.startswith("lo"):
                return name
    except OSError:
        pass
    return "lo"


def _rank0_address() -> str:
    host = socket.gethostbyname(socket.gethostname())
    with socket.socket() as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    return f"{host}:{port}"
