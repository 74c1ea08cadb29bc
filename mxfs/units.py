"""Human byte sizes: '1MiB', '4k', '2G' in, '1.5 GiB' out; and the other numbers a command
line takes (counts, seconds, fractions), checked where they are parsed, before any work starts."""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable

from mxfs.errors import UsageError

_SUFFIX = {
    "": 1, "b": 1,
    "k": 1 << 10, "kb": 1000, "kib": 1 << 10,
    "m": 1 << 20, "mb": 1000**2, "mib": 1 << 20,
    "g": 1 << 30, "gb": 1000**3, "gib": 1 << 30,
    "t": 1 << 40, "tb": 1000**4, "tib": 1 << 40,
}
_SIZE = re.compile(r"^\s*([0-9]+)(?:\.([0-9]+))?\s*([a-zA-Z]*)\s*$")
# The largest size anything here stores or sends (a signed 64-bit integer: the store's
# columns, the control protocol's integers).
MAX_SIZE = 2**63 - 1
BENCH_MIN_SIZE = 1 << 20  # the smallest file `mxfs bench` and its gates measure with
# Digits a fraction may have and still be a whole number of bytes: no suffix is more than
# 2^40, and k/2^40 needs at most 40 decimal places (trailing zeros aside).
_FRACTION_DIGITS = 40


def parse_size(text: str) -> int:
    """Parse a size; single letters and IEC suffixes are binary, 'kB'/'MB' decimal.
    Exact (integers, never floats: 10^26 bytes is not rounded to another number), and
    at most MAX_SIZE."""
    m = _SIZE.match(text)
    if not m or m.group(3).lower() not in _SUFFIX:
        raise UsageError(f"bad size {_shown(text)}", "write it like 1MiB, 512k or 4096")
    whole, frac = m.group(1).lstrip("0"), (m.group(2) or "").rstrip("0")
    if len(whole) > len(str(MAX_SIZE)):  # (before int(): thousands of digits are refused)
        raise _too_big(text)
    if len(frac) > _FRACTION_DIGITS:
        raise UsageError(f"size {_shown(text)} is not a whole number of bytes",
                         "use a larger unit")
    scale = 10 ** len(frac)
    value, rest = divmod((int(whole or "0") * scale + int(frac or "0"))
                         * _SUFFIX[m.group(3).lower()], scale)
    if rest:
        raise UsageError(f"size {_shown(text)} is not a whole number of bytes",
                         "use a larger unit")
    if value > MAX_SIZE:
        raise _too_big(text)
    return value


def _too_big(text: str) -> UsageError:
    return UsageError(f"size {_shown(text)} is too big",
                      f"give at most {MAX_SIZE} bytes (8 EiB, less 1 byte)")


def _shown(text: str) -> str:
    """`text` quoted for a message, cut short when long (a 400-digit size is one line)."""
    return repr(text) if len(text) <= 40 else f"{text[:24]!r}... ({len(text)} characters)"


def format_size(n: float) -> str:
    """Format a byte count with a binary suffix."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


# ---- argparse types: a bad number is refused by the parser, as one line naming the flag,
# not met as an internal error (or a wrong result) after minutes of work --------------

def size_arg(least: int = 0) -> Callable[[str], int]:
    """An argparse type: a size (`parse_size`) of at least `least` bytes."""
    def parse(text: str) -> int:
        try:
            n = parse_size(text)
        except UsageError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        if n < least:
            raise argparse.ArgumentTypeError(
                f"{_shown(text)} is under {format_size(least)}: give at least that" if least > 1
                else f"{_shown(text)} is not a size above 0: give one like 1MiB")
        return n
    return parse


def count_arg(least: int = 1, most: int = 1_000_000) -> Callable[[str], int]:
    """An argparse type: a whole number from `least` to `most`."""
    def parse(text: str) -> int:
        try:
            n = int(text) if len(text) <= 20 else None
        except ValueError:
            n = None
        if n is None or not least <= n <= most:
            raise argparse.ArgumentTypeError(
                f"{_shown(text)} is not a whole number from {least} to {most}")
        return n
    return parse


def finite_arg(most: float, zero: bool = False) -> Callable[[str], float]:
    """An argparse type: a number above 0 and at most `most` (seconds, minutes, ...; or 0
    itself where `zero` means none): never NaN or infinite, which sleeps and timeouts
    take as an internal error, or as 'no time at all'."""
    def parse(text: str) -> float:
        try:
            n = float(text)
        except ValueError:
            n = math.nan
        if not (zero and n == 0) and not (math.isfinite(n) and 0 < n <= most):
            raise argparse.ArgumentTypeError(
                f"{_shown(text)} is not a number above 0 and at most {most:g}"
                + (" (or 0)" if zero else ""))
        return n
    return parse


def fraction_arg(text: str) -> float:
    """An argparse type: a fraction from 0 to below 1 (a tolerance: 0.15 is 15%)."""
    try:
        n = float(text)
    except ValueError:
        n = math.nan
    if not 0 <= n < 1:  # (NaN fails every comparison)
        raise argparse.ArgumentTypeError(f"{_shown(text)} is not a fraction from 0 to below 1: "
                                         "give one like 0.15 (15%)")
    return n
