"""Work queued by tenant, taken one item from each tenant's line in turn.

First come, first served, one user's burst (a mass removal, a thousand closed
connections) held every other user's items behind it for as long as it took.  Each
tenant (`vol/tenants.py`) has a line of its own here, and each take is the first item
of the line that waited longest for a turn, that line then going to the back: another
user's item waits about one item of each busy user, not the whole queue.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Generic, TypeVar

T = TypeVar("T")


class Lines(Generic[T]):
    """Lines of items by tenant (not thread-safe: callers hold their own lock)."""

    def __init__(self) -> None:
        self._lines: OrderedDict[int, deque[T]] = OrderedDict()
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def of(self, tenant: int) -> int:
        """How many of `tenant`'s items wait."""
        line = self._lines.get(tenant)
        return 0 if line is None else len(line)

    def push(self, tenant: int, item: T) -> None:
        self._lines.setdefault(tenant, deque()).append(item)
        self._count += 1

    def pop(self) -> T:
        """The next item in turn (IndexError if none waits)."""
        if not self._count:
            raise IndexError("no item waits")
        tenant, line = next(iter(self._lines.items()))
        item = line.popleft()
        del self._lines[tenant]
        if line:
            self._lines[tenant] = line  # (to the back)
        self._count -= 1
        return item
