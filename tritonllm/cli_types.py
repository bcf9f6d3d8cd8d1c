"""argparse types shared by the command lines (the launcher, the sidecar, the benchmarks): each
parses one flag's text or raises ``argparse.ArgumentTypeError``, which argparse reports as a
usage error naming the flag (exit status 2)."""

from __future__ import annotations

import argparse
import math


def positive_int(text: str) -> int:
    """An integer >= 1.

    Raises:
        argparse.ArgumentTypeError: anything else.
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None


def seconds(text: str) -> float:
    """A finite number of seconds >= 0 (a timeout where 0 means none).

    Raises:
        argparse.ArgumentTypeError: not a number, negative, infinite or NaN.
    """
    value = _number(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds >= 0, got {text!r}")
    return value


def positive_seconds(text: str) -> float:
    """A finite number of seconds > 0 (a timeout that cannot be turned off).

    Raises:
        argparse.ArgumentTypeError: not a number, not above 0, infinite or NaN.
    """
    value = _number(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds > 0, got {text!r}")
    return value
