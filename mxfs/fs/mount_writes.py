"""Files written through a reading node's mount, on that node's own members.

A node that holds members writes its files where it runs, through its mount as
through a direct writer (`fs/node_files.py`).  Each step is judged by the writer
before this node does it (`fs/node_writes.py`): a `create` is made there at once,
named and empty, on this node's members; an open for writing (or a truncate by name)
asks the writer whether this caller may write that file, wholly on this node's
members.  Writes then land on this node's chunk files, and the file's size and mtime
are held here (`Written`, shown by this node's getattrs) until a close (or fsync)
tells the writer (`node_written`: close-to-open, as NFS gives it).  A close the
writer refuses (a quota) fails; if the file's last close here is still untold it is
told again each second (`retell`) until the writer takes it, or refuses it, and then
this node cuts its chunk files back to the size the writer holds: bytes the writer
never took are never read.  Files striped over other nodes' members are the writer's
(EROFS here).
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from mxfs.fs.fields import b64
from mxfs.fs.node_files import ForwardedFiles
from mxfs.meta import Inode
from mxfs.vol.access import Caller
from mxfs.vol.volume import Volume

log = logging.getLogger("mxfs.fs")

UNREACHED = (errno.EIO, errno.ETIMEDOUT, errno.ECONNRESET)  # the writer not reached


@dataclass
class Written:
    """A file open for writing on this node: what the writer has not been told yet."""

    caller: Caller  # who last opened it for writing here (its last close's, if untold)
    size: int
    mtime_ns: int
    changed: bool = False  # written, cut or touched since the writer was last told
    telling: trio.Lock = field(default_factory=trio.Lock)  # one tell at a time


class MountWrites:
    """The files this node's mount has open for writing, by inode."""

    def __init__(self, vol: Volume, forwarded: ForwardedFiles,
                 read_row: Callable[[int], Awaitable[Inode]],
                 cut: Callable[[Inode, int], Awaitable[None]]) -> None:
        self.vol = vol
        self.forwarded = forwarded
        self.read_row = read_row  # the row as the store holds it now (a worker's read)
        self.cut = cut  # cut a file's chunk files here to a size (in a worker thread)
        self.files: dict[int, Written] = {}
        # Last closes the writer was not told of: (the closer, what to tell), by inode.
        self.untold: dict[int, tuple[Caller, dict[str, Any]]] = {}
        self._opening: dict[int, trio.Event] = {}  # first opens here being made

    async def _ask(self, caller: Caller, op: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self.forwarded.ask(caller, op, {**body, "token": os.urandom(12).hex()})

    async def create(self, caller: Caller, parent: int, name: bytes, mode: int,
                     exclusive: bool) -> int:
        """A file made at (`parent`, `name`) by the writer, on this node's members (or,
        where the name is already a file, that file opened for writing): its inode."""
        self.forwarded.check_writable()
        made = await self._ask(caller, "node_create", {
            "parent": parent, "name": b64(name), "mode": mode, "exclusive": exclusive})
        return await self._took(int(made["ino"]), int(made["size"]), caller)

    async def open(self, node: Inode, caller: Caller) -> None:
        """An open for writing here, judged by the writer first."""
        self.forwarded.check_writable()
        far = self.vol.pool.far(self.vol.layout(node).used_members())
        if far:
            raise OSError(errno.EROFS, f"this file stripes over node "
                          f"{self.vol.pool.members[far[0]].node}'s members: write it on "
                          "the writer node, or on the node that holds them")
        took = await self._ask(caller, "node_open", {"ino": node.ino})
        await self._took(node.ino, int(took["size"]), caller)

    async def _took(self, ino: int, size: int, caller: Caller) -> int:
        """Hold `ino` for writing here, at the size the writer holds: its last close
        here told first if it was not, else its chunk files cut to that size where
        this node is the first to open it (bytes past it were never taken, and an
        extension must read zeros there)."""
        while ino in self._opening:  # (a first open of it here is being made)
            await self._opening[ino].wait()
        if ino in self.files:
            self.files[ino].caller = caller
            return ino
        done = self._opening[ino] = trio.Event()
        try:
            untold = self.untold.pop(ino, None)
            if untold is not None and await self._retold(ino, *untold):
                size = int(untold[1]["size"])
            else:
                await self.cut(await self.read_row(ino), size)
            self.files[ino] = Written(caller, size, time.time_ns())
        finally:
            del self._opening[ino]
            done.set()
        return ino

    def changed(self, ino: int, size: int | None = None, mtime_ns: int | None = None
                ) -> None:
        held = self.files[ino]
        if size is not None:
            held.size = size
        held.mtime_ns = mtime_ns if mtime_ns is not None else time.time_ns()
        held.changed = True

    async def tell(self, ino: int, caller: Caller) -> None:
        """Tell the writer the file's size and mtime, if they changed since it was last
        told (as `caller`, whose close or fsync this is).  Its refusal (a quota) is the
        caller's close's error."""
        held = self.files[ino]
        async with held.telling:  # (a second close waits for the first's answer)
            if not held.changed:
                return
            held.changed = False  # (a write while the writer is asked is told next time)
            try:
                await self._ask(caller, "node_written", {
                    "ino": ino, "size": held.size, "mtime_ns": held.mtime_ns})
            except OSError as e:
                if e.errno == errno.ENOENT:
                    return  # (removed meanwhile, as a file unlinked while open: its bytes
                held.changed = True  # go with it)
                raise
            except BaseException:
                held.changed = True
                raise

    def closed(self, ino: int) -> None:
        """The last holder of `ino` here closed it; what it left untold is told again
        from the next `retell`."""
        held = self.files.pop(ino, None)
        if held is not None and held.changed:
            self.untold[ino] = (held.caller, {"ino": ino, "size": held.size,
                                              "mtime_ns": held.mtime_ns})

    async def retell(self) -> None:
        """(Once a second.)  The untold last closes: told, or, once the writer refuses
        them, the file's chunk files here cut back to what the writer holds."""
        for ino, (caller, body) in list(self.untold.items()):
            if self.untold.get(ino, (None, None))[1] is not body or ino in self._opening:
                continue  # (opened here again meanwhile: that open tells it)
            try:
                if not await self._retold(ino, caller, body) and \
                        self.untold.get(ino, (None, None))[1] is body:
                    done = self._opening[ino] = trio.Event()  # (an open here waits)
                    try:
                        row = await self.read_row(ino)
                        await self.cut(row, row.size)
                    finally:
                        del self._opening[ino]
                        done.set()
            except OSError as e:
                if e.errno in UNREACHED:
                    continue  # (again next round)
                # (the file is gone: the writer removes its chunk files)
            if self.untold.get(ino, (None, None))[1] is body:
                del self.untold[ino]

    async def _retold(self, ino: int, caller: Caller, body: dict[str, Any]) -> bool:
        """Tell an untold close: True if the writer took it, False if it refused it
        (logged); the writer not reached raises."""
        try:
            await self._ask(caller, "node_written", body)
            return True
        except OSError as e:
            if e.errno in UNREACHED:
                raise
            log.warning("inode %d: the writer refused its size %d written here (%s); "
                        "its chunk files here are cut back to the writer's size",
                        ino, body["size"], e.strerror)
            return False
