"""Rank 0's host time per loop iteration under an offline load, phase by phase: what the loop
itself costs the host (schedule, pack, update, respond, intake, the collector's pauses) apart
from the forward. Runs one ``bench throughput``-style point (``--concurrency`` requests in flight
of ``--isl`` random prompt tokens and ``--osl`` output tokens, MPI orchestrator) with the loop's
HostClock trace on, and reports per phase the mean milliseconds per iteration, the p50 / p90 /
max of each phase's single stretches, and the iterations whose host work (every phase but the
forward and the wait for a step's tokens) took longest: the stalls a GPU would idle through.

    python tools/bench_host_loop.py                       # the default: a one-layer model on this CPU
    python tools/bench_host_loop.py --baseline-rev HEAD~1 # the same point on another revision first
    python tools/bench_host_loop.py --model shape:llama-3.1-8b --config tools/gpu_engine_512_fp8.yaml
    python tools/bench_host_loop.py --control-plane --baseline-rev HEAD~1   # no engine: µs per row

``--control-plane`` times rank 0's per-request and per-row Python alone, with no engine and no
torch in the timed code: a request's way in (its message unpacked, checked and made a
``Request``, as the loop takes arrivals in), then ``--concurrency`` decoding rows scheduled and
updated step after step as the overlap loop does (``Scheduler.schedule`` for step n + 1, then
``Scheduler.update`` with step n's tokens), over a KV pool of ``--kv-tokens``; medians over
``--steps`` steps. Per request besides: the prompt steps' ``schedule`` (admission) and ``update``
(the prompt's blocks entered into the prefix tree), and the updates in which requests finish,
each less what the step's other rows cost as decode rows (the medians). The collector runs as
in a rank process's loop: what exists before the timed code frozen, full collections deferred
(``host_clock``).

Without ``--model`` the engine is a one-layer, 64-wide model of the Llama-3.1 family with random
weights, whose forward is cheap enough on a CPU that the host's own work stands out, with a
KV pool as large as ``--kv-tokens`` (an H200's FP8 pool at 8B holds ~1.7 M tokens).
``--baseline-rev`` runs this file (this tree's copy) with a temporary git worktree of that
revision first on the path (same arguments, same machine, one after the other) and prints both.
The per-iteration host time counts every phase but the forward and the wait for a step's tokens;
``receive`` includes the loop's waits for work while it has none (at the start and the end).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

# device work (a CPU forward), waiting for it, and host_clock.IDLE_COLLECT (spelled out: a baseline
# revision run by --baseline-rev may not have the name)
HOST_ONLY_EXCLUDES = ("forward", "wait", "collect")


def one_layer_model(**overrides: Any) -> str:
    from phalanx.bench.shapes import TINY_OVERRIDES, shape_dir
    return shape_dir("llama-3.1-8b", **{**TINY_OVERRIDES, "num_hidden_layers": 1, "hidden_size": 64,
                                        "intermediate_size": 64, "num_attention_heads": 2,
                                        "num_key_value_heads": 1, "head_dim": 32, **overrides})


def run_point(a: argparse.Namespace) -> dict[str, Any]:
    from phalanx import LLM
    from phalanx.bench.shapes import resolve_model_arg
    from phalanx.bench.throughput import _run, make_prompts
    from phalanx.config import merge_yaml
    model, dummy = resolve_model_arg(a.model) if a.model else (one_layer_model(), True)
    kwargs: dict[str, Any] = {"load_format": "dummy" if dummy else "auto", "max_batch_size": a.concurrency,
                              "max_num_tokens": a.max_num_tokens}
    if not a.model:
        kwargs.update(max_seq_len=a.isl + a.osl + 64, kv_cache_config={"max_tokens": a.kv_tokens})
    if a.config:
        kwargs = merge_yaml(kwargs, a.config)
    with LLM(model, skip_tokenizer_init=dummy, **kwargs) as llm:
        prompts = make_prompts(a.num_requests + 8, a.isl, llm.vocab_size)
        asyncio.run(_run(llm, prompts[:8], 4, a.concurrency))     # warm-up
        llm.reset_prefix_cache()
        llm.control("timing:on")
        llm.control("trace:on")
        t0 = time.perf_counter()
        asyncio.run(_run(llm, prompts[8:], a.osl, a.concurrency))
        elapsed = time.perf_counter() - t0
        marks = json.loads(llm.control("trace:off").per_rank[0])
        timing = json.loads(llm.control("timing", timeout=300).per_rank[0])
        llm.control("timing:off")
    return {"out_tok_s": a.num_requests * a.osl / elapsed, "seconds": elapsed, "gc": timing.get("gc"),
            "host_ms_per_step": timing.get("host_ms_per_step"), **analyse(marks)}


def control_plane(a: argparse.Namespace) -> dict[str, Any]:
    from types import SimpleNamespace

    from phalanx.bench.throughput import make_prompts
    from phalanx.executor.messages import GenerationRequest, pack
    from phalanx.llmapi.sampling_params import SamplingParams
    vocab = 128256
    sp = SamplingParams(max_tokens=a.osl, ignore_eos=True, temperature=0.0, detokenize=False)
    wire = [pack(GenerationRequest(i, p, sp.to_dict(), [128001]))
            for i, p in enumerate(make_prompts(a.concurrency, a.isl, vocab))]
    rank = SimpleNamespace(vocab_size=vocab, max_seq_len=a.isl + a.osl + 64,
                           runner=SimpleNamespace(guided=None, spec=None))
    with rank_gc():
        return _control_plane(a, vocab, wire, rank)


def rank_gc() -> Any:
    """The collector as a rank process has it in its loop: what exists now frozen, full collections
    deferred (a revision without these, as it had it); the young collections run as they come."""
    import contextlib

    from phalanx.pyexecutor import host_clock
    if hasattr(host_clock, "freeze_startup_objects"):
        host_clock.freeze_startup_objects()
    try:
        return host_clock.GcPauses(defer_full=True)
    except (AttributeError, TypeError):
        return contextlib.nullcontext()


def _control_plane(a: argparse.Namespace, vocab: int, wire: list[bytes], rank: Any) -> dict[str, Any]:
    import random
    import statistics

    from phalanx.executor.messages import unpack
    from phalanx.kv_manager import KVCacheManager
    from phalanx.pyexecutor.py_executor import PyExecutor
    from phalanx.pyexecutor.scheduler import Scheduler, SchedulerLimits
    t0 = time.perf_counter()
    requests = [PyExecutor._make_request(rank, unpack(m)) for m in wire]   # type: ignore[arg-type]
    intake_us = (time.perf_counter() - t0) / len(wire) * 1e6
    s = Scheduler(SchedulerLimits(a.concurrency, a.max_num_tokens, a.isl + a.osl + 64),
                  KVCacheManager(max(a.kv_tokens // 32, a.concurrency * (-(-(a.isl + a.osl) // 32) + 1)), 32))
    for r in requests:
        s.add_request(r)
    rng = random.Random(0)
    prev = None
    admit_s = prompt_update_s = 0.0
    decode_rows = 0   # rows of the prompt steps already decoding (their cost is taken out below)
    while s.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in s.running):   # the prompts
        t0 = time.perf_counter()
        b = s.schedule()
        t1 = time.perf_counter()
        s.update(b, [rng.randrange(1000, vocab) if x else None for x in b.samples])
        admit_s += t1 - t0
        prompt_update_s += time.perf_counter() - t1
        decode_rows += sum(c >= r.num_prompt_tokens for r, c in zip(b.requests, b.num_computed_tokens, strict=True))
    prev = s.schedule()
    sched, upd, rows = [], [], len(prev.requests)
    # every request keeps decoding for this many steps (the earliest admitted finish first)
    left = min(r.max_total_tokens - r.num_total_tokens for r in s.running)
    if left < 1:
        raise SystemExit(f"--osl {a.osl} leaves no decode step in which every request still runs")
    for _ in range(min(a.steps, left)):
        t0 = time.perf_counter()
        batch = s.schedule()
        t1 = time.perf_counter()
        s.update(prev, [rng.randrange(1000, vocab) for _ in prev.requests])
        t2 = time.perf_counter()
        sched.append((t1 - t0) / rows * 1e6)
        upd.append((t2 - t1) / rows * 1e6)
        prev = batch
    # the rest, to the last token: the updates in which requests finish (their blocks freed, their
    # tokens entered into the prefix tree), less what the rows that go on decoding cost
    finish_s, finished, per_row = 0.0, 0, statistics.median(upd) / 1e6
    while prev.requests:
        batch = s.schedule()
        t0 = time.perf_counter()
        s.update(prev, [rng.randrange(1000, vocab) for _ in prev.requests])
        dt = time.perf_counter() - t0
        done = len(prev.requests) - len(s.running)
        if done > 0:
            finish_s += dt - per_row * len(s.running)
            finished += done
        prev = batch
    return {"rows": rows, "steps": len(sched), "intake_us_per_request": intake_us,
            "finish_us_per_request": finish_s / max(1, finished) * 1e6,
            # the prompt steps (every request admitted, its prompt computed and entered into the prefix
            # tree), less what their rows already decoding cost at the medians below
            "admit_us_per_request": (admit_s - decode_rows * statistics.median(sched) / 1e6) / len(requests) * 1e6,
            "prompt_update_us_per_request": (prompt_update_s - decode_rows * per_row) / len(requests) * 1e6,
            "schedule_us_per_row": statistics.median(sched), "update_us_per_row": statistics.median(upd)}


def analyse(marks: list[list[Any]]) -> dict[str, Any]:
    """Phase stretches and per-iteration host time from the HostClock trace: each mark ends the
    stretch of its phase that began at the previous mark."""
    stretches: dict[str, list[float]] = defaultdict(list)
    per_iteration: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for (_, _, t0), (it, phase, t1) in zip(marks, marks[1:], strict=False):
        ms = (t1 - t0) * 1e3
        stretches[phase].append(ms)
        per_iteration[it][phase] += ms
    phases = {}
    for phase, v in stretches.items():
        v.sort()
        phases[phase] = {"n": len(v), "p50": v[len(v) // 2], "p90": v[int(len(v) * 0.9)], "max": v[-1]}
    host = sorted(((sum(ms for p, ms in ph.items() if p not in HOST_ONLY_EXCLUDES), it, dict(ph))
                   for it, ph in per_iteration.items()), reverse=True)
    totals = sorted(h for h, _, _ in host)
    return {"phases": phases,
            "host_ms_per_iteration": {"p50": totals[len(totals) // 2], "p90": totals[int(len(totals) * 0.9)],
                                      "max": totals[-1]} if totals else {},
            "slowest_iterations": [{"iteration": it, "host_ms": round(h, 2),
                                    "phases": {p: round(ms, 2) for p, ms in sorted(ph.items(), key=lambda x: -x[1])
                                               if ms >= 0.5}} for h, it, ph in host[:6]]}


def print_report(label: str, r: dict[str, Any]) -> None:
    if "schedule_us_per_row" in r:
        print(f"== {label}: a request taken in {r['intake_us_per_request']:.1f} µs; {r['rows']} decoding rows "
              f"over {r['steps']} steps: schedule {r['schedule_us_per_row']:.2f} µs a row, "
              f"update {r['update_us_per_row']:.2f} µs a row (medians)")
        print(f"   per request: admitted (prompt steps' schedule) {r['admit_us_per_request']:.1f} µs, "
              f"prompt steps' update {r['prompt_update_us_per_request']:.1f} µs, "
              f"finished {r['finish_us_per_request']:.1f} µs")
        return
    print(f"== {label}: {r['out_tok_s']:.0f} out tok/s in {r['seconds']:.2f} s; GC {r['gc']}")
    h = r["host_ms_per_iteration"]
    print(f"host ms per iteration (all phases but {', '.join(HOST_ONLY_EXCLUDES)}): "
          f"p50 {h['p50']:.2f}  p90 {h['p90']:.2f}  max {h['max']:.2f}")
    print(f"{'phase':10s} {'ms/iter':>8s} {'n':>6s} {'p50':>8s} {'p90':>8s} {'max':>8s}")
    per = r["host_ms_per_step"] or {}
    for phase, s in sorted(r["phases"].items(), key=lambda x: -per.get(x[0], 0.0)):
        print(f"{phase:10s} {per.get(phase, 0.0):8.3f} {s['n']:6d} {s['p50']:8.3f} {s['p90']:8.3f} {s['max']:8.2f}")
    print("slowest iterations (host ms, phases of 0.5 ms or more):")
    for s in r["slowest_iterations"]:
        print(f"  #{s['iteration']:<6d} {s['host_ms']:8.2f}  {s['phases']}")


def baseline(rev: str, argv: list[str], script: str = __file__) -> dict[str, Any]:
    """This point on another revision: ``script`` (this file, or another tool that reports the
    same way) run with a temporary worktree of it first on the path (``argv`` holds no baseline
    or output option, and absolute paths); its first report."""
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True,
                          cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="phalanx-baseline-") as d:
        tree = os.path.join(d, "tree")
        subprocess.run(["git", "-C", root, "worktree", "add", "--detach", tree, rev], check=True,
                       capture_output=True)
        try:
            out = os.path.join(d, "report.json")
            env = {**os.environ, "PYTHONPATH": tree + os.pathsep + os.environ.get("PYTHONPATH", "")}
            subprocess.run([sys.executable, os.path.abspath(script), *argv, "--output", out], cwd=tree, env=env,
                           check=True, stdout=subprocess.DEVNULL)
            with open(out) as f:
                return json.load(f)[0]["report"]
        finally:
            subprocess.run(["git", "-C", root, "worktree", "remove", "--force", tree], check=False,
                           capture_output=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: a one-layer model of the Llama-3.1 family (random)")
    ap.add_argument("--config", default=None, help="YAML of extra LLM arguments")
    ap.add_argument("--isl", type=int, default=128)
    ap.add_argument("--osl", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=512)
    ap.add_argument("--num-requests", type=int, default=2048)
    ap.add_argument("--max-num-tokens", type=int, default=8192)
    ap.add_argument("--kv-tokens", type=int, default=1_700_000, help="KV pool tokens of the default model")
    ap.add_argument("--control-plane", action="store_true", help="no engine: intake, schedule and update alone")
    ap.add_argument("--steps", type=int, default=200, help="--control-plane: decode steps timed")
    ap.add_argument("--baseline-rev", default=None, help="first run the same point on this git revision")
    ap.add_argument("--output", default=None, help="write the report(s) as JSON here")
    a = ap.parse_args(argv)
    for name in ("isl", "osl", "concurrency", "num_requests", "max_num_tokens", "kv_tokens", "steps"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(a, name)}")
    passed = [f"--{name.replace('_', '-')}={getattr(a, name)}" for name in
              ("isl", "osl", "concurrency", "num_requests", "max_num_tokens", "kv_tokens", "steps")]
    if a.control_plane:
        passed.append("--control-plane")
    if a.config:
        passed.append(f"--config={os.path.abspath(a.config)}")
    if a.model:   # a local directory as an absolute path (the child runs in the worktree)
        passed.append(f"--model={os.path.abspath(a.model) if os.path.exists(a.model) else a.model}")
    return compare(a.baseline_rev, passed, __file__,
                   lambda: control_plane(a) if a.control_plane else run_point(a), print_report, a.output)


def compare(rev: str | None, passed: list[str], script: str, run: Callable[[], dict[str, Any]],
            show: Callable[[str, dict[str, Any]], None], output: str | None) -> int:
    """A tool's point on the baseline revision ``rev`` first (``baseline``, with ``passed``), if
    given, then on this tree (``run``); each report shown, and all written to ``output`` as JSON."""
    reports = []
    if rev:
        reports.append({"revision": rev, "report": baseline(rev, passed, script)})
        show(f"baseline {rev}", reports[-1]["report"])
    reports.append({"revision": "working tree", "report": run()})
    show("this tree", reports[-1]["report"])
    if output:
        with open(output, "w") as f:
            json.dump(reports, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
