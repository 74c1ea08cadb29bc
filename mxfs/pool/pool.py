"""A pool: the set of member folders, checked against their superblocks.

`format_members` writes superblocks on empty members (mkfs), all or nothing; `Pool.open`
finds every member from one member path or a pool config file and refuses a
pool with a missing, foreign or duplicated member, naming which.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import math
import os
import shutil
import threading
import time
import tomllib
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from mxfs.errors import MxfsError
from mxfs.io import DEFAULT_STRIPE_UNIT, PAGE, Layout
from mxfs.pool.key import KEY_NAME
from mxfs.pool.node_config import NODE_NAME, NodeConfig, read_node_config
from mxfs.pool.remote import RemoteMembers
from mxfs.pool.superblock import (
    SUPERBLOCK_NAME,
    Superblock,
    SuperblockError,
    check_label,
    read_superblock,
    superblock_path,
    write_superblock,
)
from mxfs.proto.messages import MemberUsage, ReadFds

CHUNK_DIR = "chunks"
BACKUP_DIR = "meta-backup"
META_DIR = "meta"
FANOUT = 256
# Names a freshly made filesystem already holds; a member may contain these.
_IGNORED = {"lost+found"}
# Where mkfs --force moves an old pool aside until the new one is complete.
_WIPE_DIR = ".mxfs-wipe"
# Space kept free on the metadata member so its store can always commit (unlinks included).
META_RESERVE = 16 << 20
# Metadata growth (names, xattrs, hidden files, KV rows) stops while the metadata member
# has less than this free: the rest of the reserve commits what was already answered.
META_GROWTH_FLOOR = META_RESERVE // 2
# Free space of the metadata member, measured again this often (or after this much
# growth was let through): statvfs on every mkdir would cost more than the mkdir.
META_MEASURE_S = 0.1
META_MEASURE_BYTES = 1 << 20
META_ROW = 512  # what one more metadata row costs the store, about (names added on top)
# Inodes a member keeps for the daemon's own files (a renew's copy, a store backup):
# tenants' new chunk files stop short of them, so a pool filled with files still lets
# an owner's chmod take a reader's right away.
INODE_RESERVE = 1024


log = logging.getLogger("mxfs.pool")


ALLOCATED_SLACK = 4 << 20  # blocks a chunk file may hold past its length (file systems'
                           # own: extent trees, an XFS's preallocation not yet trimmed)


def unlink_cut(path: str) -> None:
    """Blocking: cut the chunk file `path` to nothing, then remove it (missing: fine).
    Only a removed file nobody holds open goes this way (those held are moved aside
    first, and one opened after that ask is not handed out: `pool/revoke.py`), yet an
    O_PATH descriptor, which any user can make of one she was handed
    (`/proc/self/fd/N`) and which no lease probe sees, kept the whole unlinked file's
    blocks for as long as she liked; cut, they are freed whoever holds a path to it
    (which reads nothing)."""
    try:
        os.truncate(path, 0)
        os.unlink(path)
    except FileNotFoundError:
        pass


def overallocated(st: os.stat_result, length: int) -> bool:
    """Whether a chunk file holds blocks well past `length` bytes: reserved by a
    writer's fallocate(KEEP_SIZE), which a size check never sees."""
    return st.st_blocks * 512 > length + max(ALLOCATED_SLACK, length // 16)

@dataclass
class Member:
    index: int
    path: str
    failed: str | None = None  # why it is out of service (missing at mount, I/O errors)
    chunk_dir: str = field(init=False)  # (made once: chunk paths are made per request)
    node: str = ""  # the node that owns it, where that is not this one (`Pool.remote`)

    def __post_init__(self) -> None:
        self.chunk_dir = os.path.join(self.path, CHUNK_DIR)


_OURS = {SUPERBLOCK_NAME, CHUNK_DIR, META_DIR, BACKUP_DIR, SUPERBLOCK_NAME + ".tmp", _WIPE_DIR,
         KEY_NAME}
# Stripe units beyond this are a typo (1TiB for 1MiB), not a layout: refused at mkfs.
MAX_STRIPE_UNIT = 1 << 30


def check_stripe_unit(unit: int) -> None:
    """Refuse a stripe unit that is not whole pages or is absurdly large."""
    if unit <= 0 or unit % PAGE:
        raise MxfsError(f"stripe unit {unit} is not a multiple of 4 KiB",
                        "pick one such as 1MiB or 4MiB")
    if unit > MAX_STRIPE_UNIT:
        raise MxfsError(f"stripe unit {unit} is over the {MAX_STRIPE_UNIT >> 30} GiB limit",
                        "pick one such as 1MiB or 4MiB")


def remote_member(name: str) -> tuple[str, str] | None:
    """(node, path) of a member another node holds, named NODE:PATH (at mkfs, in a
    superblock's list of members); None for a path of this host's."""
    node, sep, path = name.partition(":")
    if sep and NODE_NAME.fullmatch(node) and path.startswith("/"):
        return node, path
    return None


def _make_chunk_dirs(undo: _Undo, path: str) -> None:
    undo.mkdir(os.path.join(path, CHUNK_DIR))
    for i in range(FANOUT):
        os.mkdir(os.path.join(path, CHUNK_DIR, f"{i:02x}"), 0o700)


def format_node_members(paths: list[str], indices: list[int], model: Superblock) -> None:
    """Make `paths` the members `indices` of an existing pool (`model`: any of its
    superblocks, as the writer published it), for the node that holds them: all or
    nothing.  A folder that is that member of that pool already is kept as it is."""
    undo = _Undo()
    try:
        for path, index in zip(paths, indices, strict=True):
            if os.path.exists(superblock_path(path)):
                try:
                    sb = read_superblock(path)
                except (OSError, SuperblockError) as e:
                    raise MxfsError(f"member {path} has a damaged superblock ({e})",
                                    "give an empty folder") from None
                if (sb.pool_uuid, sb.member_index) == (model.pool_uuid, index):
                    continue
                raise MxfsError(f"member {path} belongs to pool {sb.pool_uuid} as member "
                                f"{sb.member_index}", "give an empty folder")
            _check_member(path, False)
            _make_chunk_dirs(undo, path)
            undo.made += [superblock_path(path) + ".tmp", superblock_path(path)]
            write_superblock(path, replace(model, member_index=index))
    except OSError as e:
        undo.rollback()
        raise MxfsError(f"member {e.filename or ''} cannot be made ({e.strerror})",
                        "check the folder is writable and has room") from None
    except BaseException:
        undo.rollback()
        raise
    undo.commit()


def _check_member(p: str, force: bool) -> None:
    """Refuse a member that is not empty (or, with force, only ours) or not writable."""
    entries = set(os.listdir(p)) - _IGNORED
    if entries - _OURS:
        raise MxfsError(f"member {p} is not empty ({len(entries)} entries)",
                        "give an empty folder or a freshly formatted device")
    if entries and not force:
        if SUPERBLOCK_NAME in entries:
            try:
                old = read_superblock(p).pool_uuid
            except (OSError, SuperblockError):
                old = "unreadable"
            raise MxfsError(f"member {p} already belongs to pool {old}",
                            "pass --force to wipe it and make a new pool")
        raise MxfsError(f"member {p} holds the remains of an unfinished mkfs",
                        "pass --force to wipe them")
    if not os.access(p, os.W_OK | os.X_OK):
        raise MxfsError(f"member {p} is not writable", "mount it read-write or fix its owner")
    probe = os.path.join(p, f".mxfs-probe-{uuid.uuid4().hex}")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"\0" * PAGE)
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as e:
        raise MxfsError(f"member {p} cannot be written ({e.strerror})",
                        "mount it read-write, free space, or fix its owner") from None


class _Undo:
    """What a mkfs has done so far on each member, so a failure can take it all back."""

    def __init__(self) -> None:
        self.made: list[str] = []  # files and folders created, in order
        self.asides: list[str] = []  # folders holding what --force is about to wipe

    def mkdir(self, path: str) -> None:
        os.mkdir(path, 0o700)
        self.made.append(path)

    def move_aside(self, member: str) -> None:
        """Move an old pool's entries into one folder, removed only once mkfs succeeded."""
        aside = os.path.join(member, _WIPE_DIR)
        shutil.rmtree(aside, ignore_errors=True)  # left by a crashed mkfs: already wiped
        self.mkdir(aside)
        self.asides.append(aside)
        for name in sorted(set(os.listdir(member)) & (_OURS - {_WIPE_DIR})):
            os.rename(os.path.join(member, name), os.path.join(aside, name))

    def rollback(self) -> list[str]:
        """Remove what was made and put the wiped entries back; returns what stayed."""
        restored: set[str] = set()
        for path in reversed(self.made):
            if path in self.asides:
                member = os.path.dirname(path)
                for name in os.listdir(path) if os.path.isdir(path) else []:
                    with contextlib.suppress(OSError):
                        os.rename(os.path.join(path, name), os.path.join(member, name))
                        restored.add(os.path.join(member, name))
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(path)
        return [p for p in self.made if os.path.lexists(p) and p not in restored]

    def commit(self) -> None:
        for aside in self.asides:
            shutil.rmtree(aside, ignore_errors=True)


def format_members(paths: list[str], stripe_unit: int = DEFAULT_STRIPE_UNIT,
                   label: str = "", force: bool = False,
                   then: Callable[[], None] | None = None, meta: str = "") -> Superblock:
    """Write a new pool's superblocks and chunk folders; returns member 0's superblock.

    All or nothing: every check runs before the first byte is written, and a failure
    part-way (a member gone read-only, ENOSPC, or `then` raising: the caller's last
    step, such as making the metadata store) removes what was written on every
    member and puts back what --force was about to wipe.
    """
    check_stripe_unit(stripe_unit)
    check_label(label)
    if not paths:
        raise MxfsError("no members given", "name each with --member PATH")
    resolved: list[str] = []  # every member's name in the superblocks: a path, or NODE:PATH
    local: list[tuple[int, str]] = []  # (index, path) of those this host holds
    for i, p in enumerate(paths):
        if (far := remote_member(p)) is not None:
            resolved.append(f"{far[0]}:{far[1]}")
            continue
        real = os.path.realpath(p)
        if not os.path.isdir(real):
            raise MxfsError(f"member {p} is not an existing folder",
                            "create it or mount the member device there")
        resolved.append(real)
        local.append((i, real))
    if remote_member(paths[0]) is not None:
        raise MxfsError(f"member 0 ({paths[0]}) is another node's, and member 0 is the "
                        "writer's own", "list this node's members first")
    if len(local) < len(resolved) and not meta:
        raise MxfsError("members of other nodes need the metadata on a server",
                        "add --meta postgresql://HOST/DATABASE")
    _refuse_duplicates([p for _, p in local], "given")
    for _, p in local:
        _check_member(p, force)
    pool_uuid = str(uuid.uuid4())
    created = datetime.now(UTC).isoformat(timespec="seconds")
    undo = _Undo()
    try:
        for _, p in local:
            if force and set(os.listdir(p)) & _OURS:
                undo.move_aside(p)
            _make_chunk_dirs(undo, p)
        undo.mkdir(os.path.join(resolved[0], META_DIR))
        sbs = [Superblock(pool_uuid=pool_uuid, member_index=i, member_count=len(resolved),
                          stripe_unit=stripe_unit, label=label, members=resolved,
                          meta_member=0, created=created, meta=meta)
               for i, _ in local]
        for (_, p), sb in zip(local, sbs, strict=True):
            undo.made += [superblock_path(p) + ".tmp", superblock_path(p)]
            write_superblock(p, sb)
        if then is not None:
            then()
    except OSError as e:
        left = undo.rollback()
        where = f" ({e.filename})" if e.filename else ""
        if left:
            raise MxfsError(f"mkfs failed part-way: {e.strerror}{where}, and {len(left)} "
                            f"entries it made could not be removed (first: {left[0]})",
                            "remove them by hand, fix the member, and run mkfs again"
                            ) from None
        raise MxfsError(f"mkfs failed part-way: {e.strerror}{where}; every member was left "
                        "as it was", "fix the member (read-only? full?) and run mkfs again"
                        ) from None
    except BaseException:
        undo.rollback()
        raise
    undo.commit()
    return sbs[0]


def _refuse_duplicates(paths: list[str], how: str) -> None:
    """Refuse one folder named twice, however it is spelled (same device and inode)."""
    seen: dict[tuple[int, int], str] = {}
    for p in paths:
        st = os.stat(p)
        first = seen.setdefault((st.st_dev, st.st_ino), p)
        if first is not p:
            raise MxfsError(f"member {p} is {how} twice (same folder as {first})",
                            "list each member once")


def read_pool_config(path: str) -> dict[str, Any]:
    """A pool config file: members = [...], and optionally mountpoint and options."""
    try:
        with open(path, "rb") as f:
            conf = tomllib.load(f)
    except UnicodeDecodeError:  # (a data file named where a pool goes)
        raise MxfsError(f"{path} is a file, neither a pool member folder nor a pool "
                        "config (TOML)", "name the pool's member 0 folder, its mount "
                        "point or its config file (check the order of the arguments)"
                        ) from None
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
        return [m if remote_member(m) else os.path.realpath(m) for m in members], "config"
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


def _tighten(chunk_dir: str) -> None:
    """Make a chunk folder 0700 (pools made before mkfs did): only the daemon opens chunk
    paths, clients get descriptors, and no search permission here hides all below."""
    try:
        if not os.stat(chunk_dir).st_mode & 0o077:
            return
        os.chmod(chunk_dir, 0o700)
    except OSError as e:  # a read-only member still serves reads; not root: not ours to do
        log.warning("cannot make %s private: %s", chunk_dir, e.strerror)


class Pool:
    """An opened, verified pool: its members in index order and its stripe defaults."""

    def __init__(self, sb: Superblock, members: list[Member]) -> None:
        self.uuid = sb.pool_uuid
        self.label = sb.label
        self.stripe_unit = sb.stripe_unit
        self.members = members
        self.meta_member = sb.meta_member
        self.meta_url = sb.meta  # a metadata server's URL, or "" (the embedded store)
        self.superblock = sb  # (what a node making its members writes, member_index aside)
        # A reading node's pool (`open_node`): its name, where its lock lives, and the
        # owner's chunk service that serves every member (`pool/remote.py`).
        self.node = ""
        self.state_dir = ""
        self.key_file = ""
        self.config = ""  # a reading node's config, the pool was opened from
        self.remote: RemoteMembers | None = None
        # Every other node that holds members, by name (the writer's is `remote`), and
        # a reading node's own member folders (`NodeConfig.members`).
        self.remotes: dict[str, RemoteMembers] = {}
        self.own_paths: list[str] = []
        # The epoch of the writer's lease, which its changes on other nodes' members
        # carry (`RemoteMembers.change`: the owner refuses any other).
        self.epoch: Callable[[], int] = lambda: 0
        # Told of each member's share of chunk I/O: (member, "read" | "write", bytes).
        self.on_io: Callable[[int, str, int], None] | None = None
        # check_meta_room's last measure: (when, free bytes then, growth let through since)
        self._meta_room = (-math.inf, 0, 0)
        # Chunk files a writer holds that could not be moved aside (a full member), and
        # their members: held where they are (`revoke.Held`), cut, and never removed
        # under the writer.
        self.held_in_place: dict[str, int] = {}
        # Chunk files (member, inode) being opened with O_CREAT: their removal waits (an
        # open held by a member that stopped answering made its file after the inode's
        # reclaim removed it, a chunk file of no inode).
        self._creating: Counter[tuple[int, int]] = Counter()
        self._created = threading.Condition()
        # `inodes_low`'s last measure a member: (when, free inodes then, creates since)
        self._inodes: dict[int, tuple[float, int, int]] = {}
        # Growth let through since the store last committed: the open group's pages may
        # sit in SQLite's memory, unseen by statvfs until its commit writes them.
        self._meta_uncommitted = 0
        # Bytes of writes admitted to the metadata member's chunk files and not written
        # yet (landed behind their answers): counted against its reserve.
        self._meta_landing = 0
        self._landing = threading.Lock()

    @classmethod
    def open(cls, spec: str, degraded: bool = False) -> Pool:
        """Open and check every member; with `degraded`, members that are missing or
        unreadable are marked failed (their files' stripes are lost) instead of refused.
        A reading node's config (`mxfs node add`) opens a pool of no local member:
        `Volume.open` then names its members from the store (`own_remote`)."""
        if os.path.isfile(spec) and (node := read_node_config(spec)) is not None:
            return cls.open_node(node)
        paths, source = _member_paths(spec)
        lost: dict[int, str] = {}
        far = {i: f for i, p in enumerate(paths) if (f := remote_member(p)) is not None}
        _refuse_duplicates([p for p in paths if os.path.isdir(p)], "listed")
        by_index: dict[int, tuple[str, Superblock]] = {}
        reference: Superblock | None = None
        for pos, p in enumerate(paths):
            if pos in far:
                continue  # another node's: it holds and serves it
            why = None if os.path.isdir(p) else "is missing"
            try:
                sb = read_superblock(p) if why is None else None
            except FileNotFoundError:
                why = "has no mxfs superblock"
            except (OSError, SuperblockError) as e:
                why = f"is unreadable ({e})"
            if why is not None:
                if not degraded:
                    raise MxfsError(f"member {pos} ({p}) {why}",
                                    "attach it (or list where it lives now in a pool config), "
                                    "or mount with -o degraded to serve, read-only, the files "
                                    "that have no stripes on it") from None
                lost[pos] = f"{why.removeprefix('is ')} at mount"
                continue
            assert sb is not None  # read, as nothing was wrong
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
            elif (theirs := remote_member(hint)) is not None:  # (as mkfs named it; never
                # a path here, though the folder may be on this host in a test)
                members.append(Member(i, f"{theirs[0]}:{theirs[1]}", node=theirs[0]))
            elif degraded and (i in lost or source == "superblock"):
                members.append(Member(i, hint, lost.get(i, "missing at mount")))
            else:
                raise MxfsError(f"member {i} (last seen at {hint}) is missing from the "
                                f"{source}", "attach it and list it")
        if len(by_index) + sum(1 for m in members if m.failed or m.node) != count:
            raise MxfsError(f"{len(by_index)} members given but the pool has {count}",
                            "list exactly the pool's members")
        if members[reference.meta_member].failed:
            raise MxfsError(f"the metadata member {reference.meta_member} "
                            f"({members[reference.meta_member].path}) is "
                            f"{members[reference.meta_member].failed}",
                            "attach it; if it is gone for good, restore its store on a new "
                            "pool from a dump (mxfs meta restore)")
        for m in members:
            if not m.failed and not m.node:
                _tighten(m.chunk_dir)
        return cls(reference, members)

    @classmethod
    def open_node(cls, conf: NodeConfig) -> Pool:
        """A reading node's pool: the metadata server and the key from its config, the
        members not yet known (`own_remote`)."""
        sb = Superblock(pool_uuid=conf.pool, member_index=0, member_count=0,
                        stripe_unit=DEFAULT_STRIPE_UNIT, label=conf.label, meta=conf.meta)
        pool = cls(sb, [])
        pool.node, pool.state_dir, pool.key_file = conf.node, conf.state, conf.key
        pool.config = conf.path  # (tools find the pool of this node's mount by it)
        pool.own_paths = list(conf.members)
        return pool

    def name_members(self, owners: list[str], stripe_unit: int, writer: str) -> None:
        """A reading node's members, named from the store: each owned by the node
        `owners` names ("": the writer node, `writer`), this node's own at the folders
        of its config in index order (each checked to be that member of this pool)."""
        mine = iter(self.own_paths)
        members = []
        for i, owner in enumerate(owners):
            if owner != self.node:
                node = owner or writer
                members.append(Member(i, f"{node}:member{i}", node=node))
                continue
            path = next(mine, None)
            if path is None:
                raise MxfsError(f"member {i} is node {self.node}'s, and its config names no "
                                "folder for it", "join again: mxfs node add --member PATH")
            members.append(Member(i, path, self._own_failure(path, i)))
        self.members, self.stripe_unit = members, stripe_unit
        for m in members:
            if not m.node and not m.failed:
                _tighten(m.chunk_dir)

    def _own_failure(self, path: str, index: int) -> str | None:
        """Why this node's member folder cannot serve as member `index`, or None."""
        try:
            sb = read_superblock(path)
        except FileNotFoundError:
            return "has no mxfs superblock (missing at mount)"
        except (OSError, SuperblockError) as e:
            return f"is unreadable ({e})"
        if (sb.pool_uuid, sb.member_index) != (self.uuid, index):
            return f"is member {sb.member_index} of pool {sb.pool_uuid}"
        return None

    def remote_of(self, member: int) -> RemoteMembers:
        """The chunk service of the node holding `member` (another node's): EIO if this
        node reaches none."""
        node = self.members[member].node
        remote = self.remotes.get(node)
        if remote is None:
            raise OSError(errno.EIO, f"member {member} is node {node}'s, and this node "
                          "reaches no chunk service of it")
        return remote

    def far(self, members: Sequence[int] | set[int]) -> list[int]:
        """Which of `members` other nodes hold."""
        return [m for m in members if self.members[m].node]

    def owners(self, members: Sequence[int] | set[int]) -> tuple[str, ...]:
        """The other nodes that hold any of `members`, sorted."""
        return tuple(sorted({self.members[m].node for m in members if self.members[m].node}))

    def require_members(self, what: str) -> None:
        """Refuse `what` (a tool that works on the members themselves) on a reading
        node, which holds none."""
        if self.node:
            raise MxfsError(f"{what} works on the pool's members, and node {self.node} "
                            "holds none", "run it on the writer node (mxfs status shows it)")

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
        """After an error touching `member`: is the member itself gone or failing?  The
        daemon's own shortage (of descriptors, of memory) says nothing of the member:
        a user who ran the daemon out of descriptors failed a member, and the pool."""
        if err.errno in _SHORTAGE or isinstance(err, NotAnswering):
            return
        if err.errno in (errno.EIO, errno.ENODEV, errno.ENXIO, errno.ESTALE, errno.ENOTCONN):
            self.fail(member, f"I/O error ({err.strerror})")
            return
        try:
            read_superblock(self.members[member].path)
        except OSError as e:
            if e.errno not in _SHORTAGE:
                self.fail(member, f"its superblock is gone ({e}): unmounted or removed")
        except SuperblockError as e:
            self.fail(member, f"its superblock is gone ({e}): unmounted or removed")

    @property
    def meta_dir(self) -> str:
        """The metadata member's `meta/` (a reading node's own state folder): the pool
        lock, and the embedded store."""
        if self.node:
            return self.state_dir
        return os.path.join(self.members[self.meta_member].path, META_DIR)

    @property
    def meta_location(self) -> str:
        """Where the metadata store lives: a server's URL, or the metadata member's
        `meta/` folder (which holds the pool lock either way)."""
        return self.meta_url or self.meta_dir

    @property
    def backup_dir(self) -> str:
        """Where metadata backups go: the member after the metadata member."""
        own = [m for m in self.members if not m.node]
        m = next((m for m in own if m.index > self.meta_member), own[0])
        return os.path.join(m.path, BACKUP_DIR)

    def backup_dirs(self) -> list[str]:
        """Every member's backup folder (recovery looks in all of them)."""
        return [os.path.join(m.path, BACKUP_DIR) for m in self.members if not m.node]

    def layout_for(self, ino: int, unit: int | None = None, width: int | None = None,
                   node: str = "") -> Layout:
        """The layout a new file gets: defaults filled in, first member spread by inode.
        In a pool whose members other nodes hold too, a file stripes over this node's
        own members (`node`'s, for a file that node writes) unless its width asks for
        more (`mxfs setstripe --across-nodes`: every member): checkpoint shards and KV
        chunks are written where they are made, a model every node loads is spread
        over every node."""
        n = len(self.members)
        own = self.held_by(node)
        if node and width is not None and width > len(own):
            width = None  # (a node's file: on its own members, whatever the folder says)
        if own and len(own) < n and (width or 0) <= len(own):
            width = width or len(own)
            # Firsts whose `width` members (in order, around the pool) are all our own.
            mine = set(own)
            firsts = [f for f in own if all((f + k) % n in mine for k in range(width))]
            if not firsts:  # (our members not in one run: as many as one run holds)
                return self.layout_for(ino, unit, width - 1, node)
            return Layout(unit or self.stripe_unit, width, firsts[ino % len(firsts)], n)
        width = min(width or n, n)
        return Layout(unit or self.stripe_unit, width, ino % n, n)

    def held_by(self, node: str) -> list[int]:
        """The members `node` holds ("": this node's own)."""
        return [m.index for m in self.members if m.node == node]

    def chunk_path(self, member: int, ino: int) -> str:
        return f"{self.members[member].chunk_dir}/{ino % FANOUT:02x}/{ino}"

    def open_for_read(self, ino: int, layout: Layout, size: int, odirect: bool = False,
                      guard: Guard | None = None) -> tuple[ReadFds, list[int]]:
        """Read-only descriptors of a file's chunk files, for a direct reader.

        Returns ({"members": [...], "direct_members": [...]}, fds): a buffered
        descriptor for each member holding chunk data, then (with `odirect`) an
        O_DIRECT one for each of those whose filesystem allows it (tmpfs may not),
        in that order.  Never-written chunk files are absent: they read as zeros.
        EIO if a failed member holds some of the file's bytes, or (each open made
        through `guard`) one that does not answer.
        """
        def opened(m: int, flags: int) -> int:
            return self.open_chunk(m, ino, flags, guard)

        held = layout.holding(size)
        self.check(held)
        if far := [m for m in held if self.members[m].node]:
            raise OSError(errno.EREMOTE, f"member {far[0]} is node "
                          f"{self.members[far[0]].node}'s: read through the mount")
        members: list[int] = []
        direct: list[int] = []
        fds: list[int] = []
        try:
            for m in layout.used_members():
                if m not in held:
                    continue  # nothing of this file's bytes there (a lookup saved)
                try:
                    fds.append(opened(m, os.O_RDONLY | os.O_CLOEXEC))
                except FileNotFoundError:
                    continue
                members.append(m)
            for m in members if odirect else []:
                try:
                    fds.append(opened(m, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT))
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

    @contextlib.contextmanager
    def creating(self, member: int, ino: int) -> Iterator[None]:
        """(Blocking callers.)  While a chunk file of `ino` may be made on `member`:
        `remove_chunks` of it waits for the open to return."""
        with self._created:
            self._creating[(member, ino)] += 1
        try:
            yield
        finally:
            with self._created:
                self._creating[(member, ino)] -= 1
                if not self._creating[(member, ino)]:
                    del self._creating[(member, ino)]
                self._created.notify_all()

    def inodes_low(self, member: int) -> bool:
        """(Blocking callers.)  Whether `member` is down to its last INODE_RESERVE free
        inodes: measured again after a tenth of a second, or at once near the reserve
        (creates since the last measure counted off it)."""
        at, free, since = self._inodes.get(member, (-math.inf, 0, 0))
        now = time.monotonic()
        if now - at > META_MEASURE_S or free - since < 2 * INODE_RESERVE:
            st = os.statvfs(self.members[member].path)
            # (a file system with no fixed count says 0 inodes: none to run out of)
            at, free, since = now, st.f_favail if st.f_files else 1 << 62, 0
        self._inodes[member] = (at, free, since + 1)
        return free - since < INODE_RESERVE

    def create_flags(self, member: int, path: str, flags: int) -> int:
        """`flags` for opening chunk file `path` on `member`, without O_CREAT where the
        member is down to its reserve of inodes (`inodes_low`): an existing file still
        opens, a new one is ENOSPC."""
        if not flags & os.O_CREAT or not self.inodes_low(member) or os.path.exists(path):
            return flags
        raise OSError(errno.ENOSPC, f"member {member} ({self.members[member].path}) is "
                      f"down to its last {INODE_RESERVE} free inodes, kept for the daemon's "
                      "own files: remove files, or give the member more inodes")

    def open_chunk(self, member: int, ino: int, flags: int, guard: Guard | None = None
                   ) -> int:
        """A descriptor of a chunk file (made 0600 with O_CREAT), opened through
        `guard` if given: EIO if the member does not answer."""
        path = self.chunk_path(member, ino)
        if flags & os.O_CREAT:
            with self.creating(member, ino):
                return self._open_chunk(member, path, flags, guard)
        return self._open_chunk(member, path, flags, guard)

    def _open_chunk(self, member: int, path: str, flags: int, guard: Guard | None) -> int:
        def opened() -> int:  # (the inode count asked in the guard too: a member call)
            return os.open(path, self.create_flags(member, path, flags), 0o600)
        if guard is None:
            return opened()
        fd = guard(member, opened)
        if fd is None:
            raise NotAnswering(errno.EIO, f"member {member} ({self.members[member].path}) "
                               "is not answering: its files cannot be opened now")
        return fd

    def renew_far(self, ino: int, members: Sequence[int], owner: int, room: int | None
                  ) -> None:
        """Blocking: RENW to the owners of those of `members` other nodes hold: each
        makes its chunk file of `ino` anew where its readers hold it (`Held.renew`, as
        `owner`'s, within `room`).  An owner that cannot be asked raises (EIO naming it): a change
        that takes a right away is not made while a node's readers might keep it."""
        for m in self.far(members):
            self.remote_of(m).change(b"RENW", self.epoch(), ino, m, owner, room=room)

    def remove_chunks(self, ino: int, far: Sequence[int] = (), owner: int = 0) -> None:
        """Delete every chunk file of `ino`; missing ones are fine (never written).
        Those a reader or writer still holds open were moved aside first by the volume
        (`Volume._remove_chunk_files`: cut after a grace, their space ends); the rest
        are cut as they go (`unlink_cut`).  `far`:
        other nodes' members its layout uses, removed through their owners (blocking;
        an owner that cannot be reached keeps them, logged: its fsck finds them), who
        keep those their readers hold as `owner`'s (the file's tenant: REMV)."""
        for m in self.local_members():
            with self._created:  # (a create of it under way ends first: see `creating`)
                self._created.wait_for(lambda: (m, ino) not in self._creating)  # noqa: B023
            path = self.chunk_path(m, ino)
            if path not in self.held_in_place:  # (removed by the held files' sweep)
                unlink_cut(path)
        for m in far:
            try:
                self.remote_of(m).change(b"REMV", self.epoch(), ino, m, owner)
            except OSError as e:
                log.warning("the chunk file of inode %d on member %d (node %s) is left "
                            "there: %s", ino, m, self.members[m].node, e)

    def cut_chunks(self, ino: int) -> None:
        """Cut every chunk file of a never-published `ino` to nothing, so that the
        writer still holding its descriptors (whose file was refused or dropped)
        cannot keep the space; nobody else ever held them."""
        for m in self.local_members():
            try:
                self.cut(m, self.chunk_path(m, ino), 0)
            except FileNotFoundError:
                pass

    def cut(self, member: int, path: str, length: int) -> None:
        """Blocking: cut `path`, a chunk file on `member`, to `length`; on the metadata
        member the cut is committed at once (fsync): ext4 gives freed blocks back only
        when its journal commits, up to 5 s later, and a full metadata member refused
        names meanwhile though the space had been taken back."""
        os.truncate(path, length)
        self.cut_settled(member, path, length)

    def cut_settled(self, member: int, path: str, length: int) -> None:
        """Blocking: a cut of `path` to `length` made to count at once (`cut`), also
        where the file was frozen (immutable) right after it: its blocks reserved since
        stay until the next cut then."""
        if member == self.meta_member and not self.meta_url:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                if os.fstat(fd).st_blocks * 512 > length + (1 << 20):
                    with contextlib.suppress(PermissionError):  # (frozen)
                        os.truncate(path, length)  # (blocks kept past the end: again)
                os.fsync(fd)
            finally:
                os.close(fd)

    def truncate_chunks(self, ino: int, layout: Layout, size: int, far: bool = True,
                        exact: bool = False) -> None:
        """Cut every chunk file of `ino` to what a file of `size` bytes needs; other
        nodes' members through their owners (blocking), unless `far` is False: the
        caller then does `truncate_far` from a worker thread.  `exact` (a commit, its
        writers gone): any block past a chunk file's end is freed, not only those past
        ALLOCATED_SLACK: within it a writer's fallocate(KEEP_SIZE) of 4 MiB a member
        outlived the commit, charged to nobody (an empty file held 16 MiB for good)."""
        for m in layout.used_members():
            if self.members[m].node:
                if self.node:
                    raise OSError(errno.EROFS, f"member {m} is node {self.members[m].node}'s")
                continue  # (below)
            want = layout.chunk_length(m, size)
            path = self.chunk_path(m, ino)
            try:
                st = os.stat(path)
                if st.st_size > want or (st.st_blocks * 512 > -(-want // 4096) * 4096
                                         if exact else overallocated(st, want)):
                    # (frees blocks kept past its end too; never grown: a truncate that
                    # grows a file keeps them, and its holes read zeros anyway)
                    os.truncate(path, min(st.st_size, want))
            except FileNotFoundError:
                pass
        if far:
            self.truncate_far(ino, layout, size)

    def iter_chunks(self, members: Sequence[int] | None = None) -> list[tuple[int, int]]:
        """Every (member, inode) that has a chunk file (on `members`, else on every
        member this node holds), for the invariant check."""
        found = []
        for m in self.members if members is None else [self.members[i] for i in members]:
            if m.node:
                continue
            for sub in os.listdir(m.chunk_dir):
                for name in os.listdir(os.path.join(m.chunk_dir, sub)):
                    if name.isascii() and name.isdecimal():
                        found.append((m.index, int(name)))
        return found

    def local_members(self) -> list[int]:
        """The members this node holds itself (every one, but on a reading node)."""
        return [m.index for m in self.members if not m.node]

    def truncate_far(self, ino: int, layout: Layout, size: int, back: bool = False) -> None:
        """(Blocking.)  The other nodes' part of `truncate_chunks` (`back`: bytes a node
        never told cut back, not where a caller there holds the file open for writing:
        CUT_BACK)."""
        for m in self.far(layout.used_members()):
            self.remote_of(m).change(b"TRUN", self.epoch(), ino, m, layout.chunk_length(m, size),
                                     back=back)

    def check_space(self, member: int, nbytes: int, hold: bool = False) -> int:
        """Refuse a write that would eat the reserve the metadata store needs (another
        node's member: its owner refuses what it has no room for), counting the writes
        admitted before it and not yet landed; with `hold`, count this one too until
        `landed` (how many bytes it holds): writes answered before they land passed
        the same measure, hundreds at once, and ate the reserve."""
        if self.members[member].node:
            if self.node:
                raise OSError(errno.EROFS, f"member {member} is node "
                              f"{self.members[member].node}'s")
            return 0
        if not self.holds_store(member):
            return 0
        st = os.statvfs(self.members[member].path)
        with self._landing:
            if st.f_bavail * st.f_frsize - nbytes - self._meta_landing < META_RESERVE:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            if hold:
                self._meta_landing += nbytes
        return nbytes if hold else 0

    def holds_store(self, member: int) -> bool:
        """Whether `member` holds the pool's metadata store (its reserve kept: a store on
        a server is not there, and a statvfs of the member, on the daemon's thread for
        each write, waited on it when it stopped answering)."""
        return member == self.meta_member and not self.meta_url and \
            not self.members[member].node

    def landed(self, nbytes: int) -> None:
        """(Any thread.)  Bytes `check_space` held are written (or will never be)."""
        if nbytes:
            with self._landing:
                self._meta_landing -= nbytes

    def check_meta_room(self, nbytes: int) -> None:
        """ENOSPC for metadata growth of about `nbytes` (a name, an xattr, a KV row) while
        the metadata member is below META_GROWTH_FLOOR: a tenant's xattrs or names must
        not fill the store's disk and lose what others were already answered for.  A
        store on a server is its operator's to size."""
        if self.meta_url:
            return
        at, free, since = self._meta_room
        now = time.monotonic()
        if now - at > META_MEASURE_S or since > META_MEASURE_BYTES or \
                free - max(since, self._meta_uncommitted) - nbytes < META_GROWTH_FLOOR:
            # (measured afresh before a refusal: space freed since the last measure,
            # a cut or an unlink, must not be refused for the next tenth of a second)
            st = os.statvfs(self.members[self.meta_member].path)
            at, free, since = now, st.f_bavail * st.f_frsize, 0
        if free - max(since, self._meta_uncommitted) - nbytes < META_GROWTH_FLOOR:
            self._meta_room = (at, free, since)
            raise OSError(errno.ENOSPC, "the metadata member is nearly full: names, xattrs "
                          "and KV chunks are refused until space is freed on member "
                          f"{self.meta_member} ({self.members[self.meta_member].path})")
        self._meta_room = (at, free, since + nbytes)
        self._meta_uncommitted += nbytes

    def meta_committed(self) -> None:
        """The store committed everything: its growth is on disk, for statvfs to see."""
        if self._meta_uncommitted:
            self._meta_uncommitted = 0
            self._meta_room = (-math.inf, 0, 0)  # measured afresh at the next check

    def usage(self, call: MemberCall | None = None) -> list[MemberUsage]:
        """Space of each member's filesystem; "dev" tells members that share one.  Each
        member is asked through `call` if given (it answers None for a member that is
        not answering: that one shows as failed)."""
        out: list[MemberUsage] = []
        for m in self.members:
            if m.node:
                out.append({"index": m.index, "path": m.path, "size": 0, "free": 0, "used": 0,
                            "node": m.node})
                continue
            if m.failed:
                out.append({"index": m.index, "path": m.path, "size": 0, "free": 0, "used": 0,
                            "failed": m.failed})
                continue
            asked = call(m.index, functools.partial(member_space, m.path)) if call is not None \
                else member_space(m.path)
            if asked is None:
                out.append({"index": m.index, "path": m.path, "size": 0, "free": 0, "used": 0,
                            "failed": "not answering"})
                continue
            st, dev = asked
            out.append({"index": m.index, "path": m.path,
                        "dev": dev,  # members sharing a filesystem
                        "size": st.f_blocks * st.f_frsize,
                        "free": st.f_bavail * st.f_frsize,
                        "used": (st.f_blocks - st.f_bfree) * st.f_frsize})
        return out


def member_space(path: str) -> tuple[os.statvfs_result, int]:
    """A member's filesystem: its space, and its device (members may share one)."""
    return os.statvfs(path), os.stat(path).st_dev


_SHORTAGE = (errno.EMFILE, errno.ENFILE, errno.ENOMEM)  # the daemon's, not a member's


class NotAnswering(OSError):
    """A member left out of a call for now (`fs/member_calls.py`): slow or hung, not
    failed (`probe` leaves it in service)."""
Guard = Callable[[int, Callable[[], int]], int | None]  # a member call: `fs/member_calls`
MemberCall = Callable[[int, Callable[[], tuple[os.statvfs_result, int]]],
                      tuple[os.statvfs_result, int] | None]


def pool_totals(members: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """Size, used and free of the pool, counting each filesystem once: folder members
    on one disk (as in the demo) share its space and must not add it up N times."""
    seen: dict[object, Mapping[str, Any]] = {}
    for m in members:
        if m.get("failed"):
            continue
        dev = m.get("dev")
        if m.get("node"):  # another node's (as it published it): its devices are its own
            dev = (m["node"], dev if dev is not None else m["path"])
        elif dev is None:  # a daemon from before "dev": ask here
            try:
                dev = os.stat(m["path"]).st_dev
            except OSError:
                dev = ("path", m["path"])
        seen.setdefault(dev, m)
    fs = list(seen.values())
    return {"size": sum(m["size"] for m in fs), "used": sum(m["used"] for m in fs),
            "free": sum(m["free"] for m in fs), "filesystems": len(fs)}
