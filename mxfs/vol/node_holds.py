"""Files other nodes' mounts hold open, as the pool's writer counts them.

A program on a reading node that opens a file and then sees it unlinked (by itself, as
a temporary file is, or on another node) reads and writes on until its last close, as
on a local file system and as NFSv4's open state keeps a removed file for its
clients: the writer keeps an unlinked file's bytes while any node holds it, and
reclaims it once the last one lets it go or its lease ends.  A node holds a file
under its epoch; a node that joined again holds nothing of its old epoch.

No open waits for the writer.  A node tells its holds a few times a second
(`fs/held_open.py`), each time with the last change feed row it had read before it
looked at its open files (`seen`); its opens note the file before they read its row.
So an orphan whose unlink committed by feed row M is reclaimed only once every live
node told its holds past M: a node that had the file open then held it, and one that
opened it later read the row after the unlink and refused the open (ESTALE).  A
restarted writer treats the orphans it finds the same way.
"""

from __future__ import annotations

from collections import deque

MAX_HOLDS = 1 << 20  # files one node may hold open at once
STALL_S = 60.0  # an orphan waiting this long for nodes' word is logged (once a stall)


class NodeHolds:
    """Which node holds which inode open, under which epoch; how far each node's
    word goes (`seen`); and the orphans waiting for every live node's word."""

    def __init__(self) -> None:
        self._by_node: dict[str, tuple[int, set[int]]] = {}
        self._holders: dict[int, int] = {}  # inode: how many nodes hold it
        self.seen: dict[str, tuple[int, int]] = {}  # node: (epoch, feed row it had read)
        self.words: dict[str, tuple[int, int]] = {}  # node: (epoch, its last word's number)
        self._waiting: deque[tuple[int, int, float]] = deque()  # (mark, orphan, since)
        self.stalled = False  # (the oldest waited past STALL_S: said once)
        self._whole: dict[str, tuple[int, int, set[int]]] = {}  # (epoch, part, named so far)
        self.over: set[str] = set()  # nodes past MAX_HOLDS in their last word (logged)

    def __contains__(self, ino: int) -> bool:
        return ino in self._holders

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def nodes(self) -> dict[str, int]:
        """Each node holding files or heard from, with its epoch."""
        out = {node: epoch for node, (epoch, _) in self.seen.items()}
        out.update((node, epoch) for node, (epoch, _) in self._by_node.items())
        return out

    def fresh(self, node: str, epoch: int, word: int) -> bool:
        """Whether `node`'s word numbered `word` is newer than any taken from it under
        `epoch` (`took`): a word sent again, or one late on a connection given up,
        changes nothing."""
        last = self.words.get(node)
        return last is None or last[0] != epoch or word > last[1]

    def knows(self, node: str, epoch: int) -> bool:
        """Whether a word of `node` under `epoch` was taken since its holds last went."""
        last = self.words.get(node)
        return last is not None and last[0] == epoch

    def took(self, node: str, epoch: int, word: int) -> None:
        self.words[node] = (epoch, word)

    def whole(self, node: str, epoch: int, part: int, inos: list[int], last: bool
              ) -> list[int] | None:
        """Part `part` of a whole word too long for one request: its holds taken at once,
        and with the `last` part, whatever `node` held that no part named let go (the
        inodes nobody holds now).  None where the parts came out of order (a part lost:
        the node says all again)."""
        gathered = self._whole.get(node)
        if part == 0:
            gathered = self._whole[node] = (epoch, 0, set())
        elif gathered is None or gathered[:2] != (epoch, part - 1):
            self._whole.pop(node, None)
            return None
        names = gathered[2]
        names.update(inos[:MAX_HOLDS - len(names)])
        self._whole[node] = (epoch, part, names)
        freed: list[int] = []
        for ino in inos:
            freed += self.hold(node, epoch, ino)
        if last:  # (each part's holds are taken: only what none named goes now)
            del self._whole[node]
            held = self._by_node.get(node)
            if held is not None and held[0] != epoch:  # (an older epoch's: all go)
                freed += self.drop(node, held[0])
            elif held is not None:
                freed += [ino for ino in held[1] - names if self.let_go(node, epoch, ino)]
        return freed

    def held(self, node: str, epoch: int) -> set[int]:
        """What `node` holds under `epoch` (this table's own set: not to be changed)."""
        held = self._by_node.get(node)
        return held[1] if held is not None and held[0] == epoch else set()

    def hold(self, node: str, epoch: int, ino: int) -> list[int]:
        """Hold `ino` for `node` under `epoch`; the inodes nobody holds now that an
        older epoch's holds of that node went."""
        freed: list[int] = []
        held = self._by_node.get(node)
        if held is not None and held[0] != epoch:
            freed = self.drop(node, held[0])
            held = None
        if held is None:
            held = self._by_node[node] = (epoch, set())
        if ino not in held[1]:
            if len(held[1]) >= MAX_HOLDS:  # (the node opens no more: `fs/held_open.py`)
                self.over.add(node)
                return freed
            held[1].add(ino)
            self._holders[ino] = self._holders.get(ino, 0) + 1
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

    def heard(self, node: str, epoch: int, seen: int) -> None:
        """`node` told every hold it had after reading the feed up to row `seen`."""
        self.seen[node] = (epoch, seen)

    def drop(self, node: str, epoch: int | None = None) -> list[int]:
        """Everything `node` held (under `epoch`, or any: it died, or joined again):
        the inodes nobody holds now.  Its word under a newer epoch stays."""
        for said in (self.seen, self.words):
            if epoch is None or said.get(node, (epoch, 0))[0] == epoch:
                said.pop(node, None)
        if epoch is None or self._whole.get(node, (epoch,))[0] == epoch:
            self._whole.pop(node, None)
        held = self._by_node.get(node)
        if held is None or epoch is not None and held[0] != epoch:
            return []
        del self._by_node[node]
        return [ino for ino in held[1] if self._unheld(ino)]

    def wait(self, inos: list[int], mark: int, now: float) -> None:
        """These orphans' unlinks committed by feed row `mark`: reclaimed once every
        live node's word is past it (`ready`)."""
        self._waiting.extend((mark, ino, now) for ino in inos)

    def behind(self, alive: dict[str, int], now: float) -> list[str]:
        """The live nodes whose word the oldest orphan has waited for past STALL_S."""
        if not self._waiting or now - self._waiting[0][2] < STALL_S:
            return []
        mark = self._waiting[0][0]
        return sorted(node for node, epoch in alive.items()
                      if self._word(node, epoch) < mark)

    def _word(self, node: str, epoch: int) -> int:
        """The feed row `node` (under `epoch`) last said its holds past; -1: none."""
        said = self.seen.get(node)
        return said[1] if said is not None and said[0] == epoch else -1

    def ready(self, alive: dict[str, int]) -> tuple[list[int], list[int]]:
        """(orphans no live node holds, past every live node's word: reclaim them;
        those a node held meanwhile: reclaimed after its last close)."""
        floor = min((self._word(node, epoch) for node, epoch in alive.items()),
                    default=None)  # (no live node: nobody to wait for)
        free: list[int] = []
        held: list[int] = []
        while self._waiting and (floor is None or self._waiting[0][0] <= floor):
            _, ino, _ = self._waiting.popleft()
            (held if ino in self._holders else free).append(ino)
        return free, held

    def _unheld(self, ino: int) -> bool:
        left = self._holders[ino] - 1
        if left:
            self._holders[ino] = left
            return False
        del self._holders[ino]
        return True
