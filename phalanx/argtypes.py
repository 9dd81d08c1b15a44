"""argparse types that refuse values out of range as usage errors naming the flag (argparse
prints the flag, the value and this message, and exits 2)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any


def at_least(low: float, kind: type = int) -> Callable[[str], Any]:
    """A ``kind`` of at least ``low``."""
    def check(value: str) -> Any:
        v = kind(value)
        if not v >= low:
            raise argparse.ArgumentTypeError(f"{value} is below {low}")
        return v
    check.__name__ = kind.__name__      # argparse names the type in its "invalid value" message
    return check


def above(low: float, kind: type = float) -> Callable[[str], Any]:
    """A ``kind`` greater than ``low`` (inf allowed)."""
    def check(value: str) -> Any:
        v = kind(value)
        if not v > low:
            raise argparse.ArgumentTypeError(f"{value} must be greater than {low}")
        return v
    check.__name__ = kind.__name__
    return check


POSITIVE = at_least(1)
NON_NEGATIVE = at_least(0)


def port(value: str) -> int:
    p = int(value)
    if not 1 <= p <= 65535:
        raise argparse.ArgumentTypeError(f"{p} is not a TCP port (1 to 65535)")
    return p


def ratio(value: str) -> float:
    """A float in [0, 1)."""
    r = float(value)
    if not 0.0 <= r < 1.0:
        raise argparse.ArgumentTypeError(f"{value} is not in [0, 1)")
    return r
