"""Checkpoints in a folder: what is complete, which is latest, what retention removes.

A checkpoint is a folder holding a manifest (`mxfs-checkpoint.json`) and its
data files.  A save builds it as a hidden `.NAME.partial` folder and renames
it into place only after every file and the manifest are durable, so a folder
named like a checkpoint is always complete.  `latest` is a small file naming
the newest checkpoint, replaced atomically after the rename.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import time
from dataclasses import dataclass
from typing import Any

from mxfs.client.writer import create_file, sync_dir
from mxfs.errors import MxfsError
from mxfs.proc import running

MANIFEST = "mxfs-checkpoint.json"
FORMAT = "mxfs-checkpoint"
VERSION = 1
LATEST = "latest"
PARTIAL_SUFFIX = ".partial"


class CheckpointError(MxfsError):
    """A checkpoint that cannot be saved, found or trusted."""


def partial_path(path: str) -> str:
    head, name = os.path.split(os.path.abspath(path))
    return os.path.join(head, f".{name}{PARTIAL_SUFFIX}")


def write_small(path: str, data: bytes, replace: bool = True) -> None:
    """Write a small file durably and atomically (direct commit on mxfs, rename elsewhere)."""
    with create_file(path, len(data)) as w:
        w.write_at(0, memoryview(bytearray(data)))
        w.commit(len(data), replace=replace)


def read_manifest(path: str) -> dict[str, Any]:
    """The manifest of the checkpoint at `path`, checked for format and version."""
    mpath = os.path.join(path, MANIFEST)
    try:
        with open(mpath, "rb") as f:
            manifest = json.loads(f.read())
    except NotADirectoryError:
        raise CheckpointError(f"{path} is a file, not a checkpoint",
                              "give the folder of a checkpoint that mxfs.ckpt.save wrote "
                              "(mxfs ckpt ls FOLDER lists them)") from None
    except FileNotFoundError:
        if os.path.isdir(path):
            raise CheckpointError(f"{path} is not an mxfs checkpoint (it has no {MANIFEST})",
                                  "give the folder of a checkpoint that mxfs.ckpt.save wrote"
                                  ) from None
        raise CheckpointError(f"checkpoint {path} does not exist",
                              "list checkpoints with: mxfs ckpt ls FOLDER") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{mpath} is not valid JSON ({e})",
                              "the checkpoint is damaged; load an older one") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{mpath} is not an mxfs checkpoint manifest",
                              "give the folder of a checkpoint that mxfs.ckpt.save wrote")
    if manifest.get("version") != VERSION:
        raise CheckpointError(f"{mpath} has format version {manifest.get('version')}, "
                              f"this mxfs reads {VERSION}", "load it with a matching mxfs")
    return manifest


@dataclass(frozen=True)
class Entry:
    name: str
    path: str
    created_ns: int
    nbytes: int
    tensors: int
    compress: str | None
    latest: bool

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "path": self.path, "created_ns": self.created_ns,
                "bytes": self.nbytes, "tensors": self.tensors, "compress": self.compress,
                "latest": self.latest}


def latest_name(root: str) -> str | None:
    try:
        with open(os.path.join(root, LATEST)) as f:
            return f.read().strip() or None
    except FileNotFoundError:
        return None


def set_latest(root: str, name: str | None) -> None:
    """Point `latest` at `name` (atomically), or remove it when None."""
    if name is None:
        try:
            os.unlink(os.path.join(root, LATEST))
        except FileNotFoundError:
            pass
        return
    write_small(os.path.join(root, LATEST), (name + "\n").encode())


def list_checkpoints(root: str) -> list[Entry]:
    """Complete checkpoints in `root`, oldest first (partial saves are never listed)."""
    latest = latest_name(root)
    out = []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if name.startswith(".") or not os.path.isfile(os.path.join(path, MANIFEST)):
            continue
        try:
            m = read_manifest(path)
        except CheckpointError:
            continue
        files = m.get("files", {})
        out.append(Entry(name, path, int(m.get("created_ns", 0)),
                         sum(int(f["size"]) for f in files.values()),
                         sum(len(f["tensors"]) for f in files.values()),
                         m.get("compress"), name == latest))
    out.sort(key=lambda e: (e.created_ns, e.name))
    return out


OWNER = ".owner"


def claim_partial(path: str) -> str:
    """Make the hidden folder a save builds in, clearing one a dead save left behind."""
    partial = partial_path(path)
    if os.path.isdir(partial):
        if not is_stale(partial):
            raise CheckpointError(f"another process is saving {path} right now",
                                  "save under another name, or wait for it (if none is: "
                                  f"its machine or container is gone, rm -r {partial})")
        shutil.rmtree(partial)
    try:
        os.makedirs(partial)
    except OSError as e:
        if e.errno != errno.EROFS:
            raise
        raise CheckpointError(f"{path}: the checkpoint's folder cannot be made here: "
                              "the mount is read-only",
                              "mount the pool read-write (a pool with a failed member "
                              "mounts read-only: mxfs status names it)") from None
    try:
        _write_owner(partial)
    except BaseException:  # (a folder without its owner would hold the name an hour)
        with contextlib.suppress(OSError):
            os.rmdir(partial)
        raise
    return partial


def new_manifest(files: dict[str, Any], **fields: Any) -> dict[str, Any]:
    """A manifest: format, version, creation time, data files (size, checksums, tensors)."""
    return {"format": FORMAT, "version": VERSION, "created_ns": time.time_ns(), **fields,
            "files": files}


def publish(partial: str, path: str, manifest: dict[str, Any]) -> None:
    """Finish a save: manifest, then rename the hidden folder into place, then `latest`.

    Each step is durable before the next, so a crash leaves either the previous
    state or the complete checkpoint, and `latest` never names a missing one.
    """
    write_small(os.path.join(partial, MANIFEST),
                json.dumps(manifest, separators=(",", ":")).encode())
    sync_dir(partial)
    root = os.path.dirname(path)
    os.rename(partial, path)
    sync_dir(root)
    # Only now: until the rename the owner says whose the folder is (a crash leaving it
    # in the checkpoint is harmless: nothing reads it there).
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(path, OWNER))
    set_latest(root, os.path.basename(path))


# A save of another machine or container is judged by its folder's age, not its pid:
# nothing of it changed for this long (a save writes all the while) and it is left over.
FOREIGN_STALE_S = 3600.0


def _owner_id() -> str:
    """Where a pid means this process's pid: this boot of this machine, this pid
    namespace (a container has its own; another node has another boot)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return "?"


def _write_owner(folder: str) -> None:
    data = json.dumps({"pid": os.getpid(), "where": _owner_id()}).encode()
    try:
        with open(os.path.join(folder, OWNER), "wb") as f:
            f.write(data)
    except OSError as e:  # a pool's reading node writes no bytes through its mount:
        if e.errno != errno.EROFS:  # through the direct path, as its other files
            raise
        write_small(os.path.join(folder, OWNER), data)


def is_stale(partial: str) -> bool:
    """Was this partial save (or removal) left by a process that is gone?

    Its pid answers only where it was written in this machine's boot and this pid
    namespace: a save of another node or container (one pool mounted into several)
    is left over only once nothing in its folder changed for FOREIGN_STALE_S; until
    then its pid, meaningless here, must not get it removed mid-write."""
    try:
        with open(os.path.join(partial, OWNER)) as f:
            owner = json.load(f)
        pid, where = int(owner["pid"]), str(owner.get("where", ""))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return _idle_for(partial) >= FOREIGN_STALE_S  # unreadable: maybe being written
    if where != _owner_id():
        return _idle_for(partial) >= FOREIGN_STALE_S
    return pid != os.getpid() and not running(pid)


def _idle_for(folder: str) -> float:
    """Seconds since anything in `folder` (or the folder) last changed."""
    try:
        newest = max([os.stat(folder).st_mtime] +
                     [e.stat().st_mtime for e in os.scandir(folder)])
    except OSError:
        return 0.0  # going or gone: not ours to judge
    return time.time() - newest


def partials(root: str) -> list[str]:
    """Hidden folders of saves that never completed (and whose writer is gone)."""
    return sorted(p for n in os.listdir(root)
                  if n.startswith(".") and n.endswith((PARTIAL_SUFFIX, ".removing"))
                  and os.path.isdir(p := os.path.join(root, n)) and is_stale(p))


def remove(path: str) -> None:
    """Remove one checkpoint; `latest` moves to the newest one left."""
    path = os.path.abspath(path)
    read_manifest(path)  # refuse to remove what is not a checkpoint
    root, name = os.path.split(path)
    hidden = os.path.join(root, f".{name}.removing")
    os.rename(path, hidden)  # gone from listings at once, even if the removal is cut short
    _write_owner(hidden)
    if latest_name(root) == name:
        left = list_checkpoints(root)
        set_latest(root, left[-1].name if left else None)
    shutil.rmtree(hidden)
    sync_dir(root)


def prune(root: str, keep: int, protect: str | None = None) -> list[str]:
    """Keep the newest `keep` checkpoints (and `protect`); remove the rest and partials."""
    if keep < 1:
        raise CheckpointError(f"keep must be at least 1, not {keep}", "pass --keep 1 or more")
    removed = []
    for p in partials(root):
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    entries = list_checkpoints(root)
    latest = latest_name(root)
    for e in entries[:max(0, len(entries) - keep)]:
        if e.name in (protect, latest):
            continue
        remove(e.path)
        removed.append(e.path)
    return removed
