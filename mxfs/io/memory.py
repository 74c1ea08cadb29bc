"""How much memory this node has, and how much of it the kernel could give now.

Readers decide by it whether to go through the page cache: a mapped model load reads
ahead only what memory can hold, and KV gets use the cache while the node has memory
to spare.
"""

from __future__ import annotations

import time

SPARE = 0.25  # of the node's memory available: it has memory to spare
_seen: tuple[float, bool] = (0.0, False)  # (when, the answer) of the last look
LOOK_S = 1.0  # an answer this fresh is reused (a get asks at every call)


def meminfo() -> tuple[int, int]:
    """(MemAvailable, MemTotal) in bytes; (0, 0) where /proc/meminfo cannot say."""
    got: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in ("MemAvailable", "MemTotal"):
                    got[name] = int(rest.split()[0]) * 1024
                    if len(got) == 2:
                        break
    except (OSError, ValueError, IndexError):
        return 0, 0
    return got.get("MemAvailable", 0), got.get("MemTotal", 0)


def spare(available: int, total: int) -> bool:
    """Whether a node with `available` of `total` bytes has memory to spare."""
    return total > 0 and available >= SPARE * total


def has_spare() -> bool:
    """`spare` for this node now (looked at most once every LOOK_S)."""
    global _seen
    now = time.monotonic()
    if now - _seen[0] >= LOOK_S:
        _seen = (now, spare(*meminfo()))
    return _seen[1]
