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

import contextlib
import errno
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import (
    CRASH,
    HAVE_FUSE,
    Mounted,
    eventually,
    make_members,
    mkfs,
    mounted_pool,
    mxfs,
    one_line_error,
)
from pg_server import Server, private

from mxfs.client import ControlClient
from mxfs.meta import MetaStore, lease
from mxfs.pool import Pool
from mxfs.vol.mounts import runtime_dir

UUID = "00000000-0000-4000-8000-000000000016"


@pytest.fixture
def pg(pg_cluster: Server) -> Server:
    return pg_cluster


@pytest.fixture
def own_pg() -> Iterator[Server]:
    """A server of this test's own, to stop and start."""
    yield from private()


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


def pool_on(tmp_path: Path, pg: Server) -> tuple[list[str], MetaStore]:
    """A pool whose metadata is on `pg`, and a store connection of the test's own to it
    (as another node's would be)."""
    if not HAVE_FUSE:
        pytest.skip("needs root and /dev/fuse")
    url = pg.database()
    members = make_members(tmp_path)
    mkfs(members, "64KiB", "--meta", url)
    return members, MetaStore.open(url)


@pytest.mark.daemon_log(r"lease was taken by node-b", CRASH)
def test_a_mount_holds_the_lease_and_another_hosts_lease_fences_it(
        tmp_path: Path, pg: Server) -> None:
    members, store = pool_on(tmp_path, pg)
    try:
        with mounted_pool(members) as m:
            held = lease.holder(store)
            assert held is not None and held.pid == m.daemon_pid()
            assert held.mountpoint == str(m.path)
            (m.path / "before").write_bytes(b"kept")
            lines = daemon_log(members).read_text().count("lease was taken")
            foreign(store, 120)  # this one ran out and node-b took the pool
            assert eventually(lambda: daemon_log(members).read_text().count(
                "lease was taken") == lines + 1, timeout=3 * lease.TTL_S / lease.RENEWALS)
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


def test_every_take_draws_a_new_epoch_and_a_takeover_fences_the_old_holder(pg: Server) -> None:
    """Node A's lease ran out (SIGSTOP, a partition) and node B took the pool: A cannot
    commit one more change, alone or in a group begun before the takeover, even though
    nothing told A yet; B sees none of them."""
    url = pg.database()
    MetaStore.format(url, UUID, 1 << 20).close()
    a, b = MetaStore.open(url), MetaStore.open(url)
    try:
        mine = lease.take(a, "/mnt/a", ttl=0.5)
        a.set_setting("before", "a")  # committed under its epoch
        a.engine.group(60)  # a group begun now, before the takeover
        a.set_setting("grouped", "a")
        time.sleep(0.7)  # A's lease runs out
        theirs = lease.take(b, "/mnt/b", ttl=60, host="node-b")
        assert theirs.epoch == mine.epoch + 1
        with pytest.raises(OSError) as e:
            a.commit()
        assert e.value.errno == errno.EROFS and "another node took the pool" in str(e.value)
        with pytest.raises(OSError) as e:  # and every change after it
            a.set_setting("after", "a")
        assert e.value.errno == errno.EROFS
        assert a.readonly and a.engine.fenced is not None
        assert b.setting("before") == "a"
        assert b.setting("grouped") is None and b.setting("after") is None
        b.set_setting("after", "b")  # the new holder's changes count
        assert b.setting("after") == "b"
    finally:
        a.close()
        b.close()


def test_the_keeper_renews_by_the_servers_clock_and_fences_while_it_cannot(
        own_pg: Server) -> None:
    """Renewals come from the keeper's thread and connection; with the server away for
    half the TTL the holder refuses changes, and takes them again once a renewal got
    through; a takeover it hears of fences it for good."""
    url = own_pg.database()
    MetaStore.format(url, UUID, 1 << 20).close()
    store = MetaStore.open(url)
    mine = lease.take(store, "/mnt/here", ttl=2.0)
    keeper = lease.Keeper(url, mine, store.engine, ttl=2.0)
    keeper.start()
    try:
        first = mine.expires
        assert eventually(lambda: mine.expires > first + 0.5, timeout=5)
        assert abs(mine.expires - store.engine.clock() - 2.0) < 1.0  # the server's clock
        own_pg.stop()
        assert eventually(lambda: keeper.state == "stale", timeout=10)
        assert store.engine.fenced is not None and "could not be renewed" in store.engine.fenced
        own_pg.start()
        assert eventually(lambda: keeper.state == "held", timeout=20)
        assert store.engine.fenced is None
        assert eventually(lambda: _settable(store), timeout=20)  # (its own connection redials)
        foreign(store, 60)  # another node took the pool (this one ran out meanwhile)
        assert eventually(lambda: keeper.state == "taken", timeout=5)
        assert "node-b" in str(store.engine.fenced)
        with pytest.raises(OSError) as e:
            store.set_setting("after", "x")
        assert e.value.errno == errno.EROFS
    finally:
        keeper.stop()
        store.close()


def _refused(change: Callable[[], object]) -> bool:
    """Whether `change` fails at once with EROFS (else it was answered)."""
    try:
        change()
    except OSError as e:
        assert e.errno == errno.EROFS, e
        return True
    return False


def _lease_state(m: Mounted) -> str | None:
    with ControlClient(str(m.path)) as c:
        held = c.stat()["lease"]
    return None if held is None else held["state"]


def _settable(store: MetaStore) -> bool:
    try:
        store.set_setting("probe", "1")
        return True
    except OSError:
        return False


@pytest.mark.daemon_log(r"lease was taken by node-b", r"another node took the pool")
def test_a_stopped_daemon_woken_after_a_takeover_changes_nothing(tmp_path: Path,
                                                                  pg: Server) -> None:
    """SIGSTOP a daemon past its lease, let another node take the pool, SIGCONT it:
    nothing it is asked to change reaches the store (an fsync says so; later changes
    are refused at once, EROFS), and it still serves what it holds."""
    import signal

    members, store = pool_on(tmp_path, pg)
    try:
        with mounted_pool(members, "lease_s=2") as m:
            (m.path / "kept").write_bytes(b"k" * 100_000)
            with ControlClient(str(m.path)) as c:
                held = c.stat()["lease"]
            assert held is not None and held["state"] == "held" and held["ttl"] == 2
            assert "lease: held, epoch" in mxfs("status", str(m.path)).stdout
            pid = m.daemon_pid()
            fd = os.open(m.path / "during", os.O_WRONLY | os.O_CREAT)
            os.fsync(fd)
            os.kill(pid, signal.SIGSTOP)
            try:
                time.sleep(2.5)  # its lease runs out
                lease.take(store, "/mnt/b", ttl=60, host="node-b")
            finally:
                os.kill(pid, signal.SIGCONT)
            if not _refused(lambda: os.write(fd, b"w" * 10_000)):  # (the fence fired
                with pytest.raises(OSError) as err:                  # already, or:)
                    os.fsync(fd)  # its size cannot be committed: the store fences it
                assert err.value.errno in (errno.EROFS, errno.EIO)
            with contextlib.suppress(OSError):
                os.close(fd)
            assert eventually(lambda: _refused(lambda: (m.path / "woken").mkdir()))
            assert (m.path / "kept").read_bytes() == b"k" * 100_000
            assert store.entry_ino(1, b"woken") is None
            ino = store.entry_ino(1, b"during")
            assert ino is None or store.get(ino).size == 0
            assert eventually(lambda: _lease_state(m) == "taken")
            m.check = False  # (node-b holds the pool: not this test's to check)
    finally:
        store.close()
