import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

# Without a GPU, Triton kernels run in the interpreter (must be set before triton is imported).
if not os.path.exists("/dev/nvidia0") and not os.environ.get("CUDA_VISIBLE_DEVICES"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hf_reference import _moe_configs, hf_models_from, tiny_model_dirs  # noqa: E402

# make test's workers share the cores: one torch thread each, in-process engines included, and the
# rank and server processes a test starts too (they inherit OMP_NUM_THREADS). With two OpenMP threads
# a process on two cores, two busy servers spun on each other's descheduled threads: two serve test
# files side by side took more than 5.5 minutes, and 74 s with one thread (alone: ~56 s each).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    torch.set_num_threads(1)


def pytest_sessionstart(session):
    """SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so `finally` blocks stop the servers
    and MPI jobs the tests started in their own sessions instead of leaving them running."""
    import signal

    def unwind(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, unwind)


@pytest.fixture(autouse=True)
def _same_random_state():
    """Every test starts from the same global random state, whatever ran before it in its process:
    make test spreads the files over workers, so that differs from run to run."""
    import random
    random.seed(0)
    torch = sys.modules.get("torch")   # not imported for a test that does not use it
    if torch is not None:
        torch.manual_seed(0)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """model type -> directory with config.json + model.safetensors (fp32, seeded)."""
    return tiny_model_dirs(lambda name: tmp_path_factory.mktemp(f"tiny-{name}"))


@pytest.fixture(scope="session")
def hf_models(tiny_models):
    return hf_models_from(tiny_models)


@pytest.fixture(scope="session")
def tiny_moe_models(tmp_path_factory):
    """Tiny random Mixtral, Qwen3-MoE and Qwen2-MoE (shared expert) checkpoints."""
    return tiny_model_dirs(lambda name: tmp_path_factory.mktemp(f"tiny-{name}"), _moe_configs())


@pytest.fixture(scope="session")
def hf_moe_models(tiny_moe_models):
    return hf_models_from(tiny_moe_models)


@pytest.fixture(scope="session")
def smollm2_hf():
    """transformers' own float32 model of the bundled SmolLM2 GGUF (dequantized by transformers'
    GGUF loader, independently of ours): ~30 s to load here, so once a session."""
    import torch
    from transformers import AutoModelForCausalLM

    from phalanx.models.source import bundled_model_path
    path = bundled_model_path()
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                dtype=torch.float32).eval()
