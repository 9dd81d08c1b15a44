"""`phalanx bench` refuses values out of range as usage errors naming the flag, before any
engine starts; its reports are JSON every reader takes (an unmeasured figure is null)."""

import json
import socket

import pytest

from phalanx.bench.cli import run_bench
from phalanx.bench.metrics import emit_report


@pytest.mark.parametrize("kind, argv, flag", [
    ("throughput", ["--num-requests", "-1"], "--num-requests"),
    ("throughput", ["--isl", "-5"], "--isl"),
    ("throughput", ["--osl", "0"], "--osl"),
    ("throughput", ["--concurrency", "0"], "--concurrency"),
    ("decode", ["--steps", "-2"], "--steps"),
    ("decode", ["--batch", "1", "0"], "--batch"),
    ("kv", ["--prompt-blocks", "-1"], "--prompt-blocks"),
    ("overhead", ["--requests", "0"], "--requests"),
    ("serve", ["--request-rate", "0"], "--request-rate"),
    ("serve", ["--range-ratio", "1.5"], "--range-ratio"),
    ("serve", ["--max-concurrency", "0"], "--max-concurrency"),
    ("adp", ["--groups", "0"], "--groups"),
])
def test_values_out_of_range_are_usage_errors_naming_the_flag(kind, argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        run_bench(kind, argv)
    assert e.value.code == 2
    assert flag in capsys.readouterr().err


def test_a_server_that_is_not_there_is_named(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]     # nothing listens here once closed
    with pytest.raises(SystemExit) as e:
        run_bench("serve", ["--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "1"])
    assert e.value.code == 2 and "--base-url" in capsys.readouterr().err


def test_unmeasured_figures_are_null_in_the_report(tmp_path):
    path = tmp_path / "r.json"
    emit_report({"idle": float("nan"), "rate": [1.0, float("inf")], "ok": 2.5}, str(path), echo=False)
    assert json.loads(path.read_text()) == {"idle": None, "rate": [1.0, None], "ok": 2.5}
