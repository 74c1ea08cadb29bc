"""Files written through a reading node's mount, on that node's own members.

A node that holds members writes its files where it runs, through its mount as
through a direct writer (`fs/node_files.py`).  A `create` there asks the writer for
a hidden file on this node's members (`node_create` with the folder and the name, no
size declared: the writer judges the caller as its own mount would); an open for
writing of a file wholly on this node's members takes it as it is.  Writes land on
the node's chunk files, the file's size and times are held here meanwhile, and each
`flush` (a close) with changes since asks the writer to name the new file
(`node_commit`, unsealed: it stays writable) or to take the file's new size and
times (`node_written`): close-to-open, as NFS gives it.  A new file is seen at its
name on this node only until its first close names it; a failed close leaves it
unnamed, and its last release drops it (`node_abort`).  Files striped over other
nodes' members, and attributes other than size and times, are the writer's
(EROFS here).
"""

from __future__ import annotations

import base64
import errno
import os
import time
from dataclasses import dataclass

from mxfs.fs.node_files import ForwardedFiles
from mxfs.meta import Inode
from mxfs.vol.access import Caller
from mxfs.vol.volume import Volume


@dataclass
class Written:
    """A file open for writing on this node: what the writer has not been told yet."""

    caller: Caller  # who opened it first (the writer judges its changes as theirs)
    size: int
    mtime_ns: int
    at: tuple[int, bytes] | None = None  # (folder, name) of a new file not yet named
    exclusive: bool = False  # (O_EXCL) its name must still be free when it is named
    changed: bool = False  # written, cut or touched since the writer was last told
    named: bool = True  # False: a new file, not named yet (or unlinked before it was)


class MountWrites:
    """The files this node's mount has open for writing, by inode."""

    def __init__(self, vol: Volume, forwarded: ForwardedFiles) -> None:
        self.vol = vol
        self.forwarded = forwarded
        self.files: dict[int, Written] = {}
        self.unnamed: dict[tuple[int, bytes], int] = {}  # new files, by (folder, name)

    async def create(self, caller: Caller, parent: int, name: bytes, mode: int,
                     exclusive: bool) -> int:
        """A new file at (`parent`, `name`), hidden on this node's members until its
        first close: its inode."""
        self.forwarded.check_writable()
        token = os.urandom(12).hex()
        try:
            made = await self.forwarded.ask(caller, "node_create", {
                "parent": parent, "name": base64.b64encode(name).decode(), "mode": mode,
                "exclusive": exclusive, "mountpoint": "", "token": token})
        except BaseException:  # (made, perhaps, and its answer lost: dropped by name)
            self.forwarded.abort_later(caller, token=token)
            raise
        ino = int(made["ino"])
        self.files[ino] = Written(caller, 0, time.time_ns(), (parent, name), exclusive,
                                  changed=True, named=False)
        self.unnamed[(parent, name)] = ino
        self.forwarded.writing.add(ino)
        return ino

    def open(self, node: Inode, caller: Caller) -> Written:
        """A file opened for writing here (not sealed: the caller checked): one wholly
        on this node's members."""
        held = self.files.get(node.ino)
        if held is not None:
            return held
        self.forwarded.check_writable()
        far = self.vol.pool.far(self.vol.layout(node).used_members())
        if far:
            raise OSError(errno.EROFS, f"this file stripes over node "
                          f"{self.vol.pool.members[far[0]].node}'s members: write it on "
                          "the writer node, or on the node that holds them")
        held = self.files[node.ino] = Written(caller, node.size, node.mtime_ns)
        self.forwarded.writing.add(node.ino)
        return held

    def lookup(self, parent: int, name: bytes) -> int | None:
        """The inode of a new file this node's caller made there, not yet named."""
        return self.unnamed.get((parent, name))

    def unname(self, parent: int, name: bytes) -> bool:
        """Unlink a new file not yet named: it is dropped once its last holder closes
        it.  False if no such file is held here."""
        ino = self.unnamed.pop((parent, name), None)
        if ino is None:
            return False
        self.files[ino].at = None  # (never named: the writer is told nothing but the drop)
        return True

    def changed(self, ino: int, size: int | None = None, mtime_ns: int | None = None
                ) -> None:
        held = self.files[ino]
        if size is not None:
            held.size = size
        held.mtime_ns = mtime_ns if mtime_ns is not None else time.time_ns()
        held.changed = True

    async def tell(self, ino: int) -> None:
        """The writer told what changed since it was last told: a new file named at its
        folder and name, a named one given its size and times.  The writer's refusal
        (a quota, a folder the caller can no longer write) is the caller's close's."""
        held = self.files[ino]
        if not held.changed:
            return
        held.changed = False  # (a write while the writer is asked is told next time)
        try:
            if held.at is not None:
                await self.forwarded.ask(held.caller, "node_commit", {
                    "ino": ino, "size": held.size, "replace": not held.exclusive})
                if held.at is not None:  # (not unlinked meanwhile)
                    self.unnamed.pop(held.at, None)
                held.at, held.named = None, True
            elif held.named:
                await self.forwarded.ask(held.caller, "node_written", {
                    "ino": ino, "size": held.size, "mtime_ns": held.mtime_ns})
        except BaseException:
            held.changed = True
            raise

    def closed(self, ino: int) -> None:
        """The last holder of `ino` here closed it: a new file never named is dropped."""
        held = self.files.pop(ino, None)
        if held is None:
            return
        self.forwarded.writing.discard(ino)
        if held.at is not None:
            self.unnamed.pop(held.at, None)
        if not held.named:
            self.forwarded.abort_later(held.caller, ino)
