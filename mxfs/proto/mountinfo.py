"""The kernel's mount table (/proc/self/mountinfo): what the tools read before they
mount and unmount, and what a client reads before it trusts a folder's
`user.mxfs.control` (any user may set that xattr on a folder of her own: only the
root of a `fuse.mxfs` mount is an mxfs mount)."""

from __future__ import annotations

import os


def unescape(field: str) -> str:
    """A mountinfo path field as the path it names (spaces, tabs, newlines and
    backslashes come octal-escaped)."""
    return field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n") \
        .replace("\\134", "\\")


def mount_table() -> dict[str, str]:
    """Mount point -> filesystem type (of the last mount there: the top of a stack)."""
    table = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            table[unescape(left.split()[4])] = right.split()[0]
    return table


def mount_of(path: str) -> tuple[str, str]:
    """(mount point, filesystem type) of the mount holding `path` (made absolute and
    resolved): the deepest mount point at or above it."""
    path = os.path.realpath(path)
    table = mount_table()
    point = path
    while point not in table and point != "/":
        point = os.path.dirname(point)
    return point, table.get(point, "?")
