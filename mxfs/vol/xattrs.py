"""Extended attributes as mxfs keeps them: the rules every change of one passes, on
the writer's own mount and for a reading node's callers alike (`fs/ops.py`,
`fs/node_files.py`), and the layout attribute (`user.mxfs.layout`, `mxfs setstripe`).
"""

from __future__ import annotations

import errno

from mxfs.io import Layout
from mxfs.meta import Inode
from mxfs.meta.usage import NAME_ROW, xattr_cost
from mxfs.pool.pool import MAX_STRIPE_UNIT, META_ROW
from mxfs.proto import constants
from mxfs.vol.access import kept_namespace
from mxfs.vol.volume import Volume

LAYOUT_XATTR = constants.LAYOUT_XATTR.encode()
CONTROL_XATTR = constants.CONTROL_XATTR.encode()
ACL_PREFIX = b"system.posix_acl_"
XATTR_NAME_MAX = 255
XATTR_SIZE_MAX = 65536
# What one inode may hold in xattrs (ext4 gives one block, XFS 64 KiB a value).
MAX_XATTRS = 256
MAX_XATTR_BYTES = 256 << 10


def format_layout(fields: dict[str, int]) -> bytes:
    """The value of user.mxfs.layout: 'stripe_unit=N stripe_width=M ...'."""
    return " ".join(f"{k}={v}" for k, v in fields.items()).encode()


def parse_layout(raw: bytes) -> tuple[int | None, int | None]:
    """'stripe_unit=N stripe_width=M' (either may be left out) -> (unit, width)."""
    fields: dict[str, int] = {}
    for part in raw.decode(errors="replace").replace(",", " ").split():
        key, _, value = part.partition("=")
        # (ASCII digits only: "²".isdigit(), and int("²") raised ValueError: EIO; 19
        # at most: int() of 4,301 digits raised it too)
        if key not in ("stripe_unit", "stripe_width") or not value.isascii() or \
                not value.isdecimal() or len(value) > 19 or not int(value):
            raise OSError(errno.EINVAL, f"bad layout field {part!r}: write it like "
                          "stripe_unit=1048576 stripe_width=4")
        fields[key] = int(value)
    if not fields:
        raise OSError(errno.EINVAL, "empty layout")
    return fields.get("stripe_unit"), fields.get("stripe_width")


def check_sizes(name: bytes, value: bytes) -> None:
    """The kernel's bounds on a name and a value (checked where the call arrives)."""
    if len(name) > XATTR_NAME_MAX or not name:
        raise OSError(errno.ERANGE, "an xattr name is 1 to 255 bytes")
    if len(value) > XATTR_SIZE_MAX:
        raise OSError(errno.E2BIG, "an xattr value is at most 64 KiB")


def set_xattr(vol: Volume, node: Inode, name: bytes, value: bytes, uid: int) -> None:
    """Set `name` on `node` for `uid` (whose right to was judged: the kernel's rules,
    which leave system.* to us: none is kept)."""
    check_sizes(name, value)
    if name == LAYOUT_XATTR:
        set_layout(vol, node, value, uid)
        return
    if name == CONTROL_XATTR:  # (on a folder it would send clients to a fake daemon)
        raise OSError(errno.EPERM, "user.mxfs.control is the daemon's")
    if name.startswith(ACL_PREFIX):
        # No POSIX ACLs: refusing makes cp -a, tar and rsync fall back to chmod,
        # where a stored-but-ignored ACL would silently lose the mode.
        raise OSError(errno.EOPNOTSUPP, "mxfs keeps no POSIX ACLs: modes only")
    kept_namespace(name)
    store = vol.store
    names, held, replaced = store.xattr_usage(node.ino, but=name)
    if names >= MAX_XATTRS or held + len(value) > MAX_XATTR_BYTES:
        # One inode's xattrs live in one store; without a bound they fill its disk.
        raise OSError(errno.ENOSPC, f"inode {node.ino} holds its most xattrs already")
    # ... and count against the owner's byte quota (they are its metadata, a row each)
    vol.quotas.room(node.uid, xattr_cost(name, len(value)) - (replaced and NAME_ROW + replaced))
    vol.pool.check_meta_room(META_ROW + len(name) + len(value))
    store.setxattr(node, name, value)


def remove_xattr(vol: Volume, node: Inode, name: bytes) -> None:
    if name in (LAYOUT_XATTR, CONTROL_XATTR):
        raise OSError(errno.EPERM, f"{name.decode()} cannot be removed")
    kept_namespace(name)
    if not vol.store.removexattr(node, name):
        raise OSError(errno.ENODATA, "no such xattr")


def set_layout(vol: Volume, node: Inode, value: bytes, uid: int) -> None:
    """setstripe: a directory's default for new files, or an empty file's own layout."""
    if uid not in (0, node.uid):
        raise OSError(errno.EPERM, "only the owner or root sets a layout")
    unit, width = parse_layout(value)
    pool = vol.pool
    unit = unit or node.stripe_unit or pool.stripe_unit
    width = width or node.stripe_width or len(pool.members)
    try:
        Layout(unit, width, 0, len(pool.members))
    except ValueError as e:
        raise OSError(errno.EINVAL, str(e)) from None
    if unit > MAX_STRIPE_UNIT:
        raise OSError(errno.EINVAL, f"stripe unit over {MAX_STRIPE_UNIT}")
    if node.is_dir:
        vol.store.set_layout(node, unit, width)
    elif node.is_reg:
        entry = vol.open_inodes.get(node.ino)
        if node.size or entry is not None and entry.wrote:
            raise OSError(errno.EBUSY, "a file's layout is set while it is empty")
        if node.ino in vol.holds:  # (a node's writes there may not be told yet)
            raise OSError(errno.EBUSY, "the file is open on another node: its layout is "
                          "set while no other node has it open")
        vol.store.set_layout(node, unit, width)
        if entry is not None and entry.chunks is not None:
            entry.chunks.relayout(vol.layout(node))
    else:
        raise OSError(errno.EINVAL, "a layout is a file's or a directory's")
