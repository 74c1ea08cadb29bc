"""Leftover partial saves: whose they are, and when another process may clear them.

A pid says whether a save is alive only in the boot and pid namespace it came from:
a save written by another container (or node) sharing the pool is left alone while its
folder is fresh, however its pid reads here.  Plain folders: the catalog's rules do not
depend on the mount.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mxfs.ckpt import catalog
from mxfs.ckpt.catalog import FOREIGN_STALE_S, OWNER, CheckpointError


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _partial(root: Path, name: str, owner: dict | None) -> Path:
    folder = Path(catalog.partial_path(str(root / name)))
    folder.mkdir()
    if owner is not None:
        (folder / OWNER).write_text(json.dumps(owner))
    return folder


def _age(folder: Path, seconds: float) -> None:
    old = time.time() - seconds
    for p in [folder, *folder.iterdir()]:
        os.utime(p, (old, old))


def test_a_dead_save_of_this_namespace_is_stale_and_a_live_one_is_not(tmp_path: Path) -> None:
    mine = catalog.claim_partial(str(tmp_path / "step-1")).path
    assert not catalog.is_stale(mine)  # this process's own
    owner = json.loads(Path(mine, OWNER).read_text())
    dead = _partial(tmp_path, "step-2", {**owner, "pid": _dead_pid()})
    assert catalog.is_stale(str(dead))
    assert catalog.partials(str(tmp_path)) == [str(dead)]
    with pytest.raises(CheckpointError, match="saving .* right now"):
        catalog.claim_partial(str(tmp_path / "step-1"))


def test_another_containers_save_is_left_alone_until_it_has_been_idle_long(
        tmp_path: Path) -> None:
    """A save from another pid namespace or machine, its pid dead here: fresh, it is not
    stale (its owner may be writing it right now), prune leaves it and a save of the same
    name is refused with the fix; idle past FOREIGN_STALE_S, it is cleared."""
    foreign = _partial(tmp_path, "step-3", {"pid": _dead_pid(), "where": "other-boot/pid:[1]"})
    legacy = _partial(tmp_path, "step-4", {"pid": _dead_pid()})  # written before "where"
    half = _partial(tmp_path, "step-5", None)  # made, its owner not written yet
    for p in (foreign, legacy, half):
        assert not catalog.is_stale(str(p))
    assert catalog.prune(str(tmp_path), keep=1) == []
    assert foreign.exists() and legacy.exists() and half.exists()
    with pytest.raises(CheckpointError, match=r"rm -r .*step-3"):
        catalog.claim_partial(str(tmp_path / "step-3"))
    for p in (foreign, legacy, half):
        _age(p, FOREIGN_STALE_S + 60)
    assert sorted(catalog.prune(str(tmp_path), keep=1)) == sorted(
        str(p) for p in (foreign, legacy, half))
    assert not foreign.exists()


_CLAIM = """
import sys, time
from mxfs.ckpt import catalog
catalog.claim_partial(sys.argv[1])
print("claimed", flush=True)
time.sleep(600)
"""


def test_a_dead_save_of_another_container_on_this_machine_is_stale_at_once(
        tmp_path: Path) -> None:
    """A save from another pid namespace of this machine (a container; here `unshare`)
    holds its folder locked while it works: alive, its folder is not stale whatever its
    pid reads here, and its name is refused; killed, the kernel lets go of its lock and
    the name is free at once.  Judged by the folder's age alone, a container restarted
    after a crash waited an hour to save under the name its last save had left."""
    path = str(tmp_path / "step-7")
    container = subprocess.Popen(
        ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--kill-child",
         sys.executable, "-c", _CLAIM, path], stdout=subprocess.PIPE, text=True)
    try:
        assert container.stdout is not None
        assert container.stdout.readline().strip() == "claimed"
        partial = catalog.partial_path(path)
        owner = json.loads(Path(partial, OWNER).read_text())
        assert owner["where"] != catalog._owner_id()  # (another pid namespace)
        assert not catalog.is_stale(partial)
        with pytest.raises(CheckpointError, match="saving .* right now"):
            catalog.claim_partial(path)
        assert catalog.prune(str(tmp_path), keep=1) == []
    finally:
        container.kill()
        container.wait()
    deadline = time.monotonic() + 20  # (its child, pid 1 there, is killed as it dies)
    while not catalog.is_stale(partial) and time.monotonic() < deadline:
        time.sleep(0.05)
    mine = catalog.claim_partial(path)  # (the dead save's folder cleared)
    assert json.loads(Path(mine.path, OWNER).read_text())["where"] == catalog._owner_id()
    catalog.drop_partial(mine)
    assert not Path(partial).exists()


# `catalog.remove(argv[1])`, its process killed right after it renamed the checkpoint
# aside (a removal cut short: SIGKILL, the container gone).
_KILLED_REMOVE = r"""
import os, sys
from mxfs.ckpt import catalog
rename = os.rename
def killed(src, dst, **kw):
    rename(src, dst, **kw)
    if str(dst).endswith(".removing"):
        os.kill(os.getpid(), 9)
os.rename = killed
catalog.remove(sys.argv[1])
"""


def test_a_removal_of_latest_killed_midway_leaves_latest_naming_a_checkpoint(
        tmp_path: Path) -> None:
    """`latest` moves to the newest checkpoint left before the removed one goes from
    its name: a removal killed right after that rename left `latest` naming a folder
    that no longer was, and loads of `latest` failed."""
    import torch

    import mxfs.ckpt as ck

    for name in ("a", "b"):
        ck.save({"w": torch.ones(4)}, str(tmp_path / name)).wait()
    assert catalog.latest_name(str(tmp_path)) == "b"
    killed = subprocess.run([sys.executable, "-c", _KILLED_REMOVE, str(tmp_path / "b")],
                            capture_output=True, text=True)
    assert killed.returncode == -9, killed.stderr
    assert [e.name for e in catalog.list_checkpoints(str(tmp_path))] == ["a"]
    assert catalog.latest_name(str(tmp_path)) == "a"
    assert float(ck.load(str(tmp_path / "a"))["w"].sum()) == 4.0
