"""What every reader of a file offers (`Reader`), and the plain one (`PlainFile`).

Loaders take a `Reader` and need not care where the bytes come from: a plain file
(`PlainFile`), an mxfs file's chunk files on this node (`client/direct.py`), or
another node's members through its chunk service (`client/remote_file.py`).
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
from typing import Any

from mxfs.client.control import ControlClient, ControlError
from mxfs.errors import MxfsError
from mxfs.io import ReadOp, read_batch
from mxfs.proto.messages import LAYOUT
from mxfs.safe_open import open_regular

# Requests are cut into segments this big, so each member serves several at a time.
SEGMENT = 16 << 20
HUGE_PAGE = 2 << 20  # a PMD's reach on x86-64 and arm64 (4 KiB pages)


class FileChanged(MxfsError):
    """The file was replaced or written while it was being read."""


class Reader:
    """A file to read by ranges (all at once), check for changes, and close."""

    path: str
    size: int

    def read_many(self, ranges: list[tuple[int, memoryview]]) -> None:
        raise NotImplementedError

    def check_unchanged(self) -> None:
        raise NotImplementedError

    def map(self) -> mmap.mmap:
        """The whole file mapped copy-on-write, bytes paged in from the page cache."""
        raise NotImplementedError

    def mappings(self) -> int:
        """How many kernel mappings `map` makes (the kernel allows ~65k a process)."""
        return 1

    def map_risk(self) -> str | None:
        """Why someone else could change a mapping's bytes silently, or end them (the
        next touch of a cut page raises SIGBUS and kills the process); None where only
        this process's user (or root) can."""
        return "a reader of unknown kind"

    def close(self) -> None:
        raise NotImplementedError

    def read_into(self, offset: int, buf: memoryview) -> None:
        """Fill `buf` from file `offset`; holes read as zeros."""
        self.read_many([(offset, buf)])

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PlainFile(Reader):
    """A file on any filesystem, read with parallel preadv."""

    def __init__(self, path: str) -> None:
        """Open `path` (links followed: a Hugging Face cache's files are links), a
        regular file only: a FIFO or device someone named would hang or never end."""
        self.path = path
        self.fd = open_regular(path, follow=True)
        st = os.fstat(self.fd)
        self.size = st.st_size
        self._stamp = (st.st_ino, st.st_mtime_ns, st.st_size)

    def read_many(self, ranges: list[tuple[int, memoryview]]) -> None:
        """Fill each buffer from its file offset; all ranges in one parallel batch."""
        ops = []
        for offset, buf in ranges:
            check_range(self, offset, len(buf))
            ops += [ReadOp(self.fd, offset + o, [buf[o:o + SEGMENT]])
                    for o in range(0, len(buf), SEGMENT)]
        read_batch(ops)

    def check_unchanged(self) -> None:
        st = os.stat(self.path)
        if (st.st_ino, st.st_mtime_ns, st.st_size) != self._stamp:
            raise FileChanged(f"{self.path} changed while it was read",
                              "load it again once its writer is done")

    def close(self) -> None:
        os.close(self.fd)

    def map_risk(self) -> str | None:
        return map_risk(os.fstat(self.fd), self.path)

    def map(self) -> mmap.mmap:
        return mmap.mmap(self.fd, self.size, flags=mmap.MAP_PRIVATE,
                         prot=mmap.PROT_READ | mmap.PROT_WRITE)


def check_same(client: ControlClient, pool_path: str, stamp: tuple[Any, Any, int],
               path: str) -> None:
    """Raise FileChanged if `pool_path` no longer names the file of `stamp` (inode,
    generation, size) as it was opened."""
    try:
        now = client.request(LAYOUT({"path": pool_path}))
    except ControlError as e:
        if e.errno != errno.ENOENT:
            raise
        raise FileChanged(f"{path} was removed while it was read",
                          "load it again once its writer is done") from None
    if (now["ino"], now["generation"], now["size"]) != stamp:
        raise FileChanged(f"{path} was replaced or written while it was read",
                          "load it again once its writer is done")


def map_risk(st: os.stat_result, path: str, sealed: bool = False) -> str | None:
    """Why a mapping of the file `st` (opened as `path`) is at others' mercy, or None.

    Its owner may chmod it (on mxfs a chmod that takes a right to read away cuts the
    chunk files readers hold, after a grace) or remove it; whoever its mode lets
    write it may rewrite it in place (not a sealed mxfs file: none may); whoever may
    write the folder holding its link may remove or replace it (its chunk files cut
    after a grace).  So: owned by this user or root, written by no one else, in a
    folder of this user's or root's that no one else may write (or sticky).
    """
    me = os.geteuid()
    if st.st_uid not in (me, 0):
        return f"it is uid {st.st_uid}'s, who may chmod or remove it"
    if not sealed and st.st_mode & 0o022:
        return "others may write it"
    real = os.path.realpath(path)
    try:
        here, folder = os.stat(real), os.stat(os.path.dirname(real))
    except OSError as e:
        return f"its folder could not be looked at ({e.strerror})"
    if (here.st_dev, here.st_ino) != (st.st_dev, st.st_ino):
        return "its path names another file now"
    if folder.st_uid not in (me, 0) or (folder.st_mode & 0o022
                                        and not folder.st_mode & stat.S_ISVTX):
        return "others may remove or replace it in its folder"
    return None


def check_range(f: Reader, offset: int, n: int) -> None:
    if offset < 0 or offset + n > f.size:
        raise ValueError(f"read of [{offset}, {offset + n}) is outside {f.path} ({f.size} bytes)")
