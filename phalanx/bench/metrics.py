"""Latency and throughput arithmetic shared by the benchmarks."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from itertools import pairwise
from typing import Any


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]) like numpy's default; nan when empty."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(values: Sequence[float], scale: float = 1.0) -> dict[str, float]:
    """mean, median, p90, p99, min, max of ``values`` multiplied by ``scale`` (e.g. 1000 for ms)."""
    if not values:
        return {k: math.nan for k in ("mean", "median", "p90", "p99", "min", "max")}
    v = [x * scale for x in values]
    return {"mean": sum(v) / len(v), "median": percentile(v, 50), "p90": percentile(v, 90),
            "p99": percentile(v, 99), "min": min(v), "max": max(v)}


def per_user_rate(tpots: Sequence[float]) -> float | None:
    """Mean over requests of 1 / TPOT: the tokens a second each user sees after their first. A
    request whose later tokens all came in the chunk of its first (TPOT 0, a consumer slower than
    the engine) has no such rate and is left out; None when no request has one."""
    rates = [1.0 / t for t in tpots if t > 0]
    return sum(rates) / len(rates) if rates else None


def request_latencies(start: float, token_times: Sequence[float]) -> dict[str, Any]:
    """TTFT, TPOT (mean gap after the first token), ITLs and E2E of one request.

    ``token_times[i]`` is when output token i arrived (a chunk of k tokens counts k arrivals at
    the same time; its ITL is split evenly, as vLLM's benchmark does)."""
    if not token_times:
        return {"ttft": math.nan, "tpot": math.nan, "itl": [], "e2e": math.nan}
    ttft = token_times[0] - start
    e2e = token_times[-1] - start
    n = len(token_times)
    tpot = (e2e - ttft) / (n - 1) if n > 1 else math.nan
    itl = [b - a for a, b in pairwise(token_times)]
    return {"ttft": ttft, "tpot": tpot, "itl": itl, "e2e": e2e}


def emit_report(report: dict[str, Any], path: str | None, echo: bool = True) -> None:
    """Write the report as JSON to ``path`` (when given) and print it (when ``echo``, or
    when there is no path). A figure that could not be measured (NaN, an infinity: a GPU idle
    share on a CPU, a rate over nothing) is null, so that the file is JSON every reader takes."""
    text = json.dumps(_finite(report), indent=2, allow_nan=False)
    if echo or not path:
        print(text)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")


def _finite(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x
