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
opened) and answers with the bytes the node may let its owner's files there grow
before telling (`Rooms`: a share of the owner's quota reserved for that node, so two
nodes, or a node and the writer's own mount, never both spend the same bytes; the
node asks for more, `node_room`, as its writes need it; with "renew", the file a new
generation first: `mount_renew`, once a direct reader on the node was told it).
`mount_written` takes what a granted file's close (or cut) left: a size only grows
it (another node, or the writer's own mount, may have written past it meanwhile)
unless the node cut it; the owner's byte quota judged for what it grew, out of the
node's share first; an mtime from anyone but the owner or root taken as now; the
layout the node wrote with must still be the file's.
"""

from __future__ import annotations

import errno
import functools
import stat
import time
from collections import Counter
from typing import Any

from mxfs.fs.fields import Msg, b64_name_field, bool_field, int_field
from mxfs.fs.session import refuse_if_degraded
from mxfs.meta import Inode
from mxfs.meta.usage import growth
from mxfs.pool.pool import META_ROW
from mxfs.vol.access import W_OK, X_OK, Caller, may, may_change_in, owner_for
from mxfs.vol.tenants import tenant_of
from mxfs.vol.volume import Volume

# What a writer's refusal of a node's told size is (anything else: not reached, or
# passing, and told again; ESTALE: the writer holds no grant of it for that node, which
# is asked for again first).
REFUSED = (errno.EDQUOT, errno.EACCES, errno.EPERM, errno.ENOENT, errno.EFBIG,
           errno.EINVAL, errno.ENOSPC, errno.EROFS)
GRANTS = 65536  # files granted to nodes for writing at once, in all
GRANTS_PER_USER = 4096  # of them, one user's through every node (not root's)
SHARE_MIN = 8 << 20  # the least share of an owner's quota reserved for a node at once


Share = tuple[str, int, int]  # (node, epoch, owner)


class Rooms:
    """Shares of owners' byte quotas reserved for nodes, by (node, epoch, owner): held
    in the quotas' reservations (`Quotas.reserve`), so every other writer of that
    owner sees them spent.  A grant gives a node SHARE_MIN at most; its writes ask for
    more (`node_room`: at least doubled, never more than half of what the owner has
    left beyond the request: near the limit shares shrink, and others keep some);
    what the node's closes told comes out of it; the rest goes back once the node
    holds no granted file of that owner, or the node joined again or is gone.  Each
    answer names the share's version: a node keeps the newest it heard."""

    def __init__(self, vol: Volume) -> None:
        self.vol = vol
        self.shares: dict[Share, int] = {}
        self.version = 0  # (counts every change of any share)
        self.versions: dict[Share, int] = {}

    def top_up(self, share: Share, need: int = 0, grow: bool = False) -> dict[str, Any]:
        """The node's share grown toward `need` (beyond that: at least SHARE_MIN, or
        if `grow`, at least doubled), as an answer's fields (`said`)."""
        left = self.vol.quotas.left(share[2])
        if left is None:
            self.give_back(share)
            return self.said(share)
        have = self.shares.get(share, 0)
        short = max(0, need - have)
        if short <= left:  # (else the node refuses the write: EDQUOT)
            more = max(have, SHARE_MIN) if grow else max(0, SHARE_MIN - have)
            self._change(share, short + min(more, (left - short) // 2))
        return self.said(share)

    def said(self, share: Share) -> dict[str, Any]:
        """The share as an answer's fields: "room" (None: no byte limit holds for the
        owner), and "room_v" (this writer's epoch and the share's version, or for no
        share the newest of any: a node keeps the newest it heard)."""
        epoch = self.vol.lease.epoch if self.vol.lease is not None else 0
        version = [epoch, self.versions.get(share, self.version)]
        if share not in self.shares and self.vol.quotas.left(share[2]) is None:
            return {"room": None, "room_v": version}
        return {"room": self.shares.get(share, 0), "room_v": version}

    def spend(self, share: Share, grown: int) -> int:
        """A close told `grown` bytes more: how many of them the node's share covers
        (taken out of it once the store holds them: `spent`)."""
        return min(max(0, grown), self.shares.get(share, 0))

    def spent(self, share: Share, nbytes: int) -> None:
        self._change(share, -nbytes)

    def _change(self, share: Share, nbytes: int) -> None:
        if not nbytes:
            return
        self.shares[share] = self.shares.get(share, 0) + nbytes
        if nbytes > 0:
            self.vol.quotas.reserve(share[2], nbytes)
        else:
            self.vol.quotas.release(share[2], -nbytes)
        self.version += 1
        self.versions[share] = self.version

    def give_back(self, share: Share) -> None:
        """The node's share, unspent, back to everyone."""
        left = self.shares.pop(share, 0)
        self.versions.pop(share, None)
        self.version += 1  # (the node's next answer of it says none, newer than before)
        if left:
            self.vol.quotas.release(share[2], left)

    def drop(self, node: str, epoch: int | None = None) -> None:
        """Every share of `node` (under `epoch`, or any: it joined again, or died)."""
        for share in [k for k in self.shares if k[0] == node and epoch in (None, k[1])]:
            self.give_back(share)

    def nodes(self) -> set[tuple[str, int]]:
        return {(node, epoch) for node, epoch, _ in self.shares}


class Grants:
    """Files granted to nodes for writing through their mounts, by (node, inode): the
    epoch of the node that was granted each (a node that joined again is granted
    anew), the file's owner and who opened it.  A node lets a grant go after its last
    close of the file.  A user (her subordinate uids with her) holds GRANTS_PER_USER at
    most through all nodes together (root:
    GRANTS in all), and the writer GRANTS: past them an open is refused (EMFILE,
    ENFILE), never another's grant taken.  A node's last grant of an owner's files
    gives its share of that owner's quota back."""

    def __init__(self, rooms: Rooms) -> None:
        self.rooms = rooms
        self._held: dict[tuple[str, int], tuple[int, int, int]] = {}  # (epoch, owner,
        #                                                              opener's tenant)
        self._owners: dict[Share, int] = {}  # files granted, by share
        self._by_user: Counter[int] = Counter()  # by opener's tenant, through every node
        self._by_node: dict[str, set[int]] = {}
        self._epochs: Counter[tuple[str, int]] = Counter()  # grants by (node, epoch)
        self._unnamed: set[tuple[str, int]] = set()  # left out of a node's last whole word

    def room(self, node: str, epoch: int, ino: int | None, uid: int) -> None:
        """EMFILE or ENFILE where granting `ino` (None: a file to be made) to `node`
        for `uid` would pass a limit (a file granted to that node already takes no
        more)."""
        held = self._held.get((node, ino)) if ino is not None else None
        if held is not None and held[0] == epoch:
            return
        if uid != 0 and self._by_user[tenant_of(uid)] >= GRANTS_PER_USER:
            raise OSError(errno.EMFILE, f"uid {tenant_of(uid)} has {GRANTS_PER_USER} files "
                          "open for writing through other nodes' mounts (with its "
                          "subordinate uids'): close some")
        if len(self._held) >= GRANTS:
            raise OSError(errno.ENFILE, f"{GRANTS} files are open for writing through "
                          "other nodes' mounts: close some")

    def grant(self, node: str, epoch: int, ino: int, owner: int, uid: int) -> None:
        """Grant `ino` to `node` (`room` judged first); a grant it holds already stays
        as it is, its share with it."""
        held = self._held.get((node, ino))
        if held is not None and held[0] == epoch and held[1] == owner:
            return
        self.let_go(node, ino)
        self._held[(node, ino)] = (epoch, owner, tenant_of(uid))
        self._by_node.setdefault(node, set()).add(ino)
        self._by_user[tenant_of(uid)] += 1
        self._epochs[(node, epoch)] += 1
        share = (node, epoch, owner)
        self._owners[share] = self._owners.get(share, 0) + 1

    def check(self, node: str, epoch: int, ino: int) -> Share:
        """The grant's share; ESTALE where `node` under `epoch` holds no grant of it."""
        held = self._held.get((node, ino))
        if held is None or held[0] != epoch:
            raise OSError(errno.ESTALE, f"inode {ino} is not granted for writing to node "
                          f"{node} (epoch {epoch}): open it again")
        return node, epoch, held[1]

    def let_go(self, node: str, ino: int) -> Share | None:
        """The grant goes (its share, if it had one); with the node's last of that
        owner's files, the share."""
        held = self._held.pop((node, ino), None)
        if held is None:
            return None
        self._by_node[node].discard(ino)
        if not self._by_node[node]:
            del self._by_node[node]
        self._unnamed.discard((node, ino))
        self._by_user[held[2]] -= 1
        if not self._by_user[held[2]]:
            del self._by_user[held[2]]
        self._epochs[(node, held[0])] -= 1
        if not self._epochs[(node, held[0])]:
            del self._epochs[(node, held[0])]
        share = (node, held[0], held[1])
        self._owners[share] -= 1
        if not self._owners[share]:
            del self._owners[share]
            self.rooms.give_back(share)
        return share

    def nodes(self) -> set[tuple[str, int]]:
        """The (node, epoch) pairs holding grants (the writer's sweep drops those of
        nodes that died or joined again: `NodeFileTier._sweep_nodes`)."""
        return set(self._epochs)

    def named(self, node: str, epoch: int, held: set[int]) -> None:
        """`node`'s whole word (`fs/held_open.py`) named `held` open there: a grant of
        a file left out of two whole words in a row goes (an open there that failed
        after its grant, or whose answer was lost, never let it go)."""
        for ino in list(self._by_node.get(node, ())):
            if self._held[(node, ino)][0] != epoch or ino in held:
                self._unnamed.discard((node, ino))
            elif (node, ino) in self._unnamed:
                self.let_go(node, ino)
            else:
                self._unnamed.add((node, ino))

    def drop(self, node: str, epoch: int | None = None) -> list[int]:
        """Every grant of `node` (under `epoch`, or any), and its shares: the files."""
        inos = [i for i in self._by_node.get(node, ())
                if epoch in (None, self._held[(node, i)][0])]
        for ino in inos:
            self.let_go(node, ino)
        self.rooms.drop(node, epoch)
        return inos


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
    vol.quotas.room_for_entry(caller.uid, parent.uid, name, inodes=1)
    mode, gid = owner_for(parent, stat.S_IFREG | (int_field(msg, "mode") & 0o7777),
                          caller.uid, caller.gid, caller.gids.__contains__)
    row = store.create(parent.ino, name, mode, caller.uid, gid,
                       layout_for=functools.partial(vol.pick_layout, node=node))
    store.commit()
    return row, True


def mount_open(vol: Volume, caller: Caller, row: Inode, node: str,
               judged: bool = False) -> Inode:
    """An open for writing through `node`'s mount, judged before its first byte; one
    `judged` there already (a grant asked for again after the writer lost it: a
    restart) is not judged for permission again, as POSIX judges it at open only."""
    _may_write(vol, row, node)
    if not judged and not may(row, caller, W_OK):
        raise OSError(errno.EACCES, f"inode {row.ino}: write permission denied")
    vol.store.begin_write(row, dirty_data=False)
    vol.store.commit()
    return row


def mount_renew(vol: Volume, row: Inode, node: str) -> int:
    """A new generation for a granted file before `node` writes it on after a reader
    there was told the one it has (as `Volume.note_write` gives the writer's own
    writes): the generation now.  Permission is not judged again (the open was)."""
    _may_write(vol, row, node)
    vol.store.begin_write(row, dirty_data=False)
    vol.store.commit()
    return row.generation


def mount_written(vol: Volume, rooms: Rooms, share: Share, caller: Caller, msg: Msg,
                  node: str) -> Inode:
    """The size and mtime a granted file's close (or cut) through `node`'s mount left."""
    row = vol.store.get(int_field(msg, "ino"))
    _may_write(vol, row, node)
    if "layout" in msg and msg["layout"] != vol.layout(row).describe():
        raise OSError(errno.EPERM, f"inode {row.ino} was given another layout while "
                      f"node {node} wrote it: its bytes there are not the file's")
    size, now = int_field(msg, "size"), time.time_ns()
    if not bool_field(msg, "cut"):
        size = max(size, row.size)  # (written past meanwhile elsewhere: kept)
    # (read before the share is spent: a refused field let the share go unrecorded)
    mtime = int_field(msg, "mtime_ns", now) if caller.uid in (0, row.uid) else now
    grown = growth(row.size, size)  # (a BLOCK at least: meta/usage.py)
    # (reserved for it already; a share of another owner covers nothing: root chowned
    # the file since its grant, and the old owner's share let the new one's pass)
    covered = rooms.spend(share, grown) if share[2] == row.uid else 0
    vol.quotas.room(row.uid, grown - covered)
    rooms.spent(share, covered)
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
