"""Files written through a reading node's mount, on that node's own members.

A node that holds members writes its files where it runs, through its mount as
through a direct writer (`fs/node_files.py`).  Each step is judged by the writer
before this node does it (`fs/node_writes.py`): a `create` is made there at once,
named and empty, on this node's members; an open for writing (or a truncate by name)
asks the writer whether this caller may write that file, wholly on this node's
members, and is granted it with the bytes its owner may still come to own (`room`:
writes past it here are refused, EDQUOT).  Writes then land on this node's chunk
files; the file's size and mtime are held here (`Written`, shown by this node's
getattrs) until a close (or fsync) tells the writer (`node_written`: close-to-open,
as NFS gives it; a size told only grows the file).  A cut is told before it is made
(the writer's size never stands over bytes this node no longer holds), and writes
wait while one runs.  A close the writer refuses (a quota) fails; a last close left
untold is told again each second (`retell`) until the writer takes it, or refuses it,
and then this node cuts its chunk files back to the size the writer holds: bytes the
writer never took are never read.  Files striped over other nodes' members are the
writer's (EROFS here).
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
from mxfs.proto.messages import LayoutDesc
from mxfs.vol.access import Caller
from mxfs.vol.volume import Volume

log = logging.getLogger("mxfs.fs")

# What a writer's refusal of a told size is (anything else: not reached, or passing,
# and told again).
REFUSED = (errno.EDQUOT, errno.EACCES, errno.EPERM, errno.ENOENT, errno.EFBIG,
           errno.EINVAL, errno.ENOSPC)


@dataclass
class Written:
    """A file open for writing on this node: what the writer has not been told yet."""

    caller: Caller  # who last opened it for writing here (its last close's, if untold)
    size: int
    mtime_ns: int
    layout: LayoutDesc  # (as written here: told, so a layout changed meanwhile shows)
    limit: int | None = None  # the size its owner's quota lets it reach before a tell
    changed: bool = False  # written or touched since the writer was last told
    telling: trio.Lock = field(default_factory=trio.Lock)  # one tell at a time
    cut: trio.Event | None = None  # set while a cut runs: writes wait for it
    opening: int = 0  # opens granted, their handles not yet made


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
                     exclusive: bool) -> Inode:
        """A file made at (`parent`, `name`) by the writer, on this node's members (or,
        where the name is already a file, that file opened for writing), granted to
        this node: its row.  Its handle is the caller's to make (`opened`)."""
        self.forwarded.check_writable()
        made = await self._ask(caller, "node_create", {
            "parent": parent, "name": b64(name), "mode": mode, "exclusive": exclusive})
        return await self._took(made, caller)

    async def open(self, node: Inode, caller: Caller) -> None:
        """An open for writing here, judged by the writer first; its handle is the
        caller's to make (`opened`)."""
        self.forwarded.check_writable()
        far = self.vol.pool.far(self.vol.layout(node).used_members())
        if far:
            raise OSError(errno.EROFS, f"this file stripes over node "
                          f"{self.vol.pool.members[far[0]].node}'s members: write it on "
                          "the writer node, or on the node that holds them")
        await self._took(await self._ask(caller, "node_open", {"ino": node.ino}), caller)

    async def _took(self, reply: dict[str, Any], caller: Caller) -> Inode:
        """Hold the granted file for writing here, at the size the writer holds: its
        last close here told first if it was not, else its chunk files cut to that
        size where this node is the first to open it (bytes past it were never taken,
        and an extension must read zeros there)."""
        ino, size = int(reply["ino"]), int(reply["size"])
        room = reply.get("room")
        limit = None if room is None else size + int(room)
        while ino in self._opening:  # (a first open of it here is being made)
            await self._opening[ino].wait()
        row = await self.read_row(ino)
        held = self.files.get(ino)
        if held is None:
            done = self._opening[ino] = trio.Event()
            try:
                untold = self.untold.pop(ino, None)
                try:
                    told = untold is not None and await self._retold(ino, *untold)
                except BaseException:
                    assert untold is not None
                    self.untold[ino] = untold  # (told again next round: not lost)
                    raise
                if told:
                    assert untold is not None
                    size = max(size, int(untold[1]["size"]))
                else:
                    await self.cut(row, size)
                held = self.files[ino] = Written(caller, size, time.time_ns(),
                                                 self.vol.layout(row).describe(), limit)
            finally:
                del self._opening[ino]
                done.set()
        else:
            held.caller = caller
            held.limit = None if limit is None or held.limit is None \
                else max(held.limit, limit)
        held.opening += 1
        return row

    def opened(self, ino: int) -> None:
        """The handle of a granted open is made (or given up: then `closed` follows
        if no other holds the file)."""
        self.files[ino].opening -= 1

    async def allow(self, ino: int, end: int) -> None:
        """Before a write up to `end`: EDQUOT past what the owner's quota lets the file
        reach; waits while a cut of the file runs."""
        held = self.files[ino]
        while held.cut is not None:
            await held.cut.wait()
        if held.limit is not None and end > max(held.limit, held.size):
            raise OSError(errno.EDQUOT, f"inode {ino}: its owner's quota lets it reach "
                          f"{held.limit} bytes here (close it and open it again once "
                          "files were removed)")

    def wrote(self, ino: int, end: int) -> None:
        held = self.files[ino]
        held.size = max(held.size, end)
        held.mtime_ns = time.time_ns()
        held.changed = True

    def touched(self, ino: int, mtime_ns: int) -> None:
        held = self.files[ino]
        held.mtime_ns = mtime_ns
        held.changed = True

    async def cut_to(self, ino: int, size: int, caller: Caller,
                     settle: Callable[[], Awaitable[None]]) -> None:
        """Cut the file to `size`: writes wait, those queued land, the writer takes
        the size first (as `caller`: growing it is judged against the quota), then
        its chunk files here are cut."""
        held = self.files[ino]
        while held.cut is not None:
            await held.cut.wait()
        held.cut = trio.Event()
        try:
            await settle()
            async with held.telling:
                now = time.time_ns()
                await self._ask(caller, "node_written", {
                    "ino": ino, "size": size, "mtime_ns": now, "cut": True,
                    "layout": held.layout})
                await self.cut(await self.read_row(ino), size)
                held.size, held.mtime_ns, held.changed = size, now, False
        finally:
            held.cut.set()
            held.cut = None

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
                await self._ask(caller, "node_written", self._said(ino, held))
            except OSError as e:
                if e.errno == errno.ENOENT:
                    return  # (removed meanwhile, as a file unlinked while open: its bytes
                held.changed = True  # go with it)
                raise
            except BaseException:
                held.changed = True
                raise

    @staticmethod
    def _said(ino: int, held: Written) -> dict[str, Any]:
        return {"ino": ino, "size": held.size, "mtime_ns": held.mtime_ns,
                "layout": held.layout}

    def closed(self, ino: int) -> None:
        """The last handle of `ino` here closed (or an open was given up): what it left
        untold is told again from the next `retell`."""
        held = self.files.get(ino)
        if held is None or held.opening:
            return  # (an open of it is being made: it holds the file on)
        del self.files[ino]
        if held.changed:
            self.untold[ino] = (held.caller, self._said(ino, held))

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
                if e.errno not in REFUSED:
                    continue  # (again next round)
                # (the file is gone: the writer removes its chunk files)
            if self.untold.get(ino, (None, None))[1] is body:
                del self.untold[ino]

    async def _retold(self, ino: int, caller: Caller, body: dict[str, Any]) -> bool:
        """Tell an untold close: True if the writer took it, False if it refused it
        (logged); anything else (not reached, a passing refusal) raises."""
        try:
            await self._ask(caller, "node_written", body)
            return True
        except OSError as e:
            if e.errno not in REFUSED:
                raise
            log.warning("inode %d: the writer refused its size %d written here (%s); "
                        "its chunk files here are cut back to the writer's size",
                        ino, body["size"], e.strerror)
            return False
