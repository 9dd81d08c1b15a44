"""The rank entry point: ``mpirun -n N python -m phalanx.pyexecutor.worker``.

Every rank: wait for the user's ``Init`` (rank 0 receives it over IPC and broadcasts it), start
torch.distributed, build its engine shard, report (rank 0 sends ``Ready`` or the first failing
rank's traceback), then run the executor loop in lockstep until ``Shutdown``. A rank whose build
fails reports its own traceback at once and, if its peers do not all reach the exchange of
start-up statuses within ``START_FAILURE_WAIT_S`` (one may wait in a start-up collective for it),
aborts the job. Under ``phalanx launch`` an abort also ends the user's command, which runs in
rank 0's process group.

Rank 0's loop reads the user's requests from the IPC socket itself (``Rank0Link``, the loop's
request source): an idle loop waits in the socket's poll, so a request wakes it with no thread
in between. The same fetch watches the user process and shuts the job down if it disappears; a
job that cannot get there (hung in start-up) is aborted ``USER_GONE_GRACE_S`` after it does.

The address and key arrive in the environment (never argv); the key is removed from the
environment as soon as it is read.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from phalanx.executor import ipc
from phalanx.executor.ipc import DIR_ENV, FATAL_MARKER
from phalanx.executor.messages import (
    CancelRequest,
    Control,
    Fatal,
    GenerationRequest,
    Init,
    IterationInput,
    Ready,
    Response,
    Shutdown,
    pack,
    unpack,
)
from phalanx.pyexecutor.host_clock import freeze_startup_objects

logger = logging.getLogger("phalanx")



class IpcSender:
    """Rank 0's response channel; a lock makes it safe for the loop and the main thread."""

    def __init__(self, queue: ipc.IpcQueue) -> None:
        self.queue, self._lock = queue, threading.Lock()

    def send_responses(self, responses: list[Response]) -> None:
        self.send(responses)

    def send(self, obj: Any) -> None:
        with self._lock:
            self.queue.put(obj)


class Rank0Link:
    """Rank 0's two sockets to the user process. Its ``fetch`` makes it the executor loop's
    ``py_executor.RequestSource``: the loop thread alone reads the request socket."""

    ALIVE_CHECK_S = 1.0   # how often fetch asks whether the user process is still there

    def __init__(self, alive: Callable[[], bool]) -> None:
        key = bytes.fromhex(os.environ.pop(ipc.KEY_ENV))
        self.requests = ipc.IpcQueue(os.environ[ipc.REQUEST_ADDR_ENV], key, bind=False)
        self.sender = IpcSender(ipc.IpcQueue(os.environ[ipc.RESPONSE_ADDR_ENV], key, bind=False))
        self.proxy_alive = alive
        self._last_check = time.monotonic()

    def wait_init(self) -> Init | None:
        """Block until the user process sends Init (None if it went away first)."""
        while self.proxy_alive():
            msg = self.requests.get(timeout_ms=500)
            if isinstance(msg, Init):
                return msg
            if isinstance(msg, Shutdown):
                return None
        return None

    def fetch(self, idle: bool, timeout: float = 0.05) -> IterationInput:
        """Every message the user process has sent since the last fetch; waits up to ``timeout``
        for the first only when ``idle``. Nothing is read past a shutdown."""
        out = IterationInput()
        msg = self.requests.get(timeout_ms=round(timeout * 1000) if idle else 0)
        while msg is not None:
            if isinstance(msg, GenerationRequest):
                out.new.append(msg)
            elif isinstance(msg, CancelRequest):
                out.cancel.append(msg.request_id)
            elif isinstance(msg, Control):
                out.control.append(msg)
            elif isinstance(msg, Shutdown):
                out.shutdown = True
                return out
            msg = self.requests.get(timeout_ms=0)
        now = time.monotonic()
        if now - self._last_check > self.ALIVE_CHECK_S:
            self._last_check = now
            if not self.proxy_alive():
                logger.warning("the user process is gone; shutting the job down")
                out.shutdown = True
        return out


def exit_with_launcher() -> None:
    """A rank whose launcher is gone (it was SIGKILLed: its ranks are reparented) exits at once,
    whatever its loop is doing, instead of living on without a job."""
    launcher = os.getppid()

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(0.5)
        try:   # stderr was the launcher's pipe: it may be gone too
            print(f"{FATAL_MARKER} rank={os.environ.get('OMPI_COMM_WORLD_RANK', '?')}: the MPI launcher "
                  f"(pid {launcher}) is gone; exiting", file=sys.stderr, flush=True)
        finally:
            os._exit(1)

    threading.Thread(target=watch, name="phalanx-launcher-watch", daemon=True).start()


USER_GONE_GRACE_S = 10.0   # after the user process is gone, how long rank 0 lets the job end on its own


def abort_without_user(alive: Callable[[], bool], dist: Any) -> None:
    """Rank 0 takes the job down when the user process has been gone for ``USER_GONE_GRACE_S``
    and the job is still here. The loop ends the job itself within a second or two of finding the
    user gone (``Rank0Link.fetch``); this is for a job that cannot get there: one waiting in a
    start-up exchange or a collective for a rank that hangs."""

    def watch() -> None:
        while alive():
            time.sleep(Rank0Link.ALIVE_CHECK_S)
        time.sleep(USER_GONE_GRACE_S)
        with contextlib.suppress(Exception):
            print(f"{FATAL_MARKER} rank=0: the user process is gone and the job did not end; aborting",
                  file=sys.stderr, flush=True)
        dist.abort(1)

    threading.Thread(target=watch, name="phalanx-user-watch", daemon=True).start()


def run_worker(link: Rank0Link | None = None, rendezvous_dir: str | None = None) -> int:
    """The body every rank runs. Rank 0 passes its ``link``; returns the exit code."""
    from phalanx.pyexecutor.dist import Dist
    exit_with_launcher()
    dist = Dist()
    rank0 = dist.rank == 0
    if rank0 and link is None:
        link = Rank0Link(_pid_alive(int(os.environ.get(ipc.PROXY_PID_ENV, "0"))))
    if link is not None:
        abort_without_user(link.proxy_alive, dist)
    init = link.wait_init() if link is not None else None
    data = dist.bcast_bytes(pack(init) if rank0 and init is not None else None, idle=True)
    if not data:
        return 0  # the user went away before starting an engine
    init = unpack(data)
    rendezvous_dir = rendezvous_dir or os.environ.get(DIR_ENV)
    # start-up's statuses cross on a communicator of their own: a rank that failed must not meet
    # a peer still waiting in one of start-up's own exchanges, or each takes the other's data
    status_dist = dist.dup()
    engine, info, status, exchanged = None, {}, "ok", threading.Event()
    try:
        engine, info = _build(init, dist, link if rank0 else None, rendezvous_dir)
    except BaseException as e:
        status = traceback.format_exc()
        if type(e) is ValueError and "\n" not in str(e):   # a setting refused by name: the message is the report
            logger.debug("rank %d: %s", dist.rank, status)
            status = f"ValueError: {e}"
        _report_start_failure(dist, status, link, exchanged)
    statuses = [s.decode() for s in status_dist.allgather_bytes(status.encode())]
    exchanged.set()
    failed = [(r, s) for r, s in enumerate(statuses) if s != "ok"]
    if failed or engine is None:
        if link is not None and status == "ok":   # (a rank 0 that failed has reported already)
            r, tb = failed[0] if failed else (dist.rank, "no engine was built")
            link.sender.send(Fatal(r, start_failure(r, tb)))
        return 1
    # this process only serves from here: what start-up made (the model, kernels, tables) stays
    # out of every later collection, whose full passes would otherwise walk it and stall a step
    # (before Ready: the first request does not wait for the collection that precedes the freeze)
    frozen = freeze_startup_objects()
    engine.gc_pauses.defer_full = True   # and full collections wait for the loop to idle
    logger.debug("rank %d: %d start-up objects frozen out of garbage collection", dist.rank, frozen)
    processes = [p.decode() for p in dist.allgather_bytes(f"{socket.gethostname()} {os.getpid()}".encode())]
    if link is not None:
        info["rank_processes"] = [[host, int(pid)] for host, pid in (p.split() for p in processes)]
        link.sender.send(Ready(info))
    try:
        engine.run()
    except BaseException:
        tb = traceback.format_exc()
        _report_fatal(dist.rank, tb, link.sender if link is not None else None)
        dist.abort(1)
        return 1
    dist.barrier()
    _teardown()
    return 0


def _pid_alive(pid: int) -> Callable[[], bool]:
    def alive() -> bool:
        if pid <= 0:
            return True
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return alive


def _build(init: Init, dist: Any, link: Rank0Link | None, rendezvous_dir: str | None):
    import torch

    from phalanx.config import LlmArgs
    from phalanx.models.source import ModelSource, resolve_model
    from phalanx.pyexecutor.creator import create_py_executor, resolve_device
    from phalanx.pyexecutor.dist import init_torch_distributed
    from phalanx.pyexecutor.py_executor import BroadcastRequestQueue

    args = LlmArgs(**init.llm_args)
    if args.world_size != dist.size:
        raise ValueError(f"tensor_parallel_size {args.tensor_parallel_size} needs {args.world_size} ranks, "
                         f"but the MPI job has {dist.size}")
    local_rank = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", dist.rank))
    device = resolve_device(args, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = init_torch_distributed(dist, device.type, rendezvous_dir) if dist.size > 1 else None
    tp, ep = parallel_groups(args, dist.rank, dist.size, group)
    if device.type == "cuda" and tp.size > 1 and args.allreduce_strategy == "AUTO":
        from phalanx.distributed.custom_allreduce import build_for_group
        tp.custom = build_for_group(tp.rank, tp.size, device, group, len(set(dist.hostnames())) == 1)
    source = (ModelSource.from_wire(init.model_source) if init.model_source is not None
              else resolve_model(args.model, args.trust_remote_code))
    queue = BroadcastRequestQueue(dist, link)   # rank 0 reads the user's socket; the others receive
    engine, info = create_py_executor(args, source, link.sender if link else None, queue, tp, dist, device, ep)
    return engine, vars(info)


def parallel_groups(args: Any, rank: int, size: int, group: Any):
    """(attention/dense TP group, expert-parallel group) of this rank.

    Attention DP: attention and dense layers replicated, experts split over all ranks.
    Otherwise: tensor parallel over all ranks; experts split over them (ep = world, the
    default) or each expert split along its intermediate dim (ep = 1)."""
    from phalanx.models.moe import EPGroup
    from phalanx.models.parallel import TPGroup
    ep_size = args.moe_expert_parallel_size or size
    if ep_size not in (1, size):
        raise ValueError(f"moe_expert_parallel_size must be 1 or the number of ranks ({size}), got {ep_size}")
    if args.enable_attention_dp:
        if ep_size != size:
            raise ValueError("with enable_attention_dp, experts are split over all ranks: "
                             f"moe_expert_parallel_size must be {size}")
        return TPGroup(), EPGroup(rank, size, group, attention_dp=True)
    ep = EPGroup(rank, size, group) if ep_size == size and size > 1 else EPGroup()
    return TPGroup(rank, size, group), ep


START_FAILURE_WAIT_S = 5.0   # how long a rank that failed to start waits for the others' statuses


def _report_start_failure(dist: Any, tb: str, link: Rank0Link | None, exchanged: threading.Event) -> None:
    """A rank whose start-up failed says so at once: its traceback on stderr (the user process
    reads it), and through ``link`` on rank 0. It then joins the exchange of start-up statuses,
    but a peer may be waiting in one of start-up's collectives for it and never get there: if the
    exchange has not completed within ``START_FAILURE_WAIT_S``, the rank aborts the job."""
    _print_failure(dist.rank, tb)
    if link is not None:
        with contextlib.suppress(Exception):
            link.sender.send(Fatal(dist.rank, start_failure(dist.rank, tb)))

    def watch() -> None:
        if not exchanged.wait(START_FAILURE_WAIT_S):
            dist.abort(1)
    threading.Thread(target=watch, name="phalanx-start-failure-watch", daemon=True).start()


def _last_line(tb: str) -> str:
    return tb.strip().splitlines()[-1] if tb.strip() else "unknown error"


def start_failure(rank: int, tb: str) -> str:
    """The user's error for a rank that failed to start (the proxy writes the same from stderr)."""
    return f"rank {rank} failed to start: {_last_line(tb)}{_trace(tb)}"


def _trace(tb: str) -> str:
    """A traceback after its last line, or nothing for a one-line report (a refused setting)."""
    return "" if "\n" not in tb.strip() else "\n" + tb


def _print_failure(rank: int, tb: str) -> None:
    """The marker line the user process looks for on the job's stderr, then the traceback."""
    print(f"{FATAL_MARKER} rank={rank}: {_last_line(tb)}{_trace(tb)}", file=sys.stderr, flush=True)


def _report_fatal(rank: int, tb: str, sender: IpcSender | None) -> None:
    _print_failure(rank, tb)
    if sender is not None:
        with contextlib.suppress(Exception):
            sender.send(Fatal(rank, f"rank {rank} failed: {_last_line(tb)}"))


def _teardown() -> None:
    try:
        import torch.distributed as td
        if td.is_initialized():
            td.destroy_process_group()
    except Exception:
        pass


def main() -> int:
    logging.basicConfig(level=os.environ.get("PHALANX_LOG_LEVEL", "WARNING").upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s [rank %(rank)s] %(name)s: %(message)s")
    rank = os.environ.get("OMPI_COMM_WORLD_RANK", "?")
    old_factory = logging.getLogRecordFactory()

    def factory(*a: Any, **kw: Any) -> logging.LogRecord:
        record = old_factory(*a, **kw)
        record.rank = rank
        return record

    logging.setLogRecordFactory(factory)
    return run_worker()


if __name__ == "__main__":
    sys.exit(main())
