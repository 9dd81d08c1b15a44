"""HostClock: where the executor loop's host time goes, phase by phase."""

from __future__ import annotations

import gc
import time

TRACE_LIMIT = 100_000   # marks a trace keeps (a forgotten trace stops growing there)
# the loop's phases in the order a step marks them (py_executor.py, model_runner.py's launch)
PHASES = ("receive", "fetch", "schedule", "pack", "stage", "prepare", "forward", "launch", "wait", "update",
          "sample", "respond")


class HostClock:
    """Host seconds per phase of the loop while timing is on (the "timing" control op): where a
    step's host time goes, beside the GPU's idle share. ``mark(phase)`` gives the time since the
    previous mark to ``phase``; off, it is one attribute test. "receive" includes the loop's waits
    for work when it has none ("fetch" is then the intake of what arrived); "wait", the wait for a
    step's tokens.

    While a trace is on (the "trace:on" / "trace:off" control ops), every mark is also kept as
    (iteration, phase, time.monotonic()) — the clock the user process stamps a request's arrival
    and first token with (system-wide on Linux), so one request's path through the loop can be
    laid out between the two (tools/profile_ttft.py --timeline)."""

    def __init__(self) -> None:
        self.on = False           # timing or tracing: the one test ``mark`` makes when off
        self.timing = False
        self.seconds: dict[str, float] = {}
        self.trace: list[tuple[int, str, float]] | None = None
        self.iteration = 0        # the loop's, kept current by the loop for the trace
        self._last = 0.0
        self._steps: tuple[int, int | None] = (0, None)   # iterations: timing started, stopped

    def start(self, iteration: int) -> None:
        self.timing, self.seconds, self._last, self._steps = True, {}, time.monotonic(), (iteration, None)
        self.on = True

    def stop(self, iteration: int) -> None:
        if self.timing:
            self.timing, self._steps = False, (self._steps[0], iteration)
        self.on = self.timing or self.trace is not None

    def start_trace(self) -> None:
        if not self.timing:          # timing on: the phase under way keeps its start
            self._last = time.monotonic()
        self.trace, self.on = [], True

    def stop_trace(self) -> list[tuple[int, str, float]]:
        out, self.trace = self.trace or [], None
        self.on = self.timing
        return out

    def mark(self, phase: str) -> None:
        if self.on:
            now = time.monotonic()
            if self.timing:
                self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._last
            if self.trace is not None and len(self.trace) < TRACE_LIMIT:
                self.trace.append((self.iteration, phase, now))
            self._last = now

    def per_step_ms(self, iteration: int) -> dict[str, float]:
        """Milliseconds per loop iteration in each phase, over the timed iterations."""
        first, last = self._steps
        steps = (last if last is not None else iteration) - first
        return {k: round(1e3 * v / max(1, steps), 4) for k, v in self.seconds.items()}


class GcPauses:
    """The garbage collector's pauses in this process, by generation (``gc.callbacks``): how
    many collections, their total and their longest milliseconds since ``reset``. A full
    collection walks every object the process tracks, so with a model's worth of them it can
    stall the loop for a whole step; the rank loop therefore freezes what start-up made
    (``freeze_startup_objects``) and reports its pauses here."""

    def __init__(self) -> None:
        self.reset()
        self._t0 = 0.0

    def reset(self) -> None:
        self.count = [0, 0, 0]
        self.ms = [0.0, 0.0, 0.0]
        self.max_ms = 0.0

    def __enter__(self) -> GcPauses:
        """Counted while the ``with`` block runs (an executor's loop): the hook goes with it."""
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        ms = (time.perf_counter() - self._t0) * 1e3
        g = min(int(info.get("generation", 2)), 2)
        self.count[g] += 1
        self.ms[g] += ms
        self.max_ms = max(self.max_ms, ms)

    def summary(self) -> dict[str, object]:
        return {"collections": list(self.count), "ms": [round(x, 3) for x in self.ms], "max_ms": round(self.max_ms, 3)}


def freeze_startup_objects() -> int:
    """Collect once, then move every object alive now (the model, its kernels and caches, the
    engine's tables) to the collector's permanent generation, so that later collections walk
    only what serving creates; returns how many were frozen. For a process that only serves:
    a cycle among frozen objects that later becomes garbage is never collected."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
