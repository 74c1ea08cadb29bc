"""The writer's side of files written through a node's mount (`fs/mount_writes.py` is
the node's), each request judged as the writer's own mount would judge it.

`mount_create` makes the file at once, named and empty, on the node's members (as a
create through any mount makes it: `O_EXCL` exclusive across the pool, the folder's
write permission, the caller's inode quota); a name that is already a regular file is
opened instead.  `mount_open` judges an open for writing before the node writes a
byte (not sealed, the caller may write it, wholly on that node's members) and gives
the file a new generation (direct readers that opened it before see it changed).
Either grants the node the file (`Grants`: as POSIX judges permission at open, a
file made read-only meanwhile, or created so, is still written through what was
opened) and answers with the bytes its owner may still come to own, the most the
node lets the file grow past its size before telling.  `mount_written` takes what a
granted file's close (or cut) left: a size only grows it (another node, or the
writer's own mount, may have written past it meanwhile) unless the node cut it; the
owner's byte quota judged for what it grew; an mtime from anyone but the owner or
root taken as now; the layout the node wrote with must still be the file's.
"""

from __future__ import annotations

import errno
import functools
import stat
import time
from collections import OrderedDict
from typing import Any

from mxfs.fs.fields import Msg, b64_name_field, bool_field, int_field
from mxfs.fs.session import refuse_if_degraded
from mxfs.meta import Inode
from mxfs.pool.pool import META_ROW
from mxfs.vol.access import W_OK, X_OK, Caller, may, may_change_in, owner_for
from mxfs.vol.volume import Volume

GRANTS = 65536  # files granted to nodes the writer remembers (the oldest go first)


class Grants:
    """Files granted to nodes for writing through their mounts, by (node, inode): the
    epoch of the node that was granted each (a node that joined again is granted
    anew).  A node lets a grant go after its last close of the file; past GRANTS the
    oldest go, and a node told so (ESTALE) asks for the file again, judged anew."""

    def __init__(self) -> None:
        self._held: OrderedDict[tuple[str, int], int] = OrderedDict()

    def grant(self, node: str, epoch: int, ino: int) -> None:
        self._held[(node, ino)] = epoch
        self._held.move_to_end((node, ino))
        while len(self._held) > GRANTS:
            self._held.popitem(last=False)

    def check(self, node: str, epoch: int, ino: int) -> None:
        if self._held.get((node, ino)) != epoch:
            raise OSError(errno.ESTALE, f"inode {ino} is not granted for writing to node "
                          f"{node} (epoch {epoch}): open it again")

    def let_go(self, node: str, ino: int) -> None:
        self._held.pop((node, ino), None)


def mount_create(vol: Volume, caller: Caller, msg: Msg, node: str
                 ) -> tuple[Inode, bool]:
    """(the file, whether it is new) for a create through `node`'s mount."""
    refuse_if_degraded(vol)
    store = vol.store
    parent, name = store.get(int_field(msg, "parent")), b64_name_field(msg, "name")
    if not parent.is_dir:
        raise OSError(errno.ENOTDIR, f"inode {parent.ino} is not a directory")
    there = store.entry_ino(parent.ino, name)
    if there is not None:  # (the node's kernel thought the name free: opened instead)
        if bool_field(msg, "exclusive"):
            raise OSError(errno.EEXIST, "the name exists")
        if not may(parent, caller, X_OK):
            raise OSError(errno.EACCES, f"directory {parent.ino}: search permission denied")
        return mount_open(vol, caller, store.get(there), node), False
    may_change_in(parent, caller)
    if not vol.pool.held_by(node):
        raise OSError(errno.EROFS, f"node {node} holds no members of the pool")
    vol.pool.check_meta_room(META_ROW + len(name))
    vol.quotas.room(caller.uid, inodes=1)
    mode, gid = owner_for(parent, stat.S_IFREG | (int_field(msg, "mode") & 0o7777),
                          caller.uid, caller.gid, caller.gids.__contains__)
    row = store.create(parent.ino, name, mode, caller.uid, gid,
                       layout_for=functools.partial(vol.pick_layout, node=node))
    store.commit()
    return row, True


def mount_open(vol: Volume, caller: Caller, row: Inode, node: str) -> Inode:
    """An open for writing through `node`'s mount, judged before its first byte."""
    _may_write(vol, row, node)
    if not may(row, caller, W_OK):
        raise OSError(errno.EACCES, f"inode {row.ino}: write permission denied")
    vol.store.begin_write(row, dirty_data=False)
    vol.store.commit()
    return row


def granted(vol: Volume, row: Inode) -> dict[str, Any]:
    """What a node is told of a file it was granted, beside its description: its
    owner, and the bytes that owner may still come to own ("room"; absent: no byte
    limit)."""
    left = vol.quotas.left(row.uid)
    return {"owner": row.uid, **({} if left is None else {"room": left})}


def mount_written(vol: Volume, caller: Caller, msg: Msg, node: str) -> Inode:
    """The size and mtime a granted file's close (or cut) through `node`'s mount left."""
    row = vol.store.get(int_field(msg, "ino"))
    _may_write(vol, row, node)
    if "layout" in msg and msg["layout"] != vol.layout(row).describe():
        raise OSError(errno.EPERM, f"inode {row.ino} was given another layout while "
                      f"node {node} wrote it: its bytes there are not the file's")
    size, now = int_field(msg, "size"), time.time_ns()
    if not bool_field(msg, "cut"):
        size = max(size, row.size)  # (written past meanwhile elsewhere: kept)
    vol.quotas.room(row.uid, size - row.size)
    mtime = int_field(msg, "mtime_ns", now) if caller.uid in (0, row.uid) else now
    vol.store.touch(row, size=size, mtime_ns=mtime, ctime_ns=now)
    vol.store.flush(row)
    vol.store.commit()
    return row


def _may_write(vol: Volume, row: Inode, node: str) -> None:
    if not row.is_reg:
        raise OSError(errno.EISDIR if row.is_dir else errno.EINVAL,
                      f"inode {row.ino} is not a regular file")
    refuse_if_degraded(vol)
    vol.check_writable(row)
    members = vol.pool.members
    if any(members[m].node != node for m in vol.layout(row).used_members()):
        raise OSError(errno.EROFS, f"inode {row.ino} stripes over members node {node} "
                      "does not hold: write it on the writer, or the node holding them")
