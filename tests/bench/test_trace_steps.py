"""tools/trace_steps.py: what each kernel of a graph replay adds to its span."""

from __future__ import annotations

import gzip
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
import trace_steps  # noqa: E402


def _kernel(name: str, ts: float, dur: float, corr: int) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}


def test_overlapping_kernels_add_only_what_extends_the_replay(tmp_path):
    events = [
        _kernel("norm", 0.0, 2.0, 7),
        _kernel("gemm", 1.0, 10.0, 7),      # starts under the norm (PDL): adds 11 - 2 = 9, not its 10
        _kernel("norm", 14.0, 2.0, 7),      # 3 us after the gemm ended: idle 3, adds 5
        _kernel("lonely", 30.0, 1.0, 8),    # another launch, below --min-kernels
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 50.0},
    ]
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    groups = trace_steps.replays(trace_steps.load(str(path)), min_kernels=2)
    assert len(groups) == 1 and len(groups[0]) == 3
    b = trace_steps.breakdown(groups[0])
    assert b["span_us"] == 16.0 and b["idle_us"] == 3.0
    rows = {r["kernel"]: r for r in b["by_kernel"]}
    assert rows["gemm"]["added_us"] == 9.0 and rows["gemm"]["calls"] == 1
    assert rows["norm"]["added_us"] == 2.0 + 5.0 and rows["norm"]["idle_us"] == 3.0
    assert sum(r["added_us"] for r in b["by_kernel"]) == b["span_us"]
