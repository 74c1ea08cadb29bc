"""The pool key: the secret the nodes of one pool prove to each other (the chunk
service, `proto/chunk_wire.py`).

32 random bytes in `mxfs.key` beside member 0's superblock, readable by root alone; made
the first time a daemon serves chunks, copied by the operator to every node that joins
(with the member folders' superblocks it is all a node needs).  A key file anyone else
may read is refused: whoever reads it can pose as a node.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import os
import stat

from mxfs.errors import MxfsError
from mxfs.pool.safe_file import check_private_folder, write_new
from mxfs.proto.chunk_wire import KEY_BYTES

KEY_NAME = "mxfs.key"


def key_path(member0: str) -> str:
    return os.path.join(member0, KEY_NAME)


def load_key(member0: str, create: bool = False) -> bytes:
    """The pool key kept on member 0 (made there first if `create` and absent)."""
    return read_key(key_path(member0), create)


def key_id(key: bytes, pool_uuid: str) -> str:
    """A name of the key that tells nothing of it: kept in the metadata store, so a
    node joining with a copied key (`mxfs node add`) can tell it is the pool's."""
    return hmac.new(key, b"mxfs key id " + pool_uuid.encode(), hashlib.sha256).hexdigest()[:32]


def install_key(key: bytes, path: str) -> None:
    """Write `key` to `path`, root's and 0600, whole or not at all, in a folder no one
    else may write (`safe_file.py`)."""
    check_private_folder(os.path.dirname(path) or ".", "the pool key")
    write_new(path, key, 0o600)


def read_key(path: str, create: bool = False) -> bytes:
    """The pool key in the file `path` (made there first if `create` and absent)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        if not create:
            raise MxfsError(f"the pool key {path} is missing",
                            "copy it from a node of the pool (root's, mode 0600)") from None
        return _make(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise MxfsError(f"the pool key {path} is a symbolic link",
                            "replace it with the key file itself") from None
        raise
    try:
        st = os.fstat(fd)
        if st.st_mode & 0o077 or st.st_uid != os.geteuid():
            raise MxfsError(f"the pool key {path} may be read by others "
                            f"(mode {stat.S_IMODE(st.st_mode):o}, uid {st.st_uid})",
                            f"chown root {path} && chmod 600 {path}")
        key = os.read(fd, KEY_BYTES + 1)
    finally:
        os.close(fd)
    if len(key) != KEY_BYTES:
        raise MxfsError(f"the pool key {path} is damaged ({len(key)} bytes, not {KEY_BYTES})",
                        "copy it again from a node of the pool")
    return key


def _make(path: str) -> bytes:
    check_private_folder(os.path.dirname(path) or ".", "the pool key")
    key = os.urandom(KEY_BYTES)
    try:
        write_new(path, key, 0o600, put=os.link)  # the first maker wins
    except FileExistsError:
        return read_key(path)  # a racer's
    return key
