"""Human byte sizes: '1MiB', '4k', '2G' in, '1.5 GiB' out."""

from __future__ import annotations

import re

from mxfs.errors import UsageError

_SUFFIX = {
    "": 1, "b": 1,
    "k": 1 << 10, "kb": 1000, "kib": 1 << 10,
    "m": 1 << 20, "mb": 1000**2, "mib": 1 << 20,
    "g": 1 << 30, "gb": 1000**3, "gib": 1 << 30,
    "t": 1 << 40, "tb": 1000**4, "tib": 1 << 40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """Parse a size; single letters and IEC suffixes are binary, 'kB'/'MB' decimal."""
    m = _SIZE.match(text)
    if not m or m.group(2).lower() not in _SUFFIX:
        raise UsageError(f"bad size {text!r}", "write it like 1MiB, 512k or 4096")
    value = float(m.group(1)) * _SUFFIX[m.group(2).lower()]
    if value != int(value):
        raise UsageError(f"size {text!r} is not a whole number of bytes", "use a larger unit")
    return int(value)


def format_size(n: float) -> str:
    """Format a byte count with a binary suffix."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
