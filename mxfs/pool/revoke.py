"""Write descriptors the daemon handed out, and where their right to write ends.

A direct writer (`create`, `kv_create`) gets O_WRONLY descriptors of its hidden
file's chunk files, and the daemon cannot take them back.  So a file changes state
only once nobody can write it any more:

- a commit is refused (EBUSY) while any descriptor for writing one of its chunk
  files is open anywhere: the kernel refuses a read lease on a file open for
  writing, whoever holds it (a child that inherited it, a copy in flight in a
  socket), so a sealed file can never be rewritten in place behind its checksums;
- a file dropped (abort, a refused commit, its connection gone) while writers
  remain has its chunk files moved aside into `chunks/held/` on their member,
  where `Held.sweep` cuts them to nothing and removes them once the last writer is
  gone: the writer keeps no space, nothing is hidden from `du` or fsck, and the
  inode number can be reused without a stray writer reaching the new file.  Held
  files are made immutable in between (where the member's file system keeps the
  flag): that refuses `fallocate` through the kept descriptors on ext4 and XFS (a
  writer reserved a member's free space within each second between cuts) and, on
  ext4, their writes too.  Each is looked at (`stat`) every second and cut again
  only if it grew; whether its writer let go is asked at growing intervals (up to
  HELD_LOOK_MAX_S): flag changes and cuts are journal writes, and a user holding
  thousands of dropped files' descriptors cost every sweep ~30 us a file.  They
  count as their writer's tenant's (`held_by`): `max_held_files_per_user` bounds them.
  Their names say whose they are, so that a later daemon adopting them at mount (their
  holders outlive a crash or an upgrade) counts them as before (`adopt`).

Read descriptors (`open_read`, KV gets) end too: a removed file whose chunk files
someone still holds open (a write lease refused: `anyone_holds`) has them moved
aside the same way, uncut, so that reads in flight finish; past READ_GRACE_S they
are cut to nothing and removed, held or not (the holder reads an empty file, which
its client's check finds changed, and keeps an inode of nothing that the daemon no
longer tracks: kept and asked about until let go, a user's loop of gets and deletes
grew the daemon's table of them without bound).  Without it a reader kept every removed
file's space, released from its owner's quota and from KV capacity, for as long as
it liked (and across a daemon restart, a writer of a file dropped by the crash).
While they are readable they count as their owner's (`readable_of`: in the owner's
quota), and one that would take its owner past `may_keep` is cut at once instead:
a user who removed or renewed files she kept lent to herself, over and over, held
the pool's space outside every quota, a grace at a time.

Whatever goes (a removed file nobody holds, a held one let go) is cut to nothing
first (`pool.unlink_cut`): the kernel's lease counts miss an O_PATH descriptor, which
a user makes of any she was handed (`/proc/self/fd/N`) and which reads nothing, yet
keeps an unlinked file's blocks.  The ask (`anyone_holds`) and the cut are two steps,
and a descriptor opened between them read nothing where the file's bytes were: so a
file is made unreachable before its chunk files are asked about (its last link gone,
its KV key dropped), and whoever opens them to hand them out asks after its opens
whether the file is still that one (`FileOps.open_read`: linked, same generation; a
KV get: the key still holds that chunk; the chunk service's READ: judged again),
handing out nothing if not.  One that passes opened before the file went, so the
ask, later still, sees its descriptors and keeps the file aside uncut.
"""

from __future__ import annotations

import array
import contextlib
import errno
import fcntl
import logging
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence

from mxfs.errors import MxfsError
from mxfs.pool.closer import CLOSER, fdinfo
from mxfs.pool.pool import CHUNK_DIR, Pool, unlink_cut

log = logging.getLogger("mxfs.pool")

HELD_DIR = "held"
CLOSING_WAIT_S = 5.0  # a lease probe gives up waiting for the daemon's own closes of a
# file after this long with none of its member's closed (`Closer.wait_closed`)
LOOKS = 3  # ... and looks this often at most
READ_GRACE_S = 30  # how long readers of a removed file go on reading its bytes (read_grace_s)
HELD_LOOK_MAX_S = 16  # the longest a writer-held file waits between lease probes
REFILL_GRACE_S = 5  # a dropped file written into this long after: its writer is caught
# A held file's name: INO.STAMP.OWNER (the tenant it counts as, kept across a restart:
# `adopt`; INO.STAMP, root's, in pools held in before), and this where only readers
# held it; a renew's copy under way is INO.STAMP.n.
_READ_MARK = ".r"
_COPY_MARK = ".n"
NO_LEASES_FIX = "enable leases (sysctl -w fs.leases-enable=1), or put the member on a " \
    "file system that takes them"
_no_leases: str | None = None  # (`lease_trouble`)
_in_place_failures = 0  # chunk files held where they were, their move failed
_FS_IOC_GETFLAGS, _FS_IOC_SETFLAGS, _FS_IMMUTABLE_FL = 0x80086601, 0x40086602, 0x10


def set_immutable(path: str, on: bool) -> bool:
    """Blocking: set or clear the file's immutable flag; False where its file system
    keeps none (or the file is gone): there held files are cut every second alone."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return False
    try:
        flags = array.array("l", [0])
        fcntl.ioctl(fd, _FS_IOC_GETFLAGS, flags, True)
        want = flags[0] | _FS_IMMUTABLE_FL if on else flags[0] & ~_FS_IMMUTABLE_FL
        if want != flags[0]:
            flags[0] = want
            fcntl.ioctl(fd, _FS_IOC_SETFLAGS, flags, True)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def require_leases(paths: Iterable[str]) -> None:
    """Blocking, at mount: refuse a pool whose members' file systems take no leases
    (`paths`: a file on each, its superblock), as the mount's one error naming the fix:
    every descriptor the daemon hands out is judged by them (`writers_remain`,
    `anyone_holds`), and where they fail those fail closed (commits refused, removed
    files held) for good.  A file that cannot be opened is its member's to report."""
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        except BlockingIOError:
            pass  # (someone writes it: leases work)
        except OSError as e:
            raise MxfsError(f"the file system of member {os.path.dirname(path)} takes no "
                            f"leases ({os.strerror(e.errno or errno.EINVAL)}): the daemon "
                            "could not tell when a descriptor it hands out is let go",
                            NO_LEASES_FIX) from None
        finally:
            os.close(fd)


def lease_trouble() -> str | None:
    """Why the last lease probe could not tell (None: leases work): a refused commit
    names it, not a writer that may not exist."""
    return _no_leases


def _cut_frozen(path: str, freeze: bool) -> None:
    """Blocking: `path` cut to nothing, its immutable flag off for the truncate alone
    (and set after it with `freeze`): off any longer, a writer reserving space through a
    descriptor she kept every 10 ms took it in that window."""
    set_immutable(path, False)
    os.truncate(path, 0)
    if freeze:
        set_immutable(path, True)


def writers_remain(paths: Iterable[str]) -> bool:
    """Blocking: whether any of `paths` is open for writing by anyone (this process
    included: the caller holds none).  Missing files have no writers.  Where leases
    fail (disabled since the mount), True: nothing is sealed or cut under a writer
    nobody can see."""
    return any(_lease_refused(path, fcntl.F_RDLCK) for path in paths)


def anyone_holds(path: str) -> bool:
    """Blocking: whether `path` is open anywhere (for reading or writing): the kernel
    refuses a write lease then.  A missing file: no; where leases fail: yes."""
    return _lease_refused(path, fcntl.F_WRLCK)


def _open_to_probe(path: str) -> int | None:
    """A descriptor of `path` to take a lease on; None if it is missing, -1 if another
    probe's lease refused the open each of LOOKS tries (O_NONBLOCK: EWOULDBLOCK)."""
    for _ in range(LOOKS):
        try:
            return os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            return None
        except BlockingIOError:
            time.sleep(0.001)
    return -1


def _lease_refused(path: str, lease: int) -> bool:
    """Whether the kernel refuses `lease` on `path` (someone holds it open for writing,
    for F_RDLCK; open at all, for F_WRLCK), taken and given back at once.  Any other
    failure counts as a refusal (fails closed), logged once while it lasts: it said
    "nobody" before, and a commit sealed a file its writer still held, a drop cut
    and removed a file still written."""
    global _no_leases
    fd = _open_to_probe(path)
    if fd is None:
        return False
    if fd < 0:
        return True  # (another probe's lease held it each time: asked again later)
    try:
        # A lease's break is told to its holder by a signal, SIGIO unless set: any
        # open of the file between the two calls below (the daemon's own threads open
        # these files by path) killed the daemon, SIGIO's default.  SIGURG's default
        # is to ignore it, and the lease is given back at once anyway.
        fcntl.fcntl(fd, fcntl.F_SETSIG, signal.SIGURG)
        for look in range(LOOKS):
            closes = CLOSER.closes
            try:
                fcntl.fcntl(fd, fcntl.F_SETLEASE, lease)
                fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
                break
            except BlockingIOError:
                # (this daemon's own descriptors of it, given up and still closing, are
                # not anyone's: looked at again once they are closed)
                if look == LOOKS - 1 or \
                        not CLOSER.wait_closed(fdinfo(fd), CLOSING_WAIT_S, closes):
                    return True
    except OSError as e:
        why = f"the file system of {path} takes no leases ({os.strerror(e.errno or 0)})"
        if _no_leases is None:
            log.warning("%s: commits are refused and removed files held until it does "
                        "(%s)", why, NO_LEASES_FIX)
        _no_leases = why
        return True
    finally:
        os.close(fd)
    _no_leases = None
    return False


class Held:
    """Chunk files of dropped files whose writers still hold descriptors (held and
    swept from worker threads)."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.files: dict[str, None] = {}  # (in the order held)
        self._lock = threading.Lock()
        self._writers: dict[str, int] = {}  # cut, writer-held files: whose (tenant)
        self.held_by: Counter[int] = Counter()  # ... how many, by tenant
        # ... when their writers are asked next whether they let go, and the interval
        self._due: dict[str, tuple[int, int]] = {}
        self.read_grace_s = READ_GRACE_S  # (the mount option read_grace_s)
        # A writer wrote into a file held cut (its tenant): on XFS the immutable flag
        # stops no write through a descriptor opened before it, and she refilled a
        # member between cuts, others' writes ENOSPC, at no cost to her.
        self.on_refilled: Callable[[int], None] = lambda tenant: None
        self._dropped: set[str] = set()  # ... held as her file was dropped (`hold`): the
        # ones a write into, REFILL_GRACE_S after, is hers to answer for (not a file of
        # a writer whose daemon died, who was never told, nor a write in flight)
        self._readable: dict[str, tuple[int, int]] = {}  # uncut reader-held: (uid, bytes)
        self.readable_by: Counter[int] = Counter()  # ... their bytes, by owner
        # Whether the owner uid may hold that many bytes more readable (the volume's
        # per-user limit); root's are always kept.
        self.may_keep: Callable[[int, int], bool] = lambda uid, nbytes: True

    def _folder(self, member: int) -> str:
        return os.path.join(self.pool.members[member].path, CHUNK_DIR, HELD_DIR)

    def hold(self, ino: int, owner: int = 0) -> int:
        """Blocking: move `ino`'s chunk files aside (cut to nothing), counted as
        `owner`'s (the writer's tenant: `held_by`); how many moved."""
        return sum(self._hold(m, ino, cut=True, owner=owner, dropped=True)
                   for m in self.pool.local_members())

    def hold_read(self, ino: int, owner: int, members: Iterable[int] | None = None) -> int:
        """Blocking, as a removed file's chunk files go (on `members`, this node's by
        default): those someone holds open are moved aside, uncut if only readers hold
        them (cut READ_GRACE_S later; at once past what `owner` may keep), cut now and
        kept cut if a writer does (one whose daemon died: its file was dropped with
        it); how many moved (the rest are the caller's to cut and remove:
        `pool.unlink_cut`)."""
        moved = 0
        for m in self.pool.local_members() if members is None else members:
            path = self.pool.chunk_path(m, ino)
            if anyone_holds(path):
                moved += self._hold(m, ino, cut=writers_remain([path]), owner=owner)
        return moved

    def _hold(self, m: int, ino: int, cut: bool, owner: int = 0, dropped: bool = False
              ) -> bool:
        src = self.pool.chunk_path(m, ino)  # (other nodes' members are theirs to hold)
        if src in self.pool.held_in_place:  # (held already: moved aside if it can be)
            self._move_aside(src)
            return True
        dst = os.path.join(self._folder(m), f"{ino}.{time.time_ns()}.{owner}")
        try:
            if not cut and not self._keep(dst + _READ_MARK, owner, _blocks(src)):
                cut = True  # (past what its owner may keep readable)
            if cut:  # (frozen but for the truncate: `session._freeze`)
                _cut_frozen(src, True)
                self.pool.cut_settled(m, src, 0)  # (on the metadata member an fsync)
            else:
                dst += _READ_MARK
        except FileNotFoundError:
            self._let_go(dst)
            return False
        except BaseException:  # (a member failing: kept where it was, counted no more)
            self._let_go(dst)
            raise
        try:
            os.makedirs(self._folder(m), mode=0o700, exist_ok=True)
            if cut:
                set_immutable(src, False)  # (for the move alone: set again below)
            os.rename(src, dst)
        except FileNotFoundError:
            self._let_go(dst)
            return False
        except OSError as e:  # (a full member: no room for its name in held/)
            self._let_go(dst)
            return self._hold_in_place(m, src, owner if cut else None, e)
        if cut:
            set_immutable(dst, True)
        with self._lock:
            self.files[dst] = None
            if cut:
                self._writers[dst] = owner
                self.held_by[owner] += 1
                if dropped:
                    self._dropped.add(dst)
        return True

    def _hold_in_place(self, m: int, src: str, writer: int | None, err: OSError) -> bool:
        """Blocking: a chunk file whose move into held/ failed (`err`: a full member,
        where each cut is refilled at once) held where it is, cut to nothing (its
        readers', `writer` None, too: they read nothing more), swept as a moved one
        and moved aside once it can be (`_move_aside`); never left uncut and
        untracked, which let its writer take the space back through the descriptor.
        Its inode's reclaim leaves it to the sweep (`Pool.remove_chunks`)."""
        global _in_place_failures
        try:
            if writer is None:
                self.pool.cut(m, src, 0)
        except FileNotFoundError:
            return False
        with self._lock:
            self.files[src] = None
            self.pool.held_in_place[src] = m
            if writer is not None:
                self._writers[src] = writer
                self.held_by[writer] += 1
            _in_place_failures += 1
            n = _in_place_failures
        if n == 1 or n % 1000 == 0:
            log.warning("chunk file %s could not be moved aside (%s): held where it is, "
                        "cut, until it can be (%d times so far)", src, err.strerror, n)
        return True

    def _move_aside(self, src: str) -> str:
        """Blocking: a file held in place (`_hold_in_place`) cut and moved into held/
        if it can be now (made immutable there); its path then."""
        with self._lock:
            owner = self._writers.get(src)
            m = self.pool.held_in_place.get(src)
        if m is None:
            return src  # (moved by another thread meanwhile)
        dst = os.path.join(self._folder(m), f"{os.path.basename(src)}.{time.time_ns()}."
                           f"{owner or 0}")
        try:
            self.pool.cut(m, src, 0)  # (first: its space is what its name in held/ needs)
            os.makedirs(self._folder(m), mode=0o700, exist_ok=True)
            os.rename(src, dst)
        except OSError:
            return src  # (gone: the sweep forgets it; else tried again next time)
        if owner is not None:
            set_immutable(dst, True)
        with self._lock:
            self.pool.held_in_place.pop(src, None)
            self.files.pop(src, None)
            self.files[dst] = None
            if owner is not None:
                self._writers[dst] = self._writers.pop(src, owner)
        self._due.pop(src, None)
        return dst

    def _forget(self, path: str) -> None:
        """`path` is gone: its owner holds it no more."""
        self._let_go(path)
        self._due.pop(path, None)
        with self._lock:
            self._dropped.discard(path)
            owner = self._writers.pop(path, None)
            if owner is not None:
                self.held_by[owner] -= 1
                if self.held_by[owner] <= 0:
                    del self.held_by[owner]

    def _keep(self, path: str, owner: int, nbytes: int) -> bool:
        """Count `path` (`nbytes`) as `owner`'s while readable, if it may keep it."""
        with self._lock:
            if owner and not self.may_keep(owner, nbytes):
                return False
            self._readable[path] = (owner, nbytes)
            self.readable_by[owner] += nbytes
            return True

    def _let_go(self, path: str) -> None:
        """`path` is cut or gone: its bytes are its owner's no more."""
        with self._lock:
            kept = self._readable.pop(path, None)
            if kept is not None:
                self.readable_by[kept[0]] -= kept[1]
                if self.readable_by[kept[0]] <= 0:
                    del self.readable_by[kept[0]]

    def readable_of(self, owners: Callable[[int], bool]) -> int:
        """Bytes of removed or renewed files kept for their readers whose owner uid is
        one of `owners` (a quota counts them: its tenant's uids)."""
        with self._lock:
            return sum(n for uid, n in self.readable_by.items() if owners(uid))

    def renew(self, ino: int, owner: int = 0, members: Sequence[int] | None = None,
              room: int | None = None) -> int:
        """Blocking: each of `ino`'s chunk files on this node's members (`members` of
        them, where given) replaced by a copy of itself (its data ranges, holes kept),
        so that descriptors handed out before (`open_read`) hold the old file, which
        nothing writes again: what they read ends at what it held.  Copies are made in
        `chunks/held/` (a crash leaves them there, to be removed at mount) and renamed
        over; the old file is kept there as one only readers hold (cut after
        READ_GRACE_S: its readers keep no copy's space for good; cut at once past what
        `owner` may keep, or past `room`, the bytes its byte quota has left: a user
        looping chmods of a file she read held a hundred times her quota in copies);
        how many were renewed.  One nobody holds open is kept as it is (no descriptor of it is left
        to end: a chmod of a file read and closed copied it whole, on the lane's
        threads, outside every quota); an O_PATH holder, unseen, reads nothing."""
        renewed = 0
        for m in self.pool.local_members() if members is None else members:
            src = self.pool.chunk_path(m, ino)
            if not anyone_holds(src):  # (leases failing: True, copied)
                continue
            stamp = time.time_ns()
            tmp = os.path.join(self._folder(m), f"{ino}.{stamp}{_COPY_MARK}")
            old = os.path.join(self._folder(m), f"{ino}.{stamp}.{owner}{_READ_MARK}")
            try:
                fin = os.open(src, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                os.makedirs(self._folder(m), mode=0o700, exist_ok=True)
                fout = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                               0o600)
                try:
                    _copy_data(fin, fout)
                    os.fsync(fout)
                finally:
                    os.close(fout)
                os.link(src, old)
                try:
                    os.rename(tmp, src)
                except BaseException:  # (`old` is the live file's second name: cut
                    with contextlib.suppress(FileNotFoundError):  # at the next mount,
                        os.unlink(old)  # the file read zeros)
                    raise
                kept = _blocks(old)
                if room is not None and kept > room or not self._keep(old, owner, kept):
                    os.truncate(old, 0)  # (its readers read nothing more)
                elif room is not None:
                    room -= kept
                with self._lock:
                    self.files[old] = None
                renewed += 1
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
                raise
            finally:
                os.close(fin)
        return renewed

    def adopt(self) -> None:
        """Blocking, at mount: take over what an earlier daemon held (its writers and
        readers may outlive it), counted as their owners' again (`held_by`,
        `readable_by`: a restart reset every user's limits); the periodic sweep goes on
        from there (at mount it held the answer back by a lease probe a file).  What a
        renew the crash cut short left is removed as it is: its copy, and its second
        name of the file it did not replace yet (cut, the live file read zeros)."""
        for m in self.pool.local_members():
            folder = self._folder(m)
            try:
                names = os.listdir(folder)
            except FileNotFoundError:
                continue
            for name in names:
                with contextlib.suppress(FileNotFoundError):
                    self._adopt(m, os.path.join(folder, name))

    def _adopt(self, m: int, path: str) -> None:
        """Blocking: one file found held on member `m` at mount (see `adopt`)."""
        st = os.stat(path)
        if path.endswith(_COPY_MARK) or (st.st_nlink > 1 and self._is_live(m, path, st)):
            os.unlink(path)  # (nobody else ever had the copy; the live file stays)
            return
        owner = _owner(path)
        with self._lock:
            if path in self.files:
                return
            self.files[path] = None
            if path.endswith(_READ_MARK):  # (cut past its grace already: 0 bytes)
                self._readable[path] = (owner, st.st_blocks * 512)
                self.readable_by[owner] += st.st_blocks * 512
            else:
                self._writers[path] = owner
                self.held_by[owner] += 1

    def _is_live(self, m: int, path: str, st: os.stat_result) -> bool:
        """Whether held file `path` (`st`) is its inode's live chunk file on `m` under
        another name.  Only the daemon makes names in the chunk folders (root's, 0700):
        a link a user made elsewhere of one she holds is no live file's, cut as usual."""
        try:
            ino = int(os.path.basename(path).split(".")[0])
            live = os.stat(self.pool.chunk_path(m, ino))
        except (FileNotFoundError, ValueError):
            return False
        return (live.st_dev, live.st_ino) == (st.st_dev, st.st_ino)

    def _readers_done(self, path: str, now: int) -> bool:
        """Whether a file only readers held may go (cut and removed): nobody holding it
        (at once, within its grace: a renew nobody read from keeps no copy of the file
        for long), or its grace over, held or not: its readers' descriptors then read
        an empty file, and nothing is left to track.  Kept cut and asked about every
        10 s until they let go, a user who got and deleted chunks in a loop, holding
        their descriptors, grew the daemon's table of them without bound (and the
        sweep's lease probes with it)."""
        if now - _stamp(path) <= self.read_grace_s * 10**9:
            return not anyone_holds(path)
        return True

    def sweep(self, paths: Iterable[str] | None = None) -> int:
        """Blocking: of held files (`paths`, a bite of them; all by default), cut those
        a writer holds that grew (asking at growing intervals whether it let go: see the
        module's doc) and those only readers held once their grace is over, and remove
        those nobody holds any more; how many are still held, all told."""
        with self._lock:
            swept = list(self.files if paths is None else paths)
        now = time.time_ns()
        gone = []
        for path in swept:
            try:
                if path in self.pool.held_in_place:
                    path = self._move_aside(path)
                if path.endswith(_READ_MARK):  # (never made immutable: readers only)
                    if not self._readers_done(path, now):
                        continue
                    unlink_cut(path)  # (an O_PATH holder, unseen, kept it all)
                elif self._writer_holds(path, now):
                    continue
                else:  # (`_writer_holds` cleared its flag: an immutable file stays)
                    unlink_cut(path)
            except FileNotFoundError:
                pass
            except OSError as e:  # a member gone: kept, tried again next time
                log.warning("held chunk file %s: %s", path, e.strerror)
                continue
            self._forget(path)
            gone.append(path)
            self.pool.held_in_place.pop(path, None)
        with self._lock:
            for path in gone:
                self.files.pop(path, None)
            return len(self.files)

    def _writer_holds(self, path: str, now: int) -> bool:
        """Whether a writer still holds `path` (cut to nothing again, and immutable, if
        it grew): asked again once its interval is over (doubled each time it is still
        held unchanged, back to a second once it grew).  The flag is off for the cut
        alone, not for the lease probe before it (a read lease is taken on an immutable
        file): off across the probe, a writer reserving space through her descriptor
        every 10 ms took it back in that window, and grew the file for the next round."""
        st = os.stat(path)
        grew = st.st_size > 0 or st.st_blocks > 0
        due, every = self._due.get(path, (0, 0))
        if not grew and now < due:
            return True
        remain = writers_remain([path])  # (a lease probe: the flag stays meanwhile)
        if not grew and remain:
            every = min(max(every * 2, 10**9), HELD_LOOK_MAX_S * 10**9)
            self._due[path] = (now + every, every)
            return True
        if not remain:
            set_immutable(path, False)  # (no writer left: let go of, as it is)
            return False
        if due and path in self._dropped and \
                now - _stamp(path) > REFILL_GRACE_S * 10**9:  # (a writer keeping on)
            self.on_refilled(_owner(path))
        # (a file held in place is a live chunk path: cut, never frozen)
        _cut_frozen(path, path not in self.pool.held_in_place)
        self._due[path] = (now + 10**9, 10**9)
        return True


def _copy_data(fin: int, fout: int) -> None:
    """The data ranges of `fin` into `fout` at the same offsets (in the kernel, shared
    extents where the filesystem can), its length too."""
    size = os.fstat(fin).st_size
    at = 0
    while at < size:
        try:
            start = os.lseek(fin, at, os.SEEK_DATA)
        except OSError:  # (ENXIO: no data past `at`)
            break
        end = os.lseek(fin, start, os.SEEK_HOLE)
        while start < end:
            n = os.copy_file_range(fin, fout, end - start, start, start)
            if n == 0:
                break
            start += n
        at = end
    os.ftruncate(fout, size)


def _blocks(path: str) -> int:
    """Bytes `path` takes on its member (FileNotFoundError if gone)."""
    return os.stat(path).st_blocks * 512


def _stamp(path: str) -> int:
    """When a held file was held (ns, from its name INO.STAMP[.OWNER][.r])."""
    try:
        return int(os.path.basename(path).split(".")[1])
    except (IndexError, ValueError):
        return 0


def _owner(path: str) -> int:
    """Whose a held file is (its tenant, from its name INO.STAMP.OWNER[.r]); root's
    where its name says none (held before names did)."""
    parts = os.path.basename(path).split(".")
    return int(parts[2]) if len(parts) > 2 and parts[2].isdecimal() else 0
