"""mkfs, mount and umount refuse bad input with one clear line each."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import (
    eventually,
    force_unmount,
    make_members,
    mkfs,
    mounted_pool,
    mxfs,
    needs_fuse,
    one_line_error,
)
from users import ensure_users

from mxfs.pool import read_superblock
from mxfs.pool.superblock import write_superblock
from mxfs.proc import running
from mxfs.vol.mounts import wait_pid_gone


def write_config(path: Path, members: list[str]) -> None:
    path.write_text("members = [" + ", ".join(f'"{m}"' for m in members) + "]\n")


def test_mkfs_writes_a_superblock_per_member(members: list[str]) -> None:
    res = mxfs("mkfs", "--json", "--label", "lab", "--stripe-unit", "128k",
               *[a for m in members for a in ("--member", m)])
    info = json.loads(res.stdout)
    for i, m in enumerate(members):
        sb = read_superblock(m)
        assert (sb.pool_uuid, sb.member_index, sb.member_count, sb.stripe_unit) == \
            (info["pool_uuid"], i, 4, 128 * 1024)
        assert sb.label == "lab"
    assert os.path.exists(os.path.join(members[0], "meta", "mxfs.db"))


def test_mkfs_refuses_a_member_of_another_pool_unless_forced(members: list[str]) -> None:
    mkfs(members)
    line = one_line_error(mxfs("mkfs", "--member", members[0], check=False))
    assert "already belongs to pool" in line and "--force" in line
    old = read_superblock(members[0]).pool_uuid
    mxfs("mkfs", "--force", "--member", members[0], "--member", members[1])
    assert read_superblock(members[0]).pool_uuid != old


def test_mkfs_refuses_the_same_member_twice(members: list[str]) -> None:
    line = one_line_error(mxfs("mkfs", "--member", members[0], "--member",
                               members[0] + "/.", check=False))
    assert "given twice" in line


def test_mkfs_refuses_a_non_empty_folder(members: list[str]) -> None:
    Path(members[1], "precious.txt").write_text("keep me")
    line = one_line_error(mxfs("mkfs", "--member", members[0], "--member", members[1],
                               check=False))
    assert "not empty" in line and members[1] in line
    assert Path(members[1], "precious.txt").read_text() == "keep me"
    assert not os.path.exists(os.path.join(members[0], "mxfs.superblock"))


def test_mkfs_refuses_a_stripe_unit_not_a_multiple_of_4k(members: list[str]) -> None:
    line = one_line_error(mxfs("mkfs", "--stripe-unit", "5000", "--member", members[0],
                               check=False))
    assert "multiple of 4 KiB" in line


def test_wrong_flags_and_sizes_are_one_line(members: list[str]) -> None:
    assert "unrecognized" in one_line_error(mxfs("mkfs", "--member", members[0], "--bogus",
                                                 check=False))
    assert "bad size" in one_line_error(mxfs("mkfs", "--stripe-unit", "lots",
                                             "--member", members[0], check=False))
    assert "required" in one_line_error(mxfs("mkfs", check=False))


@needs_fuse
def test_mount_refuses_a_missing_member(tmp_path: Path, members: list[str]) -> None:
    mkfs(members)
    os.rename(members[2], members[2] + ".gone")
    (tmp_path / "mnt").mkdir()
    line = one_line_error(mxfs("mount", members[0], str(tmp_path / "mnt"), check=False))
    assert "member 2" in line and "missing" in line


@needs_fuse
@pytest.mark.parametrize("fault", ["foreign", "twice", "copied"])
def test_mount_refuses_a_bad_member_list(tmp_path: Path, members: list[str],
                                         fault: str) -> None:
    """A member of another pool, one folder listed twice, a copy of a member."""
    mkfs(members)
    listed = list(members)
    if fault == "foreign":
        other = make_members(tmp_path / "other", 2)
        mkfs(other)
        listed[2], expect = other[1], ["another pool", other[1]]
    elif fault == "twice":
        listed[2], expect = members[1], ["listed twice", members[1]]
    else:
        shutil.copytree(members[1], tmp_path / "copy")
        listed[2], expect = str(tmp_path / "copy"), ["both claim index 1"]
    conf = tmp_path / "pool.toml"
    write_config(conf, listed)
    (tmp_path / "mnt").mkdir()
    line = one_line_error(mxfs("mount", str(conf), str(tmp_path / "mnt"), check=False))
    assert all(e in line for e in expect), line


@needs_fuse
def test_mount_point_missing_not_empty_or_busy(tmp_path: Path, members: list[str]) -> None:
    mkfs(members)
    line = one_line_error(mxfs("mount", members[0], str(tmp_path / "nowhere"), check=False))
    assert "does not exist" in line and "mkdir" in line
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("x")
    line = one_line_error(mxfs("mount", members[0], str(full), check=False))
    assert "not empty" in line
    mp = tmp_path / "mnt"
    mp.mkdir()
    mxfs("mount", members[0], str(mp))
    try:
        line = one_line_error(mxfs("mount", members[0], str(mp), check=False))
        assert "busy" in line
        mp2 = tmp_path / "mnt2"
        mp2.mkdir()
        line = one_line_error(mxfs("mount", members[0], str(mp2), check=False))
        assert "already mounted" in line and str(mp) in line
    finally:
        mxfs("umount", str(mp))
    line = one_line_error(mxfs("umount", str(mp), check=False))
    assert "not mounted" in line


@needs_fuse
def test_status_reports_a_stopped_daemon_instead_of_hanging(mounted) -> None:
    """Finding a daemon's socket touches its mount, which a stopped daemon never
    answers: status says so (exit 2) instead of waiting with it."""
    import signal

    pid = mounted.daemon_pid()
    os.kill(pid, signal.SIGSTOP)
    try:
        res = mxfs("status", "--timeout", "2", str(mounted.path), check=False, timeout=120)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert res.returncode == 2 and "daemon not answering" in res.stdout, res
    assert "stopped or hung" in res.stdout
    assert str(mounted.path) in mxfs("status", str(mounted.path)).stdout  # answers again


@needs_fuse
def test_commands_on_a_mount_whose_daemon_died_say_so(tmp_path: Path) -> None:
    """A daemon killed leaves its mount dead (ENOTCONN): df said the path was on no
    mxfs mount, warm that it did not exist (or warmed nothing and exited 0), scrub
    and quota gave the bare errno.  Each says the daemon died, and what to run."""
    import signal

    members = make_members(tmp_path)
    mkfs(members)
    mp = tmp_path / "mnt"
    mp.mkdir()
    mxfs("mount", members[0], str(mp))
    (mp / "d").mkdir()
    pid = int(json.loads(mxfs("status", "--json", str(mp)).stdout)["pid"])
    os.kill(pid, signal.SIGKILL)
    assert wait_pid_gone(pid, 30)
    try:
        for args in (["df", str(mp)], ["scrub", str(mp)], ["quota", str(mp)],
                     ["warm", str(mp)], ["warm", str(mp / "d")]):
            line = one_line_error(mxfs(*args, check=False, timeout=60))
            assert "died" in line and "umount" in line, (args, line)
    finally:
        mxfs("umount", str(mp))


def test_warm_reads_the_folders_regular_files_and_nothing_a_link_leads_out_to(
        tmp_path: Path) -> None:
    """`warm` of a folder opened what each name led to: a FIFO waited for a writer,
    /dev/zero read forever, and a tenant's link to /proc/kmsg (which procfs calls a
    regular file) held root's warm for good, eating the kernel's log.  Only regular
    files of the folder's own file system are read, the rest named as skipped."""
    folder = tmp_path / "models"
    folder.mkdir()
    (folder / "w.bin").write_bytes(b"w" * 5000)
    (folder / "blob").write_bytes(b"b" * 3000)
    (folder / "snap.bin").symlink_to(folder / "blob")  # (a hub cache's link: read)
    os.mkfifo(folder / "fifo")
    (folder / "zero").symlink_to("/dev/zero")
    (folder / "kmsg").symlink_to("/proc/kmsg")
    (folder / "gone").symlink_to(folder / "nowhere")  # (dangling: skipped, not fatal)
    res = mxfs("warm", "--json", str(folder), timeout=60)
    assert json.loads(res.stdout)["bytes"] == 5000 + 3000 + 3000
    assert "skipped 4 paths" in res.stderr


def test_warm_judges_each_file_again_as_it_opens_it(tmp_path: Path) -> None:
    """Swapped after the walk for a link out of the folder's file system (to
    /proc/kmsg, which reads forever) or for a FIFO, a file was opened to read all the
    same; now it is looked at without being opened, and skipped."""
    from mxfs.cli.main import _open_regular, _regular_files

    (tmp_path / "a").write_bytes(b"a")
    (tmp_path / "b").write_bytes(b"b")
    (tmp_path / "c").write_bytes(b"c")
    files = _regular_files([str(tmp_path)])
    assert [os.path.basename(f) for f, _ in files] == ["a", "b", "c"]
    (tmp_path / "a").unlink()
    (tmp_path / "a").symlink_to("/proc/self/status")
    (tmp_path / "b").unlink()
    os.mkfifo(tmp_path / "b")
    opened = [_open_regular(f, dev) for f, dev in files]
    assert opened[:2] == [None, None] and opened[2] is not None
    assert os.read(opened[2], 10) == b"c"
    os.close(opened[2])


def test_a_mount_point_over_or_inside_the_pools_members_is_refused(tmp_path: Path) -> None:
    """Mounted over its own members (-o nonempty), the daemon's opens of its chunk files
    went through its own mount and hung it for good (state D); mounted inside one,
    what was written there was stored as zeros.  Refused, one line each."""
    members = make_members(tmp_path / "pool")
    mkfs(members)
    for mp, how in ((tmp_path / "pool", "holds"), (Path(members[1]), "is"),
                    (Path(members[0], "chunks"), "is in")):
        mp.mkdir(exist_ok=True)
        line = one_line_error(mxfs("mount", members[0], str(mp), "-o", "nonempty",
                                   check=False, timeout=60))
        assert f"{how} the pool's member folder" in line, line
        assert not os.path.ismount(mp)


@needs_fuse
def test_umount_detaches_a_stopped_daemons_mount_instead_of_hanging(
        tmp_path: Path) -> None:
    """Finding the daemon to ask touches its mount, which a stopped daemon never
    answers: `mxfs umount` hung with it, forever.  It asks a while, then detaches the
    mount and says why."""
    import signal

    members = make_members(tmp_path)
    mkfs(members)
    mp = tmp_path / "mnt"
    mp.mkdir()
    mxfs("mount", members[0], str(mp))
    pid = int(json.loads(mxfs("status", "--json", str(mp)).stdout)["pid"])
    os.kill(pid, signal.SIGSTOP)
    try:
        res = mxfs("umount", "--timeout", "2", str(mp), check=False, timeout=60)
    finally:
        os.kill(pid, signal.SIGCONT)
        os.kill(pid, signal.SIGTERM)
    assert res.returncode == 0 and "did not answer" in res.stdout, res
    assert not os.path.ismount(mp)
    assert wait_pid_gone(pid, 30)


@needs_fuse
def test_status_reports_members_capacity_and_daemon(tmp_path: Path, mounted) -> None:
    res = json.loads(mxfs("status", "--json", str(mounted.path)).stdout)
    assert res["mountpoint"] == str(mounted.path)
    assert [m["path"] for m in res["members"]] == mounted.members
    assert all(m["size"] > 0 and m["free"] > 0 for m in res["members"])
    assert res["pid"] == mounted.daemon_pid()
    by_pool = json.loads(mxfs("status", "--json", mounted.members[2]).stdout)
    assert by_pool["pid"] == res["pid"]
    # Every mount is listed; the exit code speaks for all of them, not only this test's.
    assert str(mounted.path) in mxfs("status", check=False).stdout


@contextmanager
def tenant_mount(uid: int, gid: int, allow_other: bool) -> Iterator[str]:
    """A fuse.mxfs mount of `uid`'s (its FUSE user_id), as fusermount3 makes one for any
    user (here /dev/fuse is root's alone, so root makes it with her ids), served by
    nobody: the device is held and never read, as a hung daemon's is."""
    mp = tempfile.mkdtemp(prefix="mxfs-tenant-")
    fd = os.open("/dev/fuse", os.O_RDWR)
    opts = f"fd={fd},rootmode=40000,user_id={uid},group_id={gid}"
    libc = ctypes.CDLL(None, use_errno=True)
    ms_nosuid_nodev = 2 | 4
    try:
        assert libc.mount(b"mxfs:tenant", mp.encode(), b"fuse.mxfs", ms_nosuid_nodev,
                          (opts + (",allow_other" if allow_other else "")).encode()) == 0, \
            os.strerror(ctypes.get_errno())
        yield mp
    finally:
        os.close(fd)  # the connection is aborted: nothing waits on it any more
        subprocess.run(["umount", "-l", mp], capture_output=True)
        os.rmdir(mp)


# In a mount namespace of its own, rid of every fuse.mxfs mount but the test's (other
# tests' on this host may be stopped on purpose): `mxfs status` as root, with no target.
ONLY_THESE = """
import ctypes, sys
from mxfs.cli.main import main
from mxfs.proto.mountinfo import mount_table
libc = ctypes.CDLL(None, use_errno=True)
while rest := [mp for mp, kind in mount_table().items()
               if kind == "fuse.mxfs" and mp not in sys.argv[1:]]:
    for mp in rest:
        assert libc.umount2(mp.encode(), 2) == 0, mp  # MNT_DETACH
sys.exit(main(["status", "--timeout", "5"]))
"""


@needs_fuse
def test_status_of_every_mount_leaves_other_users_mounts_out(mounted) -> None:
    """Any user may mount a fuse.mxfs of her own, which root may not enter (no
    allow_other) or which hangs: root's `mxfs status` names them apart and its exit
    code (a monitor's signal) speaks only for root's own pools."""
    alice = ensure_users()["alice"]
    with tenant_mount(alice.uid, alice.gid, allow_other=False) as closed, \
            tenant_mount(alice.uid, alice.gid, allow_other=True) as hung:
        res = subprocess.run(["unshare", "--mount", "--propagation", "private",
                              sys.executable, "-c", ONLY_THESE, str(mounted.path), closed,
                              hung], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res
    assert f"mounted on {mounted.path}" in res.stdout
    for mp in (closed, hung):
        assert f"{mp}: uid {alice.uid}'s mount, not asked" in res.stdout


def test_status_of_an_unmounted_pool(members: list[str]) -> None:
    mkfs(members)
    res = json.loads(mxfs("status", "--json", members[1]).stdout)
    assert res["mountpoint"] is None and len(res["members"]) == 4


def test_a_zombie_is_not_running_so_umount_does_not_wait_for_its_reaping() -> None:
    """A daemon's parent is init, which may reap late: once it has exited, umount is done."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        stat = Path(f"/proc/{child.pid}/stat")
        # exited, not yet reaped: os.kill(pid, 0) still finds it
        assert eventually(lambda: stat.read_text().rsplit(")", 1)[1].split()[0] == "Z")
        os.kill(child.pid, 0)
        assert not running(child.pid)
        assert wait_pid_gone(child.pid, 5)
    finally:
        child.wait()
    assert not running(child.pid)
    assert running(os.getpid())


def test_mkfs_refuses_a_label_that_would_add_mount_options(members: list[str]) -> None:
    """The label names the mount (fsname=mxfs:LABEL): a ',' in it added options."""
    line = one_line_error(mxfs("mkfs", "--label", "lab,dev,suid",
                               *[a for m in members for a in ("--member", m)], check=False))
    assert "label 'lab,dev,suid'" in line and "letters, digits" in line
    assert not any(os.listdir(m) for m in members)  # nothing written


def test_node_add_refuses_a_label_that_would_add_mount_options(tmp_path: Path) -> None:
    config = tmp_path / "node.toml"
    line = one_line_error(mxfs("node", "add", "--meta", "postgresql://db/mxfs", "--key",
                               str(tmp_path / "key"), "--name", "b", "--config", str(config),
                               "--label", "lab,suid", check=False))
    assert "label 'lab,suid'" in line and not config.exists()


def mount_options(mp: Path) -> tuple[set[str], str]:
    """The kernel's options of the mount on `mp` and its source (fsname)."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[4] == str(mp):
            after = fields[fields.index("-") + 1:]
            return set(fields[5].split(",")) | set(after[2].split(",")), after[1]
    raise AssertionError(f"{mp} is not mounted")


@needs_fuse
@pytest.mark.daemon_log(r"the pool's label .* holds characters a mount option cannot")
def test_a_pool_label_from_before_cannot_add_mount_options(members: list[str]) -> None:
    """A label written before labels were checked (by an older mxfs) names no mount
    option: the mount is named by the pool's uuid and stays nosuid and nodev."""
    mkfs(members)
    for m in members:
        write_superblock(m, replace(read_superblock(m), label="lab,dev,suid"))
    with mounted_pool(members) as mnt:
        opts, source = mount_options(mnt.path)
        assert {"nosuid", "nodev"} <= opts, opts
        assert source == f"mxfs:{read_superblock(members[0]).pool_uuid[:8]}"


@needs_fuse
def test_suid_or_dev_with_allow_other_is_refused(tmp_path: Path, members: list[str]) -> None:
    mkfs(members)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    for opt in ("suid", "dev"):
        try:
            line = one_line_error(mxfs("mount", "-o", f"allow_other,{opt}", members[0],
                                       str(mnt), check=False))
        finally:
            force_unmount(str(mnt))  # (were it mounted after all)
        assert f"mount option {opt} with allow_other" in line, line
