"""What only a pool whose metadata lives on a PostgreSQL server has: the superblock
names the server without a password, nothing of the store is on the members, mkfs
will not take another pool's database, migration there and back.

The mount's suites run on such a pool too: their tests marked `also_postgres` (the
POSIX surface, SIGKILL during a write storm, direct writes, checkpoints, KV, fsck,
scrub, dumps and restores, `mxfs put`) run a second time with `meta_engine`
"postgresql", and `test_differential` has a class of its own on the server.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
from conftest import (
    HAVE_FUSE,
    Mounted,
    check_pool,
    force_unmount,
    make_members,
    mkfs,
    mxfs,
    one_line_error,
)
from pg_server import Server

from mxfs.pool import Pool
from mxfs.pool.superblock import read_superblock


@pytest.fixture
def meta_engine() -> str:
    """Every pool of this module keeps its metadata on the server."""
    return "postgresql"


@pytest.fixture
def pg(pg_cluster: Server) -> Server:
    return pg_cluster


def test_the_superblock_names_the_server_without_its_password(members: list[str],
                                                             pg: Server) -> None:
    url = pg.database().replace("user=postgres",
                                "user=postgres&password=s3cret&sslpassword=k3ypass")
    mkfs(members, "64KiB", "--meta", url)
    for m in members:
        sb = read_superblock(m)
        assert sb.meta.startswith("postgresql://") or "dbname=" in sb.meta
        assert "s3cret" not in sb.meta and "k3ypass" not in sb.meta
        text = Path(m, "mxfs.superblock").read_text()  # (0644: anyone reads it)
        assert "s3cret" not in text and "k3ypass" not in text
    assert not os.path.exists(os.path.join(members[0], "meta", "mxfs.db"))
    pool = Pool.open(members[0])
    assert pool.meta_location == read_superblock(members[0]).meta
    check_pool(members)
    line = one_line_error(mxfs("mkfs", "--force", "--stripe-unit", "64KiB",
                               *[a for m in members for a in ("--member", m)],
                               "--meta", "/not/a/url", check=False))
    assert "--meta" in line


def test_mkfs_will_not_take_another_pools_database(tmp_path: Path, pg: Server) -> None:
    url = pg.database()
    first, second = make_members(tmp_path / "a", 2), make_members(tmp_path / "b", 2)
    mkfs(first, "64KiB", "--meta", url)
    args = ["mkfs", *[a for m in second for a in ("--member", m)], "--meta", url]
    line = one_line_error(mxfs(*args, check=False))
    assert "holds the metadata of pool" in line and "--force" in line
    assert not os.listdir(second[0])  # nothing was written
    mxfs(*args, "--force")
    line = one_line_error(mxfs("fsck", first[0], check=False))
    assert "belongs to pool" in line  # the first pool's metadata went with --force


def test_a_server_that_is_gone_is_one_clear_error(members: list[str]) -> None:
    line = one_line_error(mxfs("mkfs", *[a for m in members for a in ("--member", m)],
                               "--meta", "postgresql:///none?host=/nonexistent", check=False))
    assert "cannot be reached" in line
    assert not os.listdir(members[0])


def test_meta_backup_says_the_server_keeps_the_copies(mounted: Mounted) -> None:
    line = one_line_error(mxfs("meta", "backup", str(mounted.path), check=False))
    assert "pg_dump" in line


def test_migrate_moves_a_pool_to_the_server_and_back(tmp_path: Path, members: list[str],
                                                     pg: Server) -> None:
    if not HAVE_FUSE:
        pytest.skip("needs root and /dev/fuse")
    mkfs(members)  # SQLite on member 0
    mp = Path(tempfile.mkdtemp(prefix="mxfs-mnt-"))
    m = Mounted(mp, members)
    try:
        m.remount()
        (mp / "d").mkdir()
        data = os.urandom(300_000)
        (mp / "d" / "f").write_bytes(data)
        os.link(mp / "d" / "f", mp / "g")
        os.setxattr(mp / "g", "user.k", b"v")
        ino = os.stat(mp / "g").st_ino
        m.umount()
        url = pg.database()
        assert "switched the pool" in mxfs("meta", "migrate", members[0], "--to", url).stdout
        assert read_superblock(members[3]).meta == url
        assert not os.path.exists(os.path.join(members[0], "meta", "mxfs.db"))
        line = one_line_error(mxfs("meta", "migrate", members[0], "--to", url, check=False))
        assert "already lives" in line
        m.remount()
        assert (mp / "d" / "f").read_bytes() == data and os.stat(mp / "g").st_nlink == 2
        assert os.getxattr(mp / "g", "user.k") == b"v"
        (mp / "new").write_bytes(b"n")
        assert os.stat(mp / "new").st_ino > ino  # numbers go on past the copied ones
        m.umount()
        check_pool(members)
        mxfs("meta", "migrate", members[0], "--to", "member")
        assert read_superblock(members[0]).meta == ""
        m.remount()
        assert (mp / "d" / "f").read_bytes() == data
        assert (mp / "new").read_bytes() == b"n"
        m.umount()
        check_pool(members)
    finally:
        force_unmount(str(mp))
        os.rmdir(mp)
