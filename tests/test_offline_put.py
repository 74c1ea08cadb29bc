"""`mxfs put`: files copied into an unmounted pool arrive whole and sealed, or not at all."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import CRASH, Mounted, kill_daemon, mxfs, one_line_error
from users import ensure_users

from mxfs.meta import MetaStore
from mxfs.pool import Pool


@pytest.mark.also_postgres
def test_put_files_read_back_through_the_mount_sealed_and_scrubbed(
        mounted: Mounted, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    blobs = {"a.bin": random.Random(1).randbytes(3_000_000), "b.bin": b"",
             "c.bin": random.Random(2).randbytes(65536 * 4 + 1)}
    for name, data in blobs.items():
        (src / name).write_bytes(data)
    (mounted.path / "models").mkdir()
    (mounted.path / "models" / "a.bin").write_bytes(b"old bytes, to be replaced")
    mounted.umount()
    out = mxfs("put", mounted.members[0], *[str(src / n) for n in blobs], "--to", "/models")
    assert "put 3 files" in out.stdout
    mounted.remount()
    for name, data in blobs.items():
        assert (mounted.path / "models" / name).read_bytes() == data, name
    with pytest.raises(PermissionError):  # sealed, as a direct commit seals
        open(mounted.path / "models" / "a.bin", "r+b").close()
    scrub = json.loads(mxfs("scrub", str(mounted.path), "--json").stdout)
    assert scrub == {"checked": 3, "damaged": [], "unchecked": []}  # each put file has sums


def clean_flag(member: str) -> str | None:
    store = MetaStore.open(Pool.open(member).meta_location, readonly=True)
    try:
        return store.setting("clean")
    finally:
        store.close()


def test_put_refuses_bad_input_in_one_line(mounted: Mounted, tmp_path: Path) -> None:
    f = tmp_path / "f.bin"
    f.write_bytes(b"data")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "f.bin").write_bytes(b"more")
    assert clean_flag(mounted.members[0]) == "0"  # the mounted daemon's
    assert "mounted" in one_line_error(mxfs("put", mounted.members[0], str(f), check=False))
    assert clean_flag(mounted.members[0]) == "0"  # the refused put wrote nothing
    mounted.umount()
    line = one_line_error(mxfs("put", mounted.members[0], str(f),
                               str(tmp_path / "other" / "f.bin"), check=False))
    assert "same name" in line
    g = tmp_path / "g.bin"
    g.write_bytes(b"g")
    mxfs("put", mounted.members[0], str(g))  # (--to a missing folder makes it: test_newcomer)
    for where in ("/g.bin", "/g.bin/sub"):
        line = one_line_error(mxfs("put", mounted.members[0], str(f), "--to", where,
                                   check=False))
        assert f"{where} is not a folder in the pool" in line
    line = one_line_error(mxfs("put", mounted.members[0], str(tmp_path / "missing"),
                               check=False))
    assert "is not a file" in line
    mounted.remount()
    assert not (mounted.path / "f.bin").exists() and (mounted.path / "g.bin").exists()


@pytest.mark.also_postgres
@pytest.mark.daemon_log(CRASH)  # (the killed put left the store for the mount to check)
def test_a_put_killed_midway_leaves_nothing(mounted: Mounted, tmp_path: Path) -> None:
    big = tmp_path / "big.bin"
    with open(big, "wb") as f:
        for _ in range(48):
            f.write(os.urandom(8 << 20))
    mounted.umount()
    chunk_dirs = [Path(m) / "chunks" for m in mounted.members]
    before = {p for d in chunk_dirs for p in d.rglob("*") if p.is_file()}
    proc = subprocess.Popen([sys.executable, "-m", "mxfs", "put", mounted.members[0], str(big)])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        new = {p for d in chunk_dirs for p in d.rglob("*") if p.is_file()} - before
        if any(p.stat().st_size > (16 << 20) for p in new):
            break
        time.sleep(0.005)
    assert proc.poll() is None, "the put ended before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    small = tmp_path / "small.bin"
    small.write_bytes(b"s" * 1000)
    mxfs("put", mounted.members[0], str(small))  # reclaims what the killed put left
    fsck = mxfs("fsck", mounted.members[0], check=False)
    assert fsck.returncode == 0, fsck.stdout + fsck.stderr
    left = {p for d in chunk_dirs for p in d.rglob("*") if p.is_file()} - before
    assert len(left) == 1 and left.pop().stat().st_size == 1000  # small.bin's only
    mounted.remount()
    assert not (mounted.path / "big.bin").exists()
    assert (mounted.path / "small.bin").read_bytes() == small.read_bytes()


def test_put_refuses_a_tenants_link_and_no_copy_is_more_readable_than_its_file(
        mounted: Mounted, tmp_path: Path) -> None:
    alice = ensure_users()["alice"]
    secret = tmp_path / "secret"  # root's, 0600: what alice's link points at
    secret.write_bytes(b"root's secret, not for the pool\n")
    os.chmod(secret, 0o600)
    upload = tmp_path / "upload"  # the folder alice hands root to put
    upload.mkdir()
    os.chown(upload, alice.uid, alice.gid)
    link = upload / "model.safetensors"
    os.symlink(secret, link)
    os.lchown(link, alice.uid, alice.gid)
    mounted.umount()
    chunks = Path(mounted.members[0]) / "chunks"
    before = sorted(p for d in (Path(m) / "chunks" for m in mounted.members)
                    for p in d.rglob("*"))
    line = one_line_error(mxfs("put", mounted.members[0], str(link), check=False))
    assert f"{link} is a symbolic link" in line and "real path" in line, line
    line = one_line_error(mxfs("put", mounted.members[0], "/dev/zero", check=False))
    assert "/dev/zero is a character device, not a regular file" in line, line
    after = sorted(p for d in (Path(m) / "chunks" for m in mounted.members)
                   for p in d.rglob("*"))
    assert after == before and chunks.is_dir()  # nothing of either landed
    modes = {"private.bin": 0o600, "group.bin": 0o640, "tool.bin": 0o755}
    for name, mode in modes.items():
        (upload / name).write_bytes(name.encode())
        os.chown(upload / name, alice.uid, alice.gid)
        os.chmod(upload / name, mode)
    mxfs("put", mounted.members[0], *[str(upload / n) for n in modes])
    mounted.remount()
    assert not os.path.lexists(mounted.path / "model.safetensors")
    for name, mode in modes.items():  # root's, its file's bits, never more than 0644
        st = os.stat(mounted.path / name)
        assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (0, 0, mode & 0o644), name
        assert (mounted.path / name).read_bytes() == name.encode()


def test_put_copies_the_files_it_opened_whatever_is_swapped_in_meanwhile(
        mounted: Mounted, tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    mounted.umount()
    line = one_line_error(mxfs("put", mounted.members[0], str(fifo), check=False, timeout=60))
    assert f"{fifo} is a FIFO, not a regular file" in line, line
    big = tmp_path / "a.bin"  # long enough to copy that the swaps land while it is copied
    piece = os.urandom(8 << 20)
    with open(big, "wb") as f:
        for _ in range(32):
            f.write(piece)
    small = tmp_path / "b.bin"
    small.write_bytes(b"b" * 5000)
    chunk_dirs = [Path(m) / "chunks" for m in mounted.members]
    before = {p for d in chunk_dirs for p in d.rglob("*") if p.is_file()}
    proc = subprocess.Popen([sys.executable, "-m", "mxfs", "put", mounted.members[0],
                             str(big), str(small)], stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if {p for d in chunk_dirs for p in d.rglob("*") if p.is_file()} - before:
            break  # the first file's copy has begun
        time.sleep(0.002)
    assert proc.poll() is None, "the put ended before anything could be swapped"
    with open(big, "ab") as f:
        f.write(b"Z" * (1 << 20))  # grows while it is copied
    os.mkfifo(tmp_path / "swap")
    os.rename(tmp_path / "swap", small)  # a FIFO where the second file was: nobody writes it
    try:
        assert proc.wait(timeout=120) == 0
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError("the put blocked on a FIFO swapped in for a file") from None
    mounted.remount()
    assert (mounted.path / "b.bin").read_bytes() == b"b" * 5000
    assert os.stat(mounted.path / "a.bin").st_size == 32 * len(piece)  # as it was opened
    with open(mounted.path / "a.bin", "rb") as f:
        while block := f.read(len(piece)):
            assert block == piece


@pytest.mark.daemon_log(CRASH)
def test_a_put_after_a_crash_leaves_the_store_to_the_next_mounts_check(
        mounted: Mounted, tmp_path: Path) -> None:
    """A daemon killed leaves its store marked unclean, and the next mount checks every
    page of it; a `mxfs put` in between (which does not) marked it clean as it closed,
    and the next mount checked nothing.  The mark stays for the mount now."""
    kill_daemon(mounted)
    small = tmp_path / "small.bin"
    small.write_bytes(b"s" * 1000)
    mxfs("put", mounted.members[0], str(small))
    pool = Pool.open(mounted.members[0])
    store = MetaStore.open(pool.meta_location, readonly=True)
    try:
        assert store.setting("clean") != "1"
    finally:
        store.close()
    mounted.remount()
    assert (mounted.path / "small.bin").read_bytes() == small.read_bytes()
