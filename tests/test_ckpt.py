"""Checkpoints: async saves through the direct path, atomic publication, verified loads."""

from __future__ import annotations

import base64
import json
import os
import resource
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from conftest import Mounted, assert_same, check_pool, eventually, mxfs, one_line_error

import mxfs.ckpt as ck
from mxfs.ckpt import catalog
from mxfs.client import ControlClient
from mxfs.errors import MxfsError
from mxfs.io import Layout
from mxfs.load import load_file
from mxfs.pool import Pool


def training_state(seed: int = 0, n: int = 64) -> dict[str, Any]:
    """A model, Adam-like optimizer state and plain values, in many dtypes."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, n, generator=g)
    model = {
        "embed": torch.randn(300, n, generator=g).bfloat16(),
        "w": w, "tied": w,
        "half": torch.randn(17, generator=g).half(),
        "f64": torch.randn(3, 3, generator=g, dtype=torch.float64),
        "f8a": torch.randn(40, generator=g).to(torch.float8_e4m3fn),
        "f8b": torch.randn(40, generator=g).to(torch.float8_e5m2),
        "i8": torch.randint(-100, 100, (9,), generator=g, dtype=torch.int8),
        "u8": torch.randint(0, 255, (9,), generator=g, dtype=torch.uint8),
        "i32": torch.randint(0, 1 << 30, (5,), generator=g, dtype=torch.int32),
        "i64": torch.arange(7),
        "mask": torch.rand(11, generator=g) > 0.5,
        "cplx": torch.randn(4, generator=g, dtype=torch.complex64),
        "strided": torch.randn(8, 6, generator=g).t(),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
    }
    optim = {"state": {0: {"step": torch.tensor(10.0), "exp_avg": torch.randn(n, n, generator=g),
                           "exp_avg_sq": torch.rand(n, n, generator=g)}},
             "param_groups": [{"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "params": [0],
                               "foreach": None, "amsgrad": False, "max": float("inf")}]}
    return {"model": model, "optim": optim, "step": 1000 + seed, "run": "demo", "blob": b"\x00x",
            "dtype": torch.bfloat16, "shape": torch.Size([2, 3])}


@pytest.fixture(params=["mxfs", "plain"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """Checkpoints on the mount (direct path) and on a plain folder (same code, renames)."""
    if request.param == "plain":
        return tmp_path
    return request.getfixturevalue("mounted").path


@pytest.mark.parametrize("compress", [None, "zstd"])
def test_save_and_load_give_back_every_dtype_and_structure(where: Path,
                                                           compress: str | None) -> None:
    state = training_state()
    snap = ck.save(state, str(where / "step-1"), compress=compress)
    snap.staged()
    snap.wait()
    assert snap.progress["state"] == "done"
    back = ck.load(str(where / "step-1"))
    assert_same(state, back)
    assert back["model"]["tied"] is back["model"]["w"]  # stored once, tied again on load
    assert (where / "latest").read_text().strip() == "step-1"
    assert sorted(os.listdir(where / "step-1")) == ["data.safetensors", catalog.MANIFEST]
    data = str(where / "step-1" / "data.safetensors")
    if compress is None:  # a plain safetensors file: any reader loads the tensors
        for reader in (safetensors.torch.load_file, load_file):
            loaded = reader(data)
            assert torch.equal(loaded["model.embed"], state["model"]["embed"])
            exp_avg = state["optim"]["state"][0]["exp_avg"]
            assert torch.equal(loaded["optim.state.0.exp_avg"], exp_avg)
    else:
        assert set(safetensors.torch.load_file(data)) >= {"model.embed"}  # still a container


@pytest.mark.unit
def test_values_that_need_pickle_are_refused_naming_where(tmp_path: Path) -> None:
    with pytest.raises(MxfsError, match=r"model\.fn .*pickle"):
        ck.save({"model": {"fn": object()}}, str(tmp_path / "x"))
    assert not (tmp_path / "x").exists() and os.listdir(tmp_path) == []


def test_tensors_changed_after_staged_do_not_change_the_checkpoint(mounted: Mounted) -> None:
    state = {"w": torch.ones(1 << 20), "b": torch.zeros(10)}
    snap = ck.save(state, str(mounted.path / "s"))
    snap.staged()
    state["w"].add_(5)  # training goes on
    state["b"].fill_(7)
    snap.wait()
    back = ck.load(str(mounted.path / "s"))
    assert torch.equal(back["w"], torch.ones(1 << 20)) and torch.equal(back["b"], torch.zeros(10))


def test_a_hundred_saves_reuse_one_staging_buffer_and_keep_memory_flat(
        mounted: Mounted) -> None:
    saver = ck.Checkpointer(keep_last=2)
    state = training_state(n=512)  # ~3 MiB of tensors
    rss = []
    for i in range(100):
        state["step"] = i
        state["model"]["w"].add_(1)
        saver.save(state, str(mounted.path / "run" / f"step-{i:03}"))
        if i in (10, 99):
            saver.wait()
            rss.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    saver.wait()
    assert saver.staging.allocations == 1
    assert rss[1] - rss[0] < 32 * 1024  # KiB: no growth save after save
    names = [e.name for e in ck.list_checkpoints(str(mounted.path / "run"))]
    assert names == ["step-098", "step-099"]  # keep_last, newest kept
    assert (mounted.path / "run" / "latest").read_text().strip() == "step-099"
    back = ck.load(str(mounted.path / "run" / "step-099"))
    assert back["step"] == 99 and torch.equal(back["model"]["w"], state["model"]["w"])


def test_saving_over_an_existing_checkpoint_is_refused(mounted: Mounted) -> None:
    ck.save({"a": torch.ones(3)}, str(mounted.path / "c")).wait()
    with pytest.raises(ck.CheckpointError, match="already exists"):
        ck.save({"a": torch.zeros(3)}, str(mounted.path / "c"))
    assert torch.equal(ck.load(str(mounted.path / "c"))["a"], torch.ones(3))


# ---- faults --------------------------------------------------------------------------

# The writer, stopped at one step of the save (by wrapping the function that step calls),
# then killed with SIGKILL by the test.
KILLED_WRITER = r"""
import os, sys, time, torch
import mxfs.ckpt as ck
from mxfs.ckpt import snapshot, catalog, writing
from mxfs.client import writer as w
path, step = sys.argv[1], sys.argv[2]

def stop(name, fn):
    def wrapper(*a, **k):
        if stop.armed:
            print("at", name, flush=True)
            time.sleep(600)
        return fn(*a, **k)
    return wrapper
stop.armed = True

state = {"w": torch.full((3 << 20,), 7.0), "step": 2}
if step == "after-staging":  # the writer has seen the whole image staged, written nothing
    def write_snapshot(job, image, packed, progress, ready):
        ready(job.plan.size)
        print("at", step, flush=True)
        time.sleep(600)
    snapshot.write_snapshot = write_snapshot
elif step == "mid-write":
    orig = w.DirectWriter.write_at
    def write_at(self, off, buf, valid=None):
        orig(self, off, buf[:1 << 20], valid=1 << 20)
        print("at", step, flush=True)
        time.sleep(600)
    w.DirectWriter.write_at = write_at
elif step == "before-commit":
    w.DirectWriter.commit = stop(step, w.DirectWriter.commit)
elif step == "during-commit":  # the data file is committed, the manifest not yet
    catalog.write_small = stop(step, catalog.write_small)
elif step == "before-rename":  # everything written, the folder not yet renamed
    catalog.sync_dir = stop(step, catalog.sync_dir)
writing.WRITE_STEP = 1 << 20
ck.save(state, path).wait()
"""


def test_a_save_killed_in_another_container_frees_its_name_at_once(mounted: Mounted
                                                                   ) -> None:
    """A save in another pid namespace (a container: `unshare`) killed mid-write: its
    half-written name is saved again at once from here (its lock on its folder went
    with it), not an hour later when its folder's age said it was left over."""
    path = str(mounted.path / "ckpts" / "step-2")
    p = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", sys.executable,
                          "-c", KILLED_WRITER, path, "mid-write"],
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    assert p.stdout.readline().split() == ["at", "mid-write"]
    p.kill()
    p.wait()
    state = {"w": torch.arange(1000.0), "step": 2}
    assert eventually(lambda: catalog.is_stale(catalog.partial_path(path)))
    ck.save(state, path).wait()
    assert_same(ck.load(path), state)


@pytest.mark.parametrize("step", ["after-staging", "mid-write", "before-commit",
                                  "during-commit", "before-rename"])
@pytest.mark.also_postgres
def test_writer_killed_at_each_step_leaves_the_previous_checkpoint(mounted: Mounted,
                                                                    step: str) -> None:
    root = mounted.path / "ckpts"
    prev = {"w": torch.arange(1000.0), "step": 1}
    ck.save(prev, str(root / "step-1")).wait()
    p = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(root / "step-2"), step],
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    assert p.stdout.readline().split() == ["at", step]
    p.kill()
    p.wait()
    mounted.umount()
    mounted.remount()
    assert [e.name for e in ck.list_checkpoints(str(root))] == ["step-1"]
    assert (root / "latest").read_text().strip() == "step-1"
    assert_same(prev, ck.load(str(root / "step-1")))
    assert ck.verify(str(root / "step-1")) == []
    assert not (root / "step-2").exists()
    ck.prune(str(root), keep=5)  # the dead writer's hidden folder goes
    assert sorted(os.listdir(root)) == ["latest", "step-1"]
    mounted.umount()
    check_pool(mounted.members)


def _chunk_of(m: Mounted, path: Path, offset: int) -> tuple[str, int, int]:
    """(chunk file, offset in it, member) holding byte `offset` of a file on the mount."""
    with ControlClient(str(m.path)) as c:
        lay = c.layout(str(path))
    member, chunk_off = Layout.from_description(lay["layout"]).locate(offset)
    return Pool.open(m.members[0]).chunk_path(member, lay["ino"]), chunk_off, member


def test_a_flipped_byte_is_reported_with_its_file_and_tensor(mounted: Mounted) -> None:
    path = mounted.path / "c"
    ck.save({"a": torch.randn(100_000), "b": torch.randn(100_000)}, str(path)).wait()
    manifest = json.loads((path / catalog.MANIFEST).read_text())
    entry = manifest["files"]["data.safetensors"]["tensors"]["b"]
    chunk, off, member = _chunk_of(mounted, path / "data.safetensors", entry["offset"] + 200_000)
    with open(chunk, "r+b") as f:
        f.seek(off)
        byte = f.read(1)
        f.seek(off)
        f.write(bytes([byte[0] ^ 0x10]))
    want = rf"data\.safetensors.*member {member}.*tensors: b:"
    with pytest.raises(ck.CheckpointCorrupt, match=want):
        ck.load(str(path))
    res = mxfs("ckpt", "verify", str(path), check=False)
    assert res.returncode == 1
    assert "DAMAGED" in res.stdout and "data.safetensors" in res.stdout
    assert res.stdout.rstrip().endswith("tensors: b")
    report = json.loads(mxfs("ckpt", "verify", "--json", str(path), check=False).stdout)
    assert report[0]["damage"][0]["tensors"] == ["b"] and report[0]["damage"][0]["member"] == member


def test_a_member_filling_up_fails_the_save_in_wait_and_gives_space_back(
        loop_pool: Mounted) -> None:
    mp, loop_members = loop_pool.path, loop_pool.members
    prev = {"w": torch.randn(1 << 20)}
    ck.save(prev, str(mp / "step-1")).wait()
    free = [os.statvfs(m).f_bavail for m in loop_members]
    snap = ck.save({"w": torch.randn(40 << 20)}, str(mp / "step-2"))  # 160 MiB: too big
    with pytest.raises(ck.CheckpointError, match="No space left|space"):
        snap.wait()
    assert [e.name for e in ck.list_checkpoints(str(mp))] == ["step-1"]
    assert (mp / "latest").read_text().strip() == "step-1"
    assert_same(prev, ck.load(str(mp / "step-1")))
    # The failed save filled member 2 (24 MiB); all of it comes back once the hidden file
    # is reclaimed and ext4 commits the frees. The slack is metadata: the SQLite WAL on
    # member 0 grows with the save's transactions, and ext4's journal lags under load.
    assert eventually(lambda: all(os.statvfs(m).f_bavail >= f - 512
                                  for m, f in zip(loop_members, free, strict=True)),
                      timeout=60)
    assert sorted(os.listdir(mp)) == ["latest", "step-1"]
    loop_pool.umount()
    check_pool(loop_members)


@pytest.mark.also_postgres
def test_ckpt_cli_lists_removes_and_prunes(mounted: Mounted) -> None:
    root = mounted.path / "r"
    for i in range(4):
        ck.save({"x": torch.full((10,), float(i))}, str(root / f"s{i}")).wait()
    out = json.loads(mxfs("ckpt", "ls", "--json", str(root)).stdout)
    assert [c["name"] for c in out["checkpoints"]] == ["s0", "s1", "s2", "s3"]
    assert [c["latest"] for c in out["checkpoints"]] == [False, False, False, True]
    mxfs("ckpt", "rm", str(root / "s3"))
    assert (root / "latest").read_text().strip() == "s2"  # moved to the newest left
    mxfs("ckpt", "prune", str(root), "--keep", "1")
    assert [e.name for e in ck.list_checkpoints(str(root))] == ["s2"]
    assert "s2" in mxfs("ckpt", "ls", str(root)).stdout
    line = one_line_error(mxfs("ckpt", "verify", str(root / "nope"), check=False))
    assert "does not exist" in line
    line = one_line_error(mxfs("ckpt", "rm", str(mounted.path), check=False))
    assert "not an mxfs checkpoint" in line
    line = one_line_error(mxfs("ckpt", "prune", str(root), "--keep", "0", check=False))
    assert "keep" in line


def test_process_writer_saves_and_its_death_fails_only_that_save(mounted: Mounted) -> None:
    saver = ck.Checkpointer(writer="process", compress="zstd")
    try:
        state = training_state(n=256)
        saver.save(state, str(mounted.path / "p1")).wait()
        assert_same(state, ck.load(str(mounted.path / "p1")))
        pid = saver.worker.pid  # type: ignore[union-attr]
        assert pid is not None and pid != os.getpid()
        os.kill(pid, signal.SIGSTOP)  # hold it, so it dies with the next job unwritten
        snap = saver.save(training_state(1, n=256), str(mounted.path / "p2"))
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(ck.CheckpointError, match="writer process died"):
            snap.wait()
        assert [e.name for e in ck.list_checkpoints(str(mounted.path))] == ["p1"]
        assert (mounted.path / "latest").read_text().strip() == "p1"
        saver.save(training_state(2, n=256), str(mounted.path / "p3")).wait()  # a new worker
        assert saver.worker.pid != pid  # type: ignore[union-attr]
        assert_same(training_state(2, n=256), ck.load(str(mounted.path / "p3")))
    finally:
        saver.close()
        saver.staging.release()


# ---- a tenant's folder, root's commands --------------------------------------------------

# What a tenant does in her own checkpoint folder, through the mount: each action is
# [what, path, argument] (a name in place of what held it: link, fifo, folder, write),
# read from a file (a manifest is too long for an argument).
PLANT = """
with open(sys.argv[1]) as plan:
    actions = json.load(plan)
for what, path, arg in actions:
    if what != "folder" and os.path.lexists(path):
        os.unlink(path)
    if what == "link":
        os.symlink(arg, path)
    elif what == "fifo":
        os.mkfifo(path)
    elif what == "folder":
        os.mkdir(path)
    else:
        with open(path, "w") as f:
            f.write(arg)
print(json.dumps("ok"))
"""


def _tenant_checkpoints(m: Mounted, names: list[str]) -> tuple[Path, Any]:
    """Checkpoints `names` in a folder of mxfs-alice's on the mount (hers, every file)."""
    from users import ensure_users

    alice = ensure_users()["alice"]
    root = m.path / "alice"
    for i, name in enumerate(names):
        ck.save({"x": torch.full((1000,), float(i))}, str(root / name)).wait()
    for folder, _, files in os.walk(root):
        for p in [folder, *(os.path.join(folder, f) for f in files)]:
            os.chown(p, alice.uid, alice.gid)
    return root, alice


def _plant(m: Mounted, user: Any, *actions: list[str]) -> None:
    from users import run_as

    plan = m.path / "plan.json"
    plan.write_text(json.dumps(actions))
    try:
        assert run_as(user, PLANT, str(plan)) == "ok"
    finally:
        plan.unlink()


@pytest.mark.parametrize("verb", ["rm", "prune"])
def test_root_removing_a_tenants_checkpoint_never_writes_through_her_links(
        mounted: Mounted, tmp_path: Path, verb: str) -> None:
    """A removal marks the folder with its owner file before deleting it: a link the
    tenant planted under that name is replaced, not written through (as root, it
    truncated whatever file it named)."""
    root, alice = _tenant_checkpoints(mounted, ["s0", "s1"])
    outside = tmp_path / "root-only"
    outside.write_text("root's own\n")
    _plant(mounted, alice, ["link", str(root / "s0" / catalog.OWNER), str(outside)])
    if verb == "rm":
        mxfs("ckpt", "rm", str(root / "s0"))
    else:
        mxfs("ckpt", "prune", str(root), "--keep", "1")
    assert outside.read_text() == "root's own\n"
    assert sorted(os.listdir(root)) == ["latest", "s1"]
    assert (root / "latest").read_text().strip() == "s1"


def _sums(data: bytes, unit: int) -> str:
    from mxfs.io.checksum import block_sums, pack_sums

    return base64.b64encode(pack_sums(block_sums(data, unit))).decode()


def test_ckpt_verify_and_ls_refuse_a_manifest_that_reaches_outside_its_folder(
        mounted: Mounted, tmp_path: Path) -> None:
    """A tenant's manifest names the files root's `verify` reads: one naming a file
    elsewhere (or a data file that is a link out), with the right checksums, had root
    confirm a guess of bytes it may read and she may not (one-byte checksum blocks: byte
    by byte). Each is refused in one line, nothing read; `ls` does not list them."""
    cases = ["parent", "absolute", "link", "tiny-blocks", "huge", "files-list", "deep"]
    root, alice = _tenant_checkpoints(mounted, cases)
    secret = os.urandom(10_000)
    (mounted.path / "secret").write_bytes(secret)
    (mounted.path / "secret").chmod(0o600)
    outside = tmp_path / "secret"
    outside.write_bytes(secret)
    guess = {"size": len(secret), "sum_unit": 4096, "sums": _sums(secret, 4096), "tensors": {}}
    plants = []
    for case in cases:
        mpath = root / case / catalog.MANIFEST
        manifest = json.loads(mpath.read_text())
        files = manifest["files"]
        entry = files["data.safetensors"]
        data = (root / case / "data.safetensors").read_bytes()
        if case == "parent":
            files["../../secret"] = guess
        elif case == "absolute":
            files[str(outside)] = guess
        elif case == "link":
            files["data.safetensors"] = guess
            plants.append(["link", str(root / case / "data.safetensors"), str(outside)])
        elif case == "tiny-blocks":
            entry.update(sum_unit=1, sums=_sums(data, 1))
        elif case == "huge":  # a petabyte: allocated before the size was checked
            entry.update(size=1 << 50, sum_unit=1 << 40, sums=_sums(bytes(1024), 1))
        elif case == "files-list":
            manifest["files"] = [entry]
        text = json.dumps(manifest) if case != "deep" else "[" * 100_000 + "]" * 100_000
        plants.append(["write", str(mpath), text])
    _plant(mounted, alice, *plants)

    def verify(case: str) -> str:
        res = mxfs("ckpt", "verify", str(root / case), check=False, timeout=60)
        lines = res.stderr.strip().splitlines()
        refused = (res.returncode != 0 and res.stdout == "" and len(lines) == 1
                   and "Traceback" not in res.stderr and "internal error" not in res.stderr
                   and f"/{case}" in lines[0])
        return "refused" if refused else \
            f"rc {res.returncode}, out {res.stdout[:60]!r}, err {lines[-1:]}"
    with ThreadPoolExecutor(len(cases)) as verifiers:  # (each a process of its own)
        answers = dict(zip(cases, verifiers.map(verify, cases), strict=True))
    assert answers == dict.fromkeys(cases, "refused")
    listed = json.loads(mxfs("ckpt", "ls", "--json", str(root), timeout=60).stdout)
    assert [c["name"] for c in listed["checkpoints"]] == ["link"]  # ("huge": its block
    assert "huge" in str(listed["damaged"])  # of 1 TiB over MAX_SUM_UNIT, damaged)


def test_ckpt_rm_writes_latest_in_the_folder_it_opened_never_through_a_link(
        tmp_path: Path) -> None:
    """`latest` was written and removed by its path: a tenant who held the folder's
    lock (anyone who may read it may) swapped her folder for a link while root's `ckpt
    rm` waited for it, and root wrote `latest`, naming a checkpoint of hers such as
    "* * * * * root ...", into the folder the link pointed at: /etc/cron.d, say."""
    import fcntl
    import time

    root, victim = tmp_path / "ckpts", tmp_path / "victim"
    victim.mkdir()
    (victim / "latest").write_text("root's own\n")
    for name in ("a", "b"):
        ck.save({"x": torch.zeros(10)}, str(root / name)).wait()
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    rm = subprocess.Popen([sys.executable, "-m", "mxfs", "ckpt", "rm", str(root / "b")],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(1)  # (rm waits for the lock: LATEST_LOCK_S)
        os.rename(root, tmp_path / "ckpts.real")
        os.symlink(victim, root)
    finally:
        out, err = rm.communicate(timeout=60)
        os.close(fd)
    assert rm.returncode == 0, err
    assert (victim / "latest").read_text() == "root's own\n"
    real = tmp_path / "ckpts.real"
    assert sorted(os.listdir(real)) == ["a", "latest"]
    assert (real / "latest").read_text().strip() == "a"


def test_a_tenants_deep_tree_fails_its_own_removal_never_a_whole_prune(
        tmp_path: Path) -> None:
    """A checkpoint holding 1,500 nested folders overflowed the removal's recursion:
    root's prune died (internal error), left it renamed aside, and every later prune
    of the folder died on it, no other owner's checkpoint pruned again.  Now its
    removal fails alone (one line naming it), and the next prunes go on past it."""
    root = tmp_path / "ck"
    for name in ("old", "new"):
        ck.save({"x": torch.zeros(10)}, str(root / name)).wait()
    fd = os.open(root / "old", os.O_RDONLY)
    for _ in range(1500):
        os.mkdir("d", dir_fd=fd)
        fd, up = os.open("d", os.O_RDONLY, dir_fd=fd), fd
        os.close(up)
    os.close(fd)
    try:
        line = one_line_error(mxfs("ckpt", "prune", str(root), "--keep", "1", check=False))
        assert "could not be removed" in line and "old" in line, line
        ck.save({"x": torch.ones(10)}, str(root / "newer")).wait()
        mxfs("ckpt", "prune", str(root), "--keep", "1")
        assert [e.name for e in ck.list_checkpoints(str(root))] == ["newer"]
    finally:  # (pytest's own removal of tmp_path recurses as rmtree did)
        subprocess.run(["rm", "-rf", str(root)], check=True)


def test_a_damaged_checkpoint_is_verified_with_the_rest_listed_and_removed(
        tmp_path: Path) -> None:
    """`verify` of several stopped at the first damaged manifest, the rest unchecked;
    `ls` left a damaged checkpoint out without a word, and `rm` refused it ("the
    checkpoint is damaged"), so only rm -rf took it.  Now each path is verified, `ls`
    names the damaged one, and `rm` removes it (a folder with no manifest is still
    refused: not a checkpoint)."""
    root = tmp_path / "ck"
    for i in range(3):
        ck.save({"x": torch.full((100,), float(i))}, str(root / f"s{i}")).wait()
    (root / "s1" / catalog.MANIFEST).write_text("{not json")
    res = mxfs("ckpt", "verify", *(str(root / f"s{i}") for i in range(3)), check=False)
    assert res.returncode == 1
    assert res.stdout.split() == ["ok", str(root / "s0"), "ok", str(root / "s2")]
    assert len(res.stderr.strip().splitlines()) == 1 and "s1" in res.stderr
    listed = json.loads(mxfs("ckpt", "ls", "--json", str(root)).stdout)
    assert [c["name"] for c in listed["checkpoints"]] == ["s0", "s2"]
    assert listed["damaged"] == [str(root / "s1")]
    assert "s1 is damaged" in mxfs("ckpt", "ls", str(root)).stdout
    mxfs("ckpt", "rm", str(root / "s1"))
    assert sorted(os.listdir(root)) == ["latest", "s0", "s2"]
    (root / "plain").mkdir()
    assert "not an mxfs checkpoint" in one_line_error(
        mxfs("ckpt", "rm", str(root / "plain"), check=False))


@pytest.mark.unit
def test_a_manifests_counts_and_blocks_are_bounded(tmp_path: Path) -> None:
    """A manifest's numbers are anyone's to write: a date of 10**30 ns overflowed `ls`
    (its whole listing), a size of 10**400 the readers' arithmetic, and one checksum
    block of a TiB had `verify` hold the whole (sparse) file in memory.  Each is a
    damaged checkpoint now; the others list and verify as before."""
    for name in ("date", "size", "block", "good"):
        ck.save({"x": torch.zeros(1000)}, str(tmp_path / name)).wait()
    for name, change in (("date", lambda m, e: m.update(created_ns=10**30)),
                         ("size", lambda m, e: e.update(size=10**400)),
                         ("block", lambda m, e: e.update(sum_unit=1 << 40))):
        mpath = tmp_path / name / catalog.MANIFEST
        manifest = json.loads(mpath.read_text())
        change(manifest, manifest["files"]["data.safetensors"])
        mpath.write_text(json.dumps(manifest))
        with pytest.raises(ck.CheckpointError, match="damaged"):
            catalog.read_manifest(str(tmp_path / name))
    assert [e.name for e in ck.list_checkpoints(str(tmp_path))] == ["good"]
    assert sorted(os.path.basename(p) for p in catalog.listing(str(tmp_path))[1]) == \
        ["block", "date", "size"]
    assert ck.verify(str(tmp_path / "good")) == []


@pytest.mark.unit
def test_a_manifest_of_millions_of_objects_is_refused_unparsed_and_links_list_once(
        tmp_path: Path) -> None:
    """256 MiB of empty objects parse to 25 times that in memory, at each `ls`, once a
    hard link: refused by their count before any parse.  A manifest linked into other
    folders (an rsync --link-dest backup) lists in each."""
    ck.save({"x": torch.zeros(10)}, str(tmp_path / "a")).wait()
    (tmp_path / "b").mkdir()
    os.link(tmp_path / "a" / catalog.MANIFEST, tmp_path / "b" / catalog.MANIFEST)
    os.link(tmp_path / "a" / "data.safetensors", tmp_path / "b" / "data.safetensors")
    assert [e.name for e in ck.list_checkpoints(str(tmp_path))] == ["a", "b"]
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / catalog.MANIFEST).write_bytes(
        b'{"x":[' + b"{}," * catalog.MANIFEST_VALUES + b"{}]}")
    with pytest.raises(ck.CheckpointError, match="objects and lists"):
        catalog.read_manifest(str(tmp_path / "c"))


@pytest.mark.unit
def test_a_manifest_over_its_cap_is_refused_unread(tmp_path: Path) -> None:
    """A reader holds at most MANIFEST_MAX bytes of a manifest (a planted one of a
    terabyte, sparse, would fill root's memory): over it, the checkpoint is damaged."""
    ck.save({"x": torch.zeros(4)}, str(tmp_path / "c")).wait()
    with open(tmp_path / "c" / catalog.MANIFEST, "r+b") as f:
        f.truncate(catalog.MANIFEST_MAX + 1)
    with pytest.raises(ck.CheckpointError, match="over"):
        catalog.read_manifest(str(tmp_path / "c"))
    assert ck.list_checkpoints(str(tmp_path)) == []


def test_fifos_a_tenant_plants_do_not_hang_root_commands(mounted: Mounted) -> None:
    """`latest`, a manifest and a partial save's owner file as FIFOs: root's commands
    opened them to read and waited for a writer that never comes."""
    root, alice = _tenant_checkpoints(mounted, ["s0", "s1", "s2"])
    _plant(mounted, alice, ["fifo", str(root / "latest"), ""],
           ["fifo", str(root / "s1" / catalog.MANIFEST), ""],
           ["folder", str(root / ".s9.partial"), ""],
           ["fifo", str(root / ".s9.partial" / catalog.OWNER), ""])
    listed = json.loads(mxfs("ckpt", "ls", "--json", str(root), timeout=60).stdout)
    assert [(c["name"], c["latest"]) for c in listed["checkpoints"]] == [("s0", False),
                                                                         ("s2", False)]
    line = one_line_error(mxfs("ckpt", "verify", str(root / "s1"), check=False, timeout=60))
    assert "not a regular file" in line
    mxfs("ckpt", "prune", str(root), "--keep", "1", timeout=60)
    assert sorted(os.listdir(root)) == [".s9.partial", "latest", "s1", "s2"]


@pytest.mark.unit
def test_a_manifest_damaged_past_its_shape_checks_is_refused_in_one_line(
        tmp_path: Path) -> None:
    """A tree node naming no device, and a compressed tensor whose frames are empty
    and whose shape is a terabyte: each raised torch's RuntimeError from deep in the
    load (an allocator's, for the second), not the one line a damaged checkpoint
    gets."""
    ck.save({"dev": torch.device("cpu"), "x": torch.ones(2)}, str(tmp_path / "dev")).wait()
    ck.save({"x": torch.ones(1024)}, str(tmp_path / "big"), compress="zstd").wait()
    for case in ("dev", "big"):
        mpath = tmp_path / case / catalog.MANIFEST
        manifest = json.loads(mpath.read_text())
        if case == "dev":
            manifest["tree"]["items"][0][1]["v"] = "bogus"
        else:
            t = manifest["files"]["data.safetensors"]["tensors"]["x"]
            t["shape"], frame = [1 << 38], t["stored"]["frame"]
            t["length"] = 4 << 38
            t["stored"]["frames"] = [0] * -(-(4 << 38) // frame)
            t["stored"]["length"] = 0
        mpath.write_text(json.dumps(manifest))
        with pytest.raises(ck.CheckpointError, match="damaged|cannot be allocated"):
            ck.load(str(tmp_path / case))
