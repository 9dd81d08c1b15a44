"""The compile log the step timing reports: every Triton JIT compile is recorded, in order, and
the hook it chains to still decides (a hook that skips nothing lets every compile run)."""

import pytest

pytest.importorskip("triton")
from triton import knobs  # noqa: E402

from phalanx.kernels import compiles  # noqa: E402


def test_every_compile_is_recorded_in_order_and_the_earlier_hook_still_answers(monkeypatch):
    monkeypatch.setattr(compiles, "_LOG", [])
    monkeypatch.setattr(compiles, "_INSTALLED", False)
    seen = []

    def earlier(**kw):
        seen.append(kw["repr"])
        return kw["repr"] == "skip"

    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", earlier)
    compiles.install()
    compiles.install()               # once: a second call chains nothing more
    hook = knobs.runtime.jit_cache_hook
    assert hook is not earlier
    n = compiles.count()
    assert not hook(key="a", repr="_extend_kernel[num_warps=4](len_ptr: *i32)", fn=None, compile={},
                    is_manual_warmup=False, already_compiled=False)
    assert hook(key="b", repr="skip", fn=None, compile={}, is_manual_warmup=False, already_compiled=False)
    assert compiles.since(n) == ["_extend_kernel[num_warps=4](len_ptr: *i32)", "skip"]
    assert compiles.since(n + 1) == ["skip"]
    assert seen == ["_extend_kernel[num_warps=4](len_ptr: *i32)", "skip"]


def test_without_an_earlier_hook_no_compile_is_skipped(monkeypatch):
    monkeypatch.setattr(compiles, "_LOG", [])
    monkeypatch.setattr(compiles, "_INSTALLED", False)
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    compiles.install()
    assert not knobs.runtime.jit_cache_hook(key="k", repr="_decode_split_kernel", fn=None, compile={},
                                            is_manual_warmup=False, already_compiled=False)
    assert compiles.since(0) == ["_decode_split_kernel"]
