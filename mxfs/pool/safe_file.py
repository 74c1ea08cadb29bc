"""Root's small files (the pool key, a node's config, superblocks) written whole, in
folders others may not meddle with.

A temp name anyone can guess (`NAME.PID.tmp`) opened without O_EXCL is a name another
user of a writable folder can make first: as a link (root then writes through it onto
a file of the attacker's choosing) or as a file of her own, left open, that receives
the secret.  Temps here get a fresh random name, made with O_EXCL|O_NOFOLLOW.
"""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Callable
from contextlib import suppress

from mxfs.errors import MxfsError

_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def check_private_folder(folder: str, what: str) -> None:
    """MxfsError if anyone but its owner (root or the caller) may write `folder`: they
    could swap or remove `what`, or make its name first."""
    st = os.stat(folder)
    if st.st_uid not in (0, os.geteuid()) or st.st_mode & 0o022:
        raise MxfsError(f"the folder {folder}, where {what} is kept, may be written by others "
                        f"(mode {stat.S_IMODE(st.st_mode):o}, uid {st.st_uid})",
                        f"chmod go-w {folder} (and chown root {folder})")


def new_temp(path: str, mode: int) -> tuple[str, int]:
    """A fresh file beside `path` (a name nobody made first), and its descriptor."""
    for _ in range(16):
        tmp = f"{path}.{secrets.token_hex(6)}.tmp"
        try:
            fd = os.open(tmp, _NEW, mode)
        except FileExistsError:
            continue
        os.fchmod(fd, mode)  # (not the umask's)
        return tmp, fd
    raise FileExistsError(f"no fresh temp name beside {path}")


def write_new(path: str, data: bytes, mode: int,
              put: Callable[[str, str], None] = os.replace) -> None:
    """Write `data` to a fresh temp beside `path`, durably, then `put` it in place
    (os.replace; or os.link, where the first maker wins: FileExistsError when it lost);
    the temp is gone after, whatever happened."""
    tmp, fd = new_temp(path, mode)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        put(tmp, path)
    finally:
        with suppress(FileNotFoundError):  # (os.replace took it)
            os.unlink(tmp)
    dfd = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
