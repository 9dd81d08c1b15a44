"""HostClock: each mark gives the time since the previous one to its phase, per timed iteration."""

import time

from phalanx.pyexecutor.host_clock import HostClock


def test_marks_split_the_time_between_phases_over_the_timed_iterations():
    clock = HostClock()
    clock.mark("fetch")                       # off: nothing recorded
    assert clock.seconds == {}
    clock.start(iteration=10)
    for _ in range(4):
        time.sleep(0.002)
        clock.mark("schedule")
        time.sleep(0.006)
        clock.mark("wait")
    clock.stop(iteration=14)
    clock.mark("wait")                        # stopped: not counted
    ms = clock.per_step_ms(iteration=99)      # iterations after the stop do not dilute it
    assert set(ms) == {"schedule", "wait"}
    assert 1.5 < ms["schedule"] < 5 and 5.5 < ms["wait"] < 12, ms
    assert ms["wait"] > 2 * ms["schedule"]
