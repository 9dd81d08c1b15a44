"""`mpirun -n 2 phalanx launch -- phalanx serve --tp_size 2` answers; the snippets `phalanx
serve` prints work as printed."""

import os
import shlex
import signal
import subprocess
import sys
import time

import httpx
import pytest

from serve_helpers import free_port, start_server, stop_server
from phalanx.executor.proxy import find_mpirun
from phalanx.serve.cli import instructions

MODEL = "SmolLM2-135M-Instruct"


def test_printed_curl_and_openai_snippet_work_as_printed():
    proc, url = start_server(key=None)
    try:
        port = int(url.rsplit(":", 1)[1])
        text = instructions("127.0.0.1", port, MODEL, None)
        lines = [l.strip() for l in text.splitlines()]
        curl = " ".join(l.rstrip("\\").strip() for l in lines if l.startswith("curl") or l.startswith("-d"))
        out = subprocess.run(curl, shell=True, capture_output=True, text=True, timeout=120)
        assert '"choices"' in out.stdout and '"content"' in out.stdout, out.stdout + out.stderr
        snippet = next(l for l in lines if l.startswith("python -c"))
        args = shlex.split(snippet)
        args[0] = sys.executable
        res = subprocess.run(args, capture_output=True, text=True, timeout=120)
        assert res.returncode == 0 and res.stdout.strip(), res.stderr
    finally:
        assert stop_server(proc) == 0


@pytest.mark.mpi
def test_serve_under_launch_with_tp2():
    port = free_port()
    cmd = [find_mpirun(), "-n", "2", "--oversubscribe", "--bind-to", "none"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    cmd += [os.path.join(os.path.dirname(sys.executable), "phalanx"), "launch", "--",
            os.path.join(os.path.dirname(sys.executable), "phalanx"), "serve", "--tp_size", "2", "--port", str(port),
            "--max_seq_len", "512"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=dict(os.environ, OMPI_MCA_btl="^tcp"))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 240
        while time.time() < deadline:
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 16, "temperature": 0})
        assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["message"]["content"]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
