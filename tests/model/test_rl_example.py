"""examples/rl_loop.py runs end to end on the bundled model: roll out, train one step with
the engine asleep, push the trainer's tensors in, and generate with the new version. The trainer's
copy is either the example's default, the bundled GGUF read by transformers' GGUF loader (the
command its docstring gives), or a transformers checkpoint directory (``--policy``): the
session's model of the bundled GGUF, saved."""

import os
import subprocess
import sys

import pytest


def save_checkpoint(model, path) -> None:
    """A transformers checkpoint of ``model`` (loaded from a GGUF, which transformers marks quantized and
    will not save itself): its config without the GGUF marker, and its tensors (tied ones once)."""
    import copy

    from safetensors.torch import save_model
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(path)
    save_model(model, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("policy", ["bundled GGUF", "checkpoint"])
def test_rl_loop_example_updates_the_engine_each_iteration(policy, request, tmp_path):
    args = []
    if policy == "checkpoint":
        save_checkpoint(request.getfixturevalue("smollm2_hf"), tmp_path)
        args = ["--policy", str(tmp_path)]
    r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "rl_loop.py"), "--iterations", "2",
                        "--group", "2", "--max-tokens", "8", *args], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert any(line.startswith("iteration 0: weights ['0']") for line in lines), r.stdout
    assert any(line.startswith("iteration 1: weights ['step-1']") for line in lines), r.stdout
    assert "  updated to step-2" in lines and lines[-1].startswith("final (step-2): "), r.stdout
