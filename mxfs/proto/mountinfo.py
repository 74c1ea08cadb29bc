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


def fuse_mounts(fstype: str) -> dict[str, int | None]:
    """Mount point -> the FUSE `user_id` (who mounted it: root's daemons and fusermount3
    both write it) of each `fstype` mount at the top of its stack; None where the
    options carry none."""
    table: dict[str, tuple[str, int | None]] = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            kind, _, options = (right.split() + ["", ""])[:3]
            uid = next((int(o[8:]) for o in options.split(",") if o.startswith("user_id=")
                        and o[8:].isdigit()), None)
            table[unescape(left.split()[4])] = (kind, uid)
    return {point: uid for point, (kind, uid) in table.items() if kind == fstype}


def mount_of(path: str) -> tuple[str, str]:
    """(mount point, filesystem type) of the mount holding `path` (made absolute and
    resolved): the deepest mount point at or above it."""
    path = os.path.realpath(path)
    table = mount_table()
    point = path
    while point not in table and point != "/":
        point = os.path.dirname(point)
    return point, table.get(point, "?")
