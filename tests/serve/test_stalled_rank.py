"""A rank that stops (SIGSTOP) is noticed: pending requests fail with a 503 naming it,
/health turns 503, and /metrics keeps answering at once."""

import threading
import time

import httpx
import psutil

from serve_helpers import KEY, start_server, stop_server

MODEL = "SmolLM2-135M-Instruct"
H = {"Authorization": f"Bearer {KEY}"}


def test_a_stopped_rank_fails_pending_requests_with_503_naming_it():
    proc, url = start_server("--engine_iteration_timeout", "3")
    try:
        rank = next(p for p in psutil.Process(proc.pid).children(recursive=True)
                    if "phalanx.pyexecutor.worker" in " ".join(p.cmdline()) and "python" in p.cmdline()[0])
        answers = {}

        def pending():
            body = {"model": MODEL, "prompt": "Once", "max_tokens": 400, "ignore_eos": True}
            answers["r"] = httpx.post(url + "/v1/completions", json=body, headers=H, timeout=60)
        t = threading.Thread(target=pending)
        t.start()
        time.sleep(1.0)
        rank.suspend()
        t0 = time.time()
        t.join(30)
        r = answers["r"]
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert "stalled" in err["message"] and f"rank 0 (pid {rank.pid}) is stopped" in err["message"]
        assert time.time() - t0 < 20       # the watchdog's 3 s and a loaded machine's slack
        health = httpx.get(url + "/health")
        assert health.status_code == 503 and "rank 0" in health.json()["error"]["message"]
        t1 = time.time()
        assert httpx.get(url + "/metrics", timeout=10).status_code == 200 and time.time() - t1 < 5
        new = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x"}, headers=H, timeout=10)
        assert new.status_code == 503
    finally:
        assert stop_server(proc) == 0
