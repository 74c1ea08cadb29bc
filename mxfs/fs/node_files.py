"""Direct writes on a node that holds members: its bytes on its own members, its
names through the pool's writer.

A checkpoint rank (or any direct writer: `mxfs.client.writer`) on node b writes where
it runs, as the reference design's ranks write their own node's drives.  b's daemon
asks the writer node for a hidden file placed on b's members (`node_create`, a KREQ
of the chunk protocol, as the caller: the writer checks the caller may create the
path, its limits and quotas, and holds the file for node b under b's epoch), opens
the chunk files on its own members and hands their descriptors to the caller.  At
commit b checks the writer kept to its declared size and closed every descriptor,
cuts and syncs the chunk files, and asks the writer to name and seal the file
(`node_commit`); an abort, or the caller's connection ending, drops it
(`node_abort`, sent again each second until the writer has it), and the writer
removes the chunk files through b's chunk service as for any orphan.  Once b sent a
commit its chunk files are the writer's alone to remove (the writer may have named
the file whatever answer got lost).  A request may reach the writer twice (b asks
again on a new connection when one breaks): a create names itself with a token, a
repeated commit is answered as the first.  A node that dies leaves its unpublished
files to the writer, which drops them once the node's lease under that epoch has been
gone `node_grace_s` (`fs/limits.py`; or the node joined again).

Files written through a node's mount (`fs/mount_writes.py`) are made and judged by
the writer at their create and each open for writing, and told at each close
(`node_create` with a folder and a name, `node_open`, `node_written`:
`fs/node_writes.py`); its other changes of names and attributes are asked here too
(NAME_OPS, `node_setattr`, XATTR_OPS), and which files its mount holds open (`node_hold`:
`fs/held_open.py`, `vol/node_holds.py`).

`NodeFiles` is the writer's side; `ForwardedFiles` the node's (`fs/file_ops.py` calls
it on a node that holds members).
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import stat
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import trio

from mxfs.fs.answers import Answers
from mxfs.fs.failures import FailureLog
from mxfs.fs.fair import RoundRobin
from mxfs.fs.fields import (
    Msg,
    b64,
    b64_bytes_field,
    b64_field,
    b64_name_field,
    bool_field,
    int_field,
    ints_field,
    node_field,
    path_field,
    text_field,
)
from mxfs.fs.kv_forward import as_sent
from mxfs.fs.limits import Limits
from mxfs.fs.node_writes import (
    REFUSED,
    Grants,
    Rooms,
    mount_create,
    mount_open,
    mount_renew,
    mount_written,
)
from mxfs.fs.owned import OwnedSums
from mxfs.fs.session import Pending, Session, check_pending_room, refuse_if_degraded
from mxfs.fs.store_worker import SERVE_WAIT_S, StoreWorker
from mxfs.fs.xattr_pace import XattrPace
from mxfs.meta import ROOT_INO, Inode
from mxfs.meta.usage import file_cost
from mxfs.pool.pool import META_ROW
from mxfs.pool.remote import RemoteMembers
from mxfs.proto.messages import FileReply
from mxfs.proto.mountinfo import mount_table
from mxfs.vol.access import (
    W_OK,
    Caller,
    may,
    may_change_in,
    may_chmod,
    may_chown,
    may_hard_link,
    may_replace,
    may_set_times,
    may_xattr,
    owner_for,
    resolve_parent_for,
    same_folder,
)
from mxfs.vol.node_holds import MAX_HOLDS
from mxfs.vol.tenants import tenant_of
from mxfs.vol.volume import Volume
from mxfs.vol.xattrs import LAYOUT_XATTR, remove_xattr, set_xattr

log = logging.getLogger("mxfs.control")

# Publishes a held file as FileOps.commit does: (pending, its session, size, replace,
# the msg with its sums, the mount point its path is resolved under) -> its description.
Publish = Callable[[Pending, Session, int, bool, Msg, str], Awaitable[FileReply]]

MOUNT_OPS = ("node_create", "node_open", "node_written", "node_room")  # (fs/node_writes.py)
NAME_OPS = ("node_mkdir", "node_mknod", "node_symlink", "node_link", "node_unlink",
            "node_rmdir", "node_rename")
XATTR_OPS = ("node_setxattr", "node_removexattr")
ASKS_AT_ONCE = 4  # a node's file requests to the writer at once (threads of their own)
ABORTS_AT_ONCE = 2  # ... and its aborts, on threads apart from those
PATH_MAX = 4095  # bytes of a symbolic link's target, as the kernel allows
REMEMBERED = 4096  # creates and commits the writer remembers, to answer a repeat the same
REMEMBERED_PER_USER = 256  # ... of one user's through one node
# Answers to nodes' changes of names, files and attributes remembered (a repeat on a new
# connection is answered, not done twice), in all and of one user through one node: a
# user's flood pushes out its own, not everyone's (4,096 shared by all before).
NAMES_REMEMBERED = 65536
NAMES_REMEMBERED_PER_USER = 1024
UNTAKEN_MAX = 1 << 18  # files dead nodes' grants left to cut back (`Volume.untaken`)
HOLDS_AT_ONCE = 16384  # files a node holds or lets go in one request (within MAX_KREQ)


# What a failure to reach the writer, or to hear back from it, says (then what was
# asked may have been done); any other errno is the writer's answer.
UNREACHED = frozenset((errno.EIO, errno.ETIMEDOUT, errno.ECONNRESET, errno.EPIPE,
                       errno.ECONNREFUSED, errno.ECONNABORTED, errno.ENOTCONN,
                       errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ESHUTDOWN))


def answered(e: BaseException) -> bool:
    """Whether `e` is the writer's answer (a refusal: what was asked was not done), not
    a failure to reach it or to hear back."""
    return isinstance(e, OSError) and e.errno is not None and e.errno not in UNREACHED


@dataclass
class NodeFile:
    """An unpublished file the writer holds for a node's caller."""

    session: Session  # (the caller's, on the writer: its limits and quotas)
    node: str
    epoch: int
    mountpoint: str  # the node's: its caller's path (and links) are resolved under it
    token: str  # the node's name for the create (a repeat is the same file)
    dead_since: float | None = None  # when the node's lease was first seen gone


class NodeFiles:
    """The writer's side: hidden files placed on other nodes' members, held for their
    callers until those nodes commit or drop them (or die).  Every request may come
    twice (a node asks again on a new connection when one breaks mid-request): a
    repeated create gets the same file, a repeated commit the same answer, an abort of
    a file not held is done already."""

    def __init__(self, vol: Volume, mountpoint: str, limits: Limits,
                 pending_by_uid: Counter[int], publish: Publish,
                 entry_changed: Callable[[int, bytes, int], Awaitable[None]] | None = None,
                 inode_changed: Callable[[int, int], Awaitable[None]] | None = None) -> None:
        self.vol, self.mountpoint, self.limits = vol, mountpoint, limits
        self.pending_by_uid = pending_by_uid
        self.publish = publish
        self.entry_changed = entry_changed  # (this node's kernel drops those names)
        self.inode_changed = inode_changed  # (... and what it holds of those files)
        # A lent file's chunk files made anew before its access changes (the mount's
        # `MxfsOperations._renew`, its writes held meanwhile; set by the daemon).
        self.renew: Callable[[Inode, int], Awaitable[None]] | None = None
        # A file's chunk files on other nodes' members cut to its size here, in a uid's
        # turn (the mount's `MxfsOperations.cut_far`; set by the daemon).
        self.cut_far: Callable[[Inode, int], Awaitable[None]] | None = None
        self.truncating: set[int] = set()  # (the mount's: `MxfsOperations.truncating`)
        self.xattr_pace: XattrPace | None = None  # (the mount's: set by the daemon)
        self._failures = FailureLog(log)
        # What chowns move between owners, summed off the thread (`fs/owned.py`).
        self.owned = OwnedSums(vol.quotas, StoreWorker(vol.pool.meta_location,
                                                          wait_s=SERVE_WAIT_S))
        self.files: dict[int, NodeFile] = {}
        self.tokens: dict[tuple[str, str], int] = {}  # (node, token): inode
        # Commits answered for nodes, by (node, inode), each kept as its (node, user)'s.
        self.published: Answers[tuple[str, int], FileReply] = Answers(
            REMEMBERED, REMEMBERED_PER_USER)
        # Files nodes opened for writing through their mounts, and the shares of their
        # owners' quotas reserved for those nodes.
        self.rooms = Rooms(vol)
        self.grants = Grants(self.rooms)
        # Nodes (by epoch) holding files or shares, whose lease was first seen gone then.
        self.dead_since: dict[tuple[str, int], float] = {}
        # Names changed for nodes, by (node, token): a repeat is answered, not redone;
        # each kept as its (node, user)'s (a user's subordinate uids with her).
        self.names_done: Answers[tuple[str, str], dict[str, Any]] = Answers(
            NAMES_REMEMBERED, NAMES_REMEMBERED_PER_USER)

    async def request(self, caller: Caller, op: str, msg: dict[str, Any]
                      ) -> dict[str, Any]:
        """One of NODE_FILE_OPS a node asked for `caller`."""
        name, epoch = node_field(msg)
        if self.vol.reader_epochs.get(name) != epoch:
            raise OSError(errno.ESTALE, f"node {name} is not alive under epoch {epoch}")
        through_mount = op in MOUNT_OPS and (op != "node_create" or "parent" in msg)
        if op == "node_create" and not through_mount:
            return dict(self._create(caller, msg, name, epoch))
        if op == "node_commit":
            return await self._commit(caller, msg, name)
        if op in NAME_OPS or op in XATTR_OPS or through_mount:
            token = (name, text_field(msg, "token"))
            done = self.names_done.get(token)
            if done is not None:  # (asked again: done the first time, not twice)
                return done
            if op == "node_setxattr" and caller.uid and self.xattr_pace is not None:
                # (paced here too, in the tenant's buckets of this mount: her bytes
                # through every node at once are one rate at the store)
                await self.xattr_pace.turn(tenant_of(caller.uid), len(b64_bytes_field(
                    msg, "name", 255)) + len(b64_field(msg, "value")))
                done = self.names_done.get(token)  # (the same ask, done while this waited)
                if done is not None:
                    return done
            try:
                out, changed, ino = self._name(caller, op, msg, name) if op in NAME_OPS \
                    else self._xattr(caller, op, msg) if op in XATTR_OPS \
                    else self._mount(caller, op, msg, name, epoch)
            except OSError as e:
                if e.errno in REFUSED and (  # (a close refused, or the grant it asked
                        op == "node_written" and "size" in msg and bool_field(msg, "last")
                        or op == "node_open" and bool_field(msg, "again")):  # for again)
                    await self._cut_back(int_field(msg, "ino"), caller)
                raise
            self.names_done.keep(token, (name, tenant_of(caller.uid)), out)
            if self.entry_changed is not None:
                for parent, entry in changed:
                    await self.entry_changed(parent, entry, caller.uid)
            if ino is not None and self.inode_changed is not None:
                await self.inode_changed(ino, caller.uid)
            return out
        if op == "node_setattr":
            return await self._setattr(caller, msg)
        if op == "node_hold":
            return self._hold(msg, name, epoch)
        if op == "node_abort":
            ino = self.tokens.get((name, text_field(msg, "token"))) if "token" in msg \
                else int_field(msg, "ino")
            held = self.files.get(ino) if ino is not None else None
            if ino is not None and held is not None and held.node == name and \
                    held.session.caller.uid == caller.uid:
                self._drop(ino)
            return {}
        raise OSError(errno.EPERM, f"{op[:32]} is not asked of another node")

    async def _cut_back(self, ino: int, caller: Caller) -> None:
        """A node's last close of `ino` refused: what it wrote past the size held here
        is cut on its members (`cut_far`), here, where that size and this mount's
        writes are; where that cannot be done the node's bytes stay past the size,
        unread (its next first open there cuts them), and that is logged."""
        if self.cut_far is None:
            return
        try:
            row = self.vol.store.get(ino)
            if row.is_reg:
                await self.cut_far(row, caller.uid)
        except OSError as e:
            if e.errno != errno.ENOENT:  # (removed: its chunk files go with it)
                self._failures.note("the cut of a node's refused close", caller, e,
                                    trace=False)

    def _mount(self, caller: Caller, op: str, msg: Msg, node: str, epoch: int
               ) -> tuple[dict[str, Any], list[tuple[int, bytes]], int | None]:
        """A create, an open for writing or a close through `node`'s mount
        (`fs/node_writes.py`): (the reply, the names made, the inode whose bytes
        changed)."""
        if op == "node_written":
            ino = int_field(msg, "ino")
            if "size" not in msg:  # (the node's last close of a file it told of)
                share = self.grants.let_go(node, ino)
                return ({} if share is None else self.rooms.said(share)), [], None
            share = self.grants.check(node, epoch, ino)
            if ino in self.truncating and not bool_field(msg, "cut") \
                    and bool_field(msg, "cutting", True):
                # (its size, said before the node followed the cut, grew it back)
                raise OSError(errno.EAGAIN, f"inode {ino} is being cut on the writer: "
                              "tell its size again")
            row = mount_written(self.vol, self.rooms, share, caller, msg, node)
            said = self.rooms.said(share)  # (what is left of the node's share)
            if bool_field(msg, "last"):
                self.grants.let_go(node, ino)
            return {**describe(self.vol, row), **said}, [], row.ino
        if op == "node_room":  # (a granted file's writes need more of its owner's quota,
            ino = int_field(msg, "ino")  # or a new generation: "renew")
            share = self.grants.check(node, epoch, ino)
            out: dict[str, Any] = {}
            if bool_field(msg, "renew"):
                out["generation"] = mount_renew(self.vol, self.vol.store.get(ino), node)
            if "need" not in msg:
                return {**out, **self.rooms.said(share)}, [], None
            return {**out, **self.rooms.top_up(share, int_field(msg, "need"), grow=True)
                    }, [], None
        made: list[tuple[int, bytes]] = []
        if op == "node_create":
            self.grants.room(node, epoch, None, caller.uid)
            row, new = mount_create(self.vol, caller, msg, node)
            if new:
                made.append((int_field(msg, "parent"), b64_name_field(msg, "name")))
        else:
            ino = int_field(msg, "ino")
            self.grants.room(node, epoch, ino, caller.uid)
            row = mount_open(self.vol, caller, self.vol.store.get(ino), node,
                             judged=bool_field(msg, "again"))
        self.grants.grant(node, epoch, row.ino, row.uid, caller.uid)
        self.vol.untaken.discard(row.ino)  # (the node cuts them at its first open there)
        self.vol.let_go(self.vol.holds.hold(node, epoch, row.ino))  # (open there: kept)
        return {**describe(self.vol, row), "owner": row.uid,
                **self.rooms.top_up((node, epoch, row.uid))}, made, None

    def _xattr(self, caller: Caller, op: str, msg: Msg
               ) -> tuple[dict[str, Any], list[tuple[int, bytes]], int | None]:
        """An extended attribute set or removed through a node's mount, judged here as
        the kernel judges it on the writer's own (`may_xattr`; the layout attribute:
        its owner or root)."""
        refuse_if_degraded(self.vol)  # (its own mount is read-only then)
        row = self.vol.store.get(int_field(msg, "ino"))
        name = b64_bytes_field(msg, "name", 255)  # (any bytes but NUL: "/" too)
        if name != LAYOUT_XATTR:
            may_xattr(row, caller, name)
        if op == "node_setxattr":
            set_xattr(self.vol, row, name, b64_field(msg, "value"), caller.uid)
        else:
            remove_xattr(self.vol, row, name)
        self.vol.store.commit()
        return {}, [], row.ino

    def _hold(self, msg: Msg, node: str, epoch: int) -> dict[str, Any]:
        """A word of `fs/held_open.py`: the files `node`'s mount opened ("hold") and
        closed ("let_go") since its last word, or all it holds ("full", in parts when
        it is long: "part" counts them, "more" says another follows; a part out of
        order is answered "again"), and the feed row it had read before it looked
        ("seen": absent when the word could not say every hold).  Words are numbered
        ("word"): one sent again, or late, changes nothing.  The reply names this
        writer's epoch: a word meant for another writer changes nothing either, and
        the node tells all again, as it does when told "again" (a word that is not
        whole, from a node whose holds this writer dropped: its lease ran out a while,
        or this writer restarted)."""
        own = self.vol.lease.epoch if self.vol.lease is not None else 0
        if int_field(msg, "writer") != own:
            return {"writer": own}
        hold = ints_field(msg, "hold", HOLDS_AT_ONCE)
        let_go = ints_field(msg, "let_go", HOLDS_AT_ONCE)
        seen = int_field(msg, "seen") if "seen" in msg else None
        holds, freed, word = self.vol.holds, [], int_field(msg, "word")
        if not holds.fresh(node, epoch, word):
            return {"writer": own}
        if not bool_field(msg, "full") and not holds.knows(node, epoch):
            return {"writer": own, "again": True}  # (its holds went: say them all)
        try:
            if bool_field(msg, "full"):  # (in parts when it is long: "part", "more")
                got = holds.whole(node, epoch, int_field(msg, "part", 0), hold,
                                  not bool_field(msg, "more"))
                if got is None:
                    return {"writer": own, "again": True}
                freed += got
                if not bool_field(msg, "more"):  # (the word is whole: grants it left
                    self.grants.named(node, epoch, holds.held(node, epoch))  # out go)
            else:
                for ino in let_go:
                    if holds.let_go(node, epoch, ino):
                        freed.append(ino)
                for ino in hold:
                    freed += holds.hold(node, epoch, ino)
            if seen is not None:
                holds.heard(node, epoch, seen)
            holds.took(node, epoch, word)
        finally:
            self.vol.let_go(freed)
        if node in holds.over:
            holds.over.discard(node)
            log.warning("node %s holds over %d files open: those past it are not kept "
                        "if removed meanwhile", node, MAX_HOLDS)
        return {"writer": own}

    def _name(self, caller: Caller, op: str, msg: Msg, node: str
              ) -> tuple[dict[str, Any], list[tuple[int, bytes]], int | None]:
        """A change of names a node's caller made through its mount (mkdir, mknod,
        symlink, link, unlink, rmdir, rename), judged here as the kernel judges it on
        the writer's own mount (the node's kernel judged it too, on attributes perhaps
        a moment old), and committed before the answer: the node reads the rows it
        asks for next."""
        refuse_if_degraded(self.vol)  # (its own mount is read-only then)
        store = self.vol.store
        parent = store.get(int_field(msg, "parent"))
        name = b64_name_field(msg, "name")
        may_change_in(parent, caller)
        out: dict[str, Any] = {}
        if op in ("node_mkdir", "node_symlink", "node_mknod"):
            link = b64_bytes_field(msg, "target", PATH_MAX) if op == "node_symlink" \
                else None
            kind = stat.S_IFLNK | 0o777 if link is not None else \
                stat.S_IFDIR | (int_field(msg, "mode") & 0o7777) if op == "node_mkdir" \
                else _made_by_mknod(int_field(msg, "mode"), int_field(msg, "rdev", 0), caller)
            self.vol.pool.check_meta_room(META_ROW + len(name) + len(link or b""))
            self.vol.quotas.room_for_entry(caller.uid, parent.uid, name, len(link or b""), 1)
            mode, gid = owner_for(parent, kind, caller.uid, caller.gid,
                                  caller.gids.__contains__)
            place = functools.partial(self.vol.pick_layout, node=node) \
                if self.vol.pool.held_by(node) else self.vol.pick_layout  # (a file: there)
            out["ino"] = store.create(parent.ino, name, mode, caller.uid, gid, target=link,
                                      rdev=int_field(msg, "rdev", 0), layout_for=place).ino
        elif op == "node_link":
            linked = store.get(int_field(msg, "ino"))
            if caller.uid not in (0, linked.uid) and not may_hard_link(linked, caller):
                raise OSError(errno.EPERM, "linking another user's file needs read and "
                              "write permission on it (protected_hardlinks)")
            self.vol.pool.check_meta_room(META_ROW + len(name))
            self.vol.quotas.room_for_entry(caller.uid, parent.uid, name)  # (folder's owner's)
            out["ino"] = store.link(linked.ino, parent.ino, name).ino
        elif op in ("node_unlink", "node_rmdir"):
            victim = store.lookup(parent.ino, name)
            may_replace(parent, victim, caller)
            self._refuse_if_mounted_on(victim.ino)
            self.vol.unlinked((store.unlink if op == "node_unlink" else store.rmdir)(
                parent.ino, name))
        else:  # node_rename
            to, to_name = store.get(int_field(msg, "new_parent")), b64_name_field(msg, "new_name")
            may_change_in(to, caller)
            moved = store.lookup(parent.ino, name)
            may_replace(parent, moved, caller)
            if to.ino != parent.ino and moved.is_dir and not may(moved, caller, W_OK):
                raise OSError(errno.EACCES, "moving a directory to another parent needs "
                              "write permission on it")
            target = store.entry_ino(to.ino, to_name)
            if not bool_field(msg, "exchange"):  # (an exchange moves no names)
                self.vol.room_for_rename(caller.uid, parent, name, to, to_name,
                                         target is not None)
            self._refuse_if_mounted_on(moved.ino, target)
            if target is not None:
                other = store.get(target)
                may_replace(to, other, caller)
                if bool_field(msg, "exchange") and to.ino != parent.ino and other.is_dir \
                        and not may(other, caller, W_OK):
                    raise OSError(errno.EACCES, "exchanging a directory into another "
                                  "parent needs write permission on it")
            replaced = store.rename(parent.ino, name, to.ino, to_name,
                                    noreplace=bool_field(msg, "noreplace"),
                                    exchange=bool_field(msg, "exchange"))
            if replaced is not None:
                self.vol.unlinked(replaced)
        store.commit()
        changed = [(parent.ino, name)]
        if op == "node_rename":
            changed.append((to.ino, to_name))
        return out, changed, int(out["ino"]) if op == "node_link" else None  # (its nlink)

    def _refuse_if_mounted_on(self, *inos: int | None) -> None:
        """EBUSY for a name something is mounted on in the writer's own mount: its
        kernel refuses to remove or move one there (a node's request, which never
        passes that kernel, would otherwise detach what was mounted)."""
        prefix = self.mountpoint.rstrip("/") + "/"
        points = [p for p in mount_table() if p.startswith(prefix)]
        if not points:
            return
        store = self.vol.store
        for point in points:
            try:
                node = store.get(ROOT_INO)
                for part in point[len(prefix):].split("/"):
                    node = store.lookup(node.ino, os.fsencode(part))
            except OSError:
                continue  # (not a name of this pool's any more)
            if node.ino in inos:
                raise OSError(errno.EBUSY, f"{point} is a mount point on the writer node: "
                              "unmount it there first")

    async def _setattr(self, caller: Caller, msg: Msg) -> dict[str, Any]:
        """chmod, chown and times a node's caller set through its mount, judged here as
        the kernel judges them (`may_chmod`, `may_chown`, `may_set_times`)."""
        refuse_if_degraded(self.vol)
        store = self.vol.store
        row = store.get(int_field(msg, "ino"))
        mode = uid = gid = atime = mtime = None
        if "uid" in msg or "gid" in msg:
            uid = int_field(msg, "uid") if "uid" in msg else None
            gid = int_field(msg, "gid") if "gid" in msg else None
            may_chown(row, caller, uid, gid)
        async with self.owned.of(row, uid, caller.uid) as owned:  # (watched till the change)
            if uid is not None and uid != row.uid:
                self.vol.quotas.room_for_owner(row, uid, caller.uid, owned.sums)
            if "mode" in msg:
                mode = stat.S_IFMT(row.mode) | may_chmod(row, caller, int_field(msg, "mode"),
                                                         gid)
            if "atime_ns" in msg or "mtime_ns" in msg:
                may_set_times(row, caller)
                atime = int_field(msg, "atime_ns") if "atime_ns" in msg else None
                mtime = int_field(msg, "mtime_ns") if "mtime_ns" in msg else None
            if row.is_reg and self.vol.needs_renew(row) and self.renew is not None and \
                    row.takes_read(mode, uid, gid):
                await self.renew(row, caller.uid)
            store.set_attrs(row, mode=mode, uid=uid, gid=gid, atime_ns=atime, mtime_ns=mtime,
                            ctime_ns=time.time_ns(), owned=owned.now())
        store.commit()
        if self.inode_changed is not None:
            await self.inode_changed(row.ino, caller.uid)
        return dict(describe(self.vol, row))

    def _create(self, caller: Caller, msg: Msg, node: str, epoch: int) -> FileReply:
        """A hidden file on `node`'s members to be published at the path, as `create`
        makes one on the writer's own."""
        token = text_field(msg, "token")
        again = self.tokens.get((node, token))
        if again is not None:  # (asked again: the file made the first time)
            return describe(self.vol, self.files[again].session.pending[again].entry.node)
        path, size = path_field(msg), int_field(msg, "size", 0)
        mode = int_field(msg, "mode", 0o644) & 0o7777
        mountpoint = text_field(msg, "mountpoint")
        session = Session(caller, self.pending_by_uid, quotas=self.vol.quotas)
        check_pending_room(session, self.limits, self.vol)  # (the uid's: the session is new)
        if not self.vol.pool.held_by(node):
            raise OSError(errno.EROFS, f"node {node} holds no members of the pool")
        store = self.vol.store
        parent, name = resolve_parent_for(store, path, caller, mountpoint)
        dir_ino = int_field(msg, "dir_ino", 0)
        same_folder(parent, dir_ino, path)
        self.vol.quotas.room_for_entry(caller.uid, parent.uid, name, file_cost(size), 1)
        if bool_field(msg, "exclusive") and store.entry_ino(parent.ino, name) is not None:
            raise OSError(errno.EEXIST, f"{path} exists")
        mode, gid = owner_for(parent, mode, caller.uid, caller.gid, caller.gids.__contains__)
        refuse_if_degraded(self.vol)
        entry = self.vol.create_hidden(parent, mode, caller.uid, gid, node=node)
        session.hold(Pending(entry, path, size, dir_ino=dir_ino))
        ino = entry.node.ino
        self.files[ino] = NodeFile(session, node, epoch, mountpoint, token)
        self.tokens[(node, token)] = ino
        return describe(self.vol, entry.node)

    async def _commit(self, caller: Caller, msg: Msg, node: str) -> dict[str, Any]:
        """Name and seal a node's file; its description, and where it was named
        ("named": [folder inode, name as base64], for the node's kernel to drop what
        it cached there)."""
        ino = int_field(msg, "ino")
        held = self.files.get(ino)
        if held is None or held.node != node or held.session.caller.uid != caller.uid:
            done = self.published.get((node, ino))
            if done is not None:  # (asked again: it was named the first time)
                return dict(done)
            raise OSError(errno.EBADF, f"inode {ino} is not being written for uid "
                          f"{caller.uid} on node {node}")
        size = int_field(msg, "size")
        pending = held.session.pending[ino]
        if size > pending.declared:
            self._drop(ino)
            raise OSError(errno.EFBIG, f"wrote past the {pending.declared} bytes declared "
                          "at create: refused, and the file dropped")
        self._forget(ino)  # (not the sweep's while it is named)
        try:
            done = await self.publish(pending, held.session, size,
                                      bool_field(msg, "replace", True), msg, held.mountpoint)
        except BaseException:
            if ino in held.session.pending:  # still unpublished: held as before
                self.files[ino] = held
                self.tokens[(node, held.token)] = ino
            else:  # named, not yet durable: a repeat answers it named
                self._remember(node, ino, caller.uid,
                               describe(self.vol, pending.entry.node, True))
            raise
        self._remember(node, ino, caller.uid, done)
        out: dict[str, Any] = dict(done)
        try:
            parent, fname = resolve_parent_for(self.vol.store, pending.path, caller,
                                               held.mountpoint)
            out["named"] = [parent.ino, b64(fname)]
        except OSError:
            pass  # (its folder moved meanwhile: the node's kernel learns from the feed)
        return out

    def _remember(self, node: str, ino: int, uid: int, reply: FileReply) -> None:
        """A commit's answer, for a repeat (kept as `uid`'s user's through `node`: one
        user's burst of commits pushed out everyone's, and a node that asked again got
        EBADF for a file that was named)."""
        self.published.keep((node, ino), (node, tenant_of(uid)), reply)

    def _forget(self, ino: int) -> NodeFile:
        held = self.files.pop(ino)
        self.tokens.pop((held.node, held.token), None)
        return held

    def _drop(self, ino: int) -> None:
        """Forget an unpublished file: an orphan, its chunk files removed through its
        node after the next commit."""
        held = self._forget(ino)
        held.session.let_go(ino)
        self.vol.release(ino)

    def sweep(self, now: float) -> None:
        """(Once a second.)  Drop the files of nodes that joined again since, or whose
        lease has been gone `node_grace_s`: a node that died never says it let them go (one
        whose renewal was late a moment keeps them); so too what they held open, their
        grants and their quota shares."""
        alive = self.vol.reader_epochs
        self._sweep_nodes(now)
        for ino, held in list(self.files.items()):
            epoch = alive.get(held.node)
            if epoch == held.epoch:
                held.dead_since = None
                continue
            if held.dead_since is None:
                held.dead_since = now
            if epoch is not None or now - held.dead_since >= self.limits.node_grace_s:
                log.info("unpublished file %d of node %s (epoch %d) dropped: the node's "
                         "lease ran out", ino, held.node, held.epoch)
                self._drop(ino)


    def _sweep_nodes(self, now: float) -> None:
        """What nodes' mounts held open, their grants and the shares of quotas reserved
        for them go once the node joined again (at once) or its lease has been gone
        `node_grace_s` (a node whose renewal was late a moment keeps them)."""
        alive, holds = self.vol.reader_epochs, self.vol.holds
        # (each place they are held in: a node that joined again drops its old holds
        # at its first word, and grants of owners with no byte limit hold no share;
        # looked for in those alone, its grants stayed, each in its user's count)
        for node, epoch in {*holds.nodes().items(), *self.rooms.nodes(),
                            *self.grants.nodes()}:
            if alive.get(node) == epoch:
                self.dead_since.pop((node, epoch), None)
                continue
            since = self.dead_since.setdefault((node, epoch), now)
            if node in alive or now - since >= self.limits.node_grace_s:
                log.info("node %s (epoch %d) holds no files open, grants or quota shares "
                         "now: %s", node, epoch,
                         "it joined again" if node in alive else "its lease ran out")
                self.dead_since.pop((node, epoch), None)
                self.vol.let_go(holds.drop(node, epoch))
                untaken = self.vol.untaken
                for ino in self.grants.drop(node, epoch):
                    if len(untaken) < UNTAKEN_MAX:
                        untaken.add(ino)
                    else:  # (its holes may read the node's untold bytes: said)
                        self._failures.note("files to cut back", None, OSError(
                            errno.ENOSPC, f"{UNTAKEN_MAX} files wait to be cut back: "
                            f"inode {ino} of node {node} is not"), trace=False)


class ForwardedFiles:
    """A node's side: creates, commits and aborts of files on its own members, asked
    of the writer as the caller, on threads of their own (never those its reads of
    other nodes' members take).  Aborts are sent once a second until the writer has
    them (a blip of the network loses none), or until this node's epoch changes (the
    writer drops the files of a node that joined again)."""

    def __init__(self, vol: Volume) -> None:
        self.vol = vol
        # By uid in turn, one uid (but root) 3 of them: a user's flood of mkdirs waits
        # behind its own, not everyone's.
        self._asks = RoundRobin(ASKS_AT_ONCE, ASKS_AT_ONCE - 1)
        self._threads = trio.CapacityLimiter(ASKS_AT_ONCE)
        self._abort_threads = trio.CapacityLimiter(ABORTS_AT_ONCE)  # (not the asks')
        self._aborts: dict[tuple[str, object], tuple[Caller, dict[str, Any]]] = {}
        self.writing: set[int] = set()  # files callers here hold descriptors of

    def _remote(self) -> RemoteMembers:
        remote = self.vol.pool.remote
        assert remote is not None  # (a node's pool reaches its writer)
        return remote

    def _node(self) -> list[Any]:
        held = self.vol.lease
        return [self.vol.pool.node, held.epoch if held is not None else 0]

    async def ask(self, caller: Caller, op: str, body: dict[str, Any]) -> dict[str, Any]:
        """`op` asked of the writer for `caller` (blocking round trips, off this thread)."""
        remote, who = self._remote(), as_sent(caller)
        body = {**body, "node": self._node()}
        async with self._asks.slot(caller.uid):
            return await trio.to_thread.run_sync(remote.kv_request, who, op, body,
                                                 limiter=self._threads)

    def abort_later(self, caller: Caller, ino: int | None = None, token: str = "") -> None:
        """Have the writer drop a file (by inode, or by the create's token when its
        answer never came), from the next round of `send_aborts`."""
        key, what = ("ino", ino) if ino is not None else ("token", token)
        self._aborts[(key, what)] = (caller, {key: what, "node": self._node()})

    async def send_aborts(self) -> None:
        """(Once a second.)  The aborts not yet sent, each user's in a task of her own,
        outside her slots here and her turns at the writer (an abort only frees: the
        writer drops the sender's own file of this node, nothing else): a tenant whose
        turns are all busy held every other user's aborts behind hers, their declared
        sizes reserved against their quotas meanwhile.  A user's abort that fails to
        reach the writer goes to the back, her others wait for the next round."""
        epoch = self._node()
        by_user: dict[int, list[tuple[str, object]]] = {}
        for key, (caller, body) in list(self._aborts.items()):
            if body["node"] != epoch:  # (the writer drops the old epoch's files itself)
                del self._aborts[key]
                continue
            by_user.setdefault(tenant_of(caller.uid), []).append(key)
        async with trio.open_nursery() as nursery:
            for keys in by_user.values():
                nursery.start_soon(self._send_aborts_of, keys)

    async def _send_aborts_of(self, keys: list[tuple[str, object]]) -> None:
        """One user's aborts, in order, until one fails to reach the writer."""
        remote = self._remote()
        for key in keys:
            if key not in self._aborts:
                continue
            caller, body = self._aborts[key]
            try:
                await trio.to_thread.run_sync(remote.kv_request, as_sent(caller),
                                              "node_abort", body, limiter=self._abort_threads)
            except OSError as e:
                if not answered(e):  # the writer not reached: again next round, last
                    self._aborts[key] = self._aborts.pop(key)
                    return
                log.info("the writer refused to drop unpublished file %s: %s", key[1], e)
            self._aborts.pop(key, None)

    async def run_aborts(self) -> None:
        """(A task of the daemon.)  `send_aborts` once a second, apart from the rest of
        the daemon's upkeep: a tenant's aborts each waiting on her busy turns at the
        writer held the round that cuts writers back to their declared sizes."""
        while True:
            await trio.sleep(1)
            try:
                await self.send_aborts()
            except Exception as e:  # (the next round tries again)
                log.warning("aborts could not be sent to the writer: %s", e)

    async def change_name(self, caller: Caller, op: str, parent: int, name: bytes,
                          **more: Any) -> dict[str, Any]:
        """One of NAME_OPS made through this node's mount, asked of the writer (a name
        given as `new_name` in `more` is sent as base64 too)."""
        body: dict[str, Any] = {**more, "parent": parent, "name": b64(name),
                                "token": os.urandom(12).hex()}
        if "new_name" in more:
            body["new_name"] = b64(more["new_name"])
        return await self.ask(caller, op, body)

    def check_writable(self) -> None:
        if not self.vol.pool.local_members():
            raise OSError(errno.EROFS, f"node {self.vol.pool.node} holds no members: write "
                          "on the writer node, or on a node that holds members")


def _made_by_mknod(mode: int, rdev: int, caller: Caller) -> int:
    """The mode of what mknod makes: a file, FIFO or socket for anyone, a device for
    root only (CAP_MKNOD; but a whiteout, 0:0)."""
    kind = stat.S_IFMT(mode)
    if kind in (stat.S_IFCHR, stat.S_IFBLK):
        if caller.uid != 0 and not (kind == stat.S_IFCHR and rdev == 0):  # (a whiteout:
            raise OSError(errno.EPERM, "only root makes device nodes")  # anyone's)
    elif kind not in (stat.S_IFREG, stat.S_IFIFO, stat.S_IFSOCK):
        raise OSError(errno.EINVAL, "mknod makes files, FIFOs, sockets and devices")
    return kind | (mode & 0o7777)


def describe(vol: Volume, node: Inode, sealed: bool = False, tell: bool = True) -> FileReply:
    """A file's reply; it tells the generation (`tell`: to one who may read the file),
    so the next write changes it.  A write after a reader was told costs the writer a
    commit: a caller who may not read the file is not counted as told (she looped
    LAYOUT on another's file, and each of its writes became a commit on the thread)."""
    if tell:
        vol.told(node.ino)
    out: FileReply = {"ino": node.ino, "size": node.apparent_size,
                      "generation": node.generation, "mode": node.mode, "sealed": sealed}
    if node.is_reg:
        out["layout"] = vol.layout(node).describe()
    return out
