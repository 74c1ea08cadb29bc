"""Checkpoints in a folder: what is complete, which is latest, what retention removes.

A checkpoint is a folder holding a manifest (`mxfs-checkpoint.json`) and its
data files.  A save builds it as a hidden `.NAME.partial` folder and renames
it into place only after every file and the manifest are durable, so a folder
named like a checkpoint is always complete.  `latest` is a small file naming
the newest checkpoint, replaced atomically after the rename, under a lock of the
folder (`_latest_locked`), and never back to one saved earlier; a removal moves it
first, then renames the checkpoint to a hidden name of its own.

In a folder others may write, a save writes only into the folder it made: the
hidden folder is 0700 until published (then 0755 less the umask), every file is
made through a descriptor of it (the daemon refuses a create or commit whose path
leads to another folder by then), and the rename is checked to have moved it; one
of someone else's in its place fails the save, never gets the data.  Retention
counts only the caller's own checkpoints, and a `latest` that is someone else's
file (a sticky folder) leaves the save published, with a warning.

Root runs `mxfs ckpt` over folders tenants write: every file inside a checkpoint's
folder is opened relative to a descriptor of that folder, never through a symbolic
link, only if it is a regular file, and read up to a cap (`mxfs.safe_open`); the owner
file is made anew, never written through a name someone planted; a manifest that does
not parse, or whose shape is not what `new_manifest` writes (a data file named
anything but a plain name inside the folder, checksum blocks under a page), is a
damaged checkpoint, refused in one line.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import secrets
import shutil
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TypeGuard

from mxfs.client.writer import create_file, sync_dir, umask
from mxfs.errors import MxfsError
from mxfs.proc import running
from mxfs.safe_open import open_dir, read_small, remove_tree, rename_noreplace, write_new
from mxfs.text import user_name

MANIFEST = "mxfs-checkpoint.json"
FORMAT = "mxfs-checkpoint"
VERSION = 1
LATEST = "latest"
PARTIAL_SUFFIX = ".partial"
# Bytes a manifest may hold, so a planted one cannot exhaust the reader's memory: most
# of it is sums, about 11 KB a GiB of data in 1 MiB stripes (some 20 TB); a save
# refuses to write a larger one.  And the bytes of `latest` or an owner file.
MANIFEST_MAX = 256 << 20
# Objects and lists a manifest holds at most (a few a tensor): 256 MiB of empty ones
# parsed to 6.5 GB of root's memory at each `ls` of the folder.
MANIFEST_VALUES = 4 << 20
SMALL_MAX = 4096
# The smallest checksum block a manifest may name: a page (every writer's is a stripe
# unit, a multiple of one, or 1 MiB off mxfs), so damage is never reported byte by byte.
MIN_SUM_UNIT = 4096
MAX_SUM_UNIT = 1 << 30  # (a block is read whole to be checked: the largest stripe unit)
DAMAGED = "the checkpoint is damaged; load an older one"


class CheckpointError(MxfsError):
    """A checkpoint that cannot be saved, found or trusted."""


def partial_path(path: str) -> str:
    head, name = os.path.split(os.path.abspath(path))
    return os.path.join(head, f".{name}{PARTIAL_SUFFIX}")


def write_small(path: str, data: bytes, replace: bool = True, dir_fd: int | None = None
                ) -> None:
    """Write a small file durably and atomically (direct commit on mxfs, rename elsewhere);
    `dir_fd`: its folder, open (the file goes there or nowhere: `create_file`)."""
    with create_file(path, len(data), dir_fd=dir_fd) as w:
        w.write_at(0, memoryview(bytearray(data)))
        w.commit(len(data), replace=replace)


@contextlib.contextmanager
def checkpoint_folder(path: str) -> Iterator[int]:
    """A descriptor of the checkpoint folder `path` (as given: a link to it is followed),
    for reading its files; one line if there is no folder there."""
    try:
        fd = open_dir(path)
    except NotADirectoryError:
        raise CheckpointError(f"{path} is a file, not a checkpoint",
                              "give the folder of a checkpoint that mxfs.ckpt.save wrote "
                              "(mxfs ckpt ls FOLDER lists them)") from None
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} does not exist",
                              "list checkpoints with: mxfs ckpt ls FOLDER") from None
    except OSError as e:
        raise CheckpointError(f"checkpoint {path} cannot be opened ({e.strerror})",
                              "check the path") from None
    try:
        yield fd
    finally:
        os.close(fd)


def read_manifest(path: str, dir_fd: int | None = None) -> dict[str, Any]:
    """The manifest of the checkpoint at `path`, checked for format, version and shape
    (`dir_fd`: the folder, already open, whose files the caller then reads)."""
    if dir_fd is None:
        with checkpoint_folder(path) as fd:
            return read_manifest(path, fd)
    mpath = os.path.join(path, MANIFEST)
    try:
        raw = read_small(MANIFEST, dir_fd, MANIFEST_MAX)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is not an mxfs checkpoint (it has no {MANIFEST})",
                              "give the folder of a checkpoint that mxfs.ckpt.save wrote"
                              ) from None
    except OSError as e:  # (a link, a FIFO, unreadable, a disk's error: not damage
        raise CheckpointError(f"{mpath} cannot be read ({e.strerror})",  # `rm` takes)
                              "it must be a regular file its reader may read") from None
    if raw.count(b"{") + raw.count(b"[") > MANIFEST_VALUES:  # (counted, not parsed)
        raise CheckpointError(f"{mpath} holds over {MANIFEST_VALUES} objects and lists",
                              DAMAGED)
    try:
        manifest = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{mpath} is not valid JSON ({e})", DAMAGED) from None
    except RecursionError:
        raise CheckpointError(f"{mpath} nests deeper than any manifest", DAMAGED) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{mpath} is not an mxfs checkpoint manifest",
                              "give the folder of a checkpoint that mxfs.ckpt.save wrote")
    if manifest.get("version") != VERSION:
        raise CheckpointError(f"{mpath} has format version {manifest.get('version')}, "
                              f"this mxfs reads {VERSION}", "load it with a matching mxfs")
    problem = _shape_problem(manifest)
    if problem is not None:
        raise CheckpointError(f"{mpath}: {problem}", DAMAGED)
    return manifest


def is_plain_name(name: object) -> bool:
    """A name of one file inside a folder: no '/', not '.' or '..', no NUL."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name
            and "\0" not in name)


def _count(v: object) -> TypeGuard[int]:
    """A count a manifest may hold: 0 to 2**63 - 1 (a larger one, anyone's to write,
    overflowed `ls`'s date, a size's format and the readers' arithmetic)."""
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 63


def _shape_problem(m: dict[str, Any]) -> str | None:
    """What in a manifest is not as `new_manifest` writes it (None: nothing)."""
    if not _count(m.get("created_ns")):
        return "its creation time is not a number of nanoseconds"
    if not isinstance(m.get("compress"), str | None):
        return "its compression is not a name"
    files = m.get("files")
    if not isinstance(files, dict):
        return "its files are not a mapping of names to entries"
    for fname, info in files.items():
        if not is_plain_name(fname):
            return f"it names the data file {fname!r}, not a plain name inside its folder"
        if not isinstance(info, dict) or not _count(info.get("size")) \
                or not isinstance(info.get("sums"), str) \
                or not isinstance(info.get("tensors"), dict):
            return f"the entry of {fname} is damaged"
        unit = info.get("sum_unit")
        if not _count(unit) or unit < MIN_SUM_UNIT or unit % MIN_SUM_UNIT or \
                unit > MAX_SUM_UNIT:
            return (f"{fname} has checksum blocks of {unit!r} bytes, not a multiple of "
                    f"{MIN_SUM_UNIT} up to {MAX_SUM_UNIT}")
        for tname, t in info["tensors"].items():
            if not _tensor_entry_ok(t):
                return f"the entry of tensor {tname!r} in {fname} is damaged"
    return None


def _tensor_entry_ok(t: object) -> bool:
    if not isinstance(t, dict) or not isinstance(t.get("dtype"), str) \
            or not _count(t.get("offset")) or not _count(t.get("length")) \
            or not isinstance(t.get("shape"), list) or not all(map(_count, t["shape"])):
        return False
    stored = t.get("stored")
    return stored is None or (
        isinstance(stored, dict) and _count(stored.get("offset"))
        and _count(stored.get("length")) and _count(stored.get("frame")) and stored["frame"] > 0
        and isinstance(stored.get("frames"), list) and all(map(_count, stored["frames"])))


@dataclass(frozen=True)
class Entry:
    name: str
    path: str
    created_ns: int
    nbytes: int
    tensors: int
    compress: str | None
    latest: bool
    uid: int  # the folder's owner: whose checkpoint it is, to retention

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "path": self.path, "created_ns": self.created_ns,
                "bytes": self.nbytes, "tensors": self.tensors, "compress": self.compress,
                "latest": self.latest}


@contextlib.contextmanager
def _root_fd(root: str) -> Iterator[int]:
    """A descriptor of a folder of checkpoints, held while a command works in it (so
    the folder cannot be swapped for another under it)."""
    try:
        fd = open_dir(root)
    except OSError as e:
        raise CheckpointError(f"{root} cannot be opened as a folder ({e.strerror})",
                              "give the folder that holds checkpoints") from None
    try:
        yield fd
    finally:
        os.close(fd)


def latest_name(root: str) -> str | None:
    """The checkpoint `latest` names (None: none, or `latest` is no file a save wrote)."""
    with _root_fd(root) as fd:
        return _latest_at(fd)


def _latest_at(root_fd: int) -> str | None:
    try:
        name = read_small(LATEST, root_fd, SMALL_MAX).decode().strip()
    except (OSError, UnicodeDecodeError):
        return None  # absent, or a link, FIFO, ... planted in its place: none
    return name if is_plain_name(name) else None


def set_latest(root: str, root_fd: int, name: str | None) -> None:
    """Point `latest` of the folder `root_fd` (named `root`) at `name` (atomically), or
    remove it when None.  Through the folder's descriptor: by its path, root's `ckpt
    rm` wrote (or removed) a `latest` wherever a tenant's link put in the folder's
    place while it waited pointed, a root cron file say."""
    if name is None:
        try:
            os.unlink(LATEST, dir_fd=root_fd)
        except FileNotFoundError:
            pass
        return
    write_small(os.path.join(root, LATEST), (name + "\n").encode(), dir_fd=root_fd)


LATEST_LOCK_S = 2.0  # how long a change of `latest` waits for another's to end
# A checkpoint `latest` names dated this far past a save's is no save racing it but a
# clock ahead (another host's) or a date made up: `latest` moves to the save all the same.
LATEST_AHEAD_S = 600


@contextlib.contextmanager
def _latest_locked(root_fd: int) -> Iterator[None]:
    """`latest` read, judged and written by one process at a time (a lock on the
    folder of checkpoints): a removal's choice of the newest left, made while a save
    published a newer one, named the older one after the save had named its own.
    Waited for LATEST_LOCK_S at most: anyone who may read the folder may lock it, and
    one who held it for good must not hold every save's `latest` (past the wait the
    change goes on unlocked, as it always did)."""
    until = time.monotonic() + LATEST_LOCK_S
    locked = False
    while True:
        try:
            fcntl.flock(root_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            locked = True
            break
        except BlockingIOError:
            if time.monotonic() >= until:
                break
            time.sleep(0.01)
        except OSError:  # (a filesystem that takes no locks)
            break
    try:
        yield
    finally:
        if locked:
            fcntl.flock(root_fd, fcntl.LOCK_UN)


def _created_ns(root_fd: int, name: str) -> int | None:
    """When the checkpoint `name` of the folder `root_fd` was saved (None: none)."""
    try:
        fd = open_dir(name, root_fd, follow=False)
    except OSError:
        return None
    try:
        return int(read_manifest(name, fd)["created_ns"])
    except CheckpointError:
        return None
    finally:
        os.close(fd)


def _point_latest(root: str, root_fd: int, name: str, created_ns: int) -> str | None:
    """After a save: `latest` names `name`, unless it names a checkpoint saved later
    (two saves publishing at once: the newer one is latest, whichever came last);
    then that one's name."""
    with _latest_locked(root_fd):
        now = _latest_at(root_fd)
        if now is not None and now != name and \
                0 < (_created_ns(root_fd, now) or -1) - created_ns <= LATEST_AHEAD_S * 10**9:
            return now
        set_latest(root, root_fd, name)
        return None


def list_checkpoints(root: str) -> list[Entry]:
    """Complete checkpoints in `root`, oldest first (partial saves are never listed, nor
    folders whose manifest is missing or damaged, nor links)."""
    with _root_fd(root) as fd:
        return _list_at(fd, root)


def _read_once(path: str, fd: int,
               parsed: dict[tuple[int, int], dict[str, Any] | CheckpointError]
               ) -> dict[str, Any]:
    """`read_manifest` of the checkpoint folder `fd`, a manifest with other links
    parsed once a listing (one of 64 MiB hard-linked into ten folders was parsed ten
    times, 15 s and 3.3 GB of root's memory at each `ls`; 65,000 links may be made)."""
    try:
        st = os.stat(MANIFEST, dir_fd=fd, follow_symlinks=False)
    except OSError:
        return read_manifest(path, fd)  # (its own words for what is there)
    if st.st_nlink < 2:
        return read_manifest(path, fd)
    key = (st.st_dev, st.st_ino)
    if key not in parsed:
        try:
            parsed[key] = read_manifest(path, fd)
        except CheckpointError as e:
            parsed[key] = e
    got = parsed[key]
    if isinstance(got, CheckpointError):
        raise got
    return got


def listing(root: str) -> tuple[list[Entry], list[str]]:
    """`list_checkpoints` of `root`, and the paths of its checkpoints whose manifest
    was read but cannot be trusted (left out of the list, so of every prune: `remove`
    takes them), in one pass."""
    damaged: list[str] = []
    with _root_fd(root) as fd:
        entries = _list_at(fd, root, damaged)
    return entries, [os.path.join(root, n) for n in damaged]


def _list_at(root_fd: int, root: str, damaged: list[str] | None = None) -> list[Entry]:
    """The checkpoints of the folder, oldest first; `damaged` gets the names of those
    whose manifest is damaged."""
    latest = _latest_at(root_fd)
    out = []
    parsed: dict[tuple[int, int], dict[str, Any] | CheckpointError] = {}
    for name in sorted(os.listdir(root_fd)):
        if name.startswith("."):
            continue
        path = os.path.join(root, name)
        try:
            fd = open_dir(name, root_fd, follow=False)
        except OSError:
            continue  # a file, or a link: not a checkpoint of this folder
        try:
            m = _read_once(path, fd, parsed)
            uid = os.fstat(fd).st_uid
        except CheckpointError as e:
            if damaged is not None and e.fix == DAMAGED:
                damaged.append(name)
            continue
        finally:
            os.close(fd)
        files = m["files"].values()
        out.append(Entry(name, path, m["created_ns"], sum(f["size"] for f in files),
                         sum(len(f["tensors"]) for f in files), m.get("compress"),
                         name == latest, uid))
    out.sort(key=lambda e: (e.created_ns, e.name))
    return out


OWNER = ".owner"


@dataclass(frozen=True)
class Partial:
    """The hidden folder a save made and builds in: its inode and owner, so every later
    step finds that folder, not one put under its name (picklable: a writer process or
    another DCP rank opens it again by path and checks)."""

    path: str
    ino: int
    uid: int
    mode: int  # what it becomes when published: 0755 less the saver's umask


def claim_partial(path: str) -> Partial:
    """Make the hidden folder a save builds in (0700 until published), clearing one a
    dead save of this user's left behind; one of someone else's is refused, named."""
    partial = partial_path(path)
    try:
        uid = os.lstat(partial).st_uid
    except FileNotFoundError:
        uid = None
    if uid is not None and uid != os.geteuid():
        raise CheckpointError(f"{partial} is {user_name(uid)}'s: no save of {path} by "
                              f"{user_name(os.geteuid())} can be built there",
                              f"save under another name, or ask {user_name(uid)} to "
                              f"remove it (rm -r {partial})")
    if uid is not None:
        with _root_fd(os.path.dirname(partial)) as root_fd:
            cleared = _remove_stale(root_fd, os.path.basename(partial))
        if not cleared and os.path.lexists(partial):
            raise CheckpointError(f"another process is saving {path} right now",
                                  "save under another name, or wait for it (if none is: "
                                  f"its machine or container is gone, rm -r {partial})")
    try:
        os.makedirs(os.path.dirname(partial), exist_ok=True)
        os.mkdir(partial, 0o700)
    except FileExistsError:
        raise CheckpointError(f"another process is saving {path} right now",
                              "save under another name, or wait for it") from None
    except OSError as e:
        if e.errno != errno.EROFS:
            raise
        raise CheckpointError(f"{path}: the checkpoint's folder cannot be made here: "
                              "the mount is read-only",
                              "mount the pool read-write (a pool with a failed member "
                              "mounts read-only: mxfs status names it)") from None
    # Published as 0755 less the umask: never writable by others (a group-writable
    # folder, umask 002, let a member of the group swap the manifest and data for his
    # own, which a load checks only against that manifest).
    made = Partial(partial, 0, os.geteuid(), 0o755 & ~umask())
    try:
        fd = open_dir(partial, follow=False)
    except OSError as e:
        raise _replaced(made, None, e.strerror) from None
    try:
        st = os.fstat(fd)
        made = Partial(partial, st.st_ino, made.uid, made.mode)
        if st.st_uid != made.uid:
            raise _replaced(made, st.st_uid)
        try:
            _write_owner(partial, fd, _lock(fd))
        except BaseException:  # (a folder without its owner would hold the name an hour)
            drop_partial(made)
            raise
    except BaseException:
        os.close(fd)
        raise
    _forget_removed()
    _HELD[_held_key(made)] = fd  # (let go at its publish or drop: `let_go`)
    return made


def _forget_removed() -> None:
    """Let go of the locks of this process's save folders removed by another process
    (a DCP rank that failed drops the coordinator's folder)."""
    for key, fd in list(_HELD.items()):
        try:
            gone = os.fstat(fd).st_nlink == 0
        except OSError:  # (a mount may say it is gone so)
            gone = True
        if gone:
            os.close(_HELD.pop(key))


def _replaced(p: Partial, uid: int | None, why: str | None = None) -> CheckpointError:
    whose = f" (of {user_name(uid)})" if uid is not None else f" ({why})" if why else ""
    return CheckpointError(f"{p.path}, the folder this save made, was renamed away and "
                           f"another put in its place{whose}: the save stopped, writing "
                           "nothing there",
                           "save into a folder only you may write, or one with the sticky "
                           "bit (chmod +t FOLDER), where no one can rename your files")


def open_partial(p: Partial) -> int:
    """A descriptor of the folder the save made, found by its path and checked to be it
    (the save's files are made through it: `create_file`'s dir_fd)."""
    try:
        fd = open_dir(p.path, follow=False)
    except OSError as e:
        raise _replaced(p, None, e.strerror) from None
    st = os.fstat(fd)
    if (st.st_ino, st.st_uid) != (p.ino, p.uid):
        os.close(fd)
        raise _replaced(p, st.st_uid)
    return fd


def drop_partial(p: Partial) -> None:
    """Remove what a failed save made, if its path still leads to the folder it made."""
    try:
        st = os.lstat(p.path)
    except OSError:
        let_go(p)
        return
    if (st.st_ino, st.st_uid) == (p.ino, p.uid):
        shutil.rmtree(p.path, ignore_errors=True)
    let_go(p)


def let_go(p: Partial) -> None:
    """This process's lock on the folder of its save `p` (`claim_partial`), let go once
    the save is published or dropped (anywhere: a writer process publishes); nothing
    if this process holds none."""
    fd = _HELD.pop(_held_key(p), None)
    if fd is not None:
        os.close(fd)


def new_manifest(files: dict[str, Any], **fields: Any) -> dict[str, Any]:
    """A manifest: format, version, creation time, data files (size, checksums, tensors)."""
    return {"format": FORMAT, "version": VERSION, "created_ns": time.time_ns(), **fields,
            "files": files}


def publish(partial: Partial, path: str, manifest: dict[str, Any]) -> str | None:
    """Finish a save: manifest, then rename the hidden folder into place, then `latest`;
    a warning if `latest` could not be moved (the checkpoint is published all the same).

    Each step is durable before the next, so a crash leaves either the previous
    state or the complete checkpoint, and `latest` never names a missing one.
    """
    data = json.dumps(manifest, separators=(",", ":")).encode()
    if len(data) > MANIFEST_MAX:
        raise CheckpointError(f"{path}: its manifest would hold {len(data)} bytes, over the "
                              f"{MANIFEST_MAX} a reader accepts",
                              "save it in fewer files, or with a larger stripe unit")
    root = os.path.dirname(path)
    fd = open_partial(partial)
    try:
        write_small(os.path.join(partial.path, MANIFEST), data, dir_fd=fd)
        sync_dir(partial.path, fd)
        try:
            st = os.lstat(partial.path)
        except OSError as e:
            raise _replaced(partial, None, e.strerror) from None
        if st.st_ino != partial.ino:
            raise _replaced(partial, st.st_uid)
        os.rename(partial.path, path)
        if os.lstat(path).st_ino != partial.ino:  # (swapped between the check and rename)
            raise CheckpointError(f"{path}: another user's folder took the place of "
                                  f"{partial.path} and was renamed in place of this save's "
                                  "(which stays closed to others, wherever they moved it)",
                                  f"remove {path}, and save into a folder only you may "
                                  "write, or one with the sticky bit (chmod +t FOLDER)")
        # Open to others only now, published (the set-group-ID bit a shared folder gave
        # it kept, as mkdir would have).
        os.fchmod(fd, partial.mode | (os.fstat(fd).st_mode & stat.S_ISGID))
        sync_dir(root)
        # Only now: until the rename the owner says whose the folder is (a crash leaving
        # it in the checkpoint is harmless: nothing reads it there).
        with contextlib.suppress(FileNotFoundError):
            os.unlink(OWNER, dir_fd=fd)
        os.fsync(fd)
    finally:
        os.close(fd)
    let_go(partial)
    try:
        with _root_fd(root) as root_fd:
            newer = _point_latest(root, root_fd, os.path.basename(path),
                                  int(manifest["created_ns"]))
    except (OSError, CheckpointError) as e:
        return _latest_warning(root, path, e)
    if newer is not None:
        return (f"{path} is saved; {os.path.join(root, LATEST)} still names {newer}, a "
                "checkpoint another save finished after this one: load "
                f"{path} by its path")
    return None


def _latest_warning(root: str, path: str, e: OSError | CheckpointError) -> str:
    """One line: `latest` was left as it was, whose it is, and what fixes it."""
    latest = os.path.join(root, LATEST)
    try:
        whose = f", a file of {user_name(os.lstat(latest).st_uid)}'s"
    except OSError:
        whose = ""
    return (f"{path} is saved, but {latest}{whose} could not be pointed at it "
            f"({e.strerror if isinstance(e, OSError) else e}); it still names "
            f"{_latest_or_none(root)}: load {path} by its "
            f"path, and have the owner of {latest} (or root) remove it so the next save "
            "sets it")


def _latest_or_none(root: str) -> str:
    try:
        return latest_name(root) or "nothing"
    except CheckpointError:
        return "nothing"


# A save of another machine or container is judged by its folder's age, not its pid:
# nothing of it changed for this long (a save writes all the while) and it is left over.
FOREIGN_STALE_S = 3600.0


def _owner_id() -> str:
    """Where a pid means this process's pid: this boot of this machine, this pid
    namespace (a container has its own; another node has another boot)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return "?"


def _write_owner(folder: str, dir_fd: int | None = None, locked: bool = False) -> None:
    """Say whose the hidden folder `folder` is (`dir_fd`: it, already open; `locked`:
    this process holds a lock on it for as long as it works there): a new file, never
    one written through whatever held the name."""
    owner: dict[str, Any] = {"pid": os.getpid(), "where": _owner_id()}
    if locked:
        owner["locked"] = True
    data = json.dumps(owner).encode()
    try:
        fd = open_dir(folder, follow=False) if dir_fd is None else dir_fd
        try:
            write_new(OWNER, data, fd)
        finally:
            if dir_fd is None:
                os.close(fd)
    except OSError as e:  # a pool's reading node writes no bytes through its mount:
        if e.errno != errno.EROFS:  # through the direct path, as its other files
            raise
        write_small(os.path.join(folder, OWNER), data,  # (a new file: never through a
                    dir_fd=dir_fd)                      # link)


def is_stale(partial: str) -> bool:
    """Was this partial save (or removal) left by a process that is gone?

    Its pid answers only where it was written in this machine's boot and this pid
    namespace: a save of another node or container (one pool mounted into several)
    is left over only once nothing in its folder changed for FOREIGN_STALE_S; until
    then its pid, meaningless here, must not get it removed mid-write.  A link is
    never stale (nothing of it is removed)."""
    try:
        fd = open_dir(partial, follow=False)
    except OSError:
        return False  # gone, a link, or no folder: not a save to clear
    try:
        return _stale_at(fd)
    finally:
        os.close(fd)


def _stale_at(fd: int) -> bool:
    try:
        owner = json.loads(read_small(OWNER, fd, SMALL_MAX))
        pid, where = int(owner["pid"]), str(owner.get("where", ""))
        locked = owner.get("locked") is True
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return _idle_for(fd) >= FOREIGN_STALE_S  # unreadable: maybe being written
    here = _owner_id()
    if locked and where.split("/")[0] == here.split("/")[0] != "?":
        # Written in this boot of this machine, by a process that locks the folder while
        # it works there (the kernel lets go of the lock when it dies, however it dies):
        # whatever its pid namespace, its lock says.  A container restarted after a
        # crash waited an hour for the name its last save had left half-written.
        free = _lock_free(fd)
        if free is not None:
            return free
    if where != here:
        return _idle_for(fd) >= FOREIGN_STALE_S
    return pid != os.getpid() and not running(pid)


def _lock(fd: int) -> bool:
    """Lock the folder `fd` for this process's work in it (waiting out a moment's
    look of `_lock_free`); whether it could be locked."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return True
    except OSError:  # (a filesystem that takes no locks: its age judges it)
        return False


def _lock_free(fd: int) -> bool | None:
    """Whether nobody holds the folder `fd` locked (taken and let go at once, on a
    descriptor of its own); None if the filesystem cannot say."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:
        return None
    fcntl.flock(fd, fcntl.LOCK_UN)
    return True


def _held_key(p: Partial) -> tuple[str, int]:
    return p.path, p.ino


# This process's saves' folders, each held locked by a descriptor (`claim_partial`).
_HELD: dict[tuple[str, int], int] = {}


def _idle_for(fd: int) -> float:
    """Seconds since anything in the folder `fd` (or the folder) last changed."""
    try:
        newest = max([os.fstat(fd).st_mtime] +
                     [e.stat(follow_symlinks=False).st_mtime for e in os.scandir(fd)])
    except OSError:
        return 0.0  # going or gone: not ours to judge
    return time.time() - newest


def partials(root: str) -> list[str]:
    """Hidden folders of saves that never completed (and whose writer is gone)."""
    with _root_fd(root) as fd:
        return [os.path.join(root, n) for n in _partials_at(fd)]


def _partials_at(root_fd: int, owner: int | None = None) -> list[str]:
    """The stale hidden folders of `root_fd` (`owner`: only that uid's)."""
    out = []
    for name in sorted(os.listdir(root_fd)):
        if not (name.startswith(".") and name.endswith((PARTIAL_SUFFIX, ".removing"))):
            continue
        try:
            fd = open_dir(name, root_fd, follow=False)
        except OSError:
            continue  # a file, or a link: nothing a save left
        try:
            if (owner is None or os.fstat(fd).st_uid == owner) and _stale_at(fd):
                out.append(name)
        finally:
            os.close(fd)
    return out


def remove(path: str) -> None:
    """Remove one checkpoint; `latest` moves to the newest one left."""
    root, name = os.path.split(os.path.abspath(path))
    with _root_fd(root) as fd:
        _remove_at(fd, root, name)


def _remove_at(root_fd: int, root: str, name: str) -> None:
    """Remove the checkpoint `name` of the folder `root_fd`, its files by their names in
    it (never through a link someone planted in it)."""
    path = os.path.join(root, name)
    try:
        fd = open_dir(name, root_fd, follow=False)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} does not exist",
                              "list checkpoints with: mxfs ckpt ls FOLDER") from None
    except OSError as e:
        what = "a symbolic link" if e.errno == errno.ELOOP else "not a folder"
        raise CheckpointError(f"{path} is {what}, not a checkpoint",
                              "give the folder of a checkpoint (mxfs ckpt ls FOLDER lists "
                              "them)") from None
    try:
        read_manifest(path, fd)  # refuse to remove what is not a checkpoint
    except CheckpointError as e:
        if e.fix != DAMAGED:  # (a damaged one is a checkpoint: its manifest is there)
            raise
    finally:
        os.close(fd)
    # `latest` first, to the newest one left: moved after the folder went, a removal
    # cut short there left it naming nothing.
    moved = False
    with _latest_locked(root_fd):
        if _latest_at(root_fd) == name:
            left = [e for e in _list_at(root_fd, root) if e.name != name]
            set_latest(root, root_fd, left[-1].name if left else None)
            moved = True
    # A name of its own (a name someone else made, in a sticky folder, held every
    # removal of `name`, and every prune behind it, for good).  Gone from listings at
    # once, even if the removal is cut short.
    hidden = f".{name}.{secrets.token_hex(4)}.removing"
    try:
        os.rename(name, hidden, src_dir_fd=root_fd, dst_dir_fd=root_fd)
    except OSError:  # (not removed: `latest` names it again, unless a save moved it)
        if moved:
            with _latest_locked(root_fd), contextlib.suppress(OSError):
                if _latest_at(root_fd) in (None, *(e.name for e in left[-1:])):
                    set_latest(root, root_fd, name)
        raise
    try:
        fd = open_dir(hidden, root_fd, follow=False)
    except OSError as e:
        raise CheckpointError(f"{path} was replaced while it was removed ({e.strerror})",
                              f"look at {os.path.join(root, hidden)}") from None
    try:  # (without it the folder looks fresh to a prune beside: left to this one.
        # Not locked as a save's folder is: a published checkpoint is open to others,
        # whose lock on it would hold this removal, and a dead one's folder for good)
        with contextlib.suppress(OSError):
            _write_owner(os.path.join(root, hidden), fd)
    finally:
        os.close(fd)
    remove_tree(hidden, root_fd)
    os.fsync(root_fd)


def prune(root: str, keep: int, protect: str | None = None, owner: int | None = None
          ) -> list[str]:
    """Keep each owner's newest `keep` checkpoints (and `protect`); remove the rest and
    the stale partials.

    Counted per owner, as a folder's owner says: in a shared folder another user's
    manifests, dated as their writer likes, would otherwise push out the caller's own.
    `owner` (a save's retention, a user's prune) counts and removes only the folders
    that uid owns; None (root's prune) every owner's, each kept to `keep`."""
    if keep < 1:
        raise CheckpointError(f"keep must be at least 1, not {keep}", "pass --keep 1 or more")
    removed, failed = [], []
    with _root_fd(root) as fd:
        for name in _partials_at(fd, owner):
            try:  # (one that cannot go holds back none of the others)
                if _remove_stale(fd, name):
                    removed.append(os.path.join(root, name))
            except Exception as err:  # noqa: BLE001 (a tenant's tree: whatever it does)
                failed.append(f"{os.path.join(root, name)} ({err})")
        by_owner: dict[int, list[Entry]] = {}
        for e in _list_at(fd, root):  # (oldest first)
            if owner is None or e.uid == owner:
                by_owner.setdefault(e.uid, []).append(e)
        latest = _latest_at(fd)
        for entries in by_owner.values():
            for e in entries[:max(0, len(entries) - keep)]:
                if e.name in (protect, latest):
                    continue
                try:  # (one that cannot go holds back none of the others)
                    _remove_at(fd, root, e.name)
                    removed.append(e.path)
                except Exception as err:  # noqa: BLE001 (a tenant's tree: whatever it does)
                    failed.append(f"{e.path} ({getattr(err, 'strerror', None) or err})")
    if failed:
        raise CheckpointError(f"pruned {len(removed)}, but {len(failed)} could not be "
                              f"removed: {', '.join(failed[:3])}",
                              "remove those by hand (mxfs ckpt rm), as their owner or root")
    return removed


def _remove_stale(root_fd: int, name: str) -> bool:
    """Remove the stale hidden folder `name` (`_partials_at` judged it), if it still is
    that folder and still stale once locked: renamed to a name of its own first and
    checked to be it.  Removed by its name alone, a save that had meanwhile cleared the
    dead folder and made its own under the name lost it mid-write.  Whether removed."""
    try:
        fd = open_dir(name, root_fd, follow=False)
    except OSError:
        return False
    try:
        ino = os.fstat(fd).st_ino
        if not _stale_at(fd):
            return False
        try:  # (a live save holds its folder locked: `claim_partial`)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        except OSError:
            pass  # (a filesystem that takes no locks: its age judged it)
        aside = f"{name}.{secrets.token_hex(4)}.removing"
        try:
            os.rename(name, aside, src_dir_fd=root_fd, dst_dir_fd=root_fd)
        except OSError:
            return False
        if os.lstat(aside, dir_fd=root_fd).st_ino != ino:  # (made anew meanwhile: back,
            with contextlib.suppress(OSError):  # never over what took its name since)
                rename_noreplace(root_fd, aside, name)
            return False
        with contextlib.suppress(OSError):
            remove_tree(aside, root_fd)
        try:
            os.lstat(aside, dir_fd=root_fd)
        except FileNotFoundError:
            return True
        return False  # (left: removed by the next prune)
    finally:
        os.close(fd)
