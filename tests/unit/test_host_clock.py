"""HostClock: each mark gives the time since the previous one to its phase, per timed iteration."""

import time

from phalanx.pyexecutor.host_clock import HostClock


def test_marks_split_the_time_between_phases_over_the_timed_iterations(monkeypatch):
    import types
    now = [100.0]      # the host clock's monotonic time, stepped by the test (not slept: exact on any machine)
    monkeypatch.setattr("phalanx.pyexecutor.host_clock.time",
                        types.SimpleNamespace(monotonic=lambda: now[0], perf_counter=time.perf_counter))
    clock = HostClock()
    clock.mark("fetch")                       # off: nothing recorded
    assert clock.seconds == {}
    clock.start(iteration=10)
    for _ in range(4):
        now[0] += 0.002
        clock.mark("schedule")
        now[0] += 0.006
        clock.mark("wait")
    clock.stop(iteration=14)
    now[0] += 1.0
    clock.mark("wait")                        # stopped: not counted
    ms = clock.per_step_ms(iteration=99)      # iterations after the stop do not dilute it
    assert ms.keys() == {"schedule", "wait"}
    assert abs(ms["schedule"] - 2.0) < 1e-6 and abs(ms["wait"] - 6.0) < 1e-6, ms


def test_a_trace_keeps_every_mark_stamped_on_the_monotonic_clock():
    clock = HostClock()
    clock.mark("fetch")                       # off: nothing kept
    t0 = time.monotonic()
    clock.start_trace()
    clock.iteration = 7
    clock.mark("schedule")
    time.sleep(0.003)
    clock.iteration = 8
    clock.mark("wait")
    marks = clock.stop_trace()
    t1 = time.monotonic()
    assert [(it, phase) for it, phase, _ in marks] == [(7, "schedule"), (8, "wait")]
    assert t0 <= marks[0][2] < marks[1][2] <= t1 and marks[1][2] - marks[0][2] >= 0.003
    assert clock.seconds == {} and not clock.on        # timing stayed off; tracing is over
    clock.mark("fetch")
    assert clock.stop_trace() == []


def test_timing_and_a_trace_run_together_and_stop_apart():
    clock = HostClock()
    clock.start(iteration=0)
    clock.start_trace()
    clock.mark("schedule")
    assert len(clock.stop_trace()) == 1 and clock.on   # timing still on
    clock.mark("wait")
    clock.stop(iteration=1)
    assert set(clock.seconds) == {"schedule", "wait"} and not clock.on


def test_gc_pauses_count_each_collection_by_generation_while_entered():
    import gc

    from phalanx.pyexecutor.host_clock import GcPauses
    pauses = GcPauses()
    gc.collect(2)
    assert pauses.summary()["collections"] == [0, 0, 0]     # not entered: not called
    with pauses:
        gc.collect(0)
        gc.collect(2)
        gc.collect(2)
        got = pauses.summary()
        assert got["collections"][0] >= 1 and got["collections"][2] >= 2
        assert got["max_ms"] > 0 and got["max_ms"] <= sum(got["ms"])
        pauses.reset()
        assert pauses.summary() == {"collections": [0, 0, 0], "ms": [0.0, 0.0, 0.0], "max_ms": 0.0, "collected": 0,
                                    "idle_collections": 0, "idle_ms": 0.0}
    gc.collect(2)
    assert pauses.summary()["collections"] == [0, 0, 0]     # left: the hook is gone
    assert pauses._on_gc not in gc.callbacks


def test_freezing_leaves_what_is_alive_out_of_later_collections():
    import gc

    from phalanx.pyexecutor.host_clock import freeze_startup_objects
    before = gc.get_freeze_count()
    try:
        kept = [[i] for i in range(1000)]      # alive now: frozen with the rest
        frozen = freeze_startup_objects()
        assert frozen >= before + len(kept)
        collected = {id(o) for g in range(3) for o in gc.get_objects(g)}   # the generations a collection walks
        assert all(gc.is_tracked(x) and id(x) not in collected for x in kept)
    finally:
        gc.unfreeze()   # (this test process froze nothing before)


def test_deferred_full_collections_wait_for_idle_and_young_ones_go_on():
    """defer_full: while entered, allocation triggers young collections but no full one; ``idle``
    runs the full collection once the middle generation has collected as often as the
    interpreter's own threshold asks (not before) and the loop has idled IDLE_FULL_AFTER_S in a
    row (``busy`` starts that over), counts it apart, and finds the cycles; leaving restores the
    thresholds."""
    import gc

    from phalanx.pyexecutor.host_clock import GcPauses
    before = gc.get_threshold()
    pauses = GcPauses(defer_full=True)
    gc.collect()
    with pauses:
        assert gc.get_threshold() == (before[0], before[1], max(before[2], GcPauses.BUSY_FULL_AFTER))
        kept = [[i] for i in range(3 * before[0] * before[1] * before[2])]   # survivors well past the usual trigger
        got = pauses.summary()
        assert got["collections"][0] > 0 and got["collections"][1] >= before[2], got
        assert got["collections"][2] == 0, got          # the interpreter alone would have run one by now
        while gc.get_count()[2] < before[2]:
            gc.collect(1)                               # each middle-generation collection counts toward a full one
        a, b = [], []
        a.append(b)
        b.append(a)                                     # a cycle only a full pass can free now (once it is old)
        gc.collect(1)
        gc.collect(1)
        del a, b
        t = 100.0
        assert pauses.idle(t) is False                  # due, but the loop has only just idled
        assert pauses.idle(t + 0.5 * GcPauses.IDLE_FULL_AFTER_S) is False
        pauses.busy()                                   # work came: the idle run starts again
        assert pauses.idle(t + 0.9 * GcPauses.IDLE_FULL_AFTER_S) is False
        assert pauses.idle(t + 1.8 * GcPauses.IDLE_FULL_AFTER_S) is False
        assert pauses.summary()["idle_collections"] == 0
        assert pauses.idle(t + 2.0 * GcPauses.IDLE_FULL_AFTER_S) is True
        got = pauses.summary()
        assert got["idle_collections"] == 1 and got["idle_ms"] > 0 and got["collections"][2] == 0, got
        assert got["collected"] >= 2, got
        assert pauses.idle(t + 9 * GcPauses.IDLE_FULL_AFTER_S) is False   # nothing due right after one
        del kept
    assert gc.get_threshold() == before
    assert GcPauses().idle() is False                   # not deferring: never collects on idle
    gc.set_threshold(before[0], before[1], 0)           # no oldest-generation trigger: nothing to defer
    try:
        with GcPauses(defer_full=True) as none:
            assert gc.get_threshold()[2] == 0 and none.idle() is False
    finally:
        gc.set_threshold(*before)


def test_rank_executor_collects_on_an_idle_fetch_only(monkeypatch):
    """The loop's fetch runs the deferred collection when idle waits have brought nothing for
    IDLE_FULL_AFTER_S; a fetch that brings work, or runs while the loop has work, starts over."""
    import gc
    from collections import OrderedDict

    from phalanx.executor.messages import IterationInput
    from phalanx.pyexecutor.host_clock import GcPauses, HostClock
    from phalanx.pyexecutor.py_executor import PyExecutor

    class Source:
        def __init__(self, inp):
            self.inp = inp

        def fetch(self, idle, timeout=0.05):
            return self.inp

    ex = PyExecutor.__new__(PyExecutor)    # the fetch path alone: no model behind it
    ex.gc_pauses = GcPauses(defer_full=True)
    ex.shutdown_requested = False
    ex._beat = lambda: None
    ex.clock = HostClock()
    ex._cancel = lambda rid: None
    ex.intake = OrderedDict()
    now = [0.0]
    monkeypatch.setattr("phalanx.pyexecutor.host_clock.time.monotonic", lambda: now[0])
    after = GcPauses.IDLE_FULL_AFTER_S
    with ex.gc_pauses:
        for t, idle, inp, expect in ((0.0, True, IterationInput(), 0),              # an idle run starts
                                     (2 * after, False, IterationInput(), 0),      # the loop had work
                                     (2.5 * after, True, IterationInput(), 0),     # a new idle run
                                     (3 * after, True, IterationInput(cancel=[7]), 0),   # brought something
                                     (3.5 * after, True, IterationInput(), 0),
                                     (4 * after, True, IterationInput(), 0),
                                     (4.6 * after, True, IterationInput(), 1)):    # idle for IDLE_FULL_AFTER_S
            while gc.get_count()[2] < gc.get_threshold()[2] and gc.get_count()[2] < 10:
                gc.collect(1)
            now[0] = t
            ex.queue = Source(inp)
            ex._fetch(idle)
            assert ex.gc_pauses.summary()["idle_collections"] == expect, (t, idle, inp)
