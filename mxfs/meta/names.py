"""The kernel's rules for a name, checked for every path that makes one (mount or direct)."""

from __future__ import annotations

import errno

from mxfs.meta.engine import fail

NAME_MAX = 255


def check_name(name: bytes) -> None:
    if len(name) > NAME_MAX:
        raise fail(errno.ENAMETOOLONG)
    if not name or b"/" in name or b"\0" in name or name in (b".", b".."):
        raise fail(errno.EINVAL)
