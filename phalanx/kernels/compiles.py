"""Triton's compiles as they happen: each kernel form (its constants and the alignment of its
arguments) compiles on first launch, for a second or so. A compile after start-up stalls the
step that meets it, and every request in it. ``install`` hooks Triton's JIT once per process;
``since(n)`` lists the forms compiled after the first n (the step timing reports them)."""

from __future__ import annotations

import time

_LOG: list[tuple[float, str]] = []
_INSTALLED = False


def install() -> None:
    """Record every compile from now on (chained to a hook already set; never skips one)."""
    global _INSTALLED
    if _INSTALLED:
        return
    try:
        from triton import knobs
    except ImportError:      # a Triton without knobs: nothing recorded
        return
    before = knobs.runtime.jit_cache_hook

    def hook(*args, **kw):
        _LOG.append((time.monotonic(), str(kw.get("repr", ""))))
        return before(*args, **kw) if before is not None else False

    knobs.runtime.jit_cache_hook = hook
    _INSTALLED = True


def count() -> int:
    return len(_LOG)


def since(n: int) -> list[str]:
    """The kernel forms compiled after the first ``n``, in order."""
    return [r for _, r in _LOG[n:]]
