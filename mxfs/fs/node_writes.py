"""The writer's side of files written through a node's mount (`fs/mount_writes.py` is
the node's), each request judged as the writer's own mount would judge it.

`mount_create` makes the file at once, named and empty, on the node's members (as a
create through any mount makes it: `O_EXCL` exclusive across the pool, the folder's
write permission, the caller's inode quota); a name that is already a regular file is
opened instead.  `mount_open` judges an open for writing before the node writes a
byte (not sealed, the caller may write it, wholly on that node's members) and gives
the file a new generation (direct readers that opened it before see it changed).
`mount_written` takes the size and mtime the node's caller left at a close (the
owner's byte quota judged then; an mtime set by anyone but the owner or root is the
writer's clock's).
"""

from __future__ import annotations

import errno
import functools
import stat
import time

from mxfs.fs.fields import Msg, b64_name_field, bool_field, int_field
from mxfs.fs.session import refuse_if_degraded
from mxfs.meta import Inode
from mxfs.pool.pool import META_ROW
from mxfs.vol.access import W_OK, X_OK, Caller, may, may_change_in, owner_for
from mxfs.vol.volume import Volume


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
    _may_write(vol, caller, row, node)
    vol.store.begin_write(row, dirty_data=False)
    vol.store.commit()
    return row


def mount_written(vol: Volume, caller: Caller, msg: Msg, node: str) -> Inode:
    """The size and mtime a close through `node`'s mount left (judged as its open was,
    and the owner's quota for what it grew)."""
    row = vol.store.get(int_field(msg, "ino"))
    _may_write(vol, caller, row, node)
    size, now = int_field(msg, "size"), time.time_ns()
    vol.quotas.room(row.uid, size - row.size)
    mtime = int_field(msg, "mtime_ns", now) if caller.uid in (0, row.uid) else now
    vol.store.touch(row, size=size, mtime_ns=mtime, ctime_ns=now)
    vol.store.flush(row)
    vol.store.commit()
    return row


def _may_write(vol: Volume, caller: Caller, row: Inode, node: str) -> None:
    if not row.is_reg:
        raise OSError(errno.EISDIR if row.is_dir else errno.EINVAL,
                      f"inode {row.ino} is not a regular file")
    refuse_if_degraded(vol)
    vol.check_writable(row)
    if not may(row, caller, W_OK):
        raise OSError(errno.EACCES, f"inode {row.ino}: write permission denied")
    members = vol.pool.members
    if any(members[m].node != node for m in vol.layout(row).used_members()):
        raise OSError(errno.EROFS, f"inode {row.ino} stripes over members node {node} "
                      "does not hold: write it on the writer, or the node holding them")
