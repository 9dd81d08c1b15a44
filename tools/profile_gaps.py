"""When the GPU idles during an offline throughput point, and what rank 0's loop is doing then.

Runs one point of ``phalanx bench throughput`` (after an unprofiled one that warms the engine)
with rank 0 under the torch profiler, GPU activity only (no host op is recorded, so the loop runs
at its own pace), and its HostClock trace on (every phase mark, stamped). A kernel run on the
idle device, whose end the host saw at a known time (``ModelRunner.align_marker``), puts the
marks on the profile's clock. Then:

- the device's idle time: the gaps in the union of its kernels, copies and sets over the point;
- that idle time split by the host phase under way (``receive``, ``schedule``, ``pack``, ``stage``,
  ``prepare``, ``forward``, ``launch``, ``wait``, ``update``, ``sample``, ``respond``: the phase a
  mark ends; HostClock);
- the idle gaps by size, and the largest ones with the kernels on either side;
- with ``--host-ops`` (the host's ops recorded too, which slows it), its calls into CUDA of a
  millisecond or more: a call that waits for the device shows there.

The step times of ``--step-times`` count the GPU busy from the step's first event, which the
host records before it packs the step's inputs; the kernel gaps here also show the device waiting
inside a step (an eager prompt step whose kernels the host launches slower than they run).

    python tools/profile_gaps.py --model shape:llama-3.1-8b --config tools/gpu_engine_512_fp8.yaml \\
        --isl 128 --osl 128 --concurrency 512 --num-requests 1024 --trace gaps.json.gz
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import time
from bisect import bisect_left
from collections import defaultdict
from typing import Any

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
SIZES_US = (10.0, 100.0, 1000.0, 10000.0)     # idle gaps binned below these (and above the last)


def gpu_events(events: list[dict[str, Any]]) -> list[tuple[float, float, str]]:
    """(start µs, end µs, name) of every kernel, copy and set, by start."""
    out = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), str(e.get("name", "")))
           for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATS]
    return sorted(out)


def idle_gaps(gpu: list[tuple[float, float, str]]) -> list[tuple[float, float, str, str]]:
    """The gaps in the union of the device's busy intervals: (start, end, name of the work that
    ended last before, name of the work after)."""
    gaps: list[tuple[float, float, str, str]] = []
    if not gpu:
        return gaps
    end, last = gpu[0][1], gpu[0][2]
    for s, e, name in gpu[1:]:
        if s > end:
            gaps.append((end, s, last, name))
        if e >= end:
            end, last = e, name
    return gaps


def phase_spans(marks: list[tuple[int, str, float]], align_monotonic: float,
                align_ts: float) -> list[tuple[float, float, str]]:
    """HostClock marks -> (start µs, end µs, phase) on the profile's clock. A mark ends the phase
    it names, which began at the mark before it."""
    spans = []
    for (_, _, t0), (_, phase, t1) in zip(marks, marks[1:], strict=False):
        spans.append(((t0 - align_monotonic) * 1e6 + align_ts, (t1 - align_monotonic) * 1e6 + align_ts, phase))
    return spans


def idle_by_phase(gaps: list[tuple[float, float, str, str]],
                  spans: list[tuple[float, float, str]]) -> dict[str, float]:
    """µs of device idle time under each host phase; "untraced" where no span covers it."""
    out: dict[str, float] = defaultdict(float)
    starts = [s for s, _, _ in spans]
    for g0, g1, _, _ in gaps:
        covered = 0.0
        i = max(0, bisect_left(starts, g0) - 1)
        while i < len(spans) and spans[i][0] < g1:
            s, e, phase = spans[i]
            overlap = min(e, g1) - max(s, g0)
            if overlap > 0:
                out[phase] += overlap
                covered += overlap
            i += 1
        if g1 - g0 - covered > 1e-9:
            out["untraced"] += g1 - g0 - covered
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def by_size(gaps: list[tuple[float, float, str, str]]) -> list[dict[str, Any]]:
    """Idle gaps binned by length: count and µs in each bin."""
    bins = [{"below_us": b, "count": 0, "idle_us": 0.0} for b in SIZES_US] + [
        {"below_us": None, "count": 0, "idle_us": 0.0}]
    for g0, g1, _, _ in gaps:
        d = g1 - g0
        k = next((i for i, b in enumerate(SIZES_US) if d < b), len(SIZES_US))
        bins[k]["count"] += 1
        bins[k]["idle_us"] += d
    return bins


WARMUP = 2                  # requests run_phalanx sends first (and leaves out of its point)
MARKER = "spin_kernel"      # the kernels ModelRunner.align_marker runs (torch.cuda._sleep)
SLOW_CALL_US = 1000.0      # host calls into CUDA reported when at least this long


def slow_calls(events: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """The host's calls into the CUDA runtime or driver of at least SLOW_CALL_US (a profile with
    host activity): per name, how many and their total ms — a synchronizing call shows here."""
    out: dict[str, dict[str, float]] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver") and e.get("dur", 0) >= SLOW_CALL_US:
            row = out.setdefault(str(e.get("name")), {"calls": 0, "ms": 0.0})
            row["calls"] += 1
            row["ms"] += float(e["dur"]) / 1e3
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["ms"]))


def analyse(events: list[dict[str, Any]], marks: list[tuple[int, str, float]], align_monotonic: float,
            top: int = 12) -> dict[str, Any]:
    """The report: span, busy and idle µs of the device, idle by host phase and by size, the
    largest gaps. The leading ``spin_kernel`` events are the alignment markers (left out of the
    rest): the last one's end is the host's ``align_monotonic``."""
    gpu = gpu_events(events)
    lead = 0
    while lead < len(gpu) and MARKER in gpu[lead][2]:
        lead += 1
    if lead == 0:
        raise ValueError(f"the profile does not begin with the alignment marker ({MARKER})")
    if len(gpu) - lead < 1:
        raise ValueError(f"the profile holds {len(gpu) - lead} device events after its markers: nothing to analyse")
    align_ts, gpu = gpu[lead - 1][1], gpu[lead:]
    gaps = idle_gaps(gpu)
    spans = phase_spans(marks, align_monotonic, align_ts)
    span = max(e for _, e, _ in gpu) - gpu[0][0]
    idle = sum(g1 - g0 for g0, g1, _, _ in gaps)
    largest = sorted(gaps, key=lambda g: g[0] - g[1])[:top]
    return {
        "span_us": span, "busy_us": span - idle, "idle_us": idle, "idle_fraction": idle / span if span else 0.0,
        "idle_by_phase_us": idle_by_phase(gaps, spans),
        "idle_by_size": by_size(gaps),
        "slow_host_calls": slow_calls(events),
        "largest": [{"start_us": round(g0 - gpu[0][0], 1), "idle_us": round(g1 - g0, 1), "before": b[:80],
                     "after": a[:80], "phases": idle_by_phase([(g0, g1, b, a)], spans)}
                    for g0, g1, b, a in largest],
    }


def load_events(path: str) -> list[dict[str, Any]]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def print_report(r: dict[str, Any]) -> None:
    print(f"device span {r['span_us'] / 1e3:.1f} ms, busy {r['busy_us'] / 1e3:.1f} ms, "
          f"idle {r['idle_us'] / 1e3:.1f} ms ({r['idle_fraction']:.1%})")
    print("idle by rank 0's host phase:")
    for phase, us in r["idle_by_phase_us"].items():
        print(f"  {phase:10s} {us / 1e3:9.2f} ms  {us / max(r['idle_us'], 1e-9):6.1%}")
    print("idle gaps by length:")
    lo = 0.0
    for b in r["idle_by_size"]:
        hi = f"< {b['below_us']:g} us" if b["below_us"] is not None else ""
        print(f"  {lo:>7g} us {hi:12s} {b['count']:8d} gaps {b['idle_us'] / 1e3:9.2f} ms")
        lo = b["below_us"] or lo
    if r.get("slow_host_calls"):
        print(f"host calls into CUDA of {SLOW_CALL_US / 1e3:g} ms or more:")
        for name, c in r["slow_host_calls"].items():
            print(f"  {name:32s} {c['calls']:6d} calls {c['ms']:9.1f} ms")
    print("largest gaps:")
    for g in r["largest"]:
        ph = ", ".join(f"{k} {v / 1e3:.2f}" for k, v in g["phases"].items())
        print(f"  at {g['start_us'] / 1e3:9.2f} ms  {g['idle_us'] / 1e3:7.2f} ms  [{ph}]  {g['before'][:40]} -> "
              f"{g['after'][:40]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="shape:llama-3.1-8b")
    ap.add_argument("--config", default=None, help="YAML of extra LLM arguments")
    ap.add_argument("--isl", type=int, default=128)
    ap.add_argument("--osl", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=512)
    ap.add_argument("--num-requests", type=int, default=1024)
    ap.add_argument("--max-batch-size", type=int, default=512)
    ap.add_argument("--trace", default="gaps.json.gz", help="the profile's Chrome trace (.gz: compressed)")
    ap.add_argument("--analyse", default=None, metavar="TRACE",
                    help="only analyse a trace written before (with its marks file beside it)")
    ap.add_argument("--host-ops", action="store_true",
                    help="record the host's ops and CUDA calls too (slower host; shows synchronizing calls)")
    ap.add_argument("--host-profile", action="store_true",
                    help="instead: the profiled point with rank 0's loop under cProfile (functions by own time)")
    ap.add_argument("--output", default=None, help="write the report as JSON here")
    a = ap.parse_args(argv)
    for name in ("isl", "osl", "concurrency", "num_requests", "max_batch_size"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(a, name)}")
    if a.analyse:
        with open(a.analyse + ".marks.json") as f:
            saved = json.load(f)
        report = analyse(load_events(a.analyse), saved["marks"], saved["monotonic"])
    else:
        report = profile_point(a)
    if "host_profile" in report:
        print(report["host_profile"])
    else:
        print_report(report)
    if a.output:
        with open(a.output, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def profile_point(a: argparse.Namespace) -> dict[str, Any]:
    from phalanx import LLM
    from phalanx.bench.shapes import resolve_model_arg
    from phalanx.bench.throughput import _run, make_prompts, run_phalanx
    from phalanx.config import merge_yaml
    model, dummy = resolve_model_arg(a.model)
    kwargs: dict[str, Any] = {"load_format": "dummy" if dummy else "auto", "max_batch_size": a.max_batch_size}
    if a.config:
        kwargs = merge_yaml(kwargs, a.config)
    with LLM(model, skip_tokenizer_init=dummy, **kwargs) as llm:
        warm = run_phalanx(llm, a.isl, a.osl, a.concurrency, a.num_requests, warmup=WARMUP, step_times=True)
        steps = warm["steps"]
        print(f"unprofiled point: {warm['output_throughput']:.1f} out tok/s in {warm['duration_s']:.2f} s; "
              f"GPU idle between steps {steps.get('gap_ms', 0.0):.0f} ms; rank 0's GC {steps.get('gc')}; "
              f"allocator {steps.get('allocator')}", flush=True)
        prompts = make_prompts(a.num_requests + WARMUP, a.isl, llm.vocab_size)[WARMUP:]   # the point's own

        def send() -> float:
            """The point's requests again, from an empty prefix cache: seconds to the last token."""
            t0 = time.perf_counter()
            asyncio.run(_run(llm, prompts, a.osl, a.concurrency))
            return time.perf_counter() - t0

        llm.reset_prefix_cache()
        if a.host_profile:
            llm.control("timing:on")
            llm.control("hostprofile:start")
            elapsed = send()
            stats = llm.control("hostprofile:stop", timeout=120, args={"top": 70, "sort": "tottime"}).per_rank[0]
            steps = json.loads(llm.control("timing", timeout=300).per_rank[0])
            llm.control("timing:off")
            return {"host_profile": stats, "profiled_out_tok_s": a.num_requests * a.osl / elapsed,
                    "unprofiled_out_tok_s": warm["output_throughput"], "gc": steps.get("gc"),
                    "host_ms_per_step": steps.get("host_ms_per_step")}
        llm.control("trace:on")
        align = json.loads(llm.control("profile:start", args={"gpu_only": not a.host_ops, "align": True}).per_rank[0])
        elapsed = send()
        marks = json.loads(llm.control("trace:off").per_rank[0])
        kernels = json.loads(llm.control("profile:stop", timeout=600, args={"trace": a.trace}).per_rank[0])
    with open(a.trace + ".marks.json", "w") as f:
        json.dump({"monotonic": align["monotonic"], "marks": marks}, f)
    out_tokens = a.num_requests * a.osl
    print(f"profiled point: {out_tokens / elapsed:.1f} out tok/s in {elapsed:.2f} s", flush=True)
    report = analyse(load_events(a.trace), marks, align["monotonic"])
    report["kernels"] = kernels
    report["unprofiled_out_tok_s"] = warm["output_throughput"]
    report["profiled_out_tok_s"] = out_tokens / elapsed
    return report


if __name__ == "__main__":
    raise SystemExit(main())
