"""Files written beside the mount and published atomically when complete.

`create_file(path, size)` gives a `DirectWriter` for a path on an mxfs mount:
the daemon makes a hidden file and passes write descriptors of its chunk
files; this process writes the stripes in parallel (O_DIRECT when buffers are
aligned), hashing each block with xxh3; `commit` makes the daemon fsync, name
and seal the file in one durable step.  Until then nothing is visible, and a
writer that dies leaves nothing behind.  For any other path a `PlainWriter`
gives the same interface over a hidden temporary file and a rename.
"""

from __future__ import annotations

import base64
import errno
import fcntl
import os
import uuid
from collections.abc import Mapping
from typing import Any

from mxfs.client.control import ControlClient, ControlError
from mxfs.client.direct import DIO_ALIGN, SEGMENT, address_of, control_client_for
from mxfs.io import Layout, WriteOp, write_batch
from mxfs.io.batch import sync_all
from mxfs.io.checksum import block_sums, max_sum_unit, pack_sums
from mxfs.proto.messages import (
    ABORT,
    COMMIT,
    CREATE,
    CreateRequest,
    InodeRequest,
    SumsFields,
)


class Finished(InodeRequest, SumsFields):
    """What a commit-like request says of the file it publishes."""

# Checksum block of files written outside mxfs (an mxfs file uses its stripe unit).
PLAIN_SUM_UNIT = 1 << 20
# Most checksums one commit carries (8 bytes each, base64, within the 1 MiB message limit).
MAX_SUMS = 65536


def is_aligned(buf: memoryview, offset: int) -> bool:
    """Can `buf` go to `offset` with O_DIRECT (address, offset and length 4 KiB aligned)?"""
    if buf.readonly or len(buf) % DIO_ALIGN or offset % DIO_ALIGN:
        return False
    return address_of(buf) % DIO_ALIGN == 0


class FileWriter:
    """A file being written; visible only once `commit` returns."""

    path: str
    sum_unit: int

    def __init__(self) -> None:
        self._sums: dict[int, tuple[int, int]] = {}  # block -> (valid bytes, xxh3)
        self.done = False

    def _hash(self, offset: int, buf: memoryview, valid: int) -> None:
        if offset % self.sum_unit:
            raise ValueError(f"write at {offset} does not start a {self.sum_unit}-byte block")
        view = buf[:valid]
        first = offset // self.sum_unit
        for i, digest in enumerate(block_sums(view, self.sum_unit)):
            self._sums[first + i] = (min(self.sum_unit, valid - i * self.sum_unit), digest)

    def write_at(self, offset: int, buf: memoryview, valid: int | None = None) -> None:
        """Write `buf` at `offset` (a block boundary); only its first `valid` bytes count.

        Bytes past `valid` are padding that lets an aligned buffer go with
        O_DIRECT; the commit cuts them off.
        """
        raise NotImplementedError

    def sums(self, size: int) -> list[int]:
        """The checksums of a `size`-byte file, checking every block was written whole."""
        n = -(-size // self.sum_unit)
        out = []
        for k in range(n):
            got = self._sums.get(k)
            want = min(self.sum_unit, size - k * self.sum_unit)
            if got is None or got[0] != want:
                raise ValueError(f"{self.path}: bytes [{k * self.sum_unit}, "
                                 f"{k * self.sum_unit + want}) were not written in one piece")
            out.append(got[1])
        return out

    def commit(self, size: int, replace: bool = True) -> list[int]:
        """Make the file durable and visible under its path; returns its block checksums."""
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> FileWriter:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if not self.done:
            self.abort()


class DirectWriter(FileWriter):
    """A hidden mxfs file written straight to its chunk files."""

    def __init__(self, label: str, client: ControlClient, reply: Mapping[str, Any],
                 fds: list[int], size: int, direct: bool) -> None:
        """`reply` and `fds` come from a create-like request (`create`, `kv_create`)."""
        super().__init__()
        self.path = label
        self.client = client
        self.ino = int(reply["ino"])
        self.layout = Layout.from_description(reply["layout"])
        self.fds = dict(zip(reply["members"], fds, strict=True))
        stripes = max(1, -(-size // self.layout.unit))
        self.sum_unit = self.layout.unit * -(-stripes // MAX_SUMS)
        if self.sum_unit > max_sum_unit(self.layout.unit):  # (its commit would be refused)
            self.abort()
            raise OSError(errno.EFBIG, f"{label}: {size} bytes is over the "
                          f"{MAX_SUMS * max_sum_unit(self.layout.unit)} one file may hold "
                          "(its checksums would not fit one commit): split it")
        self.direct = direct and self._try_direct()

    def _try_direct(self) -> bool:
        """Set O_DIRECT on the chunk descriptors where their filesystem allows it."""
        for fd in self.fds.values():
            try:
                fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
            except OSError:
                self._set_direct(False)
                return False
        return True

    def _set_direct(self, on: bool) -> None:
        for fd in self.fds.values():
            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
            fcntl.fcntl(fd, fcntl.F_SETFL, (flags | os.O_DIRECT) if on else
                        (flags & ~os.O_DIRECT))

    def write_at(self, offset: int, buf: memoryview, valid: int | None = None) -> None:
        write_batch(self.plan_writes(offset, buf, valid))

    def plan_writes(self, offset: int, buf: memoryview, valid: int | None = None
                    ) -> list[WriteOp]:
        """Hash `buf` and return its writes, one per member and segment, to run in a batch
        (several files' writes may share one)."""
        valid = len(buf) if valid is None else valid
        self._hash(offset, buf, valid)
        if self.direct and not is_aligned(buf, offset):
            self._set_direct(False)  # O_DIRECT needs alignment; this file goes buffered
            self.direct = False
        ops = []
        for seg in range(0, len(buf), SEGMENT):
            part = buf[seg:seg + SEGMENT]
            for piece in self.layout.plan(offset + seg, len(part)):
                ops.append(WriteOp(self.fds[piece.member], piece.chunk_offset,
                                   [part[o:o + n] for o, n in piece.spans]))
        return ops

    def commit(self, size: int, replace: bool = True) -> list[int]:
        """Publish the file at `size` bytes: fsynced, then named, sealed and durable."""
        sums, fields = self.finish_request(size, sync=True)
        try:
            self.client.request(COMMIT({**fields, "replace": replace}))
        except ControlError as e:
            raise OSError(e.errno, f"{self.path}: {e.strerror}") from None
        self.done = True
        return sums

    def finish_request(self, size: int, sync: bool) -> tuple[list[int], Finished]:
        """The checksums, and the fields a commit-like request (`commit`, `kv_commit`)
        carries for `size` bytes, after the fsync (if `sync`) with the descriptors
        closed; a caller sending many at once (`ControlClient.request_many`) sets `done`
        once the daemon took each."""
        sums = self.sums(size)
        packed = pack_sums(sums)
        if sync:
            sync_all(list(self.fds.values()))
        self._close_fds()
        return sums, {"ino": self.ino, "size": size, "sum_unit": self.sum_unit,
                      "sums": base64.b64encode(packed).decode()}

    def abort(self) -> None:
        self._close_fds()
        if not self.done:
            self.done = True
            try:
                self.client.request(ABORT({"ino": self.ino}))
            except (ControlError, OSError):
                pass  # the daemon drops it anyway when this connection closes

    def _close_fds(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}


class PlainWriter(FileWriter):
    """A file on any filesystem: a hidden temporary beside it, renamed when committed."""

    def __init__(self, path: str, mode: int, direct: bool, dir_fd: int | None = None) -> None:
        """`dir_fd`: the folder of `path`, already open: the file is made and named in
        it, whatever its name leads to meanwhile."""
        super().__init__()
        self.path = path
        self.sum_unit = PLAIN_SUM_UNIT
        self.dir_fd = dir_fd
        head, name = os.path.split(os.path.abspath(path))
        self.tmp = f".{name}.mxfs-{uuid.uuid4().hex[:12]}"
        self.name = name if dir_fd is not None else os.path.abspath(path)
        if dir_fd is None:
            self.tmp = os.path.join(head, self.tmp)
        self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode,
                          dir_fd=dir_fd)
        self.direct = False
        if direct:
            try:
                fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL)
                            | os.O_DIRECT)
                self.direct = True
            except OSError:
                pass

    def write_at(self, offset: int, buf: memoryview, valid: int | None = None) -> None:
        valid = len(buf) if valid is None else valid
        self._hash(offset, buf, valid)
        if self.direct and not is_aligned(buf, offset):
            fcntl.fcntl(self.fd, fcntl.F_SETFL,
                        fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            self.direct = False
        write_batch([WriteOp(self.fd, offset + o, [buf[o:o + SEGMENT]])
                     for o in range(0, len(buf), SEGMENT)])

    def commit(self, size: int, replace: bool = True) -> list[int]:
        sums = self.sums(size)
        os.ftruncate(self.fd, size)
        os.fsync(self.fd)
        os.close(self.fd)
        self.fd = -1
        at = self.dir_fd
        if replace:
            os.rename(self.tmp, self.name, src_dir_fd=at, dst_dir_fd=at)
        else:
            try:  # (fails if the name exists: first writer wins)
                os.link(self.tmp, self.name, src_dir_fd=at, dst_dir_fd=at)
            finally:
                os.unlink(self.tmp, dir_fd=at)
        sync_dir(os.path.dirname(os.path.abspath(self.path)), at)
        self.done = True
        return sums

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if not self.done:
            self.done = True
            try:
                os.unlink(self.tmp, dir_fd=self.dir_fd)
            except FileNotFoundError:
                pass


def sync_dir(path: str, dir_fd: int | None = None) -> None:
    """fsync a directory, so entries made in it survive a crash (`dir_fd`: it, open)."""
    if dir_fd is not None:
        os.fsync(dir_fd)
        return
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def umask() -> int:
    """This process's umask, read without changing it (another thread may be creating
    files meanwhile); the old way where /proc does not say."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def create_file(path: str, size: int = 0, mode: int = 0o644, exclusive: bool = False,
                direct: bool = True, dir_fd: int | None = None) -> FileWriter:
    """A writer publishing `path` at commit: direct on an mxfs mount, else a temp file.

    `size` is what the file is expected to hold (the daemon checks it fits);
    `exclusive` refuses at once when `path` already exists (commit with
    `replace=False` settles races: the first writer wins, the others get EEXIST).
    `mode` less the umask is the file's, as open(2) makes it.  `dir_fd`, a descriptor
    of the folder `path` names, pins the file to that folder: if the name leads to
    another folder at create or commit (someone renamed it and put theirs in its
    place), the write is refused rather than published in theirs.
    """
    client = control_client_for(path)
    if client is None:
        if exclusive and os.path.lexists(path):
            raise FileExistsError(errno.EEXIST, f"{path} exists")
        return PlainWriter(path, mode, direct, dir_fd)
    request: CreateRequest = {"path": client.pool_path(path), "size": size,
                              "mode": mode & ~umask(), "exclusive": exclusive}
    if dir_fd is not None:
        request["dir_ino"] = os.fstat(dir_fd).st_ino
    try:
        reply, fds = client.request_with_fds(CREATE(request))
    except ControlError as e:
        raise OSError(e.errno, f"{path}: {e.strerror}") from None
    return DirectWriter(path, client, reply, fds, size, direct)
