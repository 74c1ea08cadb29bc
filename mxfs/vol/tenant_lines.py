"""Work queued by tenant, taken one item from each tenant's line in turn.

First come, first served, one user's burst (a mass removal, a thousand closed
connections) held every other user's items behind it for as long as it took.  Each
tenant (`vol/tenants.py`) has a line of its own here, and each take is the first item
of the line that waited longest for a turn, that line then going to the back: another
user's item waits about one item of each busy user, not the whole queue.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Container
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
        item = self.pop_where(lambda tenant: True)
        if item is None:
            raise IndexError("no item waits")
        return item

    def pop_where(self, may: Callable[[int], bool]) -> T | None:
        """The next item in turn of the tenants `may` lets go now (those it holds back
        keep their place), or None."""
        for tenant, line in self._lines.items():
            if may(tenant):
                item = line.popleft()
                del self._lines[tenant]
                if line:
                    self._lines[tenant] = line  # (to the back)
                self._count -= 1
                return item
        return None

    def any_where(self, may: Callable[[int], bool]) -> bool:
        """Whether an item of a tenant `may` lets go waits."""
        return any(may(tenant) for tenant in self._lines)

    def drop(self, items: Container[T]) -> None:
        """Take `items` out of every line."""
        for tenant in list(self._lines):
            line = self._lines[tenant]
            kept = deque(item for item in line if item not in items)
            self._count -= len(line) - len(kept)
            if kept:
                self._lines[tenant] = kept
            else:
                del self._lines[tenant]
