"""Files read beside the mount: chunk descriptors from the daemon, bytes moved here.

`open_reader(path)` gives a `DirectFile` for a file on an mxfs mount (the daemon
checks the caller may read it and passes read-only chunk descriptors), or a
`PlainFile` for any other file, with one interface, so loaders need not care.
"""

from __future__ import annotations

import errno
import os
from typing import Protocol

from mxfs.client.control import ControlClient, ControlError, mount_root
from mxfs.errors import MxfsError
from mxfs.io import Layout, ReadOp, read_batch

# Requests are cut into segments this big, so each member serves several at a time.
SEGMENT = 16 << 20


class Reader(Protocol):
    path: str
    size: int

    def read_into(self, offset: int, buf: memoryview) -> None: ...
    def read_many(self, ranges: list[tuple[int, memoryview]]) -> None: ...
    def check_unchanged(self) -> None: ...
    def close(self) -> None: ...


class FileChanged(MxfsError):
    """The file was replaced or written while it was being read."""


class PlainFile:
    """A file on any filesystem, read with parallel preadv."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        st = os.fstat(self.fd)
        self.size = st.st_size
        self._stamp = (st.st_ino, st.st_mtime_ns, st.st_size)

    def read_into(self, offset: int, buf: memoryview) -> None:
        self.read_many([(offset, buf)])

    def read_many(self, ranges: list[tuple[int, memoryview]]) -> None:
        """Fill each buffer from its file offset; all ranges in one parallel batch."""
        ops = []
        for offset, buf in ranges:
            _check_range(self, offset, len(buf))
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

    def __enter__(self) -> PlainFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class DirectFile:
    """A file on an mxfs mount, read straight from its chunk files in parallel."""

    def __init__(self, path: str, client: ControlClient) -> None:
        self.path = path
        self.client = client
        self._pool_path = client.pool_path(path)
        reply, fds = client.call_with_fds("open_read", path=self._pool_path)
        self.size = int(reply["size"])
        self.ino, self.generation = reply["ino"], reply["generation"]
        self.layout = Layout.from_description(reply["layout"])
        self.fds = dict(zip(reply["members"], fds, strict=True))

    def read_into(self, offset: int, buf: memoryview) -> None:
        """Fill `buf` from file `offset`, every member at once; holes read as zeros."""
        self.read_many([(offset, buf)])

    def read_many(self, ranges: list[tuple[int, memoryview]]) -> None:
        """Fill each buffer from its file offset; all ranges in one parallel batch."""
        ops = []
        for offset, buf in ranges:
            _check_range(self, offset, len(buf))
            for seg in range(0, len(buf), SEGMENT):
                part = buf[seg:seg + SEGMENT]
                for piece in self.layout.plan(offset + seg, len(part)):
                    bufs = [part[o:o + n] for o, n in piece.spans]
                    fd = self.fds.get(piece.member)
                    if fd is None:
                        for b in bufs:
                            b[:] = bytes(len(b))
                    else:
                        ops.append(ReadOp(fd, piece.chunk_offset, bufs))
        read_batch(ops)

    def check_unchanged(self) -> None:
        """Raise FileChanged if the path now names another file or other bytes."""
        try:
            now = self.client.call("layout", path=self._pool_path)
        except ControlError as e:
            if e.errno != errno.ENOENT:
                raise
            now = {}
        if (now.get("ino"), now.get("generation"), now.get("size")) != \
                (self.ino, self.generation, self.size):
            raise FileChanged(f"{self.path} was replaced or written while it was read",
                              "load it again once its writer is done")

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()

    def __enter__(self) -> DirectFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_range(f: Reader, offset: int, n: int) -> None:
    if offset < 0 or offset + n > f.size:
        raise ValueError(f"read of [{offset}, {offset + n}) is outside {f.path} ({f.size} bytes)")


_clients: dict[str, ControlClient] = {}


def open_reader(path: str, direct: bool = True) -> Reader:
    """A reader for `path`: direct from the chunk files when it is on an mxfs mount."""
    try:
        root = mount_root(path) if direct else None
    except OSError as e:
        if e.errno != errno.ENOTCONN:
            raise
        raise MxfsError(f"the mxfs daemon serving {path} is not running (its mount is dead)",
                        "remount: mxfs umount MOUNTPOINT, then mxfs mount POOL MOUNTPOINT") \
            from None
    if root is None:
        return PlainFile(path)
    client = _clients.get(root)
    if client is None:
        try:
            client = _clients[root] = ControlClient(root)
        except OSError as e:
            raise MxfsError(f"the mxfs daemon of {root} does not answer ({e.strerror or e})",
                            f"check it with: mxfs status {root}; if it died: mxfs umount "
                            f"{root}, then mxfs mount POOL {root}") from None
    try:
        return DirectFile(path, client)
    except ControlError as e:
        if e.errno == errno.ENOENT:
            raise FileNotFoundError(errno.ENOENT, f"{path}: no such file") from None
        if e.errno in (errno.EACCES, errno.EPERM):
            raise PermissionError(e.errno, f"{path}: {e.strerror}") from None
        raise
    except (ConnectionError, BrokenPipeError):
        _clients.pop(root, None)
        raise
