"""What each kernel of a CUDA-graph replay adds to its time, from a profiler trace.

Kernels launched with programmatic dependent launch start before the kernel in front of them has
ended and wait inside it, so their own durations overlap and summing them overstates the step
(a profile's per-kernel table counts that wait to the kernel behind). What a kernel adds to the
step is the time from the previous kernel's end to its own end: ``added``. Over a replay the
added times sum to its span from the first kernel's start to the last kernel's end, idle gaps
included; ``idle`` is the part of each kernel's added time during which nothing of the replay ran
(the gap between the previous end and its start, where it started later).

Every kernel of one graph replay carries the correlation id of its ``cudaGraphLaunch``; a
replay is the kernels of one id. Prints, for each replay of at least ``--min-kernels`` kernels:
its span, its kernels' added time grouped by name (slowest first) and its idle time.

    python tools/trace_steps.py traces/on_hit_2048+32.json.gz
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from typing import Any

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def load(path: str) -> list[dict[str, Any]]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    return sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATS), key=lambda e: e["ts"])


def replays(events: list[dict[str, Any]], min_kernels: int) -> list[list[dict[str, Any]]]:
    """The GPU events of each graph replay (one correlation id), in start order."""
    by_id: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        by_id[e.get("args", {}).get("correlation")].append(e)
    groups = [g for cid, g in by_id.items() if cid is not None and len(g) >= min_kernels]
    return sorted(groups, key=lambda g: g[0]["ts"])


def breakdown(group: list[dict[str, Any]]) -> dict[str, Any]:
    """Span, and per kernel name: calls, added time and idle time (µs)."""
    rows: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    prev_end = group[0]["ts"]
    for e in group:
        end = e["ts"] + e["dur"]
        added = max(0.0, end - prev_end)
        idle = max(0.0, e["ts"] - prev_end)
        row = rows[e["name"][:70]]
        row[0] += 1
        row[1] += added
        row[2] += idle
        prev_end = max(prev_end, end)
    span = prev_end - group[0]["ts"]
    table = sorted(([n, int(c), a, i] for n, (c, a, i) in rows.items()), key=lambda r: -r[2])
    return {"kernels": len(group), "span_us": span, "idle_us": sum(r[3] for r in table),
            "by_kernel": [{"kernel": n, "calls": c, "added_us": a, "idle_us": i} for n, c, a, i in table]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", nargs="+")
    ap.add_argument("--min-kernels", type=int, default=20)
    ap.add_argument("--top", type=int, default=16)
    a = ap.parse_args()
    for path in a.trace:
        for i, group in enumerate(replays(load(path), a.min_kernels)):
            b = breakdown(group)
            print(f"{path} replay {i}: {b['kernels']} kernels, span {b['span_us']:.1f} us, "
                  f"idle {b['idle_us']:.1f} us")
            for r in b["by_kernel"][:a.top]:
                print(f"    {r['added_us']:8.1f} us added ({r['idle_us']:6.1f} idle)  {r['calls']:4d}x  {r['kernel']}")


if __name__ == "__main__":
    main()
