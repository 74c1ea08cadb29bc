"""A pool: the set of member folders, checked against their superblocks.

`format_members` writes superblocks on empty members (mkfs); `Pool.open`
finds every member from one member path or a pool config file and refuses a
pool with a missing, foreign or duplicated member, naming which.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import tomllib
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from mxfs.errors import MxfsError
from mxfs.io import DEFAULT_STRIPE_UNIT, PAGE, Layout
from mxfs.pool.superblock import (
    SUPERBLOCK_NAME,
    Superblock,
    SuperblockError,
    read_superblock,
    write_superblock,
)

CHUNK_DIR = "chunks"
BACKUP_DIR = "meta-backup"
META_DIR = "meta"
FANOUT = 256
# Names a freshly made filesystem already holds; a member may contain these.
_IGNORED = {"lost+found"}
# Space kept free on the metadata member so SQLite can always commit (unlinks included).
META_RESERVE = 16 << 20


log = logging.getLogger("mxfs.pool")

@dataclass
class Member:
    index: int
    path: str
    failed: str | None = None  # why it is out of service (missing at mount, I/O errors)

    @property
    def chunk_dir(self) -> str:
        return os.path.join(self.path, CHUNK_DIR)


_OURS = {SUPERBLOCK_NAME, CHUNK_DIR, META_DIR, BACKUP_DIR, SUPERBLOCK_NAME + ".tmp"}


def format_members(paths: list[str], stripe_unit: int = DEFAULT_STRIPE_UNIT,
                   label: str = "", force: bool = False) -> Superblock:
    """Write a new pool's superblocks and chunk folders; returns member 0's superblock."""
    if stripe_unit <= 0 or stripe_unit % PAGE:
        raise MxfsError(f"stripe unit {stripe_unit} is not a multiple of 4 KiB",
                        "pick one such as 1MiB or 4MiB")
    if not paths:
        raise MxfsError("no members given", "name each with --member PATH")
    resolved: list[str] = []
    for p in paths:
        real = os.path.realpath(p)
        if not os.path.isdir(real):
            raise MxfsError(f"member {p} is not an existing folder",
                            "create it or mount the member device there")
        resolved.append(real)
    _refuse_duplicates(resolved, "given")
    for p in resolved:
        entries = set(os.listdir(p)) - _IGNORED
        if SUPERBLOCK_NAME in entries:
            try:
                old = read_superblock(p).pool_uuid
            except (OSError, SuperblockError):
                old = "unreadable"
            if not force:
                raise MxfsError(f"member {p} already belongs to pool {old}",
                                "pass --force to wipe it and make a new pool")
        foreign = entries - _OURS
        if foreign or (entries and SUPERBLOCK_NAME not in entries):
            raise MxfsError(f"member {p} is not empty ({len(entries)} entries)",
                            "give an empty folder or a freshly formatted device")
    pool_uuid = str(uuid.uuid4())
    created = datetime.now(UTC).isoformat(timespec="seconds")
    for p in resolved:
        for name in (CHUNK_DIR, META_DIR):
            shutil.rmtree(os.path.join(p, name), ignore_errors=True)
        os.makedirs(os.path.join(p, CHUNK_DIR))
        for i in range(FANOUT):
            os.mkdir(os.path.join(p, CHUNK_DIR, f"{i:02x}"))
    os.makedirs(os.path.join(resolved[0], META_DIR))
    first = None
    for i, p in enumerate(resolved):
        sb = Superblock(pool_uuid=pool_uuid, member_index=i, member_count=len(resolved),
                        stripe_unit=stripe_unit, label=label, members=resolved,
                        meta_member=0, created=created)
        write_superblock(p, sb)
        first = first or sb
    assert first is not None
    return first


def _refuse_duplicates(paths: list[str], how: str) -> None:
    """Refuse one folder named twice, however it is spelled (same device and inode)."""
    seen: dict[tuple[int, int], str] = {}
    for p in paths:
        st = os.stat(p)
        first = seen.setdefault((st.st_dev, st.st_ino), p)
        if first is not p:
            raise MxfsError(f"member {p} is {how} twice (same folder as {first})",
                            "list each member once")


def read_pool_config(path: str) -> dict:
    """A pool config file: members = [...], and optionally mountpoint and options."""
    try:
        with open(path, "rb") as f:
            conf = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise MxfsError(f"pool config {path} cannot be read ({e})",
                        "fix the TOML; it needs members = [\"/path\", ...]") from None
    for key, kind in (("mountpoint", str), ("options", list)):
        if key in conf and not isinstance(conf[key], kind):
            raise MxfsError(f"pool config {path}: {key} must be a {kind.__name__}",
                            'write mountpoint = "/mnt/pool", options = ["allow_other"]')
    return conf


def _member_paths(spec: str) -> tuple[list[str], str]:
    """Member paths named by `spec` (a member folder or a TOML pool config) and how."""
    if os.path.isfile(spec):
        conf = read_pool_config(spec)
        members = conf.get("members")
        if not isinstance(members, list) or not all(isinstance(m, str) for m in members) \
                or not members:
            raise MxfsError(f"pool config {spec} has no members list",
                            "add members = [\"/path/a\", \"/path/b\"]")
        return [os.path.realpath(m) for m in members], "config"
    if not os.path.isdir(spec):
        raise MxfsError(f"pool {spec} does not exist", "give a member folder or a pool config file")
    try:
        sb = read_superblock(spec)
    except FileNotFoundError:
        raise MxfsError(f"{spec} is not an mxfs pool member (no superblock)",
                        "run mxfs mkfs first, or give the right folder") from None
    except SuperblockError as e:
        raise MxfsError(f"member {spec}: {e}", "restore it or make the pool again") from None
    paths = list(sb.members)
    paths[sb.member_index] = os.path.realpath(spec)
    return paths, "superblock"


class Pool:
    """An opened, verified pool: its members in index order and its stripe defaults."""

    def __init__(self, sb: Superblock, members: list[Member]) -> None:
        self.uuid = sb.pool_uuid
        self.label = sb.label
        self.stripe_unit = sb.stripe_unit
        self.members = members
        self.meta_member = sb.meta_member
        # Told of each member's share of chunk I/O: (member, "read" | "write", bytes).
        self.on_io: Callable[[int, str, int], None] | None = None

    @classmethod
    def open(cls, spec: str, degraded: bool = False) -> Pool:
        """Open and check every member; with `degraded`, members that are missing or
        unreadable are marked failed (their files' stripes are lost) instead of refused."""
        paths, source = _member_paths(spec)
        lost: dict[int, str] = {}
        _refuse_duplicates([p for p in paths if os.path.isdir(p)], "listed")
        by_index: dict[int, tuple[str, Superblock]] = {}
        reference: Superblock | None = None
        for pos, p in enumerate(paths):
            why = None if os.path.isdir(p) else "is missing"
            try:
                sb = read_superblock(p) if why is None else None
            except FileNotFoundError:
                why = "has no mxfs superblock"
            except (OSError, SuperblockError) as e:
                why = f"is unreadable ({e})"
            if why is not None or sb is None:
                if not degraded:
                    raise MxfsError(f"member {pos} ({p}) {why}",
                                    "attach it (or list where it lives now in a pool config), "
                                    "or mount with -o degraded to serve, read-only, the files "
                                    "that have no stripes on it") from None
                lost[pos] = f"{why.removeprefix('is ')} at mount"
                continue
            if reference is None:
                reference = sb
            elif sb.pool_uuid != reference.pool_uuid:
                raise MxfsError(f"member {p} belongs to another pool ({sb.pool_uuid}, "
                                f"not {reference.pool_uuid})", "remove it from the member list")
            if sb.member_index in by_index:
                raise MxfsError(f"members {by_index[sb.member_index][0]} and {p} both claim "
                                f"index {sb.member_index}", "one is a copy; list the original only")
            by_index[sb.member_index] = (p, sb)
        if reference is None:
            raise MxfsError(f"no member of pool {spec} can be read", "attach its members")
        count = reference.member_count
        members = []
        for i in range(count):
            hint = reference.members[i] if i < len(reference.members) else "?"
            if i in by_index:
                members.append(Member(i, by_index[i][0]))
            elif degraded and (i in lost or source == "superblock"):
                members.append(Member(i, hint, lost.get(i, "missing at mount")))
            else:
                raise MxfsError(f"member {i} (last seen at {hint}) is missing from the "
                                f"{source}", "attach it and list it")
        if len(by_index) + sum(1 for m in members if m.failed) != count:
            raise MxfsError(f"{len(by_index)} members given but the pool has {count}",
                            "list exactly the pool's members")
        if members[reference.meta_member].failed:
            raise MxfsError(f"the metadata member {reference.meta_member} "
                            f"({members[reference.meta_member].path}) is "
                            f"{members[reference.meta_member].failed}",
                            "attach it; if it is gone for good, restore its store on a new "
                            "pool from a dump (mxfs meta restore)")
        return cls(reference, members)

    @property
    def failed(self) -> list[Member]:
        return [m for m in self.members if m.failed]

    def fail(self, member: int, why: str) -> None:
        """Take a member out of service: every file with stripes on it now reads EIO."""
        m = self.members[member]
        if m.failed is None:
            m.failed = why
            log.error("member %d (%s) failed: %s; files with stripes on it are lost "
                      "(mxfs status lists them)", member, m.path, why)

    def check(self, members: list[int] | set[int]) -> None:
        """EIO if any of these members is out of service."""
        for i in members:
            if self.members[i].failed:
                raise OSError(errno.EIO, f"member {i} failed ({self.members[i].failed})")

    def probe(self, member: int, err: OSError) -> None:
        """After an error touching `member`: is the member itself gone or failing?"""
        if err.errno in (errno.EIO, errno.ENODEV, errno.ENXIO, errno.ESTALE, errno.ENOTCONN):
            self.fail(member, f"I/O error ({err.strerror})")
            return
        try:
            read_superblock(self.members[member].path)
        except (OSError, SuperblockError) as e:
            self.fail(member, f"its superblock is gone ({e}): unmounted or removed")

    @property
    def meta_dir(self) -> str:
        return os.path.join(self.members[self.meta_member].path, META_DIR)

    @property
    def backup_dir(self) -> str:
        """Where metadata backups go: the member after the metadata member."""
        m = self.members[(self.meta_member + 1) % len(self.members)]
        return os.path.join(m.path, BACKUP_DIR)

    def backup_dirs(self) -> list[str]:
        """Every member's backup folder (recovery looks in all of them)."""
        return [os.path.join(m.path, BACKUP_DIR) for m in self.members]

    def layout_for(self, ino: int, unit: int | None = None, width: int | None = None) -> Layout:
        """The layout a new file gets: defaults filled in, first member spread by inode."""
        n = len(self.members)
        return Layout(unit or self.stripe_unit, min(width or n, n), ino % n, n)

    def chunk_path(self, member: int, ino: int) -> str:
        return os.path.join(self.members[member].path, CHUNK_DIR, f"{ino % FANOUT:02x}", str(ino))

    def open_for_read(self, ino: int, layout: Layout, size: int, odirect: bool = False
                      ) -> tuple[dict[str, list[int]], list[int]]:
        """Read-only descriptors of a file's chunk files, for a direct reader.

        Returns ({"members": [...], "direct_members": [...]}, fds): a buffered
        descriptor for each member holding chunk data, then (with `odirect`) an
        O_DIRECT one for each of those whose filesystem allows it (tmpfs may not),
        in that order.  Never-written chunk files are absent: they read as zeros.
        EIO if a failed member holds some of the file's bytes.
        """
        self.check(layout.holding(size))
        members: list[int] = []
        direct: list[int] = []
        fds: list[int] = []
        try:
            for m in layout.used_members():
                if self.members[m].failed:
                    continue  # holds nothing of this file (checked above)
                try:
                    fds.append(os.open(self.chunk_path(m, ino), os.O_RDONLY | os.O_CLOEXEC))
                except FileNotFoundError:
                    continue
                members.append(m)
            for m in members if odirect else []:
                try:
                    fds.append(os.open(self.chunk_path(m, ino),
                                       os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT))
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
                    continue  # this member's filesystem has no direct I/O
                direct.append(m)
        except OSError:
            for fd in fds:
                os.close(fd)
            raise
        return {"members": members, "direct_members": direct}, fds

    def remove_chunks(self, ino: int) -> None:
        """Delete every chunk file of `ino`; missing ones are fine (never written)."""
        for m in range(len(self.members)):
            try:
                os.unlink(self.chunk_path(m, ino))
            except FileNotFoundError:
                pass

    def truncate_chunks(self, ino: int, layout: Layout, size: int) -> None:
        """Cut every chunk file of `ino` to what a file of `size` bytes needs."""
        for m in layout.used_members():
            want = layout.chunk_length(m, size)
            path = self.chunk_path(m, ino)
            try:
                if os.stat(path).st_size > want:
                    os.truncate(path, want)
            except FileNotFoundError:
                pass

    def iter_chunks(self) -> list[tuple[int, int]]:
        """Every (member, inode) that has a chunk file, for the invariant check."""
        found = []
        for m in self.members:
            for sub in os.listdir(m.chunk_dir):
                for name in os.listdir(os.path.join(m.chunk_dir, sub)):
                    if name.isdigit():
                        found.append((m.index, int(name)))
        return found

    def check_space(self, member: int, nbytes: int) -> None:
        """Refuse a write that would eat the reserve the metadata store needs."""
        if member != self.meta_member:
            return
        st = os.statvfs(self.members[member].path)
        if st.f_bavail * st.f_frsize - nbytes < META_RESERVE:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def usage(self) -> list[dict[str, int | str]]:
        out: list[dict[str, int | str]] = []
        for m in self.members:
            if m.failed:
                out.append({"index": m.index, "path": m.path, "size": 0, "free": 0, "used": 0,
                            "failed": m.failed})
                continue
            st = os.statvfs(m.path)
            out.append({"index": m.index, "path": m.path,
                        "size": st.f_blocks * st.f_frsize,
                        "free": st.f_bavail * st.f_frsize,
                        "used": (st.f_blocks - st.f_bfree) * st.f_frsize})
        return out
