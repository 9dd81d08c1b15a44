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
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stdout.read()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
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
