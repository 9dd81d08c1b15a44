"""Where time to first token goes: TTFT of streamed requests (one at a time, each
on an idle engine: the next is sent once the last has finished) for short and long
prompts, cold and with a cached prefix, on the Llama-3.1-8B-shaped dummy model; then one request
of each kind under the torch profiler (host ops and GPU kernels, one engine in this process),
with a Chrome trace of each (the rank's host ops and kernels). With ``--timeline``, each request's
path laid out in time (the median of the repeats): the user's call, the proxy's arrival stamp, every
mark of rank 0's loop (HostClock's trace: fetch, schedule, prepare, forward, launch, wait, update,
sample, respond, by iteration), the proxy's first-token stamp and the user's return.

    python tools/profile_ttft.py --output ttft.json --trace-dir traces/     # extend graphs off, then on
    python tools/profile_ttft.py --extend-graphs on --timeline
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import os
import statistics
import time
from typing import Any

import torch

import trace_steps  # tools/, beside this script
from phalanx import LLM, SamplingParams
from phalanx.bench.shapes import TINY_OVERRIDES, profiling_engine_args, shape_dir

SP = SamplingParams(max_tokens=2, ignore_eos=True, detokenize=False)


def workloads(seed: int) -> dict[str, tuple[list[int] | None, list[int]]]:
    """name -> (a prefix to cache first or None, the measured prompt)."""
    g = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(1000, 120000, (n,), generator=g).tolist()
    shared = ids(2048)
    return {"cold_32": (None, ids(32)), "cold_512": (None, ids(512)), "cold_2048": (None, ids(2048)),
            "hit_2048+32": (shared + ids(32), shared + ids(32))}


async def ttft(llm: LLM, prompt: list[int], drain: bool = True) -> float:
    """Time to the first streamed output. ``drain``: return once the request has finished, so
    that the next request finds the engine idle; otherwise at the first output (the next then
    arrives while this one's last decode step still runs, and waits for it)."""
    t0 = time.perf_counter()
    first = None
    async for _ in llm.generate_async(prompt, SP, streaming=True):
        first = first or time.perf_counter() - t0
        if not drain:
            break
    if first is None:
        raise RuntimeError("no output")
    return first


async def stamped(llm: LLM, prompt: list[int]) -> list[tuple[str, float]]:
    """The user's call, the proxy's arrival and first-token stamps and the user's return, on the
    monotonic clock the rank's trace uses."""
    t0 = time.monotonic()
    stamps: list[tuple[str, float]] = []
    async for out in llm.generate_async(prompt, SP, streaming=True):
        if not stamps:
            t1 = time.monotonic()
            m = out.metrics
            stamps = [("user call", t0), ("proxy arrival", m["arrival_time"]),
                      ("proxy first token", m["arrival_time"] + m["ttft"]), ("user has it", t1)]
    if not stamps:
        raise RuntimeError("no output")
    return stamps


def timeline(llm: LLM, loop: asyncio.AbstractEventLoop, a: argparse.Namespace, run: dict[str, Any],
             mode: str) -> None:
    """Each workload's requests with the rank's loop traced; the marks between the user's call
    and return, in order, as milliseconds since the call (median over the repeats, which must
    take the same path: runs whose sequence of marks differs from the first are dropped)."""
    for name in workloads(0):
        paths: list[list[tuple[str, float]]] = []
        for r in range(a.repeats):
            prefix, prompt = workloads(500 + r)[name]
            if prefix is not None:
                loop.run_until_complete(ttft(llm, prefix))
            llm.control("trace:on")
            user = loop.run_until_complete(stamped(llm, prompt))
            marks = json.loads(llm.control("trace:off").per_rank[0])
            t0, t1 = user[0][1], user[-1][1]
            rank = [(f"rank it{it} {phase}", t) for it, phase, t in marks if t0 <= t <= t1]
            if rank:   # iterations numbered from the request's first
                first = int(rank[0][0].split()[1][2:])
                rank = [(f"rank +{int(n.split()[1][2:]) - first} {n.split()[2]}", t) for n, t in rank]
            path = sorted(user + rank, key=lambda e: e[1])
            paths.append([(n, (t - t0) * 1e3) for n, t in path])
        same = [p for p in paths if [n for n, _ in p] == [n for n, _ in paths[0]]]
        median = [(n, statistics.median(p[i][1] for p in same)) for i, (n, _) in enumerate(same[0])]
        run.setdefault("timeline_ms", {})[name] = {"runs_used": len(same), "marks": median}
        print(f"extend graphs {mode}, timeline {name} ({len(same)} of {len(paths)} runs, ms since the call):",
              flush=True)
        prev = 0.0
        for n, t in median:
            print(f"    {t:7.3f}  (+{t - prev:6.3f})  {n}", flush=True)
            prev = t


def measure(llm: LLM, a: argparse.Namespace, run: dict[str, Any], mode: str) -> None:
    loop = asyncio.new_event_loop()
    # round 0 compiles whatever a new shape needs; round 1 is the figure; round 2 sends each
    # request as soon as the previous one's first output arrived (as rounds did before: the engine
    # is then still running that request's last step)
    for rnd in range(3):
        for name, _ in workloads(0).items():
            times = []
            for r in range(a.repeats):
                prefix, prompt = workloads(100 * rnd + r + 1)[name]
                if prefix is not None:
                    loop.run_until_complete(ttft(llm, prefix))
                times.append(loop.run_until_complete(ttft(llm, prompt, drain=rnd < 2)) * 1e3)
            run["ttft_ms"].setdefault(name, []).append(
                {"round": rnd, "p50": statistics.median(times), "min": min(times), "all": times,
                 "engine": "idle" if rnd < 2 else "finishing the previous request"})
            print(f"extend graphs {mode}, round {rnd} {name}: TTFT p50 {statistics.median(times):.1f} ms "
                  f"(min {min(times):.1f}){' back to back' if rnd == 2 else ''}", flush=True)
    if a.timeline:
        timeline(llm, loop, a, run, mode)
    if a.host_profile:   # the rank loop's host time by function over the hits (cProfile inflates small calls)
        llm.control("hostprofile:start")
        for r in range(a.repeats):
            prefix, prompt = workloads(700 + r)["hit_2048+32"]
            loop.run_until_complete(ttft(llm, prefix))
            loop.run_until_complete(ttft(llm, prompt))
        stats = llm.control("hostprofile:stop", args={"top": 70, "sort": "tottime"}).per_rank[0]
        run["host_profile_hits"] = stats
        print(f"extend graphs {mode}, rank 0's loop under cProfile over {a.repeats} (prefix, hit) pairs:\n{stats}",
              flush=True)
    for name in workloads(0):      # one request of each kind under the engine's profiler
        prefix, prompt = workloads(999)[name]
        if prefix is not None:
            loop.run_until_complete(ttft(llm, prefix))
        trace = None
        if a.trace_dir:
            os.makedirs(a.trace_dir, exist_ok=True)
            trace = os.path.abspath(os.path.join(a.trace_dir, f"{mode}_{name}.json"))
        llm.control("profile:start")
        t = loop.run_until_complete(ttft(llm, prompt))
        kernels = json.loads(llm.control("profile:stop", timeout=120, args={"trace": trace}).per_rank[0])
        gpu_us = sum(k["us_per_step"] for k in kernels)
        run["profiles"][name] = {"ttft_ms": t * 1e3, "gpu_us": gpu_us, "kernels": kernels}
        print(f"extend graphs {mode}, profiled {name}: TTFT {t * 1e3:.1f} ms, GPU {gpu_us / 1e3:.1f} ms", flush=True)
        if trace and os.path.exists(trace):
            steps = [trace_steps.breakdown(r) for r in trace_steps.replays(trace_steps.load(trace), 20)]
            with open(trace, "rb") as f, gzip.open(trace + ".gz", "wb") as g:
                g.write(f.read())
            os.remove(trace)
            run["profiles"][name]["replays"] = steps
            for i, b in enumerate(steps):
                print(f"    replay {i}: {b['kernels']} kernels, span {b['span_us']:.1f} us, "
                      f"idle {b['idle_us']:.1f} us; "
                      + ", ".join(f"{r['kernel'][:32]} {r['added_us']:.0f}" for r in b["by_kernel"][:10]), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--config", default="tools/gpu_engine.yaml")
    ap.add_argument("--orchestrator", default="mpi", choices=["inprocess", "mpi"])
    ap.add_argument("--tiny", action="store_true", help="a 2-layer shape (checks the tool on a CPU)")
    ap.add_argument("--extend-graphs", choices=["on", "off", "both"], default="both",
                    help="CUDA graphs for prefill/extend steps (cuda_graph_config.extend_num_tokens), or eager")
    ap.add_argument("--trace-dir", default=None)
    ap.add_argument("--timeline", action="store_true", help="each request's path through the loop, in time")
    ap.add_argument("--host-profile", action="store_true", help="rank 0's loop under cProfile over prefix hits")
    ap.add_argument("--output", default=None)
    a = ap.parse_args()
    base = profiling_engine_args(a.orchestrator, a.config)
    report: dict[str, Any] = {"settings": vars(a), "runs": {}}
    tiny = {k: v for k, v in TINY_OVERRIDES.items() if k != "vocab_size"}   # the prompts use ids up to 120k
    for mode in {"on": ["on"], "off": ["off"], "both": ["off", "on"]}[a.extend_graphs]:
        graphs = dict(base.get("cuda_graph_config") or {})
        if mode == "off":
            graphs["extend_num_tokens"] = []
        run = report["runs"][f"extend_graphs_{mode}"] = {"ttft_ms": {}, "profiles": {}}
        model = shape_dir(a.model, **(tiny if a.tiny else {}))
        with LLM(model, **{**base, "cuda_graph_config": graphs}) as llm:
            measure(llm, a, run, mode)
    if a.output:
        with open(a.output, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
