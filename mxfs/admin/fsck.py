"""`mxfs fsck`: check an unmounted pool's metadata against its chunk files, and repair.

Every finding is one line naming the inode or path and what was (or would be)
done.  Repairs keep data where they can: an inode no entry reaches is linked
into `/lost+found` (as e2fsck does; root's own 0700 folder, never one a user made
there), not dropped; only bytes nothing refers to
(chunk files without an inode, tails past a file's size) are removed.
"""

from __future__ import annotations

import itertools
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from mxfs.io import Layout
from mxfs.meta import ROOT_INO, MetaStore, check
from mxfs.meta.survey import inode_numbers, path_of, sealed_files
from mxfs.pool.pool import unlink_cut
from mxfs.text import shown
from mxfs.vol.volume import Volume
from mxfs.vol.xattrs import ACL_PREFIX

LOST_FOUND = b"lost+found"


@dataclass
class Finding:
    kind: str
    text: str
    repaired: bool = False
    fatal: bool = False  # cannot be repaired here (restore from a backup)

    def line(self) -> str:
        state = "repaired" if self.repaired else ("NOT REPAIRABLE" if self.fatal else "found")
        return f"{state}: {self.kind}: {self.text}"


def fsck(vol: Volume, repair: bool) -> list[Finding]:
    """Every inconsistency of the pool, repaired when `repair` (the pool must be locked)."""
    if repair and not vol.holds_lock:
        raise ValueError("fsck repairs only a pool it holds: Volume.open(spec, hold=...)")
    store = vol.store
    out: list[Finding] = []

    def found(kind: str, text: str, fix: Callable[[], object] | None = None,
              fatal: bool = False) -> None:
        f = Finding(kind, text, fatal=fatal)
        if repair and fix is not None:
            fix()
            f.repaired = True
        out.append(f)

    found_problems = check.problems(store)
    for p in found_problems:
        if p.kind == check.ENGINE:
            found("metadata store", p.text, fatal=True)
    if any(f.fatal for f in out):
        return out  # nothing else can be trusted; restore the metadata store
    orphans = set(store.orphans())
    adopted = {p.ino for p in found_problems if p.kind == check.UNREACHABLE}
    if adopted:  # (before anything is linked into it)
        foreign = _foreign_lost_found(store)
        if foreign is not None:
            text, aside = foreign
            found("lost+found", text, partial(_replace_lost_found, store, aside))
    for p in found_problems:
        if p.kind == check.DANGLING_ENTRY:
            found("dangling entry", f"entry {p.cookie} in {path_of(store, p.parent)} points to "
                  f"missing inode {p.ino}: removed",
                  partial(store.drop_entry, p.parent, p.name))
        elif p.kind == check.DANGLING_KV:
            found("dangling KV chunk", f"{shown(p.ns)}/{p.name!r} points to missing inode "
                  f"{p.ino}: dropped", partial(store.kv.drop_entry, p.ns, p.name))
        elif p.kind == check.UNREACHABLE:
            found("unreachable inode", f"inode {p.ino}: linked as /lost+found/{p.ino}",
                  partial(_to_lost_found, store, p.ino))
        elif p.kind == check.LINK_COUNT and p.ino not in orphans | adopted:
            # (orphans are reclaimed below; adopted inodes get the count of their new name)
            found("link count", f"{path_of(store, p.ino)} has nlink {store.get(p.ino).nlink} "
                  f"but {p.found} names: set to {p.found}",
                  partial(store.repair_nlink, p.ino, p.found))
        elif p.kind == check.DIR_LINK_COUNT:
            found("directory link count", f"{path_of(store, p.ino)} has nlink "
                  f"{store.get(p.ino).nlink}, {p.found - 2} subdirectories: set to {p.found}",
                  partial(store.repair_nlink, p.ino, p.found))
        elif p.kind == check.PARENT_NOT_DIR:  # where would it go? left for a person
            found("entry outside a directory", p.text)
    store.commit()
    orphans_left = store.orphans()
    for ino in orphans_left:
        found("orphan", f"inode {ino} has no name and no open handle: reclaimed")
        out[-1].repaired = repair
    if repair:  # (in bites, one sync each: one an orphan took an hour for a million)
        vol.queue_orphans(orphans_left)
        vol.reclaim_pending()

    def cut_to_size(ino: int) -> None:
        node = store.get(ino)
        if node.is_reg:
            # (other nodes' members: the writer cuts them when it next truncates; reads
            # stop at the size meanwhile)
            vol.pool.truncate_chunks(ino, vol.layout(node), node.size, far=False)
        store.clear_dirty_data(ino)

    for ino in store.dirty_data():
        found("unsynced size", f"{path_of(store, ino)} was being written at a crash: its "
              "chunk files were cut to the recorded size", partial(cut_to_size, ino))
    out += _chunk_findings(vol, repair)
    store.durable()
    return out


def _chunk_findings(vol: Volume, repair: bool) -> list[Finding]:
    """Chunk files against inodes: strays, tails past the size, missing sealed data."""
    store, out = vol.store, []
    inodes = inode_numbers(store)
    for member, ino in vol.pool.iter_chunks():
        path = vol.pool.chunk_path(member, ino)
        if ino not in inodes or not store.get(ino).is_reg:
            f = Finding("stray chunk file", f"{path} belongs to no file: removed")
            if repair:
                unlink_cut(path)  # (a descriptor kept past the daemon keeps nothing)
                f.repaired = True
            out.append(f)
            continue
        node = store.get(ino)
        want = vol.layout(node).chunk_length(member, node.size)
        have = os.stat(path).st_size
        if have > want:
            f = Finding("tail", f"{path_of(store, ino)}: member {member} holds {have - want} "
                        "bytes past the file's size: cut")
            if repair:
                os.truncate(path, want)
                f.repaired = True
            out.append(f)
    for s in sealed_files(store):
        f_ = s.file
        lay = Layout(f_.stripe_unit, f_.stripe_width, f_.first_member, len(vol.pool.members))
        for m in lay.used_members():
            if vol.pool.members[m].node:
                continue  # another node's: its owner holds those bytes
            want = lay.chunk_length(m, f_.size)
            try:
                have = os.stat(vol.pool.chunk_path(m, f_.ino)).st_size
            except FileNotFoundError:
                have = 0
            if have < want:
                out.append(Finding("missing data", f"{path_of(store, f_.ino)}: member {m} holds "
                                   f"{have} of its {want} bytes (lost; scrub names the files)",
                                   fatal=True))
    return out


def _is_roots_own(store: MetaStore, ino: int) -> bool:
    """A folder only root may enter: root's, mode 0700, no ACL granting anyone else."""
    node = store.get(ino)
    return node.is_dir and node.uid == 0 and stat.S_IMODE(node.mode) == 0o700 and \
        not any(n.startswith(ACL_PREFIX) for n in store.listxattr(ino))


def _foreign_lost_found(store: MetaStore) -> tuple[str, bytes] | None:
    """A `/lost+found` that is not root's own folder (the pool's root may let users make
    one, to catch what fsck links there: files from others' private folders): what it
    is, and the unique name it is moved aside to; None if there is none or it is root's."""
    lf = store.entry_ino(ROOT_INO, LOST_FOUND)
    if lf is None or _is_roots_own(store, lf):
        return None
    node = store.get(lf)
    kind = "folder" if node.is_dir else "symbolic link" if stat.S_ISLNK(node.mode) else "file"
    aside = next(name for k in itertools.count(1)
                 if store.entry_ino(ROOT_INO, name := LOST_FOUND + f".{k}".encode()) is None)
    return (f"/lost+found was uid {node.uid}'s {kind} (mode {stat.S_IMODE(node.mode):04o}), "
            f"not root's own: moved aside to /{aside.decode()}, and a root's 0700 one made",
            aside)


def _replace_lost_found(store: MetaStore, aside: bytes) -> None:
    store.rename(ROOT_INO, LOST_FOUND, ROOT_INO, aside, noreplace=True)
    store.create(ROOT_INO, LOST_FOUND, stat.S_IFDIR | 0o700, 0, 0)


def _to_lost_found(store: MetaStore, ino: int) -> None:
    lf = store.entry_ino(ROOT_INO, LOST_FOUND)
    if lf is None:
        lf = store.create(ROOT_INO, LOST_FOUND, stat.S_IFDIR | 0o700, 0, 0).ino
    if not _is_roots_own(store, lf):  # (fsck moved any other aside first)
        raise RuntimeError("/lost+found is not root's own folder")
    store.adopt(ino, lf, str(ino).encode())
