"""The pool's daemon lease (mxfs/meta/lease.py): a row naming who serves the pool.

On both engines: a live lease of another host refuses a second holder and names it,
one that ran out is taken over, a lease of this host (a dead daemon's: the caller
holds the node's file lock) is taken over, renewing a lease someone took says so, and
dropping removes only one's own.  Through a real mount on PostgreSQL: the daemon holds
the row while mounted and gives it back at unmount; a mount and an offline writer are
refused while another host's lease is live, each with one line naming it; a daemon
whose lease another host took refuses changes (EROFS) with one log line, and still
unmounts.  Other hosts are rows written as another node's daemon would write them.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import HAVE_FUSE, eventually, make_members, mkfs, mounted_pool, mxfs, one_line_error
from pg_server import Server, server_or_skip

from mxfs.meta import MetaStore, lease
from mxfs.pool import Pool
from mxfs.vol.mounts import runtime_dir

UUID = "00000000-0000-4000-8000-000000000016"


@pytest.fixture(scope="module")
def pg() -> Iterator[Server]:
    yield from server_or_skip()


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[MetaStore]:
    if request.param == "postgresql":
        where = request.getfixturevalue("pg").database()
    else:
        where = str(tmp_path / "meta")
        os.mkdir(where)
    s = MetaStore.format(where, UUID, 1 << 20)
    yield s
    s.close()


def foreign(store: MetaStore, expires_in: float, host: str = "node-b") -> lease.Lease:
    """The row another node's daemon would have written."""
    other = lease.Lease(host, 4242, "/mnt/models", "f" * 32, time.time() + expires_in)
    store.set_setting(lease.KEY, other.encode())
    return other


def test_a_live_lease_of_another_host_refuses_and_names_it(store: MetaStore) -> None:
    foreign(store, 60)
    with pytest.raises(lease.LeaseHeld) as e:
        lease.take(store, "/mnt/here")
    assert "node-b" in str(e.value) and "/mnt/models" in str(e.value)
    assert lease.live_elsewhere(store) is not None


def test_a_lease_that_ran_out_or_is_this_hosts_is_taken_over(store: MetaStore) -> None:
    foreign(store, -1)  # its node died a while ago
    mine = lease.take(store, "/mnt/here")
    assert lease.holder(store) == mine and lease.live_elsewhere(store) is None
    dead = foreign(store, 60, host=mine.host)  # a daemon of this host, SIGKILLed
    again = lease.take(store, "/mnt/here")
    assert again.token != dead.token and lease.holder(store) == again


def test_renew_extends_ones_own_and_tells_of_a_takeover(store: MetaStore) -> None:
    mine = lease.take(store, "/mnt/here", ttl=5)
    before = mine.expires
    assert lease.renew(store, mine, ttl=60) and mine.expires > before
    assert lease.holder(store) == mine
    other = foreign(store, 60)  # it ran out, and another node took the pool
    assert not lease.renew(store, mine)
    lease.drop(store, mine)  # not ours any more: left alone
    assert lease.holder(store) == other
    with pytest.raises(lease.LeaseHeld):
        lease.take(store, "/mnt/here")


def test_drop_gives_the_pool_back(store: MetaStore) -> None:
    mine = lease.take(store, "/mnt/here")
    lease.drop(store, mine)
    assert lease.holder(store) is None
    assert lease.take(store, "/mnt/other").mountpoint == "/mnt/other"


def daemon_log(members: list[str]) -> Path:
    return Path(runtime_dir(), f"{Pool.open(members[0]).uuid}.log")


def test_a_mount_holds_the_lease_and_another_hosts_lease_fences_it(
        tmp_path: Path, pg: Server) -> None:
    if not HAVE_FUSE:
        pytest.skip("needs root and /dev/fuse")
    url = pg.database()
    members = make_members(tmp_path)
    mkfs(members, "64KiB", "--meta", url)
    store = MetaStore.open(url)
    try:
        with mounted_pool(members) as m:
            held = lease.holder(store)
            assert held is not None and held.pid == m.daemon_pid()
            assert held.mountpoint == str(m.path)
            (m.path / "before").write_bytes(b"kept")
            lines = daemon_log(members).read_text().count("lease was taken")
            foreign(store, 120)  # this one ran out and node-b took the pool
            assert eventually(lambda: daemon_log(members).read_text().count(
                "lease was taken") == lines + 1, timeout=3 * lease.RENEW_S)
            with pytest.raises(OSError) as err:
                (m.path / "after").mkdir()
            assert err.value.errno == errno.EROFS
            assert (m.path / "before").read_bytes() == b"kept"
        # Unmounted; node-b's lease is live: neither a mount nor an offline writer may go on.
        other = tmp_path / "mnt"
        other.mkdir()
        res = mxfs("mount", members[0], str(other), check=False)
        assert res.returncode != 0 and "node-b" in one_line_error(res)
        src = tmp_path / "src"
        src.write_bytes(b"x")
        res = mxfs("put", members[0], str(src), check=False)
        assert res.returncode != 0 and "node-b" in one_line_error(res)
        foreign(store, -1)  # node-b went away and its lease ran out
        with mounted_pool(members) as m:
            assert (m.path / "before").read_bytes() == b"kept"
            (m.path / "after").mkdir()
        assert lease.holder(store) is None  # given back at unmount
    finally:
        store.close()
