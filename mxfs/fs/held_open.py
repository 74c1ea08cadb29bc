"""A reading node's side of `vol/node_holds.py`: the files its mount has open, held
for it on the pool's writer, so that one unlinked meanwhile (here, as a temporary file
is, or on another node) keeps its bytes until this node's last close.

No open waits for the writer: an open notes the file (`opening`) before it reads the
file's row, and refuses a file whose row has no link left (ESTALE, as NFS answers a
file removed elsewhere) unless this node has it open already.  A few times a second
(`run`) the node tells the writer what its mount opened and closed since it last
said (`node_hold`), with the last change feed row it had read before it looked
(`seen`): the writer frees an orphan only once every live node's word is past the
row that unlinked it, so a file open here then is held, and one opened later was
refused.  An open for writing is held by the writer's grant itself (`granted`).  A
reply from a writer other than the one last told (it restarted) makes the node tell
it everything again.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable

import trio

from mxfs.fs.node_files import HOLDS_AT_ONCE, ForwardedFiles
from mxfs.vol.access import Caller

log = logging.getLogger("mxfs.control")

ROUND_S = 0.2  # how often the node tells the writer (an orphan waits about this long)
ROOT = Caller(pid=0, uid=0, gid=0, gids=frozenset({0}))  # (the daemon's own requests)
UNREACHED = (errno.EIO, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNREFUSED,
             errno.EHOSTUNREACH, errno.ENETUNREACH)


class HeldOpen:
    """The regular files this node's mount has open (`want`), those the writer holds
    for it (`told`, under the writer's epoch `told_to`), and the feed row its last
    word was past (`said`)."""

    def __init__(self, forwarded: ForwardedFiles, seen: Callable[[], int]) -> None:
        self.forwarded = forwarded
        self.seen = seen  # the last change feed row this node read
        self.want: set[int] = set()
        self.told: set[int] = set()
        self.told_to = 0
        self.said = -1
        self._lock = trio.Lock()  # (one word at a time: holds and let-gos in order)

    def opening(self, ino: int) -> None:
        """Before `ino`'s row is read for an open here."""
        self.want.add(ino)

    def granted(self, ino: int) -> None:
        """The writer holds `ino` for this node already (it granted an open for
        writing): let go at the last close, as any other."""
        self.want.add(ino)
        self.told.add(ino)

    def closed(self, ino: int) -> None:
        """The last handle of `ino` here is gone: let go with the next word."""
        self.want.discard(ino)

    async def run(self) -> None:
        """The daemon's task: a word every ROUND_S; a writer not reached hears it later."""
        while True:
            await trio.sleep(ROUND_S)
            try:
                await self.tell()
            except OSError as e:
                if e.errno not in UNREACHED:
                    log.warning("the writer refused this node's open files: %s", e)

    async def tell(self) -> None:
        """Tell the writer what changed since the last word, if anything did."""
        async with self._lock:
            for _ in range(2):  # (again at once when the writer turned out another)
                seen = self.seen()  # (read before looking at what is open)
                hold = sorted(self.want - self.told)
                let_go = sorted(self.told - self.want)[:HOLDS_AT_ONCE]
                whole = len(hold) <= HOLDS_AT_ONCE
                if not hold and not let_go and seen == self.said:
                    return
                sent = hold[:HOLDS_AT_ONCE]
                body: dict[str, object] = {"hold": sent, "let_go": let_go,
                                           "writer": self.told_to}
                if whole:  # (the word covers every hold: the writer may rely on it)
                    body["seen"] = seen
                reply = await self.forwarded.ask(ROOT, "node_hold", body)
                if reply["writer"] != self.told_to:  # (it restarted: tell it everything)
                    self.told, self.told_to, self.said = set(), reply["writer"], -1
                    continue
                stale = set(reply["stale"])
                self.told.difference_update(let_go)
                self.told.update(set(sent) - stale)
                if whole:
                    self.said = seen
                if stale:
                    log.info("%d file(s) open here were freed on the writer before it "
                             "heard of them", len(stale))
                return
