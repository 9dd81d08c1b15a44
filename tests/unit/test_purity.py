"""The control plane imports no torch, triton, transformers, mpi4py or fastapi."""

import subprocess
import sys

import pytest

HEAVY = ("torch", "triton", "transformers", "mpi4py", "fastapi", "numpy")
PURE_MODULES = [
    "phalanx",
    "phalanx.kv_manager",
    "phalanx.pyexecutor.scheduler",
    "phalanx.pyexecutor.request",
    "phalanx.executor.messages",
    "phalanx.llmapi.sampling_params",
    "phalanx.llmapi.lora_request",
    "phalanx.attention_dp.router",
    "phalanx.config",
    "phalanx.serve.responses",     # the Responses API's conversions: plain data
    "phalanx.serve.item_stream",
    "phalanx.serve.messages",
]


@pytest.mark.parametrize("module", PURE_MODULES)
def test_module_imports_no_heavy_dependency(module):
    code = (f"import sys, {module}\n"
            f"bad = [m for m in {HEAVY!r} if m in sys.modules]\n"
            "print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"{module} pulled in {out.stdout.strip()}"


def test_resolving_the_bundled_model_imports_no_torch():
    """The user process resolves the model before it starts the ranks: torch (~2 s to import)
    is not on that path."""
    code = ("import sys\n"
            "from phalanx.models.source import resolve_model\n"
            "src = resolve_model(None)\n"
            "assert src.kind == 'gguf' and src.config.num_layers > 0\n"
            "print(','.join(m for m in ('torch', 'triton', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"resolving the model pulled in {out.stdout.strip()}"
