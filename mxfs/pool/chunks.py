"""The chunk files of one open file, and striped reads and writes over them.

Descriptors are opened lazily per member and shared by every handle of the
inode; reads of a member that has no chunk file yet return zeros (a hole).  Members
another node holds are read through its chunk service, and on the writer node written,
synced and cut through it (`RemoteMembers.change`), each member's share at once.
Methods block: the daemon calls them from worker threads.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from mxfs.io import Layout, Piece, ReadOp, WriteOp, read_batch, write_batch
from mxfs.io.batch import Begun, finish_all, sync_all
from mxfs.pool.closer import close_later
from mxfs.pool.pool import Pool
from mxfs.pool.read_ahead import ReadAhead

if TYPE_CHECKING:
    from mxfs.pool.remote import RemoteMembers

RETIRED_S = 10.0  # descriptors of renewed chunk files stay open this long (I/O begun)


class _Retired:
    """Descriptors retired by every open file, still open (any thread): counted in the
    daemon's descriptor budget (`fs/descriptors.py`), as those still closing are."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0

    def add(self, n: int) -> None:
        with self._lock:
            self.count += n


RETIRED = _Retired()


class ChunkFiles:
    """Open chunk descriptors of one inode (one per member it has written)."""

    def __init__(self, pool: Pool, ino: int, layout: Layout) -> None:
        self.pool = pool
        self.ino = ino
        self.layout = layout
        self._fds: dict[int, int] = {}
        self._readonly: set[int] = set()  # members whose filesystem refused writing
        self._lock = threading.Lock()
        self._closed = False
        self._prepared = False  # (`prepare` opens the first member's file once at most)
        self._retired: deque[tuple[float, list[int]]] = deque()  # (`reopen`)
        self._using = 0  # local reads, writes and syncs in flight through `_fds`
        self._using_lock = threading.Lock()
        self._far_written: set[int] = set()  # other nodes' members written (to sync)
        self.relayout(layout)

    def relayout(self, layout: Layout) -> None:
        """The file's layout (set anew on an empty file: `mxfs setstripe`)."""
        self.layout = layout
        self._far = self.pool.far(layout.used_members())  # other nodes' members it uses
        # Another node's stripes read in order come in windows (`pool/read_ahead.py`);
        # the writer drops them after each write and cut (a window fetched before
        # holds the bytes before).
        self._ahead = ReadAhead(layout.unit * layout.width, self._read_now) \
            if self._far else None

    @property
    def far(self) -> bool:
        """Whether some of its members are other nodes' (its I/O waits on them)."""
        return bool(self._far)

    @property
    def owners(self) -> tuple[str, ...]:
        """The other nodes its I/O waits on (none: this node's own members alone)."""
        return self.pool.owners(self._far)

    def fd(self, member: int, create: bool) -> int | None:
        fd = self._fds.get(member)
        if fd is not None and not (create and member in self._readonly):
            return fd
        with self._lock:
            if member in self._fds and not (create and member in self._readonly):
                return self._fds[member]
            if self._closed:  # (a window read ahead that ends after the last close)
                raise OSError(errno.EBADF, f"inode {self.ino} was closed")
            self.pool.check([member])
            try:
                fd = self._open(member, create)
            except FileNotFoundError as e:
                self.pool.probe(member, e)  # a hole, unless the member itself is gone
                self.pool.check([member])
                if create:
                    raise
                return None
            except OSError as e:
                self.pool.probe(member, e)
                raise
            old = self._fds.get(member)
            if old is not None:  # a read-only descriptor, replaced by a writable one: a
                # read that took it without the lock may still use it (closed, its number
                # could be another file's by then), so it is retired as `reopen` retires
                self._retire([old])
                self._sweep(time.monotonic())
            self._fds[member] = fd
        if self._closed:  # (closed while this open waited: see `close`)
            self._closed_meanwhile()
            raise OSError(errno.EBADF, f"inode {self.ino} was closed")
        return fd

    def _open(self, member: int, create: bool) -> int:
        path = self.pool.chunk_path(member, self.ino)
        try:
            if create:
                with self.pool.creating(member, self.ino):
                    fd = os.open(path, self.pool.create_flags(
                        member, path, os.O_RDWR | os.O_CLOEXEC | os.O_CREAT), 0o600)
            else:
                fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            self._readonly.discard(member)
            return fd
        except OSError as e:
            if e.errno != errno.EROFS or create:
                raise
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)  # a read-only member still serves reads
        self._readonly.add(member)
        return fd

    def read(self, offset: int, buf: memoryview, reader: int = 0, end: int | None = None
             ) -> None:
        """Fill `buf` with file bytes from `offset` (the caller clips to the file size,
        `end`): this node's members read here, another node's through its chunk
        service, all at once (or from the windows read ahead of a file read in order,
        counted as `reader`'s: a tenant, `pool/read_ahead.py`; none past `end`)."""
        if self._ahead is None or not self._ahead.read(offset, buf, reader, end):
            self._read_now(offset, buf)

    def _read_now(self, offset: int, buf: memoryview) -> None:
        pieces = self.layout.plan(offset, len(buf))
        self.pool.check({p.member for p in pieces})
        far = [p for p in pieces if self.pool.members[p.member].node]
        begun = self._begin_far([(p.member, "read", (self.ino, p.member, p.chunk_offset,
                                                      [buf[o:o + n] for o, n in p.spans]))
                                 for p in far])
        try:
            self._read_local([p for p in pieces if not self.pool.members[p.member].node],
                             buf)
        finally:  # every remote read ends before `buf` goes back to the caller
            finish_all(begun)
        self._account(pieces, "read")

    def _begin_far(self, calls: list[tuple[int, str, tuple[Any, ...]]]
                   ) -> list[Begun[None]]:
        """Calls (member, "read" or "change", args) of other nodes' members, begun on
        their owners' helpers idle now (a slow owner holds those, not the I/O threads
        of this node's members); `finish_all` runs on this thread what none took: an
        owner's eight threads, first come, held one user's SYNCs of large files, and
        another's reads there, in his turn, waited behind them."""
        by_owner: dict[RemoteMembers, list[Callable[[], None]]] = {}
        for member, what, args in calls:
            remote = self.pool.remote_of(member)
            by_owner.setdefault(remote, []).append(
                functools.partial(getattr(remote, what), *args))
        return [remote.helpers.begin(owned, keep=0) for remote, owned in by_owner.items()]

    def _read_local(self, pieces: list[Piece], buf: memoryview) -> None:
        with self._in_use():
            ops = []
            for piece in pieces:
                bufs = [buf[o:o + n] for o, n in piece.spans]
                fd = self.fd(piece.member, create=False)
                if fd is None:
                    for b in bufs:
                        b[:] = bytes(len(b))
                else:
                    ops.append(ReadOp(fd, piece.chunk_offset, bufs))
            if ops:
                self._guard(read_batch, ops)

    @contextlib.contextmanager
    def _in_use(self) -> Iterator[None]:
        """Local I/O through these descriptors, from before it takes one until it is
        done: `reopen` closes the old ones at once when none is in flight."""
        with self._using_lock:
            self._using += 1
        try:
            yield
        finally:
            with self._using_lock:
                self._using -= 1

    def admit(self, offset: int, n: int) -> list[Piece]:
        """The pieces of a write of `n` bytes at `offset`, once it is known every member
        it touches is in service and the metadata member keeps its reserve, counting
        this write against it until `write` (or `unadmit`) ends (cheap: the daemon asks
        before it answers a write it lands later)."""
        pieces = self.layout.plan(offset, n)
        self.pool.check({p.member for p in pieces})
        held = 0
        try:
            for piece in pieces:  # (EROFS: another node's)
                held += self.pool.check_space(piece.member, piece.length, hold=True)
        except BaseException:
            self.pool.landed(held)
            raise
        return pieces

    def unadmit(self, pieces: list[Piece]) -> None:
        """What `admit` counted of `pieces` against the reserve is let go (written, or
        never to be)."""
        self.pool.landed(sum(p.length for p in pieces if self.pool.holds_store(p.member)))

    def write(self, offset: int, data: memoryview, pieces: list[Piece] | None = None
              ) -> None:
        """Write `data` at file `offset`, each member's share in parallel (`pieces`:
        what `admit` gave for it, if the caller asked already; let go here)."""
        if pieces is None:
            pieces = self.admit(offset, len(data))
        try:
            self._write(data, pieces)
        finally:
            self.unadmit(pieces)
        self._account(pieces, "write")

    def _write(self, data: memoryview, pieces: list[Piece]) -> None:
        ops = []
        far = [p for p in pieces if self.pool.members[p.member].node]
        begun = self._begin_far([(p.member, "change", (b"WRIT", self.pool.epoch(), self.ino,
                                                       p.member, p.chunk_offset,
                                                       [data[o:o + n] for o, n in p.spans]))
                                 for p in far])
        try:
            with self._in_use():
                for piece in (p for p in pieces if not self.pool.members[p.member].node):
                    fd = self.fd(piece.member, create=True)
                    assert fd is not None
                    ops.append(WriteOp(fd, piece.chunk_offset,
                                       [data[o:o + n] for o, n in piece.spans]))
                self._guard(write_batch, ops)
        finally:  # every remote write ends before `data` goes back to the caller
            try:
                finish_all(begun)
            finally:  # (marked once ended: a sync taking the marks before would send
                # no SYNC for a WRIT still to come, and the next sync none either)
                self._far_written |= {p.member for p in far}
                self.drop_read_ahead()

    def _account(self, pieces: list[Any], what: str) -> None:
        if self.pool.on_io is not None:
            for p in pieces:
                self.pool.on_io(p.member, what, p.length)

    def _guard(self, run: Callable[[list[Any]], None], ops: list[Any]) -> None:
        """Run a batch; after an error that may be a member's, redo each member's share
        alone to find which one fails, and take it out of service."""
        try:
            run(ops)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise
            member_of = {fd: m for m, fd in self._fds.items()}
            for m in {member_of.get(op.fd) for op in ops} - {None}:
                try:
                    run([op for op in ops if member_of.get(op.fd) == m])
                except OSError as again:
                    self.pool.probe(m, again)  # type: ignore[arg-type]
            raise

    def truncate(self, size: int) -> None:
        self.pool.truncate_chunks(self.ino, self.layout, size)
        self.drop_read_ahead()

    def sync(self, datasync: bool = False, size: int | None = None) -> None:
        """Make every written member durable, all members at once (other nodes' through
        their owners).  `size` (the file's): every member holding its bytes too, not
        only those written through these descriptors.  fsync(2) promises the file's
        bytes, whoever wrote them: a file written, closed (its descriptors here closed
        with it, its bytes perhaps not yet on the members' disks) and opened again to
        be synced held no descriptor, and its fsync synced nothing."""
        if size is not None:
            for m in sorted(self.layout.holding(size)):
                if m in self._far:
                    self._far_written.add(m)
                elif m not in self._fds:
                    self.fd(m, create=False)  # (None: a hole, nothing to make durable)
        far, self._far_written = sorted(self._far_written), set()
        begun = self._begin_far([(m, "change", (b"SYNC", self.pool.epoch(), self.ino, m,
                                                int(datasync)))
                                 for m in far])
        try:
            try:
                with self._in_use():
                    sync_all(list(self._fds.values()), datasync)
            finally:
                finish_all(begun)
        except BaseException:  # (here or on an owner: asked again at the next sync, which
            self._far_written.update(far)  # else said durable what no owner synced)
            raise

    def prepare(self) -> None:
        """Create the chunk file of the first member (where every file's first byte
        goes) ahead of the writes, from a worker thread; nothing once closed, and
        nothing the second time: whoever calls it first (the spares' thread, or a put
        that took the file before it) makes the file, and a later call opens nothing,
        so no descriptor for writing it is open here once the first call returned (a
        commit refuses a file that has one: `refuse_if_writers`).  Its descriptor is
        closed again (spares hold none): opening a file that exists costs a lookup,
        creating one a journal entry.  An error is left to the write that needs the
        file, which reports and probes it."""
        with self._lock:
            if self._prepared or self._closed or self.layout.first in self._fds or \
                    self.layout.first in self._far:
                return
            self._prepared = True
            close_later([self._open(self.layout.first, create=True)])
        if self._closed:
            self._closed_meanwhile()

    def drop_read_ahead(self) -> None:
        """The file changed on its owner node: windows fetched before are not its bytes
        (any thread; reads go on, fetched afresh)."""
        if self._ahead is not None:
            self._ahead.close()

    def reopen(self) -> None:
        """The chunk files were renewed (`revoke.Held.renew`): open them afresh.
        The old descriptors are closed at once if no I/O is in flight through them,
        else retired, not closed, while I/O begun with them may still run (it reads
        the same bytes); closed RETIRED_S later, or at close.  Retired whatever was in
        flight, a user looping chmods of a file she had lent herself left its
        descriptors open by the thousand, counted nowhere."""
        now = time.monotonic()
        with self._lock:
            if self._fds:
                old = list(self._fds.values())
                self._fds.clear()  # (before `_using` is read: an I/O that begins
                self._readonly.clear()  # after it finds none of the old ones)
                with self._using_lock:
                    busy = self._using
                if busy:
                    self._retire(old)
                else:
                    close_later(old)
            self._sweep(now)
        if self._closed:
            self._closed_meanwhile()

    def _retire(self, fds: list[int]) -> None:
        """(Under the lock.)  Keep `fds` open RETIRED_S more (I/O begun with them)."""
        self._retired.append((time.monotonic(), fds))
        RETIRED.add(len(fds))

    def _sweep(self, now: float) -> None:
        """(Under the lock.)  Close the descriptors retired RETIRED_S ago."""
        while self._retired and now - self._retired[0][0] > RETIRED_S:
            fds = self._retired.popleft()[1]
            RETIRED.add(-len(fds))
            close_later(fds)

    def close(self) -> None:
        """Close its descriptors, never waiting (it is called on the daemon's thread):
        a thread opening one of its files (on a member that may not answer) holds the
        lock, sees it closed once its open returns, and closes them then; each is
        closed by its mount's thread (`pool/closer.py`: a close can wait on a member)."""
        if self._ahead is not None:
            self._ahead.close(final=True)
        self._closed = True
        if not self._lock.acquire(blocking=False):
            return
        try:
            self._close_all()
        finally:
            self._lock.release()

    def _closed_meanwhile(self) -> None:
        """(A thread that held the lock, once it let it go.)  `close` may have found
        the lock held and left its descriptors to the holder: close them now."""
        with self._lock:
            self._close_all()

    def _close_all(self) -> None:
        """(Under the lock.)"""
        retired = [fd for _, old in self._retired for fd in old]
        RETIRED.add(-len(retired))
        fds = [*self._fds.values(), *retired]
        self._fds.clear()
        self._retired.clear()
        close_later(fds)
