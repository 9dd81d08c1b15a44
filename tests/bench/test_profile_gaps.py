"""tools/profile_gaps.py: the device's idle gaps, and the host phase each falls under."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

from phalanx import LLM, SamplingParams

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
import profile_gaps  # noqa: E402


def _gpu(name: str, ts: float, dur: float, cat: str = "kernel") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_idle_gaps_are_the_holes_in_the_union_of_the_devices_work():
    events = [
        _gpu("spin_kernel", 900.0, 1.0),                     # the profiler's first launch
        _gpu("spin_kernel", 999.0, 1.0),                     # the marker: its end is host time 50.0 s
        _gpu("a", 1100.0, 50.0),
        _gpu("b", 1120.0, 10.0),                       # inside a: no gap after it
        _gpu("copy", 1160.0, 5.0, cat="gpu_memcpy"),   # 10 us after a ended
        _gpu("c", 1400.0, 20.0),                       # 235 us after the copy
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1150.0, "dur": 300.0},   # host ops do not count
    ]
    # host marks (seconds): "update" ends at 50.000120 s, "respond" at 50.000300, "fetch" at 50.000500
    marks = [(1, "wait", 50.0), (1, "update", 50.000120), (1, "respond", 50.000300), (2, "fetch", 50.000500)]
    r = profile_gaps.analyse(events, marks, align_monotonic=50.0)
    assert r["span_us"] == 320.0 and r["idle_us"] == 245.0 and r["busy_us"] == 75.0
    # on the profile's clock update spans 1000..1120 us, respond 1120..1300, fetch 1300..1500: the
    # 10 us gap (1150..1160) and the first 135 us of the 235 us one (1165..1400) fall in respond
    assert r["idle_by_phase_us"] == pytest.approx({"respond": 10.0 + 135.0, "fetch": 100.0})
    sizes = {b["below_us"]: (b["count"], b["idle_us"]) for b in r["idle_by_size"]}
    assert sizes[10.0] == (0, 0.0) and sizes[100.0] == (1, 10.0) and sizes[1000.0] == (1, 235.0)
    big = r["largest"][0]
    assert big["idle_us"] == 235.0 and big["before"] == "copy" and big["after"] == "c"
    assert big["phases"] == pytest.approx({"respond": 135.0, "fetch": 100.0})


def test_idle_outside_every_traced_phase_is_reported_as_untraced():
    events = [_gpu("spin_kernel", -1.0, 1.0), _gpu("a", 10.0, 5.0), _gpu("b", 40.0, 5.0)]
    r = profile_gaps.analyse(events, [(1, "fetch", 0.0), (1, "schedule", 0.000020)], align_monotonic=0.0)
    assert r["idle_by_phase_us"] == pytest.approx({"schedule": 5.0, "untraced": 20.0})


def test_a_profile_without_its_marker_or_device_work_is_refused():
    with pytest.raises(ValueError, match="0 device events after its markers"):
        profile_gaps.analyse([_gpu("spin_kernel", 0.0, 1.0)], [], 0.0)
    with pytest.raises(ValueError, match="does not begin with the alignment marker"):
        profile_gaps.analyse([_gpu("a", 0.0, 1.0), _gpu("spin_kernel", 5.0, 1.0)], [], 0.0)


def test_slow_host_calls_into_cuda_are_counted_by_name():
    events = [{"ph": "X", "cat": "cuda_runtime", "name": "cudaFree", "ts": 0.0, "dur": 5000.0},
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaFree", "ts": 9.0, "dur": 3000.0},
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 9.0, "dur": 20.0},   # quick
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 9000.0}]             # not a CUDA call
    assert profile_gaps.slow_calls(events) == {"cudaFree": {"calls": 2, "ms": 8.0}}


def test_the_profile_start_control_answers_the_host_time_of_its_marker(tiny_models):
    with LLM(tiny_models["llama"], skip_tokenizer_init=True, orchestrator_type="inprocess") as llm:
        before = time.monotonic()
        answer = llm.control("profile:start", args={"gpu_only": True, "align": True}).per_rank[0]
        after = time.monotonic()
        llm.generate([[5] * 8], SamplingParams(max_tokens=2), use_tqdm=False)
        assert llm.control("profile:stop").per_rank[0].startswith("[")
        plain = llm.control("profile:start").per_rank[0]
        llm.control("profile:stop")
    assert before <= json.loads(answer)["monotonic"] <= after
    assert plain == "ok"
