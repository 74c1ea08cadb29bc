"""What one control connection holds, and helpers shared by the control operations."""

from __future__ import annotations

import base64
import errno
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from mxfs.fs.access import Caller
from mxfs.fs.volume import OpenInode, Volume
from mxfs.meta import Inode
from mxfs.proto import ProtocolError


@dataclass
class Pending:
    """A hidden file one connection is writing: published by a commit, else dropped."""

    entry: OpenInode
    path: str  # where a commit names it ("" for a KV chunk)


@dataclass
class Session:
    """One control connection: who is calling and what it holds."""

    caller: Caller
    pending: dict[int, Pending] = field(default_factory=dict)
    pins: Counter[tuple[str, bytes]] = field(default_factory=Counter)  # KV read leases


def path_field(msg: dict[str, Any]) -> str:
    path = msg.get("path")
    if not isinstance(path, str):
        raise ProtocolError(f"{msg.get('op')} needs a string 'path'")
    return path


def int_field(msg: dict[str, Any], key: str, default: int | None = None) -> int:
    value = msg.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ProtocolError(f"{msg.get('op')} needs a non-negative integer {key!r}")
    return value


def sums_field(msg: dict[str, Any], unit: int, size: int) -> tuple[int, bytes]:
    """(sum_unit, packed xxh3 sums) of a commit, checked against the file's size."""
    sum_unit = int_field(msg, "sum_unit")
    try:
        sums = base64.b64decode(msg.get("sums", ""), validate=True)
    except (ValueError, TypeError):
        raise ProtocolError(f"{msg.get('op')} needs base64 'sums'") from None
    if sum_unit == 0 or sum_unit % unit:
        raise OSError(errno.EINVAL, f"sum_unit {sum_unit} is not a multiple of the "
                      f"stripe unit {unit}")
    if len(sums) != 8 * (-(-size // sum_unit)):
        raise OSError(errno.EINVAL, f"{len(sums) // 8} checksums for {size} bytes in "
                      f"units of {sum_unit}")
    return sum_unit, sums


def refuse_if_degraded(vol: Volume) -> None:
    """Nothing new is written to a pool with a failed member (it is served read-only)."""
    failed = vol.pool.failed
    if failed:
        raise OSError(errno.EROFS, f"the pool is degraded (member {failed[0].index} failed: "
                      f"{failed[0].failed}): read-only")


def open_hidden(vol: Volume, parent: Inode, mode: int, uid: int, gid: int
                ) -> tuple[OpenInode, list[int], list[int]]:
    """A hidden file and write descriptors of its chunk files: (entry, members, fds)."""
    refuse_if_degraded(vol)
    entry = vol.create_hidden(parent, mode, uid, gid)
    node = entry.node
    members, fds = [], []
    try:
        for m in vol.layout(node).used_members():
            entry.chunks.fd(m, create=True)  # type: ignore[union-attr]
            fds.append(os.open(vol.pool.chunk_path(m, node.ino), os.O_WRONLY | os.O_CLOEXEC))
            members.append(m)
    except OSError:
        for fd in fds:
            os.close(fd)
        vol.release(node.ino)
        raise
    return entry, members, fds


def read_fds(vol: Volume, node: Inode, odirect: bool = False
             ) -> tuple[dict[str, list[int]], list[int]]:
    """Read-only descriptors of a file's chunk files (see Pool.open_for_read)."""
    return vol.pool.open_for_read(node.ino, vol.layout(node), node.size, odirect)
