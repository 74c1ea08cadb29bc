"""Metadata safety: online backups, dumps and restores, recovery from a damaged store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CRASH, Mounted, check_pool, chunk_files, eventually, mxfs, one_line_error


def _corrupt(m: Mounted) -> None:
    db = Path(m.members[0]) / "meta" / "mxfs.db"
    with open(db, "r+b") as f:
        f.seek(0)
        f.write(b"this is not a database" * 200)


@pytest.mark.daemon_log(r"recovered from the backup", CRASH)
def test_damaged_store_is_recovered_from_the_newest_backup_at_mount(mounted: Mounted) -> None:
    (mounted.path / "before").write_bytes(b"b" * 200_000)
    out = json.loads(mxfs("meta", "backup", "--json", str(mounted.path)).stdout)
    assert out["backup"].startswith(mounted.members[1])  # the member after the metadata one
    (mounted.path / "after").write_bytes(b"a" * 200_000)  # not in the backup
    mounted.umount()
    listed = json.loads(mxfs("meta", "ls", "--json", mounted.members[0]).stdout)
    assert [c["problem"] for c in listed] == [None]
    _corrupt(mounted)
    res = mxfs("mount", "-o", "allow_other", mounted.members[0], str(mounted.path))
    assert "warning: the metadata store was recovered from the backup" in res.stderr
    assert "changes made after that backup are lost" in res.stderr
    assert (mounted.path / "before").read_bytes() == b"b" * 200_000
    assert not (mounted.path / "after").exists()
    mounted.umount()
    check_pool(mounted.members)  # the lost file's chunk files were dropped too


def test_damaged_store_without_a_backup_refuses_the_mount(mounted: Mounted) -> None:
    mounted.umount()
    _corrupt(mounted)
    line = one_line_error(mxfs("mount", mounted.members[0], str(mounted.path), check=False))
    assert "no good backup" in line and "mxfs meta restore" in line


def test_the_daemon_backs_up_on_a_schedule(tmp_path: Path, mounted: Mounted) -> None:
    mounted.umount()
    mxfs("mount", "-o", "allow_other,meta_backup=1", mounted.members[0], str(mounted.path))
    backups = Path(mounted.members[1]) / "meta-backup"
    assert eventually(lambda: backups.is_dir() and len(os.listdir(backups)) >= 2)
    assert len([n for n in os.listdir(backups) if n.endswith(".db")]) <= 3  # the newest kept


@pytest.mark.daemon_log(r"metadata backup failed \(the next is tried")
def test_a_full_backup_member_fails_backups_not_the_daemon(loop_members: list[str]) -> None:
    """A user fills member 1 (where backups go) with ordinary bytes: each backup fails
    with one logged line and leaves no half copy; the daemon and its mount go on, and
    backups resume once there is room."""
    from conftest import mkfs, mounted_pool

    mkfs(loop_members)
    backups = Path(loop_members[1]) / "meta-backup"
    with mounted_pool(loop_members) as m:
        m.umount()
        mxfs("mount", "-o", "allow_other,meta_backup=1", loop_members[0], str(m.path))
        pid = m.daemon_pid()
        assert eventually(lambda: backups.is_dir() and len(os.listdir(backups)) >= 1)
        for old in backups.iterdir():
            old.unlink()
        filler = Path(loop_members[1]) / "filler"
        with open(filler, "wb") as f:
            try:
                while True:
                    f.write(b"\xff" * (1 << 20))
                    f.flush()
            except OSError:
                pass
        for _ in range(3):  # three backup rounds against the full member
            (m.path / "still-served").write_bytes(b"y" * 100)
            subprocess.run(["sleep", "1.2"])
        assert m.daemon_pid() == pid
        assert not [n for n in os.listdir(backups) if n.endswith((".tmp", "-journal"))]
        filler.unlink()
        assert eventually(lambda: any(n.endswith(".db") for n in os.listdir(backups)))
        assert (m.path / "still-served").read_bytes() == b"y" * 100


@pytest.mark.also_postgres
@pytest.mark.parametrize("name", ["meta.sql.zst", "meta.json", "meta.json.zst"])
def test_dump_then_restore_brings_back_that_namespace(tmp_path: Path, mounted: Mounted,
                                                      name: str, meta_engine: str) -> None:
    if meta_engine == "postgresql" and ".sql" in name:
        pytest.skip(".sql dumps are SQLite's own")
    (mounted.path / "d").mkdir()
    (mounted.path / "d" / "kept").write_bytes(os.urandom(300_000))
    kept = (mounted.path / "d" / "kept").read_bytes()
    os.setxattr(mounted.path / "d" / "kept", "user.tag", b"\x00\xffbin")
    dump = tmp_path / name
    rows = json.loads(mxfs("meta", "dump", "--json", str(dump), str(mounted.path)).stdout)
    assert rows["rows"] > 3 and dump.stat().st_size > 0
    (mounted.path / "d" / "later").write_bytes(os.urandom(300_000))
    before = len(chunk_files(mounted.members))
    line = one_line_error(mxfs("meta", "restore", str(dump), mounted.members[0], check=False))
    assert "is mounted" in line
    mounted.umount()
    mxfs("meta", "restore", str(dump), mounted.members[0])
    assert len(chunk_files(mounted.members)) < before  # the later file's chunks are gone
    check_pool(mounted.members)
    mounted.remount()
    assert sorted(os.listdir(mounted.path / "d")) == ["kept"]
    assert (mounted.path / "d" / "kept").read_bytes() == kept
    assert os.getxattr(mounted.path / "d" / "kept", "user.tag") == b"\x00\xffbin"
    (mounted.path / "new").write_bytes(b"n")  # inode numbers go on from where they were
    assert os.stat(mounted.path / "new").st_ino > os.stat(mounted.path / "d" / "kept").st_ino


def test_restore_refuses_what_is_not_a_dump(tmp_path: Path, mounted: Mounted) -> None:
    mounted.umount()
    junk = tmp_path / "junk.sql"
    junk.write_text("this is not SQL at all;")
    line = one_line_error(mxfs("meta", "restore", str(junk), mounted.members[0], check=False))
    assert "junk.sql" in line
    line = one_line_error(mxfs("meta", "dump", str(tmp_path / "x.txt"), mounted.members[0],
                               check=False))
    assert ".sql" in line
    res = subprocess.run([sys.executable, "-m", "mxfs", "fsck", mounted.members[0]],
                         capture_output=True, text=True)
    assert res.returncode == 0  # the pool was not touched
