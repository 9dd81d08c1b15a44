"""examples/rl_loop.py runs end to end on the bundled model: roll out, train one step with
the engine asleep, push the trainer's tensors in, and generate with the new version."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_rl_loop_example_updates_the_engine_each_iteration():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "rl_loop.py"), "--iterations", "2",
                        "--group", "2", "--max-tokens", "8"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert any(line.startswith("iteration 0: weights ['0']") for line in lines), r.stdout
    assert any(line.startswith("iteration 1: weights ['step-1']") for line in lines), r.stdout
    assert "  updated to step-2" in lines and lines[-1].startswith("final (step-2): "), r.stdout
