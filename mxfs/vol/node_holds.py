"""Files other nodes' mounts hold open, as the pool's writer counts them.

A program on a reading node that opens a file and then sees it unlinked (by itself, as
a temporary file is, or on another node) reads and writes on until its last close, as
on a local file system and as NFSv4's open state keeps a removed file for its
clients: the writer keeps an unlinked file's bytes while any node holds it, and
reclaims it once the last one lets it go or its lease ends.  A node holds a file
under its epoch; a node that joined again holds nothing of its old epoch.  After a
writer restart the orphans it finds wait CLAIM_S for the nodes to hold them again.
"""

from __future__ import annotations

import errno

MAX_HOLDS = 1 << 20  # files one node may hold open at once
CLAIM_S = 10.0  # how long a restarted writer keeps the orphans it found for nodes


class NodeHolds:
    """Which node holds which inode open, under which epoch; and the orphans a
    restarted writer keeps until nodes hold them again or CLAIM_S passes."""

    def __init__(self) -> None:
        self._by_node: dict[str, tuple[int, set[int]]] = {}
        self._holders: dict[int, int] = {}  # inode: how many nodes hold it
        self.unclaimed: dict[int, float] = {}  # orphan found at recovery: until when

    def __contains__(self, ino: int) -> bool:
        return ino in self._holders or ino in self.unclaimed

    def holds(self, node: str, epoch: int, ino: int) -> bool:
        held = self._by_node.get(node)
        return held is not None and held[0] == epoch and ino in held[1]

    def nodes(self) -> dict[str, int]:
        """Each node holding files, with its epoch."""
        return {node: epoch for node, (epoch, _) in self._by_node.items()}

    def hold(self, node: str, epoch: int, ino: int) -> list[int]:
        """Hold `ino` for `node` under `epoch`; the inodes nobody holds now that an
        older epoch's holds of that node went."""
        freed: list[int] = []
        held = self._by_node.get(node)
        if held is not None and held[0] != epoch:
            freed = self.drop(node)
            held = None
        if held is None:
            held = self._by_node[node] = (epoch, set())
        if ino not in held[1]:
            if len(held[1]) >= MAX_HOLDS:
                raise OSError(errno.ENFILE, f"node {node} holds {MAX_HOLDS} files open "
                              "on the writer already")
            held[1].add(ino)
            self._holders[ino] = self._holders.get(ino, 0) + 1
            self.unclaimed.pop(ino, None)
        return freed

    def let_go(self, node: str, epoch: int, ino: int) -> bool:
        """`node` closed `ino`; True if nobody holds it now."""
        held = self._by_node.get(node)
        if held is None or held[0] != epoch or ino not in held[1]:
            return False
        held[1].discard(ino)
        if not held[1]:
            del self._by_node[node]
        return self._unheld(ino)

    def drop(self, node: str) -> list[int]:
        """Everything `node` held (it died, or joined again): the inodes nobody holds now."""
        _, inos = self._by_node.pop(node, (0, set()))
        return [ino for ino in inos if self._unheld(ino)]

    def await_claims(self, inos: list[int], until: float) -> None:
        """(A restarted writer.)  Keep these orphans until `until` unless held by then."""
        for ino in inos:
            self.unclaimed[ino] = until

    def unclaimed_past(self, now: float) -> list[int]:
        """The recovery's orphans no node held in time (forgotten here: reclaim them)."""
        out = [ino for ino, until in self.unclaimed.items() if until <= now]
        for ino in out:
            del self.unclaimed[ino]
        return out

    def _unheld(self, ino: int) -> bool:
        left = self._holders[ino] - 1
        if left:
            self._holders[ino] = left
            return False
        del self._holders[ino]
        return True
