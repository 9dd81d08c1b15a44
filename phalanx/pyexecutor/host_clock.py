"""HostClock: where the executor loop's host time goes, phase by phase."""

from __future__ import annotations

import gc
import time

TRACE_LIMIT = 100_000   # marks a trace keeps (a forgotten trace stops growing there)
# the loop's phases in the order a step marks them (py_executor.py, model_runner.py's launch)
PHASES = ("receive", "fetch", "schedule", "pack", "stage", "prepare", "forward", "launch", "wait", "update",
          "sample", "respond")
IDLE_COLLECT = "collect"   # not a step's: a full garbage collection run while the loop idled (GcPauses.idle)


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
    many collections, their total and their longest milliseconds since ``reset``, and how many
    objects they found unreachable. A full collection walks every object the process tracks, so
    with a model's worth of them it can stall the loop for a whole step; the rank loop therefore
    freezes what start-up made (``freeze_startup_objects``) and reports its pauses here.

    ``defer_full`` (rank processes, set once at build): while the loop runs (the ``with``
    block), the young generations collect as usual but a full collection waits for the loop to
    idle: ``idle()``, which the loop calls when an idle wait brought nothing, runs it once
    ``gc.get_threshold()[2]`` collections of the middle generation have passed since the last
    (the interpreter's own trigger, less its rule that the old generation grow by a quarter) and
    the loop has idled for ``IDLE_FULL_AFTER_S`` in a row.
    What serving keeps (the radix tree's nodes, the requests) still made a full collection
    15–20 ms at 512 sequences on an H200 host (docs/gpu_notes.md, twenty-ninth round), longer
    than the decode step it stalled, while the loop makes no cyclic garbage for it to find (a
    CPU engine's rank 0 at 512 in flight: 0 objects over 618 collections). A loop that never
    idles still gets one after BUSY_FULL_AFTER middle-generation collections (minutes of work;
    later if the interpreter's quarter rule holds it back). An interpreter whose oldest
    generation has no such trigger (an incremental collector) is left as it is.
    Idle collections are counted apart (``idle_collections``, ``idle_ms``): no step waited."""

    BUSY_FULL_AFTER = 1000
    # how long the loop must have had nothing to do before ``idle`` runs a full collection: a
    # wave of requests finishing together leaves the loop idle for a moment until the next wave
    # arrives, and a 45-50 ms collection begun there delays that wave (thirty-first round, the
    # 128/128 FP8 point: both idle profiles had one in the wait at the first wave's end)
    IDLE_FULL_AFTER_S = 1.0

    def __init__(self, defer_full: bool = False) -> None:
        self.defer_full = defer_full
        self._thresholds: tuple[int, int, int] | None = None   # the interpreter's, while deferring
        self._idle = False
        self._idle_since: float | None = None   # monotonic start of the current run of empty idle waits
        self.reset()
        self._t0 = 0.0

    def reset(self) -> None:
        self.count = [0, 0, 0]
        self.ms = [0.0, 0.0, 0.0]
        self.max_ms = 0.0
        self.collected = 0        # unreachable objects the collections freed (cycles: what refcounts miss)
        self.idle_count = 0
        self.idle_ms = 0.0

    def __enter__(self) -> GcPauses:
        """Counted while the ``with`` block runs (an executor's loop): the hook goes with it."""
        gc.callbacks.append(self._on_gc)
        if self.defer_full:
            t0, t1, t2 = before = gc.get_threshold()
            gc.set_threshold(t0, t1, max(t2, self.BUSY_FULL_AFTER))
            if t2 > 0 and gc.get_threshold()[2] == max(t2, self.BUSY_FULL_AFTER):
                self._thresholds = before
            else:   # no oldest-generation trigger to raise (an incremental collector): nothing deferred
                gc.set_threshold(*before)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        if self._thresholds is not None:
            gc.set_threshold(*self._thresholds)
            self._thresholds = None

    def idle(self, now: float | None = None) -> bool:
        """An idle wait of the loop brought nothing: run the full collection deferred so far, if
        one is due and the loop has had nothing to do for ``IDLE_FULL_AFTER_S`` (since the first
        of these calls after the last ``busy``). ``now``: monotonic seconds (default: the clock)."""
        now = time.monotonic() if now is None else now
        if self._idle_since is None:
            self._idle_since = now
        if (self._thresholds is None or not gc.isenabled() or gc.get_count()[2] < self._thresholds[2]
                or now - self._idle_since < self.IDLE_FULL_AFTER_S):
            return False
        self._idle = True
        try:
            gc.collect()
        finally:
            self._idle = False
        return True

    def busy(self) -> None:
        """The loop has work (a fetch brought some, or it has requests): an idle run ends."""
        self._idle_since = None

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        ms = (time.perf_counter() - self._t0) * 1e3
        self.collected += int(info.get("collected", 0))
        if self._idle:
            self.idle_count += 1
            self.idle_ms += ms
            return
        g = min(int(info.get("generation", 2)), 2)
        self.count[g] += 1
        self.ms[g] += ms
        self.max_ms = max(self.max_ms, ms)

    def summary(self) -> dict[str, object]:
        return {"collections": list(self.count), "ms": [round(x, 3) for x in self.ms], "max_ms": round(self.max_ms, 3),
                "collected": self.collected, "idle_collections": self.idle_count, "idle_ms": round(self.idle_ms, 3)}


def freeze_startup_objects() -> int:
    """Collect once, then move every object alive now (the model, its kernels and caches, the
    engine's tables) to the collector's permanent generation, so that later collections walk
    only what serving creates; returns how many were frozen. For a process that only serves:
    a cycle among frozen objects that later becomes garbage is never collected."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
