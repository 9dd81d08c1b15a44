"""tools/bench_lora.py: the forms it times agree (``--check``: the decode and grouped kernels against the
dense form over its projections' part counts, tiny shapes in the interpreter on a CPU)."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

TOOL = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "bench_lora.py")


def test_the_tool_s_two_forms_agree():
    run = subprocess.run([sys.executable, TOOL, "--check"], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1")})
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.strip().splitlines()
    assert lines[-1] == "ok" and sum("relative error" in line for line in lines) == 16
