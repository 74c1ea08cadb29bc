"""Answers the writer keeps for a node's repeated request, bounded in all and per owner.

A node that lost an answer (its connection broke after the writer acted) asks again,
and is answered as the first time, not served twice.  The writer keeps a bounded
number of such answers, the oldest going first: one shared table let a user's burst of
requests through one node push out everyone else's (a user whose answer went got
EBADF for a file that was in fact named), so each owner (a node and a user, her
subordinate uids with her) keeps `per_owner` at most, and the table `most` in all.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Answers(Generic[K, V]):
    def __init__(self, most: int, per_owner: int) -> None:
        self.most = most
        self.per_owner = per_owner
        self._answers: OrderedDict[K, V] = OrderedDict()
        self._owner: dict[K, Hashable] = {}
        self._by_owner: dict[Hashable, deque[K]] = {}

    def __len__(self) -> int:
        return len(self._answers)

    def get(self, key: K) -> V | None:
        return self._answers.get(key)

    def keep(self, key: K, owner: Hashable, answer: V) -> None:
        """Keep `answer` for `key`, `owner`'s (the first answer stands)."""
        if key in self._answers:
            return
        self._answers[key] = answer
        self._owner[key] = owner
        mine = self._by_owner.setdefault(owner, deque())
        mine.append(key)
        if len(mine) > self.per_owner:
            self.forget(mine[0])
        while len(self._answers) > self.most:
            self.forget(next(iter(self._answers)))

    def forget(self, key: K) -> None:
        self._answers.pop(key, None)
        owner = self._owner.pop(key, None)
        mine = self._by_owner.get(owner) if owner is not None else None
        if mine is None:
            return
        if mine[0] == key:
            mine.popleft()  # (the oldest, most often)
        else:
            mine.remove(key)
        if not mine:
            del self._by_owner[owner]
