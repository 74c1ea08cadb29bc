"""A reading node's side of `vol/node_holds.py`: the files its mount has open, held
for it on the pool's writer, so that one unlinked meanwhile (here, as a temporary file
is, or on another node) keeps its bytes until this node's last close.

No open waits for the writer: an open counts itself (`open_begins`) before it reads
the file's row, and refuses a file whose row has no link left (ESTALE, as NFS answers
a file removed elsewhere) unless this node has it open already.  A few times a second
(`run`) the node tells the writer what changed among the files it holds, those
opened, opening or closed since its last word, against what it last told (`node_hold`:
a round costs what changed, not what is open), with the last change feed row
it had read before it looked (`seen`): the writer frees an orphan only once every
live node's word is past the row that unlinked it, so a file open here then is held,
and one opened later was refused.  Words are numbered and told in order; one whose
answer never came is sent again as it was, and every FULL_S (`-o holds_full_s`), to a
writer of another epoch (it restarted) and to one that dropped this node's holds (its
lease ran out a while) the node says all it holds (in parts of HOLDS_AT_ONCE, or
`-o holds_at_once`: the writer lets go what no part named only with the last), so no
lost answer, lapse or restart leaves the writer holding too much or too little for
long.  Opens for writing
are held by the writer's grants themselves (`granted`).
"""

from __future__ import annotations

import errno
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import trio

from mxfs.fs.node_files import HOLDS_AT_ONCE, ForwardedFiles
from mxfs.vol.access import Caller
from mxfs.vol.node_holds import MAX_HOLDS

log = logging.getLogger("mxfs.control")

ROUND_S = 0.2  # how often the node tells the writer (an orphan waits about this long)
FULL_S = 10  # how often it says all it holds (-o holds_full_s)
ROOT = Caller(pid=0, uid=0, gid=0, gids=frozenset({0}))  # (the daemon's own requests)
# The writer not reached, or not counting this node alive a moment (its lease late):
# the word waits for the next round.
UNREACHED = (errno.EIO, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNREFUSED,
             errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ESTALE)


class HeldOpen:
    """What this node's mount has open or opening, what the writer holds for it
    (`told`, under the writer's epoch `told_to`), and the feed row its last whole
    word was past (`said`)."""

    def __init__(self, forwarded: ForwardedFiles, seen: Callable[[], int],
                 full_s: float = FULL_S, at_once: int = HOLDS_AT_ONCE) -> None:
        """`full_s` and `at_once`: the mount's options (shorter, fewer: a test sees a
        whole word, and one in parts, without waiting 10 s or opening 16,384 files)."""
        self.forwarded = forwarded
        self.full_s, self.at_once = full_s, at_once
        self.vol = forwarded.vol
        self.seen = seen  # the last change feed row this node read
        self.opening: Counter[int] = Counter()  # opens under way, by inode
        self.touched: set[int] = set()  # opened, opening or closed since the last word
        self.told: set[int] = set()
        self.told_to = 0
        self.said = -1
        self.word = 0  # the last word's number
        self.pending: dict[str, Any] | None = None  # a word whose answer never came
        self.full_at = 0.0  # when all was last said
        self._lock = trio.Lock()  # (one word at a time: in order)

    def open_begins(self, ino: int) -> None:
        """Before `ino`'s row is read for an open here (`open_ends` after); ENFILE
        where this node holds as many files as the writer keeps for one."""
        if ino not in self.opening and ino not in self.vol.open_inodes and \
                len(self.opening) + len(self.vol.open_inodes) >= MAX_HOLDS:
            raise OSError(errno.ENFILE, f"this node has {MAX_HOLDS} files open: close some")
        self.opening[ino] += 1
        self.touched.add(ino)

    def open_ends(self, ino: int) -> None:
        self.opening[ino] -= 1
        if not self.opening[ino]:
            del self.opening[ino]
        self.touched.add(ino)

    def closed(self, ino: int) -> None:
        """The last handle of `ino` here is gone."""
        self.touched.add(ino)

    def granted(self, ino: int) -> None:
        """The writer holds `ino` for this node (it granted an open for writing)."""
        self.told.add(ino)
        self.touched.add(ino)  # (let go with the next word if no handle came of it)

    def holds(self, ino: int) -> bool:
        """Whether this node holds `ino` now: open here, or being opened."""
        entry = self.vol.open_inodes.get(ino)
        return ino in self.opening or entry is not None and entry.node.is_reg

    def want(self) -> set[int]:
        """Every file this node holds (for a whole word, every `full_s`)."""
        open_now = {ino for ino, entry in self.vol.open_inodes.items() if entry.node.is_reg}
        return open_now | set(self.opening)

    async def run(self) -> None:
        """The daemon's task: a word every ROUND_S; a writer not reached hears it later."""
        while True:
            await trio.sleep(ROUND_S)
            try:
                await self.tell()
            except OSError as e:
                if e.errno not in UNREACHED:
                    log.warning("the writer refused this node's open files: %s", e)
            except Exception:  # (a bug: logged, the next round tries again; raised, it
                #                 ended the daemon, the mount with it)
                log.exception("telling the writer this node's open files failed")

    async def tell(self) -> None:
        """Tell the writer what changed since the last word, if anything did."""
        async with self._lock:
            if self.pending is not None:  # (sent again as it was: it may have been taken)
                await self._send(self.pending)
            for _ in range(2):  # (again at once when the writer turned out another)
                seen = self.seen()  # (read before looking at what is open)
                if self.told_to == 0 or time.monotonic() - self.full_at >= self.full_s:
                    if await self._tell_all(seen):
                        return
                    continue
                touched, self.touched = self.touched, set()  # (a round costs what changed)
                hold = sorted(i for i in touched if i not in self.told and self.holds(i))
                let_go = sorted(i for i in touched if i in self.told and not self.holds(i))
                self.touched.update(let_go[self.at_once:])  # (the rest: next word)
                self.touched.update(hold[self.at_once:])
                if not hold and not let_go and seen == self.said:
                    return
                body: dict[str, Any] = {"hold": hold[:self.at_once],
                                        "let_go": let_go[:self.at_once]}
                if len(hold) <= self.at_once:  # (it says every hold: the writer may
                    body["seen"] = seen  # rely on it)
                if await self._send(self._numbered(body)):
                    return

    async def _tell_all(self, seen: int) -> bool:
        """A whole word: every file held, in parts of `at_once` (the writer lets go
        what none named only with the last); False if the writer turned out another.
        What was touched stays touched: a file granted just before (told) and opened
        just after the look is checked again by the next word (cleared here, it was
        told as held while the writer, whose last part did not name it, let it go: an
        unlink within the next 10 s freed a file open here)."""
        held = sorted(self.want())
        parts = [held[i:i + self.at_once] for i in range(0, len(held), self.at_once)]
        for n, part in enumerate(parts or [[]]):
            body: dict[str, Any] = {"hold": part, "let_go": [], "full": True, "part": n}
            if n < len(parts) - 1:
                body["more"] = True
            else:
                body["seen"] = seen
            if not await self._send(self._numbered(body)):
                return False
        self.told = set(held)
        self.full_at = time.monotonic()
        return True

    def _numbered(self, body: dict[str, Any]) -> dict[str, Any]:
        self.word += 1
        return {**body, "writer": self.told_to, "word": self.word}

    async def _send(self, body: dict[str, Any]) -> bool:
        """Send a word and take its answer; False if the writer is of another epoch
        than it was meant for, or holds nothing of this node's now (then nothing of
        it was taken: all is told again)."""
        self.pending = body
        reply = await self.forwarded.ask(ROOT, "node_hold", body)
        self.pending = None
        if reply["writer"] != body["writer"] or reply.get("again"):
            self.told, self.told_to, self.said, self.full_at = set(), reply["writer"], -1, 0.0
            return False
        if not body.get("full"):  # (a whole word's parts: `_tell_all` when all went)
            self.told.difference_update(body["let_go"])
            self.told.update(body["hold"])
        if "seen" in body:
            self.said = body["seen"]
        return True
