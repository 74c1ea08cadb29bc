"""Copying files into an unmounted pool, as root, without FUSE.

For GPU machines that read the pool with `OfflinePool` and have no FUSE to write it
with, and for seeding a pool before its first mount.  The pool is claimed with the
daemon's own lock, so it cannot be mounted meanwhile.  Each file is written as a
direct commit is: a hidden inode committed before any chunk file exists, stripes
written and fsynced, then named and sealed with its xxh3 block sums in one durable
change; a copy that fails or is killed leaves nothing visible (fsck and the next
mount reclaim the orphan).

Root puts files that users may control: each source is opened once, without following a
symbolic link and without blocking, before the pool is claimed, and only a regular file
is copied, exactly the size it had then, from that descriptor (a name swapped for a link,
a FIFO or a device afterwards is never opened).  The copy is root's, with its file's
permission bits but never more than 0644: no copy is more readable than its file.
"""

from __future__ import annotations

import errno
import io
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass

from mxfs.errors import MxfsError
from mxfs.io.checksum import block_sums, pack_sums
from mxfs.meta import ROOT_INO, Inode
from mxfs.vol.volume import Volume

PIECE = 64 << 20  # bytes read from the source and written to the members at a time
MOST_READABLE = 0o644  # a copy's mode: its file's permission bits, but no more than this


@dataclass(frozen=True)
class Put:
    source: str
    path: str
    size: int


def _resolve_dir(vol: Volume, path: str) -> Inode:
    """The folder `path` of the pool, made (root's, 0755) where it is missing, as
    `mkdir -p` would."""
    node = vol.store.get(ROOT_INO)
    for part in path.strip("/").split("/"):
        if part in ("", "."):
            continue
        if not node.is_dir:
            break
        name = os.fsencode(part)
        try:
            node = vol.store.lookup(node.ino, name)
        except FileNotFoundError:
            try:
                node = vol.store.create(node.ino, name, stat.S_IFDIR | 0o755, 0, 0,
                                        layout_for=vol.pick_layout)
            except OSError as e:
                raise MxfsError(f"folder {path} cannot be made in the pool ({e.strerror})",
                                "give another folder with --to") from None
    if not node.is_dir:
        raise MxfsError(f"{path} is not a folder in the pool", "name a folder to put into")
    return node


def put_files(spec: str, sources: list[str], dest: str,
              progress: Callable[[int], None] | None = None) -> list[Put]:
    """Copy local `sources` into folder `dest` of the unmounted pool `spec`, sealed.

    An existing file of the same name is replaced atomically.  `progress` is told
    the bytes written as they go.
    """
    if os.geteuid() != 0:
        raise MxfsError("writing an unmounted pool needs root (chunk files are root's)",
                        "run as root, or mount the pool and copy into the mount")
    names = [os.path.basename(src) for src in sources]
    if len(set(names)) < len(names):
        raise MxfsError("two of the files have the same name", "put them into different "
                        "folders (one mxfs put each)")
    opened: list[_Source] = []
    try:
        for src in sources:  # (all of them before the pool is claimed: none can block it)
            try:
                opened.append(_open_source(src))
            except OSError as e:
                if e.errno != errno.EMFILE:
                    raise
                raise MxfsError(f"{len(sources)} files are more than this process may hold "
                                "open at once", "put them in several runs, or raise the "
                                "open-file limit (ulimit -n)") from None
        vol = Volume.claim(spec, "mxfs put")
        done = []
        try:
            vol.recover()  # what a crashed daemon or put left: reclaimed, as a mount would
            parent = _resolve_dir(vol, dest)
            for source in opened:
                done.append(_put_one(vol, parent, source, dest, progress))
        finally:
            vol.close()  # marks the store clean and gives the lock back
    finally:
        for source in opened:
            source.file.close()
    return done


@dataclass(frozen=True)
class _Source:
    path: str
    file: io.FileIO  # the descriptor checked is the one copied
    size: int  # what fstat said at the open: the bytes copied
    mode: int  # the copy's permission bits


_KINDS = {stat.S_IFDIR: "folder", stat.S_IFCHR: "character device", stat.S_IFBLK:
          "block device", stat.S_IFIFO: "FIFO", stat.S_IFSOCK: "socket"}


def _open_source(src: str) -> _Source:
    """`src` opened for the copy: a regular file, reached without following a link in
    its last component, opened without blocking (a FIFO or a device would otherwise
    hold the put, and the pool's lock, forever)."""
    try:
        fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY
                     | os.O_CLOEXEC)
    except FileNotFoundError:
        raise MxfsError(f"{src} is not a file", "put copies files (name each one)") from None
    except OSError as e:
        if e.errno == errno.ELOOP and os.path.islink(src):
            raise MxfsError(f"{src} is a symbolic link (put follows none: whoever owns it "
                            "could point it anywhere)", "give the real path of the file "
                            "to put") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = _KINDS.get(stat.S_IFMT(st.st_mode), "special file")
            raise MxfsError(f"{src} is a {kind}, not a regular file",
                            "put copies regular files (name each one)")
        os.set_blocking(fd, True)
        f = open(fd, "rb", buffering=0)  # noqa: SIM115 - closed by put_files
    except BaseException:
        os.close(fd)
        raise
    return _Source(src, f, st.st_size, stat.S_IMODE(st.st_mode) & MOST_READABLE)


def _fill(f: io.RawIOBase, buf: memoryview) -> int:
    """Read until `buf` is full or the file ends; the bytes read."""
    got = 0
    while got < len(buf) and (n := f.readinto(buf[got:])):
        got += n
    return got


def _put_one(vol: Volume, parent: Inode, source: _Source, dest: str,
             progress: Callable[[int], None] | None) -> Put:
    src = source.path
    name = os.path.basename(src)
    entry = vol.create_hidden(parent, source.mode, 0, 0)
    node = entry.node
    unit = vol.layout(node).unit
    sums: list[int] = []
    size = 0
    assert entry.chunks is not None
    try:
        buf = memoryview(bytearray(unit * max(1, PIECE // unit)))  # whole sum blocks
        while size < source.size:  # (what it grew by meanwhile is not copied)
            n = _fill(source.file, buf[:min(len(buf), source.size - size)])
            if not n:
                raise MxfsError(f"{src} shrank while it was put (from "
                                f"{source.size} bytes to {size})",
                                "put it again once nothing writes it")
            entry.chunks.write(size, buf[:n])
            sums += block_sums(buf[:n], unit)
            size += n
            if progress:
                progress(n)
        vol.settle_hidden(entry, size)
        vol.publish(entry, parent.ino, os.fsencode(name), size, True, unit, pack_sums(sums))
    except (OSError, MxfsError) as e:
        vol.release(node.ino)
        vol.store.commit()
        vol.reclaim_pending()
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            raise MxfsError(f"the pool is full while putting {src}",
                            "free space in the pool (mxfs df), then put again") from None
        raise
    vol.release(node.ino)
    vol.store.durable()
    vol.reclaim_pending()
    return Put(src, os.path.join(dest, name), size)
