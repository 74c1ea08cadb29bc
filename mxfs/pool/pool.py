"""A pool: the set of member folders, checked against their superblocks.

`format_members` writes superblocks on empty members (mkfs); `Pool.open`
finds every member from one member path or a pool config file and refuses a
pool with a missing, foreign or duplicated member, naming which.
"""

from __future__ import annotations

import errno
import os
import shutil
import tomllib
import uuid
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


@dataclass(frozen=True)
class Member:
    index: int
    path: str

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

    @classmethod
    def open(cls, spec: str) -> Pool:
        paths, source = _member_paths(spec)
        for pos, p in enumerate(paths):
            if not os.path.isdir(p):
                raise MxfsError(f"member {pos} ({p}) is missing",
                                "attach it, or list where it lives now in a pool config file")
        _refuse_duplicates(paths, "listed")
        by_index: dict[int, tuple[str, Superblock]] = {}
        reference: Superblock | None = None
        for pos, p in enumerate(paths):
            try:
                sb = read_superblock(p)
            except FileNotFoundError:
                raise MxfsError(f"member {pos} ({p}) has no mxfs superblock",
                                "attach the right device there, or restore the member") from None
            except (OSError, SuperblockError) as e:
                raise MxfsError(f"member {pos} ({p}): {e}", "restore the member") from None
            if reference is None:
                reference = sb
            elif sb.pool_uuid != reference.pool_uuid:
                raise MxfsError(f"member {p} belongs to another pool ({sb.pool_uuid}, "
                                f"not {reference.pool_uuid})", "remove it from the member list")
            if sb.member_index in by_index:
                raise MxfsError(f"members {by_index[sb.member_index][0]} and {p} both claim "
                                f"index {sb.member_index}", "one is a copy; list the original only")
            by_index[sb.member_index] = (p, sb)
        assert reference is not None
        count = reference.member_count
        for i in range(count):
            if i not in by_index:
                hint = reference.members[i] if i < len(reference.members) else "?"
                raise MxfsError(f"member {i} (last seen at {hint}) is missing from the "
                                f"{source}", "attach it and list it")
        if len(by_index) != count:
            raise MxfsError(f"{len(by_index)} members given but the pool has {count}",
                            "list exactly the pool's members")
        members = [Member(i, by_index[i][0]) for i in range(count)]
        return cls(reference, members)

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
            st = os.statvfs(m.path)
            out.append({"index": m.index, "path": m.path,
                        "size": st.f_blocks * st.f_frsize,
                        "free": st.f_bavail * st.f_frsize,
                        "used": (st.f_blocks - st.f_bfree) * st.f_frsize})
        return out
