"""What one control connection holds, and helpers shared by the control operations."""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import threading
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import trio

from mxfs.fs.descriptors import Descriptors
from mxfs.fs.failures import FailureLog
from mxfs.fs.fair import RoundRobin
from mxfs.fs.fields import Msg
from mxfs.fs.limits import Limits
from mxfs.fs.member_calls import MemberCalls
from mxfs.io import PAGE
from mxfs.meta import Inode
from mxfs.meta.usage import file_cost
from mxfs.pool.pool import Guard, overallocated
from mxfs.pool.prealloc import reserved_by_writer
from mxfs.pool.revoke import NO_LEASES_FIX, lease_trouble, set_immutable, writers_remain
from mxfs.proto.messages import ReadFds
from mxfs.vol.access import Caller
from mxfs.vol.kv_index import Chunk
from mxfs.vol.quota import Quotas
from mxfs.vol.tenants import tenant_of
from mxfs.vol.volume import OpenInode, Volume

log = logging.getLogger("mxfs.control")

# What serving a request gives: the reply's fields (its op's reply in `proto/messages.py`)
# and descriptors to pass with it.
Rep = TypeVar("Rep", bound=Mapping[str, Any])
T = TypeVar("T")
Answer = tuple[Rep, list[int]]
Reply = Answer[Mapping[str, Any]]


@dataclass
class Pending:
    """A hidden file one connection is writing: published by a commit, else dropped."""

    entry: OpenInode
    path: str  # where a commit names it ("" for a KV chunk)
    declared: int  # the size given at create: the most its chunk files may hold
    # What its quota charge holds beyond its declared size's (a KV chunk's key row,
    # `usage.key_cost`): booked with it, so puts at once count each other's keys.
    extra: int = 0
    overdrawn: bool = False  # its chunk files were cut back: it wrote past `declared`
    # (A node's file) its commit was sent to the writer, which may have named it: its
    # chunk files are the writer's to remove from now on, never cut here.
    committing: bool = False
    namespace: str = ""  # (a KV chunk) the namespace it was made for: committed there
    # What its declared size holds of the metadata member's room, let go with it
    # (`Pool.check_space` with hold, `Pool.landed`).
    meta_room: int = 0
    let_room_go: Callable[[int], None] | None = None
    tenant: int = 0  # its writer's (`Session.hold`): held cut as hers if dropped held
    dir_ino: int = 0  # the folder its path must still lead to at commit (0: any)


@dataclass(slots=True)
class Lease:
    """A connection's read leases on one chunk: the chunk itself (a chunk put again
    under its key is another, whose leases are others'), and how many."""

    chunk: Chunk
    n: int = 0


@dataclass
class Session:
    """One control connection: who is calling and what it holds."""

    caller: Caller
    # Unpublished files of every connection by uid (the server's one tally).
    pending_by_uid: Counter[int] = field(default_factory=Counter)
    pending: dict[int, Pending] = field(default_factory=dict)
    dropping: dict[int, Pending] = field(default_factory=dict)  # (being cut: `drop_pending`)
    pins: dict[tuple[str, bytes], Lease] = field(default_factory=dict)  # KV read leases
    pinned: int = 0  # their sum
    # What it holds through a reading node (`fs/kv_forward.py`), so an idle one is not
    # closed: put buffers and keys pinned on the writer, and when its last claim there
    # runs out (trio's clock).
    far: int = 0
    far_claims_until: float = 0.0
    conn: Any = None  # the socket (asked how much of what it sent is unread)
    sent_fds: int = 0  # descriptors sent in replies the peer may not have read yet
    quotas: Quotas | None = None  # charged each unpublished file's declared size
    # The daemon's descriptors held for tenants, charged `fds_each` an unpublished file
    # (the chunk files it may open here: a commit syncs them, and a commit refused
    # after that leaves them open until the file is let go).
    fds: Descriptors | None = None
    fds_each: int = 0
    # What the request being served took that its reply hands over (a get's read
    # leases), undone if the reply cannot go as made (`refused`).
    undo: list[Callable[[], None]] = field(default_factory=list)
    # Whose per-user limits and turns it shares (a user's subordinate uids are hers:
    # `vol/tenants.py`), fixed at connect so what it counts is given back to the same.
    tenant: int = field(init=False)

    def __post_init__(self) -> None:
        self.tenant = tenant_of(self.caller.uid)

    def refused(self) -> None:
        """The reply the request made was replaced by an error (too many descriptors in
        flight, too large): what it took for its caller is given back, as she was told
        of none of it."""
        undo, self.undo = self.undo, []
        for fn in undo:
            fn()

    def hold(self, pending: Pending, booked: bool = False) -> None:
        """Hold an unpublished file, counted against the limits and its writer's quota
        now (or already, `booked`)."""
        if not booked:  # (refused before it is held)
            self.book(pending.declared, pending.extra)
        self.pending[pending.entry.node.ino] = pending
        pending.tenant = self.tenant

    @contextlib.contextmanager
    def booking(self, declared: int, extra: int = 0) -> Iterator[None]:
        """`book` for the block that makes the file, undone if it fails (the caller
        `hold`s what it made, `booked`)."""
        self.book(declared, extra)
        try:
            yield
        except BaseException:
            self.unbook(declared, extra)
            raise

    def book(self, declared: int, extra: int = 0) -> None:
        """Count a file about to be held, before the awaits that make it: checks made
        before them would let others' requests pass the same ones meanwhile (64
        creates at once each passed a quota that had room for one)."""
        if self.fds is not None:
            self.fds.take(self.tenant, self.fds_each)
        self.pending_by_uid[self.tenant] += 1
        if self.quotas is not None:  # (what the file will be charged: a BLOCK at least)
            self.quotas.reserve(self.caller.uid, file_cost(declared) + extra)

    def unbook(self, declared: int, extra: int = 0) -> None:
        """A booked file was not made after all."""
        self.pending_by_uid[self.tenant] -= 1
        if not self.pending_by_uid[self.tenant]:
            del self.pending_by_uid[self.tenant]
        if self.fds is not None:
            self.fds.give(self.tenant, self.fds_each)
        if self.quotas is not None:
            self.quotas.release(self.caller.uid, file_cost(declared) + extra)

    def let_go(self, ino: int) -> Pending:
        """Forget an unpublished file (committed or dropped); KeyError if not held."""
        pending = self.pending.pop(ino)
        self.forget(pending)
        return pending

    def forget(self, pending: Pending) -> None:
        """What an unpublished file no longer held was counted against, given back."""
        self.unbook(pending.declared, pending.extra)
        if pending.let_room_go is not None:
            pending.let_room_go(pending.meta_room)


def check_pending_room(session: Session, limits: Limits, vol: Volume) -> None:
    """Refuse one more unpublished file to a user caught writing past her word, for her
    penalty (`vol/overdrafts.py`), past the limits of a connection or a user (each
    holds descriptors of its chunk files in the daemon), or to a user holding
    `max_held_files_per_user` chunk files of files dropped while she kept their write
    descriptors (each held, and looked at, until she lets go: pool/revoke.py)."""
    if len(session.pending) >= limits.max_pending:
        raise OSError(errno.EMFILE, f"this connection holds {limits.max_pending} unpublished "
                      "files, the limit (mount option max_pending): commit or abort some")
    uid = session.tenant
    left = vol.overdrafts.left(uid)
    if uid != 0 and left:
        raise OSError(errno.EDQUOT, f"uid {uid} wrote past the size it declared for an "
                      "unpublished file (or reserved space past its end): its unpublished "
                      f"files were revoked, and its creates are refused for {math.ceil(left)} "
                      "s more (mount option overdraft_penalty_s; doubled at each repeat, up "
                      f"to {vol.overdrafts.most_s()} s)")
    if uid != 0 and session.pending_by_uid[uid] >= limits.max_pending_per_user:
        raise OSError(errno.EMFILE, f"uid {uid} holds {limits.max_pending_per_user} "
                      "unpublished files, the limit (mount option max_pending_per_user)")
    held = vol.held.held_by.get(uid, 0)
    if uid != 0 and held >= limits.max_held_files_per_user:
        trouble = lease_trouble()
        if trouble is not None:  # (then every removed file is held as if written)
            raise OSError(errno.ENOLCK, f"{trouble}: uid {uid}'s {held} removed or dropped "
                          "files are held until it can be told that nobody writes them, "
                          f"the limit (mount option max_held_files_per_user) ({NO_LEASES_FIX})")
        raise OSError(errno.EMFILE, f"uid {uid} holds write descriptors of {held} chunk "
                      "files of dropped (aborted) files, the limit (mount option "
                      "max_held_files_per_user): close them")


def page_up(declared: int) -> int:
    """What a file declared `declared` bytes may be written to: up to a page boundary
    (O_DIRECT writers pad the last piece; the commit cuts it)."""
    return -(-declared // PAGE) * PAGE


def allowed_length(vol: Volume, node: Inode, member: int, declared: int) -> int:
    """How long `node`'s chunk file on `member` may be for a file declared `declared`
    bytes (`page_up`)."""
    return vol.layout(node).chunk_length(member, page_up(declared))


def overdrew(vol: Volume, pending: Pending) -> bool:
    """Blocking: whether this file's writer wrote past what it declared, now (a chunk
    file too long) or before its chunk files were cut back."""
    return pending.overdrawn or bool(grown_chunks(vol, pending.entry.node, pending.declared))


def sparse_chunks(vol: Volume, node: Inode, size: int) -> list[int]:
    """Blocking: members whose chunk file of `node`, settled at `size`, has fewer bytes
    allocated than it spans (holes a writer left by truncating or punching): a chunk
    sealed so would cost its checksums' memory and its size in every count of bytes,
    and no disk.  Blocks reserved but not written (fallocate) count as allocated."""
    lay = vol.layout(node)
    sparse = []
    for m in sorted(lay.holding(size)):
        st = os.stat(vol.pool.chunk_path(m, node.ino))
        if st.st_blocks * 512 < lay.chunk_length(m, size) // PAGE * PAGE:
            sparse.append(m)
    return sparse


def grown_chunks(vol: Volume, node: Inode, declared: int) -> list[int]:
    """Blocking: members whose chunk file of `node` runs past what `declared` allows."""
    grown = []
    for m in vol.layout(node).used_members():
        try:
            st = os.stat(vol.pool.chunk_path(m, node.ino))
        except FileNotFoundError:
            continue
        if st.st_size > allowed_length(vol, node, m, declared):
            grown.append(m)
    return grown


def chunk_paths(vol: Volume, node: Inode) -> list[str]:
    return [vol.pool.chunk_path(m, node.ino) for m in vol.layout(node).used_members()]


# A commit refused EBUSY (a writer still holds the file) is tried again after these, on
# the loop's clock (no thread held meanwhile): a writer's last reference may still be on
# its way out of the kernel just after her close (an io_uring request's file, put after
# its completion was seen), and CI saw commits refused as if a writer remained.
SETTLE_S = (0.05, 0.25)


async def again_while_busy(run: Callable[[], Awaitable[T]]) -> T:
    """`run`, again SETTLE_S later each time it is refused EBUSY (`refuse_if_writers`
    in it); the last refusal raised."""
    for wait in (*SETTLE_S, None):
        try:
            return await run()
        except OSError as e:
            if e.errno != errno.EBUSY or wait is None:
                raise
        await trio.sleep(wait)
    raise AssertionError("unreachable")


def refuse_if_writers(vol: Volume, pending: Pending) -> None:
    """Blocking: EBUSY while any descriptor for writing the file is open, anywhere: a
    published file is sealed, and a kept descriptor would rewrite it behind its
    checksums (pool/revoke.py).  The file stays unpublished: close and commit again."""
    if writers_remain(chunk_paths(vol, pending.entry.node)):
        trouble = lease_trouble()
        if trouble is not None:
            raise OSError(errno.ENOLCK, f"{trouble}: whether a descriptor for writing this "
                          f"file is still open cannot be told, so it is not committed "
                          f"({NO_LEASES_FIX})")
        raise OSError(errno.EBUSY, "a descriptor for writing this file is still open (in "
                      "this process or one it shared it with): close every one, then commit")


async def drop_pending(vol: Volume, session: Session, ino: int) -> None:
    """Forget an unpublished file: its space now, its chunk files after the next commit;
    if a writer still holds descriptors, the files are moved aside and held cut to
    nothing until it lets go (pool/revoke.py), so the inode number can be reused.  The
    files are probed and cut in a settling thread (a closing connection's 256 files of
    2 GiB each held trio's thread for seconds), in the caller's turn: a user closing
    hundreds of connections, each cut fsynced on the metadata member, waits behind her
    own cuts (first come first served on trio's shared threads, every user's commits
    waited behind all of them)."""
    # Out of the connection's files at once (nothing commits it now), but counted (its
    # quota and pending room) and cut back each second (`dropping`) until its chunk
    # files are cut: let go before, a user's drops queued behind her own slow commits
    # freed her quota for new files while their old ones took writes without limit.
    pending = session.pending.pop(ino)
    session.dropping[ino] = pending
    paths = chunk_paths(vol, pending.entry.node)

    def cut() -> None:
        if not pending.overdrawn and grown_chunks(vol, pending.entry.node, pending.declared):
            vol.caught(pending.tenant)  # (written past her word, then dropped: caught)
        if writers_remain(paths):
            vol.held.hold(ino, session.tenant)
        else:
            vol.pool.cut_chunks(ino)
    try:
        with trio.CancelScope(shield=True):  # (the inode is released after, whatever)
            await settle_off_loop(session.caller.uid, cut)
    finally:
        del session.dropping[ino]
        session.forget(pending)
        vol.release(ino)


def cut_back(vol: Volume, pendings: list[Pending]) -> int:
    """Blocking (a worker thread): cut chunk files of unpublished files that run past
    their writers' declared sizes back to them, marking those files refused; how many
    chunk files were cut.  A writer cannot be stopped, but the space it took past its
    word is taken back (on the metadata member, at once: `Pool.cut`), and a file whose
    writers still hold it past their word (grown, or blocks reserved past its end) is
    held as a dropped one is (`Held.hold`: moved aside, cut every second, immutable
    where the member's file system keeps the flag): a writer that reserved a member's
    space with fallocate(KEEP_SIZE) and kept its descriptors, never committing, held
    it outside every quota for as long as it liked.  A tenant caught so loses every
    unpublished file she holds at once, and her creates are refused a while
    (`vol/overdrafts.py`): one at a time, she filled the metadata member with the next
    of a thousand files each time the last was cut.  Each chunk file is looked at once
    a round (`stat`); one file's failure (a member failing, a full one) is logged and
    stops no other's cut-back."""
    cut = 0
    for pending in pendings:
        cut += _each(_cut_back_one, vol, pending, pendings)
    for pending in pendings:  # (a tenant caught before this round, at a commit)
        if not pending.overdrawn and not pending.committing and \
                vol.overdrafts.left(pending.tenant):
            cut += _each(_revoke_one, vol, pending)
    return cut


_CUT_FAILURES = FailureLog(log)  # (noted from worker threads: under its lock)
_CUT_FAILURES_LOCK = threading.Lock()


def _each(fn: Callable[..., int], vol: Volume, pending: Pending, *args: Any) -> int:
    """`fn(vol, pending, *args)`, its failure logged (rate-limited) as 0 cut."""
    try:
        return fn(vol, pending, *args)
    except Exception as e:
        with _CUT_FAILURES_LOCK:
            _CUT_FAILURES.note(f"cut-back of inode {pending.entry.node.ino}", None, e,
                               trace=not isinstance(e, OSError))
        return 0


def _cut_back_one(vol: Volume, pending: Pending, pendings: list[Pending]) -> int:
    """`cut_back` of one file.  Its writer's tenant caught, every other file of hers in
    `pendings` is held first, and this one's space freed last: freed first, she took
    it again through the next of them before the round reached it."""
    cut = 0
    node = pending.entry.node
    was = pending.overdrawn
    grown = []  # (member, chunk file, its allowed length) past it
    reserved = False  # (blocks past its end that a writer still holding it reserved)
    for m in vol.layout(node).used_members():
        path = vol.pool.chunk_path(m, node.ino)
        try:
            st = os.stat(path)
            allowed = allowed_length(vol, node, m, pending.declared)
            if st.st_size > allowed:
                pending.overdrawn = True  # cut back or not, its commit is refused
                grown.append((m, path, allowed))
            elif overallocated(st, allowed) and reserved_by_writer(path):
                # (fallocate with KEEP_SIZE: not XFS's own preallocation past the end
                # of a file written buffered, which it trims at the last close)
                if writers_remain([path]):  # (a commit frees them: truncate_chunks)
                    reserved = True
                else:
                    os.truncate(path, st.st_size)
                    cut += 1
        except OSError:
            pass  # (gone, or a member failing: its own checks say so)
    if not pending.committing and (pending.overdrawn or reserved) and \
            writers_remain(chunk_paths(vol, node)):
        pending.overdrawn = True
        _freeze(vol, pending, True)  # (at once: held last, after her other files)
        cut += _caught(vol, pending, was, pendings)
        try:
            return cut + vol.held.hold(node.ino, pending.tenant)  # (cut to nothing)
        except BaseException:
            _cut_to(vol, grown)  # (its hold failed: what it took past its word goes)
            raise
    if grown and not pending.committing:  # (written past her word, then let go of:
        cut += _caught(vol, pending, was, pendings)  # caught all the same)
    return cut + _cut_to(vol, grown)  # (no writer left, or a node's file whose commit
    #                                    was sent: the writer's to hold)


def _caught(vol: Volume, pending: Pending, was: bool, pendings: list[Pending]) -> int:
    """`pending`'s tenant caught overdrawing (unless it was before this round): while
    her penalty runs, every other unpublished file of hers is revoked; how many chunk
    files that cut.  (Caught only where she still held it, she wrote gigabytes past
    her word, let go within the round, and made the next file, never penalised.)"""
    if not was:
        vol.caught(pending.tenant)
    cut = 0
    if vol.overdrafts.left(pending.tenant):
        others = [o for o in pendings if o is not pending and o.tenant == pending.tenant
                  and not o.overdrawn and not o.committing]
        # Every one frozen first, then revoked one by one (a lease probe each, then a
        # move): revoked in turn alone, she went on reserving space through the files
        # not yet reached, each 10 ms.
        for other in others:
            _freeze(vol, other, True)
        for other in others:
            cut += _each(_revoke_one, vol, other)
    return cut


def _freeze(vol: Volume, pending: Pending, on: bool) -> None:
    """Set (or clear) the immutable flag of `pending`'s chunk files on this node: a
    writer's fallocate through a descriptor she kept is refused EPERM while it is set
    (`Held` clears it for each cut, and sets it again where the file lands)."""
    for path in chunk_paths(vol, pending.entry.node):
        set_immutable(path, on)


def _cut_to(vol: Volume, grown: list[tuple[int, str, int]]) -> int:
    """Chunk files cut back to their allowed lengths: (member, path, length) each; how
    many were (one gone, or on a member failing, is its own checks' to report)."""
    cut = 0
    for m, path, allowed in grown:
        try:
            vol.pool.cut(m, path, allowed)
            cut += 1
        except OSError:
            pass
    return cut


def _revoke_one(vol: Volume, pending: Pending) -> int:
    """A file of a tenant caught overdrawing: refused at commit, held if written."""
    pending.overdrawn = True
    if writers_remain(chunk_paths(vol, pending.entry.node)):
        return vol.held.hold(pending.entry.node.ino, pending.tenant)
    _freeze(vol, pending, False)  # (no writer left to hold it from: its abort removes it)
    return 0


def refuse_if_degraded(vol: Volume) -> None:
    """Nothing new is written to a pool with a failed member (it is served read-only)."""
    failed = vol.pool.failed
    if failed:
        raise OSError(errno.EROFS, f"the pool is degraded (member {failed[0].index} failed: "
                      f"{failed[0].failed}): read-only")


# Commits settle their files' chunk files (stats, leases, truncates, syncs), and dropped
# files' are cut, in threads of their own: on a hung member they would hold the threads
# every other worker call shares.  Handed out by uid in turn, one uid holding half at
# most: a user committing files with gigabytes of dirty pages, or closing hundreds of
# connections, waits behind her own syncs and cuts, not everyone's.
SETTLERS = 4
SETTLING = trio.CapacityLimiter(SETTLERS)
_SETTLING_TURNS = RoundRobin(SETTLERS, SETTLERS // 2)


async def settle_off_loop(uid: int, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` (blocking: a commit's stats, truncates and syncs, a drop's cuts) in a
    settling thread, in `uid`'s turn."""
    async with _SETTLING_TURNS.slot(uid):
        return await trio.to_thread.run_sync(fn, *args, limiter=SETTLING)


async def open_hidden(vol: Volume, parent: Inode, mode: int, uid: int, gid: int,
                      calls: MemberCalls) -> tuple[OpenInode, list[int], list[int]]:
    """A hidden file and write descriptors of its chunk files, opened off the loop:
    (entry, members, fds)."""
    refuse_if_degraded(vol)
    return await open_writers_off_loop(vol, vol.create_hidden(parent, mode, uid, gid),
                                       calls, uid)


async def open_writers_off_loop(vol: Volume, entry: OpenInode, calls: MemberCalls,
                                uid: int, before: Callable[[], object] | None = None
                                ) -> tuple[OpenInode, list[int], list[int]]:
    """Write descriptors of a held hidden file's chunk files, made where missing:
    (entry, members, fds), opened (after `before()`, if given) in a worker thread in
    `uid`'s turn, each through the member guard: a member that stopped answering
    holds only its own callers.  On failure the file is let go (an orphan:
    reclaimed)."""
    def opened() -> tuple[list[int], list[int]]:
        if before is not None:
            before()
        return chunk_writers(vol, entry.node, calls.guarded)
    try:
        members, fds = await calls.run_whole(opened, uid, vol.layout(entry.node).used_members())
    except BaseException:
        vol.release(entry.node.ino)
        raise
    return entry, members, fds


def chunk_writers(vol: Volume, node: Inode, guard: Guard | None = None
                  ) -> tuple[list[int], list[int]]:
    """(Blocking.)  Write descriptors of `node`'s chunk files, made where missing:
    (members, fds); on failure those opened are closed."""
    members, fds = [], []
    try:
        if far := vol.pool.far(vol.layout(node).used_members()):
            raise OSError(errno.EREMOTE, f"this file stripes over node "
                          f"{vol.pool.members[far[0]].node}'s members: write it through "
                          "the mount")
        for m in vol.layout(node).used_members():
            vol.pool.check([m])
            try:  # the writer's descriptor is the only one: the daemon keeps none open
                fds.append(vol.pool.open_chunk(m, node.ino,
                                               os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, guard))
            except OSError as e:
                vol.pool.probe(m, e)
                raise
            members.append(m)
    except OSError:
        for fd in fds:
            os.close(fd)
        raise
    return members, fds


def read_fds(vol: Volume, node: Inode, odirect: bool = False, guard: Guard | None = None
             ) -> tuple[ReadFds, list[int]]:
    """Read-only descriptors of a file's chunk files (see Pool.open_for_read)."""
    return vol.pool.open_for_read(node.ino, vol.layout(node), node.size, odirect, guard)


# A control operation: serves one request of a connection.
Handler = Callable[[Msg, Session], Awaitable[Reply]]
