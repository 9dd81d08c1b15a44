"""Triton's compiles as they happen: each kernel form (its constants and the alignment of its
arguments) compiles on first launch, for a second or so. A compile after start-up stalls the
step that meets it, and every request in it. ``install`` hooks Triton's JIT once per process;
``since(n)`` lists the forms compiled after the first n (the step timing reports them)."""

from __future__ import annotations

import inspect
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
        try:
            what = describe(kw)
        except Exception:  # noqa: BLE001 - a Triton whose hook arguments differ: its own words
            what = str(kw.get("repr", "?"))
        _LOG.append((time.monotonic(), what))     # (a compile the earlier hook skips is listed too)
        return before(*args, **kw) if before is not None else False

    knobs.runtime.jit_cache_hook = hook
    _INSTALLED = True


def describe(kw: dict) -> str:
    """``kernel(16-byte aligned arguments; argument=value for the values compiled in)``: what
    tells one form of a kernel from another (the constexprs a launch passes are left out)."""
    fn = getattr(kw.get("fn"), "jit_function", None)
    names = list(getattr(fn, "arg_names", ()) or ())
    declared = _constexprs(fn)
    info = kw.get("compile") or {}
    name = getattr(kw.get("fn"), "name", None) or str(kw.get("repr", "")).split("[", 1)[0]
    if not names or not isinstance(info, dict):
        return str(kw.get("repr", name))
    arg = lambda key: names[key[0]] if isinstance(key, tuple) and key and key[0] < len(names) else str(key)  # noqa: E731
    attrs = (info.get("configs") or [{}])[0] or {}
    aligned = sorted(arg(k) for k, v in attrs.items() if any(a[0] == "tt.divisibility" for a in v))
    values = sorted(f"{arg(k)}={v}" for k, v in (info.get("constants") or {}).items() if arg(k) not in declared)
    return f"{name}({' '.join(aligned)}; {' '.join(values)})"


def _constexprs(fn) -> set[str]:
    """The parameters a kernel declares ``tl.constexpr``."""
    try:
        params = inspect.signature(fn.fn).parameters.values()
    except (AttributeError, TypeError, ValueError):
        return set()
    return {p.name for p in params if "constexpr" in str(p.annotation)}


def count() -> int:
    return len(_LOG)


def since(n: int) -> list[str]:
    """The kernel forms compiled after the first ``n``, in order."""
    return [r for _, r in _LOG[n:]]
