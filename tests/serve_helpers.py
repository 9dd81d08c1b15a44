"""Start and stop a real `phalanx serve` on loopback (used by tests/serve and tests/adp)."""

import os
import signal
import socket
import subprocess
import sys
import time

import httpx

KEY = "test-key-123"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def phalanx_bin() -> str:
    return os.path.join(os.path.dirname(sys.executable), "phalanx")


def start_server(*args: str, key: str | None = KEY, timeout: float = 180.0):
    port = free_port()
    cmd = [phalanx_bin(), "serve", "--port", str(port), "--max_seq_len", "512", "--enable_debug_endpoints", *args]
    if key:
        cmd += ["--api-key", key]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    return proc, wait_healthy(proc, port, timeout, proc.kill)


def wait_healthy(proc: subprocess.Popen, port: int, timeout: float, give_up) -> str:
    """The server's URL once /health answers 200; raises with its output if it exits, and
    calls give_up() first if it is not healthy within ``timeout`` seconds."""
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stdout.read()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    give_up()
    raise RuntimeError("server did not become healthy")


def stop_server(proc: subprocess.Popen, timeout: float = 60.0) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            return proc.wait()
    return proc.returncode


def start_launched_server(*serve_args: str, ranks: int = 2, timeout: float = 240.0, env: dict | None = None):
    """`mpirun -n RANKS phalanx launch -- phalanx serve ARGS` on a free loopback port, healthy;
    returns (process, url). Stop it with stop_launched_server."""
    from phalanx.executor.proxy import find_mpirun
    port = free_port()
    phalanx = [sys.executable, "-m", "phalanx.cli"]
    cmd = [find_mpirun(), "-n", str(ranks), "--oversubscribe", "--bind-to", "none"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    cmd += [*phalanx, "launch", "--", *phalanx, "serve", *serve_args, "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=dict(os.environ, **(env or {})))
    return proc, wait_healthy(proc, port, timeout, lambda: stop_launched_server(proc))


def stop_launched_server(proc: subprocess.Popen) -> None:
    """SIGTERM to the whole job (mpirun and its ranks), SIGKILL after 60 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def job_exposure(root_pid: int) -> tuple[bool, list]:
    """(whether every process of the job below ``root_pid`` runs in a network namespace of its
    own, the (pid, address) of every socket the job listens on in this host's namespace beyond
    loopback)."""
    import psutil
    root = psutil.Process(root_pid)
    job = [root] + root.children(recursive=True)
    own = os.readlink("/proc/self/ns/net")
    isolated = all(os.readlink(f"/proc/{p.pid}/ns/net") != own for p in job if p.pid != os.getpid())
    pids = {p.pid for p in job}
    exposed = [(c.pid, c.laddr) for c in psutil.net_connections("inet")
               if c.status == psutil.CONN_LISTEN and c.pid in pids and c.laddr.ip not in ("127.0.0.1", "::1")]
    return isolated, exposed
