"""Files opened inside a folder someone else controls, by a process that must not be
led astray: root's admin commands over a tenant's checkpoint folder, say.

Every open is of one name relative to a descriptor of the folder, never follows a
symbolic link in that last step (O_NOFOLLOW), and refuses what is not a regular file
(a FIFO would hang the reader, a device feed it without end); reads are capped; a new
file is made with O_EXCL after the name is unlinked, so nothing is ever written through
a name someone planted.  Stdlib only: any layer may use it.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat


def open_dir(path: str, dir_fd: int | None = None, follow: bool = True) -> int:
    """A descriptor of the folder `path` (relative to `dir_fd` when given); with
    `follow` False, a symbolic link there is refused (ELOOP) rather than followed."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    return os.open(path, flags, dir_fd=dir_fd)


def open_regular(name: str, dir_fd: int | None = None, follow: bool = False) -> int:
    """`name` in the folder `dir_fd`, opened to read: OSError ELOOP if it is a symbolic
    link (unless `follow`), EINVAL if it is not a regular file (opened without
    blocking, so a FIFO answers at once; the descriptor blocks again after)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP and not follow:
            raise OSError(errno.ELOOP, "is a symbolic link", name) from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "is not a regular file", name)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_small(name: str, dir_fd: int, limit: int) -> bytes:
    """The bytes of the regular file `name` in the folder `dir_fd` (as `open_regular`),
    OSError EFBIG if it holds more than `limit`."""
    fd = open_regular(name, dir_fd)
    try:
        if os.fstat(fd).st_size > limit:
            raise OSError(errno.EFBIG, f"is over {limit} bytes", name)
        parts, got = [], 0
        while got <= limit:  # (it may grow as it is read)
            part = os.read(fd, limit + 1 - got)
            if not part:
                break
            parts.append(part)
            got += len(part)
        if got > limit:
            raise OSError(errno.EFBIG, f"is over {limit} bytes", name)
        return b"".join(parts)
    finally:
        os.close(fd)


def write_new(name: str, data: bytes, dir_fd: int, mode: int = 0o644, tries: int = 3) -> None:
    """Make `name` in the folder `dir_fd` a new file holding `data`: whatever held the
    name (a link someone planted) is unlinked first, and the file is made with O_EXCL,
    never opened through an existing name (EEXIST if the name keeps coming back)."""
    for attempt in range(tries):
        try:
            os.unlink(name, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        try:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW |
                         os.O_CLOEXEC, mode, dir_fd=dir_fd)
        except FileExistsError:
            if attempt == tries - 1:
                raise
            continue
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        return


def rename_noreplace(dir_fd: int, old: str, new: str) -> None:
    """Rename `old` to `new` in the folder `dir_fd`, never over something already named
    `new` (renameat2 RENAME_NOREPLACE: EEXIST; rename(2) replaces an empty folder)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.renameat2(dir_fd, os.fsencode(old), dir_fd, os.fsencode(new), 1) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), new)


MAX_TREE_DEPTH = 128  # folders nested in one removed (a checkpoint's are a level or two)


def remove_tree(name: str, dir_fd: int) -> None:
    """Remove the folder `name` of the folder `dir_fd` with all it holds, never through
    a link (each folder entered by a descriptor, O_NOFOLLOW, held while its contents
    go: a folder moved away meanwhile takes nothing of its new place with it).  Walked
    without recursion (shutil.rmtree's overflowed Python's stack on a tenant's 1,500
    nested folders, and each later prune of the folder failed on it); OSError ELOOP
    past MAX_TREE_DEPTH, what was under that left."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    stack = [(dir_fd, name, os.open(name, flags, dir_fd=dir_fd))]  # (parent, name, fd)
    try:
        while stack:
            parent, here, fd = stack[-1]
            deeper = None
            with os.scandir(fd) as entries:
                for entry in entries:
                    if entry.is_dir(follow_symlinks=False):
                        deeper = entry.name
                        break
                    os.unlink(entry.name, dir_fd=fd)
            if deeper is not None:
                if len(stack) >= MAX_TREE_DEPTH:
                    raise OSError(errno.ELOOP, f"folders nested deeper than "
                                  f"{MAX_TREE_DEPTH} levels", here)
                stack.append((fd, deeper, os.open(deeper, flags, dir_fd=fd)))
                continue
            stack.pop()
            os.close(fd)
            os.rmdir(here, dir_fd=parent)
    finally:
        for _, _, fd in stack:
            os.close(fd)
