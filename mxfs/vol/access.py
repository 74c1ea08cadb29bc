"""POSIX permission checks for callers of the control socket.

The mount lets the kernel check permissions (default_permissions); the
control socket must refuse exactly what the mount would, so it applies the
same owner/group/other rules to the caller's SO_PEERCRED identity.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass

from mxfs.meta import ROOT_INO, Inode, MetaStore

R_OK, W_OK, X_OK = 4, 2, 1


@dataclass(frozen=True)
class Caller:
    pid: int
    uid: int
    gid: int
    gids: frozenset[int]  # every group, the primary one included


def supplementary_groups(pid: int) -> set[int]:
    """The groups of process `pid`, from /proc (empty if it is gone).

    Read as bytes: the `Name:` line holds whatever the process named itself, which
    need not be UTF-8 (a caller could otherwise end the daemon with its own name).
    """
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Groups:"):
                    return {int(g) for g in line.split()[1:]}
    except (OSError, ValueError):
        pass
    return set()


def may(node: Inode, caller: Caller, mask: int) -> bool:
    """Would the kernel's generic_permission grant `mask` (R/W/X bits) on `node`?"""
    if caller.uid == 0:
        # root passes everything except executing a file nobody may execute.
        return not (mask & X_OK and not node.is_dir and not node.mode & 0o111)
    if caller.uid == node.uid:
        bits = (node.mode >> 6) & 7
    elif node.gid in caller.gids:
        bits = (node.mode >> 3) & 7
    else:
        bits = node.mode & 7
    return bits & mask == mask


MAXSYMLINKS = 40  # the kernel's limit of links followed in one lookup (ELOOP past it)
MAX_WALK = 1024  # components one walk takes, links included: a request of the daemon's thread


def resolve_for(store: MetaStore, path: str, caller: Caller, follow: bool = True,
                mountpoint: str = "") -> Inode:
    """Walk `path` (relative to the pool root) as `caller` would through the mount.

    Search permission is checked on every directory passed, symbolic links are
    followed as the kernel follows them (every one on the way, the last one too when
    `follow`; relative targets from the link's folder, absolute ones through
    `mountpoint`; at most MAXSYMLINKS), and `..` goes up.  EXDEV when the walk leaves
    the mount (a link to elsewhere, `..` above the root): the caller reads such a file
    as a plain one, through the kernel.
    """
    root = store.get(ROOT_INO)
    node, parts, links, steps = root, _parts(path), 0, 0
    while parts:
        part = parts.pop()
        steps += 1
        if steps > MAX_WALK:  # 40 links of 2,048 components each: 80,000 lookups
            raise OSError(errno.ELOOP, f"{path}: over {MAX_WALK} components to walk, links "
                          "included")
        if not node.is_dir:
            raise OSError(errno.ENOTDIR, f"{path}: a component is not a directory")
        if not may(node, caller, X_OK):
            raise OSError(errno.EACCES, f"{path}: search permission denied")
        if part == "..":
            if node.ino == ROOT_INO:
                raise OSError(errno.EXDEV, f"{path}: leads out of the mount")
            node = store.get(store.parent_of(node.ino))
            continue
        child = store.lookup(node.ino, os.fsencode(part))
        if not stat.S_ISLNK(child.mode) or not (parts or follow):
            node = child
            continue
        links += 1
        if links > MAXSYMLINKS:
            raise OSError(errno.ELOOP, f"{path}: too many levels of symbolic links")
        target = os.fsdecode(child.target or b"")
        if target.startswith("/"):
            inside = os.path.relpath(target, mountpoint) if mountpoint else os.pardir
            if inside == os.pardir or inside.startswith(os.pardir + os.sep):
                raise OSError(errno.EXDEV, f"{path}: a symbolic link leads out of the mount")
            node, target = root, inside
        parts += _parts(target)
    return node


def _parts(path: str) -> list[str]:
    """The components of `path` to walk, last first (a stack: links push theirs)."""
    return [p for p in reversed(path.split("/")) if p not in ("", ".")]


def owner_for(parent: Inode, mode: int, uid: int, gid: int,
              in_group: Callable[[int], bool]) -> tuple[int, int]:
    """(mode, gid) of a new inode: a set-group-ID directory passes its group on.

    `in_group(g)` says whether the creator belongs to group g (asked only when
    the answer matters: the kernel drops S_ISGID on a file whose group the
    creator is not in).
    """
    if parent.mode & stat.S_ISGID:
        gid = parent.gid
        if stat.S_ISDIR(mode):
            mode |= stat.S_ISGID
    if mode & stat.S_ISGID and not stat.S_ISDIR(mode) and uid != 0 and not in_group(gid):
        mode &= ~stat.S_ISGID
    return mode, gid


def resolve_parent_for(store: MetaStore, path: str, caller: Caller, mountpoint: str = ""
                       ) -> tuple[Inode, bytes]:
    """The directory that would hold `path` and the last name, if `caller` may add to it."""
    head, _, name = path.rstrip("/").rpartition("/")
    if name in ("", ".", ".."):
        raise OSError(errno.EINVAL, f"{path}: not a file name")
    parent = resolve_for(store, head or "/", caller, mountpoint=mountpoint)
    if not parent.is_dir:
        raise OSError(errno.ENOTDIR, f"{head}: not a directory")
    if not may(parent, caller, W_OK | X_OK):
        raise OSError(errno.EACCES, f"{head or '/'}: write permission denied")
    return parent, os.fsencode(name)


def same_folder(parent: Inode, dir_ino: int, path: str) -> None:
    """Refuse (ESTALE) when the caller pinned the folder of `path` (`dir_ino`, 0: not)
    and the path leads to another: its folder was renamed away and another user's put
    in its place, where the file would be published, readable by them."""
    if dir_ino and parent.ino != dir_ino:
        raise OSError(errno.ESTALE, f"{path}: its folder was replaced by another (inode "
                      f"{parent.ino}, not the caller's {dir_ino}): not written there")


def may_replace(parent: Inode, victim: Inode, caller: Caller) -> None:
    """The kernel's rule for removing or replacing `victim` in `parent` (beyond write and
    search on `parent`, which resolve_parent_for checks): in a sticky directory only
    the victim's owner, the directory's owner or root may."""
    if parent.mode & stat.S_ISVTX and caller.uid not in (0, parent.uid, victim.uid):
        raise OSError(errno.EPERM, "the directory is sticky and the entry is another "
                      "user's: only its owner, the directory's owner or root may replace it")


def may_chmod(node: Inode, caller: Caller, mode: int, gid: int | None = None) -> int:
    """The kernel's rule for chmod (EPERM but for the owner or root; anyone may drop
    set-ID bits, as the kernel does when another user writes the file): the permission
    bits `node` takes, S_ISGID dropped where the caller is not in the file's group
    (`gid`: the one a chown in the same change gives it), as setattr_prepare drops it."""
    mode &= 0o7777
    setid = stat.S_ISUID | stat.S_ISGID
    if caller.uid not in (0, node.uid) and (
            mode & ~setid != node.mode & 0o7777 & ~setid or mode & setid & ~node.mode):
        raise OSError(errno.EPERM, "only the owner or root may change a file's mode")
    group = node.gid if gid is None else gid
    if mode & stat.S_ISGID and caller.uid != 0 and group not in caller.gids:
        mode &= ~stat.S_ISGID
    return mode


def may_chown(node: Inode, caller: Caller, uid: int | None, gid: int | None) -> None:
    """The kernel's rule for chown: EPERM but for root, or the owner giving the file to
    a group of its own, its owner unchanged.  (The set-ID bits a chown drops come with
    it, as a mode change in the same setattr.)"""
    if caller.uid == 0:
        return
    if caller.uid != node.uid or (uid is not None and uid != node.uid):
        raise OSError(errno.EPERM, "only root may give a file to another user")
    if gid is not None and gid != node.gid and gid not in caller.gids:
        raise OSError(errno.EPERM, "a file's owner may give it only to a group of its own")


def may_set_times(node: Inode, caller: Caller) -> None:
    """utimensat's rule as near as a setattr shows it (the owner or root; write
    permission for times set to now, which a setattr cannot tell apart: accepted for
    anyone the file's write bits let in, as the node's kernel already judged)."""
    if caller.uid not in (0, node.uid) and not may(node, caller, W_OK):
        raise OSError(errno.EPERM, "only the owner, root or a user who may write the "
                      "file may change its times")


def kept_namespace(name: bytes) -> bytes:
    """The namespace of an attribute mxfs keeps (user.*, trusted.*, security.*: the
    kernel judges who may change the last two); EOPNOTSUPP for any other, system.*
    above all, whose changes the kernel leaves to the filesystem to judge (it would
    let anyone set them on anyone's file)."""
    space, dot, rest = name.partition(b".")
    if not dot or space not in (b"user", b"trusted", b"security"):
        raise OSError(errno.EOPNOTSUPP, "only user.*, trusted.* and security.* "
                      "attributes are kept")
    if not rest:
        raise OSError(errno.EINVAL, "an attribute name needs more than its namespace")
    return space


def may_xattr(node: Inode, caller: Caller, name: bytes) -> None:
    """The kernel's rules for changing an extended attribute (xattr_permission):
    trusted.* and security.* are root's; user.* only on regular files and folders
    (a sticky folder's its owner's), for who may write the inode; other namespaces are
    not kept."""
    space = kept_namespace(name)
    if space != b"user":
        if caller.uid != 0:
            raise OSError(errno.EPERM, f"{space.decode()}.* attributes are root's")
        return
    if not (node.is_reg or node.is_dir):
        raise OSError(errno.EPERM, "user.* attributes are on files and folders only")
    if node.is_dir and node.mode & stat.S_ISVTX and caller.uid not in (0, node.uid):
        raise OSError(errno.EPERM, "a sticky folder's user.* attributes are its owner's")
    if not may(node, caller, W_OK):
        raise OSError(errno.EACCES, f"inode {node.ino}: write permission denied")


def may_change_in(parent: Inode, caller: Caller) -> None:
    """Write and search on a folder: what making or removing a name in it needs."""
    if not parent.is_dir:
        raise OSError(errno.ENOTDIR, f"inode {parent.ino} is not a directory")
    if not may(parent, caller, W_OK | X_OK):
        raise OSError(errno.EACCES, f"directory {parent.ino}: write permission denied")


def may_hard_link(node: Inode, caller: Caller) -> bool:
    """fs.protected_hardlinks: another user's file may be linked by a caller that may
    read and write it, if it is a regular file without set-ID bits that mean anything."""
    setgid_exec = stat.S_ISGID | stat.S_IXGRP
    return node.is_reg and not node.mode & stat.S_ISUID and \
        node.mode & setgid_exec != setgid_exec and may(node, caller, R_OK | W_OK)
