"""Copying files into an unmounted pool, as root, without FUSE.

For GPU machines that read the pool with `OfflinePool` and have no FUSE to write it
with, and for seeding a pool before its first mount.  The pool is claimed with the
daemon's own lock, so it cannot be mounted meanwhile.  Each file is written as a
direct commit is: a hidden inode committed before any chunk file exists, stripes
written and fsynced, then named and sealed with its xxh3 block sums in one durable
change; a copy that fails or is killed leaves nothing visible (fsck and the next
mount reclaim the orphan).
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
    for src in sources:
        if not os.path.isfile(src):
            raise MxfsError(f"{src} is not a file", "put copies files (name each one)")
    names = [os.path.basename(src) for src in sources]
    if len(set(names)) < len(names):
        raise MxfsError("two of the files have the same name", "put them into different "
                        "folders (one mxfs put each)")
    vol = Volume.claim(spec, "mxfs put")
    done = []
    try:
        vol.recover()  # what a crashed daemon or put left: reclaimed, as a mount would
        parent = _resolve_dir(vol, dest)
        for src in sources:
            done.append(_put_one(vol, parent, src, dest, progress))
    finally:
        vol.close()  # marks the store clean and gives the lock back
    return done


def _fill(f: io.RawIOBase, buf: memoryview) -> int:
    """Read until `buf` is full or the file ends; the bytes read."""
    got = 0
    while got < len(buf) and (n := f.readinto(buf[got:])):
        got += n
    return got


def _put_one(vol: Volume, parent: Inode, src: str, dest: str,
             progress: Callable[[int], None] | None) -> Put:
    name = os.path.basename(src)
    entry = vol.create_hidden(parent, 0o644, 0, 0)
    node = entry.node
    unit = vol.layout(node).unit
    sums: list[int] = []
    size = 0
    assert entry.chunks is not None
    try:
        with open(src, "rb", buffering=0) as f:
            buf = memoryview(bytearray(unit * max(1, PIECE // unit)))  # whole sum blocks
            while n := _fill(f, buf):
                entry.chunks.write(size, buf[:n])
                sums += block_sums(buf[:n], unit)
                size += n
                if progress:
                    progress(n)
        vol.settle_hidden(entry, size)
        vol.publish(entry, parent.ino, os.fsencode(name), size, True, unit, pack_sums(sums))
    except OSError as e:
        vol.release(node.ino)
        vol.store.commit()
        vol.reclaim_pending()
        if e.errno == errno.ENOSPC:
            raise MxfsError(f"the pool is full while putting {src}",
                            "free space in the pool (mxfs df), then put again") from None
        raise
    vol.release(node.ino)
    vol.store.durable()
    vol.reclaim_pending()
    return Put(src, os.path.join(dest, name), size)
