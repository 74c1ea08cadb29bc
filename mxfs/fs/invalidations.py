"""A mount's kernel invalidations, made by threads of their own so that one directory
held stalls only its own: a reading node's from its change feed
(`fs/feed_follower.py`), and the names and files a request changed behind the kernel's
back (a direct commit, a node's name change: `MxfsOperations.entry_changed`), which
that request waits for a while (`waited`).

`pyfuse3.invalidate_entry` takes the directory's inode lock in the kernel, which a
user's request on it holds as long as it lasts (a mkdir the writer answers late, a
listing into a buffer that faults slowly, or never: a page of her own FUSE mount's);
the call cannot be cancelled.  Made one at a time on the feed's thread, one such
request held every user's invalidations, the feed itself and what hangs on it; made on
a shared pool of 16 threads, each commit into her directory took one for good and
then everyone's commits waited.  Here each directory (its names) and each inode (its
attributes, its pages) is a key: one thread at a time makes a key's invalidations, in
the order they came, and a key already waiting takes what comes for it meanwhile (the
same name twice is one call).  Threads are started while work waits and none is free,
MAX_THREADS at most besides those held: a thread whose call has lasted HELD_S is set
aside, MAX_HELD at most (past as many directories held at once the rest wait their
turn; a request waiting on them is answered all the same), and ends after IDLE_S idle.
Keys wait in a line a tenant (whose request's changes began them, or the feed's own,
FEED: `vol/tenant_lines.py`), taken in turn, and one tenant's (not root's) are made by
MAX_THREADS // USER_PART threads at once at most besides its threads held in the
kernel, MAX_HELD // USER_PART of those: a user who held the locks of the directories
she committed into took every thread and every place set aside, and everyone's
invalidations waited; one who held another's lost him his share.

What waits is bounded: past MAX_WAITING names, inodes and requests' waits from changes
(a directory held while its names keep changing), the largest keys' waiting batches are
dropped (their waits answered, their items counted in `dropped`) until half of it is
left: the keys that overflow pay, every other key's work waits on as it was (dropping
all of it once let one user, holding her directory's lock while she commits into it,
throw away every tenant's invalidations and tell their commits done).  Of the dropped
keys, what the kernel may hold (`held`) is invalidated instead, key by key as above:
on a reading node the daemon's own bounded table of its answers (that part is not
counted: it is at most what the table holds); on the writer, which keeps no such table
(`fs/kernel_cache.py`), only open files, so a dropped directory's names stay stale
until their entry timeout.  (The batches are sorted at an overflow, at most once per
MAX_WAITING // 2 items from changes.)
"""
from __future__ import annotations

import contextlib
import errno
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import pyfuse3
import trio

from mxfs.vol.tenant_lines import Lines
from mxfs.vol.tenants import tenant_of

log = logging.getLogger("mxfs.fs")

MAX_THREADS = 32
USER_PART = 2  # one tenant's keys (not root's) made by MAX_THREADS // USER_PART at once,
               # and MAX_HELD // USER_PART of its threads held in the kernel at most
FEED = -1  # the tenant a reading node's change feed adds as (capped, as a user is)
HELD_S = 1.0  # a call this long is held in the kernel: its thread is set aside
MAX_HELD = 1024  # threads set aside at most
IDLE_S = 5.0
WAIT_S = 1.0  # how long a request waits for what it changed (`waited`)
MAX_WAITING = 100_000
EVERYTHING_BITE = 1024  # keys of an `everything` queued under the lock at once (~3 ms)
ENTRY, INODE = 0, 1  # a key's kind: a directory's names, an inode's attributes (pages)

Key = tuple[int, int]  # (ENTRY or INODE, inode)
Held = Callable[[], tuple[list[int], list[tuple[int, bytes]]]]


class _Done:
    """A caller's `done`, called once every key its `add` touched was made (or
    dropped): `left` of them still to come."""

    __slots__ = ("call", "left")

    def __init__(self, call: Callable[[], None]) -> None:
        self.call, self.left = call, 0


@dataclass
class _Batch:
    """What waits for one key."""

    names: set[bytes] = field(default_factory=set)  # (ENTRY)
    pages: bool = False  # (INODE) the pages too, not only the attributes
    counted: int = 0  # of it, items from changes (MAX_WAITING counts them)
    tenant: int = 0  # whose request's changes began it (`vol/tenants.py`; 0: root's; FEED)
    done: list[_Done] = field(default_factory=list)  # told once it is made


class Invalidations:
    """`stop`: set as the mount ends (FUSE's session may be gone: no call after it).
    `entry`, `inode`: the kernel's calls (pyfuse3's)."""

    def __init__(self, held: Held, stop: threading.Event,
                 entry: Callable[[int, bytes], None] = pyfuse3.invalidate_entry,
                 inode: Callable[[int, bool], None] = pyfuse3.invalidate_inode) -> None:
        self.held = held
        self.stop = stop
        self.entry, self.inode = entry, inode
        self.made = 0  # calls the kernel answered, ENOENT too (status: `invalidations`)
        self.overflows = 0  # times the largest batches were dropped (MAX_WAITING)
        self.dropped = 0  # ... names and inodes of them
        self._lock = threading.Condition()
        self._waiting: dict[Key, _Batch] = {}
        # Keys waiting that no thread makes now, once each, in a line a tenant taken in
        # turn, and the threads making each tenant's keys now (held in the kernel too).
        self._ready: Lines[Key] = Lines()
        self._busy_by: Counter[int] = Counter()
        self._busy: set[Key] = set()  # keys a thread makes now
        self._items = 0  # names and inodes waiting
        self._making = 0  # ... and being invalidated now
        self._counted = 0  # ... of them from changes, and requests' waits
        self._threads: set[threading.Thread] = set()
        self._since: dict[threading.Thread, float] = {}  # threads in a call: since when
        self._making_for: dict[threading.Thread, int] = {}  # ... and whose key it is
        self._idle = 0
        self._timer: threading.Timer | None = None  # (to set held threads aside)

    @property
    def pending(self) -> int:
        """Names and inodes not invalidated yet (waiting, or being made now)."""
        return self._items + self._making

    def add(self, names: Iterable[tuple[int, bytes]], data: Iterable[int],
            attrs: Iterable[int], done: Callable[[], None] | None = None,
            uid: int = 0) -> None:
        """Invalidate entries, inodes' pages and attributes, and inodes' attributes
        that `uid`'s request changed; `done()` (from another thread) once all of it is
        made, dropped or nothing."""
        waiter = _Done(done) if done is not None else None
        with self._lock:
            self._add(names, data, attrs, counted=1, waiter=waiter, tenant=tenant_of(uid))
            told = [waiter] if waiter is not None and not waiter.left else []
            dropped: list[Key] = []
            if self._counted > MAX_WAITING:
                dropped, told_dropped = self._drop_largest()
                told += told_dropped
            self._start()
        for d in told:
            d.call()
        if dropped:
            log.warning("more than %d kernel invalidations wait (a directory held by a "
                        "request): those of the %d largest keys are dropped, what the "
                        "kernel may hold of them invalidated instead",
                        MAX_WAITING, len(dropped))
            entries = {ino for kind, ino in dropped if kind == ENTRY}
            inodes = {ino for kind, ino in dropped if kind == INODE}
            inos, held_names = self.held()
            self.everything([ino for ino in inos if ino in inodes],
                            [n for n in held_names if n[0] in entries])

    def _drop_largest(self) -> tuple[list[Key], list[_Done]]:
        """(Under the lock.) Drop the largest waiting batches until half of MAX_WAITING
        is left: the keys dropped, and the waiters whose last key that was."""
        dropped: list[Key] = []
        told: list[_Done] = []
        for key in sorted(self._waiting, key=lambda k: self._waiting[k].counted,
                          reverse=True):
            if self._counted <= MAX_WAITING // 2:
                break
            batch = self._waiting.pop(key)
            size = len(batch.names) if key[0] == ENTRY else 1
            self._items -= size
            self._counted -= batch.counted
            self.dropped += size
            told += self._told(batch.done)  # (a waiter's other keys still count)
            dropped.append(key)
        self._ready.drop(set(dropped))
        self.overflows += 1
        return dropped, told

    async def waited(self, names: Iterable[tuple[int, bytes]] = (), data: Iterable[int] = (),
                     wait_s: float = WAIT_S, uid: int = 0) -> bool:
        """`add` from trio's thread, and wait until it is made, `wait_s` at most: a
        request that changed names waits so that its caller's next lookup sees them,
        but is answered all the same once a held directory keeps them (made later)."""
        made = trio.Event()
        token = trio.lowlevel.current_trio_token()

        def done() -> None:
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(made.set)

        self.add(names, data, (), done, uid)
        with trio.move_on_after(wait_s):
            await made.wait()
        return made.is_set()

    @staticmethod
    def _told(waiters: Iterable[_Done]) -> list[_Done]:
        """(Under the lock.) Of `waiters` of a key made or dropped, those whose last
        key this was."""
        told = []
        for d in waiters:
            if d.left:
                d.left -= 1
                if not d.left:
                    told.append(d)
        return told

    def everything(self, inos: list[int], names: list[tuple[int, bytes]], uid: int = 0
                   ) -> None:
        """Invalidate all the kernel may hold (`held()`'s answer): inodes' pages too;
        queued a bite at a time, the lock let go between (200,000 at once held it
        0.56 s, and with it the loop's direct commits waiting to queue theirs)."""
        tenant = tenant_of(uid)
        for start in range(0, max(len(inos), len(names)), EVERYTHING_BITE):
            with self._lock:
                self._add(names[start:start + EVERYTHING_BITE],
                          inos[start:start + EVERYTHING_BITE], (), counted=0, tenant=tenant)
                self._start()
            time.sleep(0)  # (the interpreter to a thread waiting for the lock)

    def _add(self, names: Iterable[tuple[int, bytes]], data: Iterable[int],
             attrs: Iterable[int], counted: int, waiter: _Done | None = None,
             tenant: int = 0) -> None:
        for parent, name in names:
            batch = self._batch((ENTRY, parent), waiter, counted, tenant)
            if name not in batch.names:
                batch.names.add(name)
                self._count(batch, counted)
        for pages, inos in ((True, data), (False, attrs)):
            for ino in inos:
                new = (INODE, ino) not in self._waiting
                batch = self._batch((INODE, ino), waiter, counted, tenant)
                batch.pages |= pages
                if new:
                    self._count(batch, counted)

    def _batch(self, key: Key, waiter: _Done | None, counted: int, tenant: int) -> _Batch:
        batch = self._waiting.get(key)
        if batch is None:
            batch = self._waiting[key] = _Batch(tenant=tenant)
            if key not in self._busy:  # (else queued again when its thread is done)
                self._ready.push(tenant, key)
        if waiter is not None and (not batch.done or batch.done[-1] is not waiter):
            batch.done.append(waiter)
            waiter.left += 1
            batch.counted += counted  # (a wait is memory too: `_count` without an item)
            self._counted += counted
        return batch

    def _count(self, batch: _Batch, counted: int) -> None:
        batch.counted += counted
        self._counted += counted
        self._items += 1

    def _start(self) -> None:
        """(Under the lock.) A thread more, if work waits and none is free: threads
        held in a call HELD_S and more not counted, MAX_HELD of them at most."""
        may = self._may_start()
        if self.stop.is_set():
            return
        if not self._ready.any_where(may):
            if self._ready and self._timer is None and self._since:  # (a call going on
                self._timer = threading.Timer(HELD_S, self._again)  # may be held by
                self._timer.daemon = True  # then: its tenant's keys may go on)
                self._timer.start()
            return
        if self._idle:
            self._lock.notify()
            return
        now = time.monotonic()
        held = sum(now - since >= HELD_S for since in self._since.values())
        if len(self._threads) < MAX_THREADS + min(held, MAX_HELD):
            thread = threading.Thread(target=self._work, name="mxfs-invalidate",
                                      daemon=True)  # (one held in the kernel never ends)
            self._threads.add(thread)
            thread.start()
        elif self._timer is None and held < MAX_HELD:  # (a call may be held by then)
            self._timer = threading.Timer(HELD_S, self._again)
            self._timer.daemon = True
            self._timer.start()

    def _may_start(self) -> Callable[[int], bool]:
        """(Under the lock.)  Whether a thread may take one more of a tenant's keys now:
        while fewer than MAX_THREADS // USER_PART of its keys are made and not held in
        the kernel, and fewer than MAX_HELD // USER_PART are held there (root's: always).
        One user holding the locks of the directories she committed into set a thread
        aside each, MAX_HELD of them, and every other user's invalidations waited; held
        threads counted as live ones, a user who held 16 of bob's directories (his
        commits into them) left every other invalidation of his waiting, and a reading
        node's feed, root's, was not held to any share."""
        now = time.monotonic()
        held = Counter(self._making_for[t] for t, since in self._since.items()
                       if now - since >= HELD_S)
        live_most, held_most = max(1, MAX_THREADS // USER_PART), max(1, MAX_HELD // USER_PART)

        def may(tenant: int) -> bool:
            return not tenant or (self._busy_by[tenant] - held[tenant] < live_most
                                  and held[tenant] < held_most)
        return may

    def _again(self) -> None:
        with self._lock:
            self._timer = None
            self._start()

    def _work(self) -> None:
        try:
            self._loop()
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())

    def _loop(self) -> None:
        me = threading.current_thread()
        while True:
            with self._lock:
                while not self._ready.any_where(self._may_start()) \
                        and not self.stop.is_set():
                    self._idle += 1
                    woken = self._lock.wait(IDLE_S)
                    self._idle -= 1
                    if not woken and not self._ready.any_where(self._may_start()):
                        break
                key = self._ready.pop_where(self._may_start())
                if key is None or self.stop.is_set():
                    return
                batch = self._waiting.pop(key)
                self._busy.add(key)
                self._busy_by[batch.tenant] += 1
                self._since[me] = time.monotonic()
                self._making_for[me] = batch.tenant
                size = len(batch.names) if key[0] == ENTRY else 1
                self._items -= size
                self._making += size
                self._counted -= batch.counted
                self._start()  # (the rest waits for none held here)
            try:
                self._make(key, batch)
            finally:
                with self._lock:
                    self._making -= size
                    self._busy.discard(key)
                    self._busy_by[batch.tenant] -= 1
                    if not self._busy_by[batch.tenant]:
                        del self._busy_by[batch.tenant]
                    del self._since[me]
                    del self._making_for[me]
                    if key in self._waiting:  # (it came again meanwhile: in order)
                        self._ready.push(self._waiting[key].tenant, key)
                    told = self._told(batch.done)
                    self._start()  # (the tenant's next keys may go now)
                for d in told:
                    d.call()

    def _make(self, key: Key, batch: _Batch) -> None:
        kind, ino = key
        if kind == ENTRY:
            for name in batch.names:
                self._call(self.entry, ino, name)
        else:
            self._call(self.inode, ino, not batch.pages)  # (attr_only)

    def _call(self, call: Callable[..., None], *args: object) -> None:
        if self.stop.is_set():  # (the mount is ending: FUSE's session may be gone)
            return
        try:
            call(*args)
        except OSError as e:
            if e.errno != errno.ENOENT:  # (ENOENT: the kernel held nothing of it, as
                log.warning("invalidating %s in the kernel: %s", args, e)  # after a
                return  # reclaim or a drop of caches: answered all the same)
        with self._lock:
            self.made += 1

    def close(self, timeout: float) -> None:
        """As the mount ends (`stop` set): idle threads end, and those making a call
        are waited for a while (not longer: one held in the kernel may never end)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            self._lock.notify_all()
            threads = list(self._threads)
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
