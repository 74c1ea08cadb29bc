"""Names that users chose, shown on a terminal: the one place that renders them.

A file name, a path or a KV key in the pool is whatever bytes a tenant picked: an
escape sequence, a newline, a right-to-left override or bytes that are not UTF-8 would
reach root's terminal raw through `mxfs scrub`, `fsck` or `status` (clear the screen,
forge a clean report), or stop the command with a UnicodeEncodeError.  Every name an
admin command prints goes through `shown` (`shown_key` for KV keys).
"""

from __future__ import annotations

import pwd


def shown(name: bytes | str) -> str:
    """`name` for a terminal: printable text as it is; each other character escaped,
    `\\xNN` for ASCII and for a byte that is not UTF-8, `\\uNNNN` (or `\\UNNNNNNNN`)
    for the rest.

    The result is printable ASCII where `name` was not, so showing it twice changes
    nothing (a daemon's answer shown again by the CLI stays as it was).
    """
    text = name.decode("utf-8", "surrogateescape") if isinstance(name, bytes) else name
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _escaped(c) for c in text)


def _escaped(c: str) -> str:
    n = ord(c)
    if n < 0x80:
        return f"\\x{n:02x}"
    if 0xDC80 <= n <= 0xDCFF:  # a byte that was not UTF-8 (surrogateescape)
        return f"\\x{n - 0xDC00:02x}"
    return f"\\u{n:04x}" if n <= 0xFFFF else f"\\U{n:08x}"


def shown_key(key: bytes) -> str:
    """A KV key for a terminal (`mxfs kv ls`): printable UTF-8 as it is, else `0x` and
    its bytes in hex (keys are often binary hashes)."""
    try:
        text = key.decode()
    except UnicodeDecodeError:
        return "0x" + key.hex()
    return text if text.isprintable() else "0x" + key.hex()


def user_name(uid: int, with_uid: bool = False) -> str:
    """A uid as a person reads it: its login name (and the uid, `with_uid`), or
    "uid N" where no account has it (a container's user, a deleted one)."""
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"
    return f"{name} (uid {uid})" if with_uid else name
