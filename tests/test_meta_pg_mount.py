"""The mount's suites on a pool whose metadata lives on a PostgreSQL server.

The same test functions as the SQLite runs (POSIX surface, the differential state
machine against a plain folder, SIGKILL during a write storm, direct writes,
checkpoints, KV, fsck, scrub, dumps and restores, `mxfs put`), collected here with a
`mounted` fixture whose pool was made with `mxfs mkfs --meta postgresql://...`, plus
what only such a pool has: the superblock names the server without a password, and
nothing of the store is on the members.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import test_differential
import test_meta_backup
from conftest import (
    HAVE_FUSE,
    Mounted,
    check_pool,
    force_unmount,
    make_members,
    mkfs,
    mounted_pool,
    mxfs,
    one_line_error,
)
from hypothesis import HealthCheck, settings
from pg_server import Server, server_or_skip
from test_check import (  # noqa: F401 - collected here, on PostgreSQL
    test_fsck_reports_then_repairs_each_kind_of_damage,
    test_scrub_names_the_damaged_sealed_files_and_members_online,
)
from test_ckpt import (  # noqa: F401
    test_ckpt_cli_lists_removes_and_prunes,
    test_writer_killed_at_each_step_leaves_the_previous_checkpoint,
)
from test_direct_write import (  # noqa: F401
    test_commit_publishes_whole_sealed_file_at_once,
    test_daemon_killed_with_a_file_half_written_reclaims_it_at_mount,
    test_replace_is_atomic_and_exclusive_commits_let_the_first_writer_win,
)
from test_faults import (  # noqa: F401
    test_file_deleted_while_open_is_reclaimed_after_a_crash,
    test_sigkill_during_write_storm_loses_nothing_synced,
)
from test_kv import (  # noqa: F401
    test_capacity_evicts_least_recently_used_but_never_pinned,
    test_index_persists_across_remount_and_daemon_crash,
    test_put_get_round_trip_first_writer_wins,
)
from test_offline_put import (  # noqa: F401
    test_a_put_killed_midway_leaves_nothing,
    test_put_files_read_back_through_the_mount_sealed_and_scrubbed,
)
from test_posix import (  # noqa: F401 - the POSIX surface, on PostgreSQL
    test_chmod_chown_utimens_and_ctime,
    test_directories_and_errors,
    test_hard_links_and_symlinks,
    test_holes_read_as_zeros,
    test_layout_xattr_and_setstripe,
    test_mknod_fifo_and_socket,
    test_mtime_and_ctime_follow_writes_and_entries,
    test_open_flags_trunc_append_excl,
    test_open_unlinked_file_keeps_data_until_last_close,
    test_permissions_are_enforced_for_other_users,
    test_readdir_is_stable_while_entries_change,
    test_rename_replace_noreplace_exchange,
    test_striped_write_and_read_back_across_members,
    test_truncate_down_then_up_reads_zeros,
    test_xattrs_get_set_list_remove,
)

from mxfs.pool import Pool
from mxfs.pool.superblock import read_superblock


@pytest.fixture(scope="module")
def pg() -> Iterator[Server]:
    yield from server_or_skip()


@pytest.fixture
def mounted(tmp_path: Path, members: list[str], pg: Server) -> Iterator[Mounted]:
    """A pool made with --meta on the server, mounted (replaces conftest's here)."""
    if not HAVE_FUSE:
        pytest.skip("needs root and /dev/fuse")
    mkfs(members, "64KiB", "--meta", pg.database())
    with mounted_pool(members) as m:
        yield m


@pytest.fixture(scope="module")
def roots(pg: Server) -> Iterator[None]:
    """The differential state machine's pool, on the server."""
    if not HAVE_FUSE:
        pytest.skip("needs root and /dev/fuse")
    base = Path(tempfile.mkdtemp(prefix="mxfs-diff-"))
    members = make_members(base)
    mkfs(members, "64KiB", "--meta", pg.database())
    mp = base / "mnt"
    mp.mkdir()
    (base / "plain").mkdir()
    mxfs("mount", members[0], str(mp))
    test_differential.ROOTS.update(mxfs=mp, plain=base / "plain")
    try:
        yield
    finally:
        test_differential.ROOTS.clear()
        force_unmount(str(mp))
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.usefixtures("roots")
class TestDifferentialOnPostgres(test_differential.SameAsPlainFolder.TestCase):
    settings = settings(max_examples=40, stateful_step_count=40, deadline=None,
                        suppress_health_check=list(HealthCheck))


@pytest.mark.parametrize("name", ["meta.json", "meta.json.zst"])  # .sql dumps are SQLite's
def test_dump_then_restore_on_the_server(tmp_path: Path, mounted: Mounted, name: str) -> None:
    test_meta_backup.test_dump_then_restore_brings_back_that_namespace(tmp_path, mounted, name)


def test_the_superblock_names_the_server_without_its_password(members: list[str],
                                                             pg: Server) -> None:
    url = pg.database().replace("user=postgres", "user=postgres&password=s3cret")
    mkfs(members, "64KiB", "--meta", url)
    for m in members:
        sb = read_superblock(m)
        assert sb.meta.startswith("postgresql://") or "dbname=" in sb.meta
        assert "s3cret" not in sb.meta
        assert "s3cret" not in Path(m, "mxfs.superblock").read_text()
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
