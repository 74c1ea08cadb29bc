"""Reading an unmounted pool straight from its members, as root.

For tools, and GPU machines that load models without FUSE: the namespace comes from
the metadata store (opened read-only), the bytes from the chunk files.  A shared lock
on the pool keeps it from being mounted (and changed) while it is read this way.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from typing import Any

from mxfs.errors import MxfsError
from mxfs.io import Layout
from mxfs.meta import ROOT_INO, Inode, MetaStore
from mxfs.pool.lock import LOCK_NAME  # the daemon holds it exclusively while mounted
from mxfs.pool.pool import Pool


class OfflinePool:
    def __init__(self, spec: str) -> None:
        if os.geteuid() != 0:
            raise MxfsError("reading an unmounted pool needs root (chunk files are root's)",
                            "run as root, or mount the pool and read through the mount")
        self.pool = Pool.open(spec)
        self.pool.require_members("reading an unmounted pool")
        path = os.path.join(self.pool.meta_dir, LOCK_NAME)
        self._lock = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock)
            raise MxfsError(f"pool {self.pool.uuid} is mounted",
                            "read it through its mount (mxfs status shows where)") from None
        self.store = MetaStore.open(self.pool.meta_location, readonly=True)

    def close(self) -> None:
        self.store.close()
        os.close(self._lock)

    def __enter__(self) -> OfflinePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def resolve(self, path: str) -> Inode:
        node = self.store.get(ROOT_INO)
        for part in path.strip("/").split("/"):
            if part in ("", "."):
                continue
            if not node.is_dir:
                raise NotADirectoryError(errno.ENOTDIR, f"{path}: a component is not a folder")
            try:
                node = self.store.lookup(node.ino, os.fsencode(part))
            except FileNotFoundError:
                raise FileNotFoundError(errno.ENOENT, f"{path}: no such file in the pool") \
                    from None
        return node

    def listdir(self, path: str) -> list[str]:
        node = self.resolve(path)
        if not node.is_dir:
            raise NotADirectoryError(errno.ENOTDIR, f"{path} is not a folder")
        out, after = [], 0
        while batch := self.store.readdir(node.ino, after):
            out += [os.fsdecode(e.name) for e in batch]
            after = batch[-1].cookie
        return out

    def open_read(self, path: str, odirect: bool = True) -> tuple[dict[str, Any], list[int]]:
        """What `open_read` on the control socket gives: size, layout, members, descriptors."""
        node = self.resolve(path)
        if not stat.S_ISREG(node.mode):
            raise IsADirectoryError(errno.EISDIR, f"{path} is not a regular file")
        assert node.stripe_unit and node.stripe_width and node.first_member is not None
        layout = Layout(node.stripe_unit, node.stripe_width, node.first_member,
                        len(self.pool.members))
        which, fds = self.pool.open_for_read(node.ino, layout, node.size, odirect)
        return {"size": node.size, "ino": node.ino, "generation": node.generation,
                "layout": layout.describe(), **which}, fds
