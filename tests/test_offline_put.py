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
from conftest import Mounted, mxfs, one_line_error

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
