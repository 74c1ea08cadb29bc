"""A reading node's side of `vol/node_holds.py`: the files its mount has open, held
for it on the pool's writer, so that one unlinked meanwhile (here, as a temporary file
is, or on another node) keeps its bytes until this node's last close.

The first open of a file here waits for the writer's word (`node_hold`, one round
trip; a file removed before it arrived is ESTALE, as NFS answers); an open for writing
is held by the writer's grant itself.  Last closes are let go with the next round,
once a second, told together with any holds in one request, in order.  A writer that
restarted (a new epoch) is told every hold again, within the time it keeps its
orphans for that (`CLAIM_S`).  A writer that cannot be reached holds the open up no
longer than the request's bound: the file opens, and is held with the next round.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable

import trio

from mxfs.fs.node_files import HOLDS_AT_ONCE, ForwardedFiles
from mxfs.vol.access import Caller

log = logging.getLogger("mxfs.control")

ROOT = Caller(pid=0, uid=0, gid=0, gids=frozenset({0}))  # (the rounds: the daemon's own)
UNREACHED = (errno.EIO, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNREFUSED,
             errno.EHOSTUNREACH, errno.ENETUNREACH)


class HeldOpen:
    """The regular files this node's mount has open (`want`) and those the writer
    holds for it (`told`, under the writer's epoch `told_to`)."""

    def __init__(self, forwarded: ForwardedFiles, writer_epoch: Callable[[], int | None]
                 ) -> None:
        self.forwarded = forwarded
        self.writer_epoch = writer_epoch
        self.want: set[int] = set()
        self.told: set[int] = set()
        self.told_to: int | None = None
        self._lock = trio.Lock()  # (one request at a time: holds and let-gos in order)

    async def opening(self, ino: int, caller: Caller) -> None:
        """Before a handle of `ino` is made here: held on the writer (ESTALE if the
        file has no name there any longer)."""
        self.want.add(ino)
        if ino in self.told and self.told_to == self.writer_epoch():
            return
        try:
            stale = await self.tell(caller)
        except OSError as e:
            if e.errno in UNREACHED:
                return  # (held with the next round)
            raise
        if ino in stale:
            raise OSError(errno.ESTALE, f"inode {ino} was removed on the writer")

    def granted(self, ino: int) -> None:
        """The writer holds `ino` for this node already (it granted an open for
        writing): no request of its own."""
        self.want.add(ino)
        if self.told_to == self.writer_epoch():
            self.told.add(ino)

    def closed(self, ino: int) -> None:
        """The last handle of `ino` here is gone: let go with the next round."""
        self.want.discard(ino)

    async def round(self) -> None:
        """(Once a second.)  What changed, told; a writer not reached hears it next round."""
        try:
            await self.tell()
        except OSError as e:
            if e.errno not in UNREACHED:
                raise

    async def tell(self, caller: Caller = ROOT) -> set[int]:
        """Tell the writer what changed since the last word (as `caller`); the inodes it
        would not hold (forgotten here)."""
        async with self._lock:
            epoch = self.writer_epoch()
            if epoch != self.told_to:  # (a writer that restarted holds nothing yet)
                self.told, self.told_to = set(), epoch
            hold = sorted(self.want - self.told)[:HOLDS_AT_ONCE]
            let_go = sorted(self.told - self.want)[:HOLDS_AT_ONCE]
            if not hold and not let_go:
                return set()
            reply = await self.forwarded.ask(caller, "node_hold",
                                             {"hold": hold, "let_go": let_go})
            stale = set(reply.get("stale", []))
            self.told.difference_update(let_go)
            self.told.update(set(hold) - stale)
            if stale:
                log.info("the writer holds %d file(s) open here no longer: removed before "
                         "it heard of the open", len(stale))
            self.want.difference_update(stale)  # (its handles here read what is left)
            return stale
