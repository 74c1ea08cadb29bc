"""The file operations of the control socket: the direct read and write paths.

`open_read` hands a caller read descriptors of a file's chunk files (after the
permission checks the mount would make), or on a reading node connections to their
owner scoped to the file (`fs/remote_reads.py`); `create` makes a hidden file and hands its
writer write descriptors; `commit` settles, names, seals and makes it durable in one
step, `abort` drops it.  The unpublished files every connection holds are kept to
their writers' declared sizes here (`revoke`, `trim_overdrafts`).
"""

from __future__ import annotations

import base64
import errno
import logging
import os
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import trio

from mxfs.fs.fair import in_bites
from mxfs.fs.fields import Msg, bool_field, int_field, path_field, sums_field
from mxfs.fs.limits import Limits
from mxfs.fs.member_calls import MemberCalls
from mxfs.fs.meta_ops import SharedSync
from mxfs.fs.node_files import ForwardedFiles, NodeFiles, answered, describe
from mxfs.fs.remote_reads import RemoteReads
from mxfs.fs.session import (
    Answer,
    Handler,
    Pending,
    Session,
    again_while_busy,
    check_pending_room,
    cut_back,
    drop_pending,
    open_hidden,
    open_writers_off_loop,
    overdrew,
    page_up,
    read_fds,
    refuse_if_writers,
    settle_off_loop,
)
from mxfs.fs.store_worker import StoreWorker
from mxfs.meta import Inode, MetaStore
from mxfs.meta.usage import file_cost
from mxfs.pool.closer import close_later
from mxfs.proto import MAX_FDS
from mxfs.proto.messages import CreateReply, Empty, FileReply, OpenReadReply
from mxfs.vol.access import (
    R_OK,
    may,
    may_replace,
    owner_for,
    resolve_for,
    resolve_parent_for,
    same_folder,
)
from mxfs.vol.tenants import tenant_of
from mxfs.vol.volume import Volume

log = logging.getLogger("mxfs.control")

# Times an open_read judges and opens again when a renew of its file began meanwhile.
RENEW_TRIES = 8
HELD_BITE = 1024  # held chunk files a sweep's worker thread call looks at


class FileOps:
    def __init__(self, vol: Volume, mountpoint: str, limits: Limits,
                 sessions: Callable[[], Iterable[Session]],
                 writeback_cache: bool = False,
                 entry_changed: Callable[[int, bytes, int], Awaitable[None]] | None = None,
                 settle: Callable[[int], Awaitable[None]] | None = None,
                 remote: RemoteReads | None = None, reads: StoreWorker | None = None,
                 pending_by_uid: Counter[int] | None = None,
                 syncs: SharedSync | None = None) -> None:
        self.vol = vol
        self.syncs = syncs or SharedSync(vol.store)  # (shared with the mount's fsyncs)
        self.mountpoint = mountpoint
        self.limits = limits
        self.sessions = sessions  # every connection's (their unpublished files)
        self.writeback_cache = writeback_cache
        # Told about names that commits create or replace, so the kernel's cached
        # entries (including "no such name") are dropped.
        self.entry_changed = entry_changed
        # Waits until the mount's answered writes of an inode are on its members, so a
        # direct reader sees them (the mount lands writes behind their answers).
        self.settle = settle
        # Direct reads of other nodes' members (a reading node): fs/remote_reads.py.
        self.remote = remote
        # Waits while an inode's chunk files are cut or renewed; True if it waited
        # (`MxfsOperations.renewing`, set by the daemon).
        self.renewing: Callable[[int], Awaitable[bool]] | None = None
        # A reading node's store reads (round trips to the server), off trio's thread:
        # the FUSE handlers' worker (`fs/ops.py`), users taking turns.
        self.reads = reads
        # Calls into the members' filesystems (the mount's set, once the daemon has it).
        self.calls = MemberCalls(len(vol.pool.members))
        # Direct writes on a node that holds members (`fs/node_files.py`): on that node,
        # asked of the writer; on the writer, the files it holds for those nodes.
        self.forwarded = ForwardedFiles(vol) if vol.pool.node else None
        self.for_nodes = NodeFiles(
            vol, mountpoint, limits, pending_by_uid if pending_by_uid is not None
            else Counter(), self._publish, entry_changed) if not vol.pool.node else None

    def handlers(self) -> dict[str, Handler]:
        return {"layout": self.layout, "open_read": self.open_read, "create": self.create,
                "commit": self.commit, "abort": self.abort}

    def _describe(self, node: Inode, sealed: bool | None = None, tell: bool = True
                  ) -> FileReply:
        if sealed is None:
            sealed = self.vol.store.is_sealed(node.ino)
        return describe(self.vol, node, sealed, tell)

    async def _find(self, path: str, session: Session) -> tuple[Inode, bool]:
        """The inode `path` names, walked as the caller, and whether it is sealed: read
        here, or on a reading node in its store's worker, in the caller's turn."""
        def find(store: MetaStore) -> tuple[Inode, bool]:
            node = resolve_for(store, path, session.caller, mountpoint=self.mountpoint)
            return node, store.is_sealed(node.ino)
        if self.reads is None:
            return find(self.vol.store)
        return await self.reads.run(find, session.caller.uid)

    async def open_read(self, msg: Msg, session: Session) -> Answer[OpenReadReply]:
        """Read-only descriptors of a file's chunk files, if the caller may read it
        (with "odirect": O_DIRECT ones too, for reads that bypass the page cache).

        A renew of its chunk files (its access being taken away: `Volume.renew`)
        that runs or begins while it is judged and opened makes it wait for the change
        and judge again: descriptors opened meanwhile might be of the new files, which
        the file's later writes go to.  So does a file found removed (or another file
        under its number) once they are opened (`_live`): its chunk files go only after
        its last link (reclaim, a node's REMV), each asked first whether anyone holds it
        and cut to nothing if not, and one opened after that ask read nothing.  Found
        linked after the opens, it was unlinked after them, so the ask comes later
        still, sees them, and keeps the file aside uncut."""
        path, caller = path_field(msg), session.caller
        for _ in range(RENEW_TRIES):
            node, sealed = await self._find(path, session)
            mark = self.vol.renew_mark(node.ino)  # (before the check: see renew_mark)
            generation = node.generation  # (a reading node's row is read into `node`)
            if node.is_dir:
                raise OSError(errno.EISDIR, f"{path} is a directory")
            if not node.is_reg:
                raise OSError(errno.EINVAL, f"{path} is not a regular file")
            if not may(node, caller, R_OK):
                raise OSError(errno.EACCES, f"{path}: read permission denied")
            # Lent from the check on, before any await: a chmod or chown meanwhile renews
            # it (`Volume.renew`) and changes the mark, and this judges again (marked
            # lent only once its descriptors were opened, a chmod in between found it
            # not lent, renewed nothing, and the reader kept what was written after).
            self.vol.lent.add(node.ino)
            if self.renewing is not None and await self.renewing(node.ino):
                continue
            got = await self._open_read(msg, session, path, node, sealed)
            if "remote" in got[0]:
                return got  # (a reading node's connections: its writer renews, not here)
            try:
                live = await self._live(node.ino, generation, caller.uid)
            except BaseException:
                close_later(got[1])  # (a close can wait on the member)
                raise
            if live and self.vol.renew_mark(node.ino) == mark:
                return got
            close_later(got[1])
        raise OSError(errno.EAGAIN, f"{path}: its access changed, or it was replaced, while "
                      "it was opened, again and again: try again")

    async def _live(self, ino: int, generation: int, uid: int) -> bool:
        """Whether `ino` is still linked, as the file of `generation`: asked after its
        chunk files were opened (`open_read`), of memory on the writer (an unlink marks
        its row there before any reclaim of it), of the store on a reading node (the
        writer removes its chunk files here only after the unlink is committed)."""
        try:
            node = await self._row(ino, uid)
        except OSError as e:
            if e.errno != errno.ENOENT:
                raise
            return False
        return node.nlink > 0 and node.generation == generation

    async def _open_read(self, msg: Msg, session: Session, path: str, node: Inode,
                         sealed: bool) -> Answer[OpenReadReply]:
        caller = session.caller
        entry = self.vol.open_inodes.get(node.ino)
        if self.writeback_cache and entry is not None and entry.wrote:
            # Its newest bytes may still sit in the kernel's writeback cache.
            raise OSError(errno.EBUSY, f"{path} is open for writing through the mount")
        if self.settle is not None and entry is not None:
            await self.settle(node.ino)
        # Two descriptors a member with O_DIRECT: only while one message can carry them.
        layout = self.vol.layout(node)
        members = len(layout.used_members())
        odirect = bool_field(msg, "odirect") and 2 * members <= MAX_FDS
        calls = self.calls
        try:  # (opened off the loop, in the caller's turn: a hung member holds no one)
            which, fds = await calls.run_whole(
                lambda: read_fds(self.vol, node, odirect=odirect, guard=calls.guarded),
                caller.uid, layout.holding(node.size))
        except OSError as e:
            # Another node's members (a reading node): connections to their owner,
            # scoped to this file, for a caller that takes them; else the mount reads it.
            pool = self.vol.pool
            if e.errno != errno.EREMOTE or self.remote is None or \
                    not bool_field(msg, "remote") or any(
                        pool.members[m].node != pool.members[0].node or not pool.node
                        for m in layout.holding(node.size)):
                raise  # (connections go to the writer node only: others read the mount)
            held = len(layout.holding(node.size))
            grant, fds = await self.remote.open([node], max(held, 1), session)
            return {**self._describe(node, sealed), "members": [], "remote": grant}, fds
        return {**self._describe(node, sealed), **which}, fds

    # ---- direct writes -------------------------------------------------------

    async def create(self, msg: Msg, session: Session) -> Answer[CreateReply]:
        """A hidden file to be published at `path`, and write descriptors of its chunk files.

        The caller must be allowed to create `path` (as the mount would), and the
        declared `size` must fit without eating the metadata store's reserve: it is
        also the most the commit will accept.
        """
        path, caller = path_field(msg), session.caller
        size = int_field(msg, "size", 0)
        mode = int_field(msg, "mode", 0o644) & 0o7777
        exclusive = bool_field(msg, "exclusive")
        dir_ino = int_field(msg, "dir_ino", 0)
        check_pending_room(session, self.limits, self.vol)
        if self.forwarded is not None:  # a node: on its own members, named by the writer
            return await self._create_here(session, {
                "path": path, "size": size, "mode": mode, "exclusive": exclusive,
                "dir_ino": dir_ino, "mountpoint": self.mountpoint,
                "token": os.urandom(12).hex()})
        parent, name = resolve_parent_for(self.vol.store, path, caller, self.mountpoint)
        same_folder(parent, dir_ino, path)
        self.vol.quotas.room_for_entry(caller.uid, parent.uid, name, file_cost(size), 1)
        if exclusive and self.vol.store.entry_ino(parent.ino, name) is not None:
            raise OSError(errno.EEXIST, f"{path} exists")
        # Its declared share of the metadata member is held until it is committed or
        # dropped (two creates declared as large as the room took it all): the most one
        # member may get of it, wherever it starts (its first member is its inode's,
        # and the first holds the most: an even share held a quarter of a 1 GiB file
        # striped in units of 1 GiB, which the writer then put whole on member 0).
        layout = self.vol.pool.layout_for(0, parent.stripe_unit, parent.stripe_width)
        pool, held = self.vol.pool, 0
        try:
            held = pool.check_space(pool.meta_member,
                                    layout.chunk_length(layout.first, page_up(size)),
                                    hold=True)
            mode, gid = owner_for(parent, mode, caller.uid, caller.gid,
                                  caller.gids.__contains__)
            with session.booking(size):
                entry, members, fds = await open_hidden(self.vol, parent, mode, caller.uid,
                                                        gid, self.calls)
        except BaseException:
            pool.landed(held)
            raise
        session.hold(Pending(entry, path, size, meta_room=held, let_room_go=pool.landed,
                             dir_ino=dir_ino), booked=True)
        return {**self._describe(entry.node), "members": members}, fds

    async def _create_here(self, session: Session, body: dict[str, Any]
                           ) -> Answer[CreateReply]:
        """`create` on a node that holds members: the writer makes the hidden file on
        this node's members (`node_create`); its chunk files are opened here."""
        assert self.forwarded is not None
        self.forwarded.check_writable()
        caller, size = session.caller, int(body["size"])
        with session.booking(size):
            try:
                made = await self.forwarded.ask(caller, "node_create", body)
            except BaseException as e:  # (made, perhaps, and its answer lost: dropped by
                if not answered(e):     # name; one the writer refused was never made)
                    self.forwarded.abort_later(caller, token=str(body["token"]))
                raise
            ino = int(made["ino"])
            try:
                node = await self._row(ino, caller.uid)
                entry, members, fds = await open_writers_off_loop(
                    self.vol, self.vol.acquire(node), self.calls, caller.uid)
            except BaseException:
                self.forwarded.abort_later(caller, ino)
                raise
        session.hold(Pending(entry, str(body["path"]), size, dir_ino=int(body["dir_ino"])),
                     booked=True)
        self.forwarded.writing.add(ino)
        return {**self._describe(node, False), "members": members}, fds

    async def _row(self, ino: int, uid: int) -> Inode:
        """The row of `ino` as the store holds it now (a reading node's worker)."""
        if self.reads is None:
            return self.vol.store.get(ino)
        return await self.reads.run(lambda store: store.get(ino), uid)

    def _pending(self, msg: Msg, session: Session) -> Pending:
        pending = session.pending.get(int_field(msg, "ino"))
        if pending is None:
            raise OSError(errno.EBADF, f"inode {msg.get('ino')} is not being written here")
        return pending

    async def commit(self, msg: Msg, session: Session) -> Answer[FileReply]:
        """Publish a hidden file: settle its bytes, name it, seal it, make it durable.

        A writer that wrote past the size it declared at create is refused and its
        file reclaimed (its descriptors cannot be taken back, but its space can).
        """
        pending = self._pending(msg, session)
        entry, node = pending.entry, pending.entry.node
        size = int_field(msg, "size")
        replace = bool_field(msg, "replace", True)
        sums_field(msg, self.vol.layout(node).unit, size)  # (checked before any work)
        uid = session.caller.uid
        was = pending.overdrawn
        overdrawn = await settle_off_loop(uid, overdrew, self.vol, pending)
        if size > pending.declared or overdrawn:
            if overdrawn and not was:  # (found here first: her other files go too)
                self.vol.caught(session.tenant)
            await self._drop(session, node.ino)
            raise OSError(errno.EFBIG, f"wrote past the {pending.declared} bytes declared at "
                          "create: refused, and the file's space reclaimed")
        await again_while_busy(lambda: settle_off_loop(uid, refuse_if_writers, self.vol,
                                                       pending))
        # No other request of this connection runs meanwhile (one at a time), so the
        # file is still this session's after the awaits.
        await settle_off_loop(uid, self.vol.settle_hidden, entry, size)
        if self.forwarded is not None:  # a node's file: the writer names and seals it
            pending.committing = True  # (named there, perhaps, whatever comes back)
            reply = await self.forwarded.ask(session.caller, "node_commit", {
                **{k: msg[k] for k in ("sum_unit", "sums", "replace") if k in msg},
                "ino": node.ino, "size": size})
            session.let_go(node.ino)
            self.vol.release(node.ino)
            self.forwarded.writing.discard(node.ino)
            named = reply.pop("named", None)
            if named is not None and self.entry_changed is not None:  # ("no such name"
                await self.entry_changed(int(named[0]), base64.b64decode(named[1]),
                                         session.caller.uid)  # here)
            return reply, []  # type: ignore[return-value]
        return await self._publish(pending, session, size, replace, msg), []

    async def _publish(self, pending: Pending, session: Session, size: int, replace: bool,
                       msg: Msg, mountpoint: str | None = None) -> FileReply:
        """Name a settled hidden file at its path (resolved under `mountpoint`: a node's
        for its files, `fs/node_files.py`), seal it with the sums in `msg`, make it
        durable."""
        entry, node = pending.entry, pending.entry.node
        sum_unit, sums = sums_field(msg, self.vol.layout(node).unit, size)
        parent, name = resolve_parent_for(self.vol.store, pending.path, session.caller,
                                          self.mountpoint if mountpoint is None
                                          else mountpoint)
        same_folder(parent, pending.dir_ino, pending.path)
        if tenant_of(parent.uid) != session.tenant:  # (judged at create for the folder
            # its path led to then: a link moved since sends the name to another
            # owner's folder, who is charged it, checked here)
            self.vol.quotas.room_for_entry(session.caller.uid, parent.uid, name)
        old = self.vol.store.entry_ino(parent.ino, name)
        if old is not None and replace:
            may_replace(parent, self.vol.store.get(old), session.caller)
        self.vol.publish(entry, parent.ino, name, size, replace, sum_unit, sums)
        session.let_go(node.ino)
        self.vol.release(node.ino)
        lost = self.vol.store.groups_lost
        try:
            await self.syncs.durable()
        except OSError as e:
            if self.vol.store.groups_lost != lost:  # its group went: it was never named
                raise
            # Named in memory and in the open group (SQLite keeps it past a full member)
            raise OSError(e.errno, f"the file is published but not yet durable ({e.strerror}"
                          "); it is kept if the daemon lives until its next commit") from None
        finally:  # the mount shows what the daemon holds, durable or not
            if self.entry_changed is not None:
                await self.entry_changed(parent.ino, name, session.caller.uid)
        return self._describe(node)

    async def abort(self, msg: Msg, session: Session) -> Answer[Empty]:
        await self._drop(session, self._pending(msg, session).entry.node.ino)
        return {}, []

    async def _drop(self, session: Session, ino: int) -> None:
        """Drop an unpublished file (on a node, the writer told too, its chunk files
        left to the writer once its commit was sent: it may have named it)."""
        if self.forwarded is None:
            await drop_pending(self.vol, session, ino)
            return
        if session.pending[ino].committing:
            session.let_go(ino)
            self.vol.release(ino)
        else:
            await drop_pending(self.vol, session, ino)
        self.forwarded.writing.discard(ino)
        self.forwarded.abort_later(session.caller, ino)

    async def layout(self, msg: Msg, session: Session) -> Answer[FileReply]:
        node, sealed = await self._find(path_field(msg), session)
        return self._describe(node, sealed, tell=may(node, session.caller, R_OK)), []

    async def release(self, session: Session) -> None:
        """A connection ended: its unpublished files are dropped (each one tried; the
        first failure raised after)."""
        failed: Exception | None = None
        for ino in list(session.pending):
            try:
                await self._drop(session, ino)
            except Exception as e:
                failed = failed or e
        if failed is not None:
            raise failed

    def _all_pending(self) -> list[Pending]:
        """Every unpublished file held, and those being dropped (cut back as held)."""
        return [p for s in self.sessions() for held in (s.pending, s.dropping)
                for p in held.values()]

    async def trim_overdrafts(self) -> int:
        """Now: cut every unpublished file's chunk files back to what its writer
        declared (the metadata member runs short), in a worker thread (a stat, a lease
        probe and a truncate a file: thousands of them, or one on a member that stopped
        answering, held the loop).  How many were cut."""
        cut = await trio.to_thread.run_sync(cut_back, self.vol, self._all_pending())
        if cut:
            log.warning("metadata member short of space: cut %d chunk files of unpublished "
                        "files back to their declared sizes", cut)
        return cut

    async def revoke(self) -> None:
        """Once a second (a task of the daemon): unpublished files cut back to their
        declared sizes, in a worker thread, as both stat and truncate files."""
        cut = await trio.to_thread.run_sync(cut_back, self.vol, self._all_pending())
        if cut:
            log.warning("cut %d chunk files of unpublished files back to the sizes their "
                        "writers declared", cut)

    async def sweep_held(self) -> None:
        """Held chunk files of dropped or removed ones cut or removed (pool/revoke.py),
        HELD_BITE a worker thread call, stepping aside between: apart from `revoke`, so
        that thousands of them a user keeps never hold back others' cut-backs."""
        async for bite in in_bites(list(self.vol.held.files), HELD_BITE):
            await trio.to_thread.run_sync(self.vol.held.sweep, bite)
        if self.for_nodes is not None:
            self.for_nodes.sweep(trio.current_time())

