"""Checkpoints in folders other users write: a save's data goes only where it made its
folder, retention counts only the saver's own, others' names are refused or warned of."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import Mounted
from users import User, as_user, ensure_users, run_as

import mxfs.ckpt as ck
from mxfs.client.writer import create_file

# Alice's save, held once its hidden folder is made (before anything is written in it)
# until a line comes on stdin; then its outcome as JSON.
HELD_SAVE = r"""
import torch
import mxfs.ckpt as ck
from mxfs.ckpt import snapshot
os.umask(0o022)
orig = snapshot.stage
def stage(*a, **k):
    print("claimed", flush=True)
    sys.stdin.readline()
    return orig(*a, **k)
snapshot.stage = stage
try:
    snap = ck.save({"w": torch.full((1 << 20,), 7, dtype=torch.uint8)}, sys.argv[1]).wait()
    print(json.dumps({"error": None}))
except ck.CheckpointError as e:
    print(json.dumps({"error": str(e)}))
"""

# Bob's moves, from a JSON plan: rename, mkdir (mode, his umask 0), manifest (a folder
# holding a valid empty checkpoint dated created_ns), write.
BOB = r"""
os.umask(0)
for op, a, b in json.load(open(sys.argv[1])):
    if op == "rename":
        os.rename(a, b)
    elif op == "mkdir":
        os.mkdir(a, int(b, 8))
    elif op == "manifest":
        os.mkdir(a)
        with open(os.path.join(a, "mxfs-checkpoint.json"), "w") as f:
            json.dump({"format": "mxfs-checkpoint", "version": 1, "created_ns": int(b),
                       "files": {}}, f)
    elif op == "write":
        with open(a, "w") as f:
            f.write(b)
print(json.dumps("ok"))
"""

# Alice's saves of argv[2:] into argv[1] (keep_last from the environment); each's
# error or warnings, as JSON.
SAVES = r"""
import torch
import mxfs.ckpt as ck
out = []
for name in sys.argv[2:]:
    try:
        snap = ck.save({"w": torch.ones(4)}, os.path.join(sys.argv[1], name),
                       keep_last=int(os.environ.get("KEEP", "0")) or None).wait()
        out.append({"error": None, "warnings": getattr(snap, "warnings", None)})
    except ck.CheckpointError as e:
        out.append({"error": str(e)})
print(json.dumps(out))
"""


def _as(user: User, script: str, *args: str) -> list[str]:
    """`as_user`'s command, the save's modules imported while still root (the
    interpreter's own library may be readable by root alone)."""
    cmd = as_user(user, script, *args)
    cmd[2] = "import torch, mxfs.ckpt.snapshot\n" + cmd[2]
    return cmd


def _bob(m: Mounted, bob: User, *plan: list[str]) -> None:
    f = m.path / "bob-plan.json"
    f.write_text(json.dumps(plan))
    try:
        assert run_as(bob, BOB, str(f)) == "ok"
    finally:
        f.unlink()


def _shared(m: Mounted, mode: int) -> Path:
    d = m.path / "team"
    d.mkdir()
    os.chmod(d, mode)
    return d


def test_a_partial_folder_swapped_by_another_user_never_gets_the_save(mounted: Mounted
                                                                       ) -> None:
    """Bob renames alice's hidden folder away (a folder everyone writes, no sticky bit)
    and makes his own, 0777, under its name: her save fails naming it, writes nothing in
    his folder and publishes nothing; her own stays 0700, closed to him."""
    users = ensure_users()
    team = _shared(mounted, 0o777)
    p = subprocess.Popen(_as(users["alice"], HELD_SAVE, str(team / "step-1")),
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdin is not None and p.stdout is not None
    try:
        assert p.stdout.readline().strip() == "claimed"
        _bob(mounted, users["bob"], ["rename", str(team / ".step-1.partial"),
                                     str(team / ".moved")],
             ["mkdir", str(team / ".step-1.partial"), "777"])
        p.stdin.write("go\n")
        p.stdin.flush()
        said = json.loads(p.stdout.readline())
    finally:
        p.kill()
        p.wait()
    assert said["error"] is not None and "renamed away" in said["error"]
    assert not (team / "step-1").exists()
    assert os.listdir(team / ".step-1.partial") == []  # nothing of hers in his
    assert os.stat(team / ".moved").st_mode & 0o777 == 0o700


@pytest.mark.parametrize("where", ["mxfs", "plain"])
def test_a_file_pinned_to_its_folder_never_lands_in_the_one_put_in_its_place(
        mounted: Mounted, tmp_path: Path, where: str) -> None:
    """A file made through a descriptor of its folder, the folder then renamed and
    another made under its name before the commit: on mxfs the daemon refuses the
    commit (ESTALE); elsewhere the file is named in the folder held."""
    root = mounted.path if where == "mxfs" else tmp_path
    (root / "d").mkdir()
    fd = os.open(root / "d", os.O_RDONLY | os.O_DIRECTORY)
    try:
        w = create_file(str(root / "d" / "f"), 4096, dir_fd=fd)
        os.rename(root / "d", root / "moved")
        (root / "d").mkdir()
        with w:
            w.write_at(0, memoryview(bytearray(b"x" * 4096)))
            if where == "mxfs":
                with pytest.raises(OSError) as e:
                    w.commit(4096)
                assert e.value.errno == errno.ESTALE
            else:
                w.commit(4096)
        assert os.listdir(root / "d") == []
        assert os.listdir(root / "moved") == ([] if where == "mxfs" else ["f"])
        if where == "mxfs":  # and a create whose path leads elsewhere already
            with pytest.raises(OSError) as e:
                create_file(str(root / "d" / "g"), 4096, dir_fd=fd)
            assert e.value.errno == errno.ESTALE
    finally:
        os.close(fd)


def test_a_save_takes_its_modes_from_the_umask(mounted: Mounted) -> None:
    """Files and folder as open(2) and mkdir(2) would make them: umask 077 keeps the
    checkpoint the saver's alone; 022 leaves it readable by the group (shared loads).
    Never writable by others: with umask 002 the folder was the group's to write, and
    a member of the group swapped its manifest and data for his own."""
    old = os.umask(0o077)
    try:
        ck.save({"w": torch.ones(4)}, str(mounted.path / "private")).wait()
        os.umask(0o022)
        ck.save({"w": torch.ones(4)}, str(mounted.path / "shared")).wait()
        os.umask(0o002)
        ck.save({"w": torch.ones(4)}, str(mounted.path / "group")).wait()
    finally:
        os.umask(old)
    for name, folder, file in (("private", 0o700, 0o600), ("shared", 0o755, 0o644),
                               ("group", 0o755, 0o644)):
        assert os.stat(mounted.path / name).st_mode & 0o777 == folder
        for f in os.listdir(mounted.path / name):
            assert os.stat(mounted.path / name / f).st_mode & 0o777 == file, (name, f)


def test_retention_counts_and_removes_only_the_savers_own(mounted: Mounted) -> None:
    """Bob's folders in a shared sticky folder, dated in the future and in the past, are
    neither counted nor removed by alice's keep_last: her newest two stay, every save
    succeeds."""
    users = ensure_users()
    team = _shared(mounted, 0o1777)
    _bob(mounted, users["bob"], *[["manifest", str(team / f"zz-{i}"), str(2**62 + i)]
                                  for i in range(3)],
         *[["manifest", str(team / f"aa-{i}"), "1"] for i in range(2)])
    said: Any = _alice_saves(users["alice"], team, ["a-1", "a-2", "a-3"], keep=2)
    assert [s["error"] for s in said] == [None] * 3
    assert sorted(os.listdir(team)) == ["a-2", "a-3", "aa-0", "aa-1", "latest", "zz-0",
                                        "zz-1", "zz-2"]


def test_a_removal_name_another_user_made_holds_back_no_removal(mounted: Mounted) -> None:
    """A removal renames the checkpoint to a hidden name first; in a sticky folder bob
    made `.a-1.removing` before alice saved: her keep_last removes a-1 all the same,
    and root's prune after it goes on.  Renamed onto bob's folder (EPERM in a sticky
    folder), a-1 stayed for good, and every prune stopped at it."""
    users = ensure_users()
    team = _shared(mounted, 0o1777)
    _bob(mounted, users["bob"], ["mkdir", str(team / ".a-1.removing"), "755"],
         ["write", str(team / ".a-1.removing" / "x"), "bob's"])
    said: Any = _alice_saves(users["alice"], team, ["a-1", "a-2", "a-3"], keep=2)
    assert [s["error"] for s in said] == [None] * 3
    assert [s["warnings"] for s in said] == [[], [], []], said
    assert sorted(os.listdir(team)) == [".a-1.removing", "a-2", "a-3", "latest"]
    got = subprocess.run([sys.executable, "-m", "mxfs", "ckpt", "prune", "--json",
                          str(team), "--keep", "1"], capture_output=True, text=True)
    assert got.returncode == 0, got.stderr
    assert sorted(os.listdir(team)) == [".a-1.removing", "a-3", "latest"]
    assert (team / "latest").read_text().strip() == "a-3"


# `mxfs ckpt prune --json` of argv[1] keeping argv[2], in this process: (exit status,
# its JSON or its error line).
PRUNE = r"""
import contextlib, io
out, err = io.StringIO(), io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    status = main(["ckpt", "prune", "--json", sys.argv[1], "--keep", sys.argv[2]])
print(json.dumps([status, json.loads(out.getvalue()) if status == 0 else err.getvalue()]))
"""


# The same prune run first as root on an empty folder: every module it imports loaded
# while the interpreter's library (perhaps root's alone) can still be read.
WARM_PRUNE = r"""
import contextlib, io, tempfile
from mxfs.cli.main import main
with contextlib.redirect_stdout(io.StringIO()), tempfile.TemporaryDirectory() as d:
    assert main(["ckpt", "prune", "--json", d, "--keep", "1"]) == 0
"""


def test_a_prune_by_hand_keeps_each_owners_newest(mounted: Mounted) -> None:
    """Bob's folders in a shared sticky folder, dated in the future and in the past:
    alice's `mxfs ckpt prune` removes only her oldest, counting hers alone; root's
    keeps each owner's newest, so bob's dates push out nobody else's."""
    users = ensure_users()
    team = _shared(mounted, 0o1777)
    said: Any = _alice_saves(users["alice"], team, ["a-1", "a-2", "a-3"])
    assert [s["error"] for s in said] == [None] * 3
    _bob(mounted, users["bob"], *[["manifest", str(team / f"zz-{i}"), str(2**62 + i)]
                                  for i in range(3)],
         *[["manifest", str(team / f"aa-{i}"), "1"] for i in range(2)])
    cmd = _as(users["alice"], PRUNE, str(team), "2")
    cmd[2] = WARM_PRUNE + cmd[2]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    status, out = json.loads(res.stdout)
    assert status == 0, out
    assert out["removed"] == [str(team / "a-1")]
    got = subprocess.run([sys.executable, "-m", "mxfs", "ckpt", "prune", "--json",
                          str(team), "--keep", "2"], capture_output=True, text=True)
    assert got.returncode == 0, got.stderr
    assert sorted(os.listdir(team)) == ["a-2", "a-3", "latest", "zz-1", "zz-2"]


def test_names_another_user_holds_are_warned_of_or_refused_by_name(mounted: Mounted
                                                                   ) -> None:
    """In a sticky folder bob made `latest` and a hidden `.s2.partial` first: alice's
    save of s1 is published and says `latest` stayed his (one warning naming him); her
    save of s2 is refused naming his folder, which stays."""
    users = ensure_users()
    team = _shared(mounted, 0o1777)
    _bob(mounted, users["bob"], ["write", str(team / "latest"), "nothing\n"],
         ["mkdir", str(team / ".s2.partial"), "755"])
    s1, s2 = _alice_saves(users["alice"], team, ["s1", "s2"])
    assert s1["error"] is None
    assert len(s1["warnings"]) == 1 and "mxfs-bob" in s1["warnings"][0]
    assert "latest" in s1["warnings"][0]
    assert ck.load(str(team / "s1"))["w"].tolist() == [1.0] * 4
    assert (team / "latest").read_text() == "nothing\n"
    assert s2["error"] is not None and "mxfs-bob's" in s2["error"]
    assert ".s2.partial" in s2["error"]
    assert (team / ".s2.partial").is_dir() and not (team / "s2").exists()


def _alice_saves(alice: User, root: Path, names: list[str], keep: int = 0) -> Any:
    env = {**os.environ, "KEEP": str(keep)}
    res = subprocess.run(_as(alice, SAVES, str(root), *names), capture_output=True,
                         text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.splitlines()[-1])
