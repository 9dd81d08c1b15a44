"""HostClock: where the executor loop's host time goes, phase by phase."""

from __future__ import annotations

import time


class HostClock:
    """Host seconds per phase of the loop while timing is on (the "timing" control op): where a
    step's host time goes, beside the GPU's idle share. ``mark(phase)`` gives the time since the
    previous mark to ``phase``; off, it is one attribute test. "fetch" includes the loop's waits
    for work when it has none; "wait", the wait for a step's tokens."""

    def __init__(self) -> None:
        self.on = False
        self.seconds: dict[str, float] = {}
        self._last = 0.0
        self._steps: tuple[int, int | None] = (0, None)   # iterations: timing started, stopped

    def start(self, iteration: int) -> None:
        self.on, self.seconds, self._last, self._steps = True, {}, time.perf_counter(), (iteration, None)

    def stop(self, iteration: int) -> None:
        if self.on:
            self.on, self._steps = False, (self._steps[0], iteration)

    def mark(self, phase: str) -> None:
        if self.on:
            now = time.perf_counter()
            self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._last
            self._last = now

    def per_step_ms(self, iteration: int) -> dict[str, float]:
        """Milliseconds per loop iteration in each phase, over the timed iterations."""
        first, last = self._steps
        steps = (last if last is not None else iteration) - first
        return {k: round(1e3 * v / max(1, steps), 4) for k, v in self.seconds.items()}
