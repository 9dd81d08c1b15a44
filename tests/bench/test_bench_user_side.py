"""tools/bench_user_side.py: the user process against a scripted rank 0 over the real sockets."""

from __future__ import annotations

import json
import os
import subprocess
import sys

TOOL = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "bench_user_side.py")


def test_every_request_streams_its_tokens_and_each_refill_is_timed(tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, TOOL, "--num-requests", "24", "--concurrency", "8", "--isl", "16",
                           "--osl", "5", "--step-ms", "4", "--output", str(out)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (entry,) = json.loads(out.read_text())
    r = entry["report"]
    assert r["num_requests"] == 24 and r["output_tokens"] == 24 * 5   # every token reached its stream
    assert r["steps"] >= 3 * 5                      # three waves of 8, five steps each, at best
    assert r["steps_s"] == 3 * 5 * 0.004 and r["wall_s"] >= 0.8 * r["steps_s"]   # (a wave's first step is at once)
    lag = r["refill_lag_ms"]
    assert 0 <= lag["min"] <= lag["p50"] <= lag["max"] and lag["max"] < 30_000
    assert r["cpu_us_per_token"] > 0 and "refill lag" in proc.stdout


def test_the_serve_mode_streams_every_completion_over_http(tmp_path):
    """--serve: phalanx serve's server in front, an HTTP client process; the client exits
    non-zero unless every stream ends with all its tokens and [DONE]."""
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, TOOL, "--serve", "--num-requests", "12", "--concurrency", "4", "--isl", "16",
                           "--osl", "6", "--step-ms", "4", "--output", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (entry,) = json.loads(out.read_text())
    r = entry["report"]
    assert r["num_requests"] == 12 and r["output_tokens"] == 12 * 6
    assert r["steps"] >= 3 * 6                      # three waves of 4, six steps each, at best
    assert 0 <= r["refill_lag_ms"]["p50"] <= r["refill_lag_ms"]["max"] < 30_000
