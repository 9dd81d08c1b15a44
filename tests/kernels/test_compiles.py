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
    assert not hook(key="a", repr="_prefill_kernel[num_warps=4](len_ptr: *i32)", fn=None, compile={},
                    is_manual_warmup=False, already_compiled=False)
    assert hook(key="b", repr="skip", fn=None, compile={}, is_manual_warmup=False, already_compiled=False)
    assert compiles.since(n) == ["_prefill_kernel[num_warps=4](len_ptr: *i32)", "skip"]
    assert compiles.since(n + 1) == ["skip"]
    assert seen == ["_prefill_kernel[num_warps=4](len_ptr: *i32)", "skip"]


def test_without_an_earlier_hook_no_compile_is_skipped(monkeypatch):
    monkeypatch.setattr(compiles, "_LOG", [])
    monkeypatch.setattr(compiles, "_INSTALLED", False)
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    compiles.install()
    assert not knobs.runtime.jit_cache_hook(key="k", repr="_decode_split_kernel", fn=None, compile={},
                                            is_manual_warmup=False, already_compiled=False)
    assert compiles.since(0) == ["_decode_split_kernel"]


def test_a_compile_is_described_by_its_aligned_arguments_and_compiled_in_values():
    jit = pytest.importorskip("triton.runtime.jit")
    from phalanx.kernels import triton_attention

    fn = triton_attention._decode_merge_kernel
    names = fn.arg_names
    kw = {"key": "k", "repr": "r", "fn": jit.JitFunctionInfo("m", "_decode_merge_kernel", fn),
          "compile": {"constants": {(names.index("D"),): 128, (names.index("window"),): 1},
                      "configs": [{(names.index("part_ptr"),): [["tt.divisibility", 16]],
                                   (names.index("len_ptr"),): [["tt.divisibility", 16]]}]}}
    assert compiles.describe(kw) == "_decode_merge_kernel(len_ptr part_ptr; window=1)"   # D: a declared constexpr
