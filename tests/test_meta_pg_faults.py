"""PostgreSQL faults: the server stopped and started again under a write storm and
during a checkpoint's commit, two processes' transactions conflicting on one
directory, the server full, and the server hung (SIGSTOP).  Each test that stops or
fills the server runs its own cluster (`pg_server.private`), so the shared one is
never disturbed.  Real server, real mount, real processes; no durations are asserted,
only that every wait ends (each wait here has a generous bound).
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import HAVE_FUSE, STORM, Mounted, check_pool, eventually, mkfs, mounted_pool
from pg_server import Server, private

from mxfs.meta import MetaStore
from mxfs.meta.check import problems
from mxfs.meta.inode import ROOT_INO
from mxfs.meta.pg_engine import PgEngine
from mxfs.pool import Pool
from mxfs.proc import running
from mxfs.vol.mounts import runtime_dir

# What the daemons say as their server goes away, fills up or comes back.
pytestmark = pytest.mark.daemon_log(
    r"the metadata server \S+ (went away|cannot be reached|is full)",
    r"metadata store: (the open group of changes was rolled back|a group of changes was lost)",
    r"commit for the daemon failed",
    r"the pool's lease (could not be renewed|is renewed again)",
    r"recovered pool \S+: unclean=")  # (what an outage left: trimmed tails, orphans)


@pytest.fixture
def own_pg() -> Iterator[Server]:
    yield from private()


@pytest.fixture
def pg_mount(members: list[str], own_pg: Server) -> Iterator[Mounted]:
    if not HAVE_FUSE:
        pytest.skip("needs root and /dev/fuse")
    mkfs(members, "64KiB", "--meta", own_pg.database())
    with mounted_pool(members) as m:
        yield m


def daemon_log(m: Mounted) -> Path:
    return Path(runtime_dir(), f"{Pool.open(m.members[0]).uuid}.log")


def write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def writes_work(mp: Path) -> bool:
    try:
        write_synced(mp / "probe", b"p")
        return True
    except OSError as e:
        assert e.errno == errno.EIO, e
        return False


def storm_results(procs: list[subprocess.Popen]) -> dict[str, str]:
    """Wait for the storm's writers (each ends at its first error); what they synced."""
    synced: dict[str, str] = {}
    for p in procs:
        out, _ = p.communicate(timeout=60)  # a writer hung on the mount fails here
        for line in out.splitlines():
            what, name, *digest = line.split()
            if what == "synced":
                synced[name] = digest[0]
            else:
                synced.pop(name, None)
    return synced


@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_server_stopped_and_started_during_a_write_storm(pg_mount: Mounted, own_pg: Server,
                                                         mode: str) -> None:
    mp, pid, log = pg_mount.path, pg_mount.daemon_pid(), daemon_log(pg_mount)
    seen = log.stat().st_size
    procs = [subprocess.Popen([sys.executable, "-c", STORM, str(mp), str(w)],
                              stdout=subprocess.PIPE, text=True) for w in range(3)]
    assert eventually(lambda: len(list(mp.iterdir())) > 30)
    own_pg.stop(mode)
    synced = storm_results(procs)  # every writer saw its error, none hung
    assert len(synced) > 5, "the storm wrote too little to test anything"
    with pytest.raises(OSError) as err:
        write_synced(mp / "while-away", b"x")
    assert err.value.errno == errno.EIO
    with pytest.raises(OSError) as err:
        os.mkdir(mp / "dir-while-away")
    assert err.value.errno == errno.EIO
    assert running(pid)
    own_pg.start()
    assert eventually(lambda: writes_work(mp), timeout=30)  # no remount needed
    (mp / "after").mkdir()
    write_synced(mp / "after" / "f", b"after the restart")
    assert running(pid)
    lines = log.read_text()[seen:].splitlines()
    errors = [line for line in lines if " ERROR " in line]
    assert len(errors) == 1 and "changes fail until it is back" in errors[0], lines
    assert len([line for line in lines if " INFO " in line and "is back" in line]) == 1, lines
    assert "Traceback" not in "\n".join(lines)
    pg_mount.umount()
    pg_mount.remount()
    for name, digest in synced.items():
        assert hashlib.sha256((mp / name).read_bytes()).hexdigest() == digest, name
    assert (mp / "after" / "f").read_bytes() == b"after the restart"
    pg_mount.umount()
    check_pool(pg_mount.members)


# The checkpoint's writer, held before its first direct commit until the test says go.
HELD_WRITER = r"""
import sys, torch
import mxfs.ckpt as ck
from mxfs.ckpt import writing
from mxfs.client import writer as w
path = sys.argv[1]
orig = w.DirectWriter.commit
def commit(self, *a, **k):
    if not commit.held:
        commit.held = True
        print("at commit", flush=True)
        sys.stdin.readline()
    return orig(self, *a, **k)
commit.held = False
w.DirectWriter.commit = commit
writing.WRITE_STEP = 1 << 20
try:
    ck.save({"w": torch.full((1 << 20,), 7.0), "step": 2}, path).wait()
except Exception as e:
    print("failed", type(e).__name__, e, flush=True)
    sys.exit(3)
print("saved", flush=True)
"""


def test_server_stopped_during_a_checkpoint_commit(pg_mount: Mounted, own_pg: Server) -> None:
    torch = pytest.importorskip("torch")
    import mxfs.ckpt as ck

    root, pid = pg_mount.path / "ckpts", pg_mount.daemon_pid()
    prev = {"w": torch.arange(1000.0), "step": 1}
    ck.save(prev, str(root / "step-1")).wait()
    p = subprocess.Popen([sys.executable, "-c", HELD_WRITER, str(root / "step-2")],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdin is not None
    assert p.stdout.readline().split() == ["at", "commit"]
    own_pg.stop("immediate")
    out, _ = p.communicate("go\n", timeout=60)
    assert p.returncode == 3 and "failed" in out, out  # refused, not hung
    assert running(pid)
    own_pg.start()
    assert eventually(lambda: writes_work(pg_mount.path), timeout=30)
    names = [e.name for e in ck.list_checkpoints(str(root))]
    assert names == ["step-1"]  # the interrupted one is absent, never half there
    assert torch.equal(ck.load(str(root / "step-1"))["w"], prev["w"])
    assert ck.verify(str(root / "step-1")) == []
    pg_mount.umount()
    pg_mount.remount()
    assert [e.name for e in ck.list_checkpoints(str(root))] == ["step-1"]
    ck.prune(str(root), keep=5)  # the writer's hidden folder goes
    assert torch.equal(ck.load(str(root / "step-1"))["w"], prev["w"])
    pg_mount.umount()
    check_pool(pg_mount.members)


# One process of the conflict storm: its own connection, changes in one directory.
CONFLICTER = r"""
import sys
from mxfs.meta import MetaStore, engine
from mxfs.meta.inode import ROOT_INO
url, me, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
runs_again = 0
pause = engine._pause
def counted(attempt):  # counts the changes run again, to know the storm conflicted
    global runs_again
    runs_again += 1
    pause(attempt)
engine._pause = counted
store = MetaStore.open(url)
d = store.lookup(ROOT_INO, b"shared").ino
print("ready", flush=True)
sys.stdin.readline()
pick = lambda ino, unit, width: (unit or 65536, width or 1, 0)
for i in range(n):
    name = f"{me}-{i}".encode()
    store.create(d, name, 0o100644, 0, 0, layout_for=pick)
    if i % 3 == 0:
        store.rename(d, name, d, name + b"-moved")
        name += b"-moved"
    if i % 5 == 4:
        store.unlink(d, name)
    if i % 7 == 0:
        store.create(d, f"{me}-dir{i}".encode(), 0o040755, 0, 0)
store.close()
print("done", runs_again, flush=True)
"""


def expected_names(me: str, n: int) -> set[str]:
    out = set()
    for i in range(n):
        if i % 5 != 4:
            out.add(f"{me}-{i}-moved" if i % 3 == 0 else f"{me}-{i}")
        if i % 7 == 0:
            out.add(f"{me}-dir{i}")
    return out


def test_two_processes_conflicting_on_one_directory_both_finish(own_pg: Server) -> None:
    url, n = own_pg.database(), 150
    store = MetaStore.format(url, "conflicts", 65536)
    shared = store.create(ROOT_INO, b"shared", 0o040755, 0, 0)
    procs = [subprocess.Popen([sys.executable, "-c", CONFLICTER, url, me, str(n)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for me in ("a", "b")]
    for p in procs:
        assert p.stdout is not None and p.stdout.readline() == "ready\n"
    for p in procs:  # both at once
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    runs_again = 0
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0 and out.split()[0] == "done", err
        runs_again += int(out.split()[1])
    assert runs_again > 0, "the two never conflicted: nothing was tested"
    store.close()
    store = MetaStore.open(url)
    try:
        names = {e.name.decode() for e in store.readdir(shared.ino, 0, limit=10_000)}
        assert names == expected_names("a", n) | expected_names("b", n)
        d = store.get(shared.ino)
        assert d.nlink == 2 + len([x for x in names if "-dir" in x])
        assert problems(store) == []
    finally:
        store.close()


@pytest.fixture
def small_tablespace_db(tmp_path: Path, own_pg: Server) -> Iterator[str]:
    """A database on a tablespace of its own: a 24 MiB ext4 image, loop-mounted."""
    if os.geteuid() != 0:
        pytest.skip("needs root for the loop mount")
    img = tmp_path / "ts.img"
    with open(img, "wb") as f:
        f.truncate(24 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(img)], check=True,
                   capture_output=True)
    where = Path(tempfile.mkdtemp(prefix="mxfs-ts-"))  # not pytest's: the server's user
    os.chmod(where, 0o755)                             # must reach it
    res = subprocess.run(["mount", "-o", "loop", str(img), str(where)], capture_output=True)
    if res.returncode:
        os.rmdir(where)
        pytest.skip(f"loop mounts unavailable: {res.stderr.decode().strip()}")
    try:
        os.chmod(where, 0o755)
        space = where / "pg"
        space.mkdir()
        if own_pg.user:
            shutil.chown(space, own_pg.user, own_pg.user)
        import psycopg
        with psycopg.connect(own_pg.url("postgres"), autocommit=True) as c:
            c.execute(f"CREATE TABLESPACE small LOCATION '{space}'")
            c.execute("CREATE DATABASE onsmall TABLESPACE small")
        yield own_pg.url("onsmall")
    finally:
        own_pg.stop("immediate")  # before its tablespace goes
        subprocess.run(["umount", "-l", str(where)], capture_output=True)
        os.rmdir(where)


def test_a_full_server_gives_enospc_with_one_line(members: list[str], own_pg: Server,
                                                  small_tablespace_db: str) -> None:
    if not HAVE_FUSE:
        pytest.skip("needs root and /dev/fuse")
    mkfs(members, "64KiB", "--meta", small_tablespace_db)
    with mounted_pool(members) as m:
        pid, log = m.daemon_pid(), daemon_log(m)
        seen = log.stat().st_size
        (m.path / "f").write_bytes(b"kept")
        value = os.urandom(60_000)  # incompressible: each one takes its room
        with pytest.raises(OSError) as err:
            for i in range(1000):  # 60 MB: more than the tablespace holds (3 an inode:
                f = m.path / f"x{i // 3}"  # an inode holds 256 KiB of xattrs at most)
                if not i % 3:
                    f.write_bytes(b"")
                os.setxattr(f, f"user.k{i % 3}", value)
        assert err.value.errno == errno.ENOSPC
        for i in range(3):  # each change that needs room: ENOSPC, not one line each
            with pytest.raises(OSError) as err:
                os.setxattr(m.path / "f", f"user.more{i}", value)
            assert err.value.errno == errno.ENOSPC
        assert running(pid)
        assert (m.path / "f").read_bytes() == b"kept"
        assert os.getxattr(m.path / "x0", "user.k0") == value
        lines = log.read_text()[seen:].splitlines()
        full = [line for line in lines if "is full" in line]
        assert len(full) == 1 and "ENOSPC" in full[0], lines
        m.umount()
    check_pool(members)


def test_a_hung_server_is_away_after_the_wait_bound_not_forever(
        own_pg: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a Unix socket no TCP timeout notices a server that stops answering: the
    client bounds each wait itself, then the server is away (EIO at once) until it
    answers again, and the store goes on without being opened again."""
    from mxfs.meta import pg_engine
    store = MetaStore.format(own_pg.database(), "hung", 65536)
    pick = lambda ino, unit, width: (unit or 65536, width or 1, 0)  # noqa: E731
    monkeypatch.setattr(pg_engine, "WAIT_S", 2.0)
    try:
        store.create(ROOT_INO, b"before", 0o100644, 0, 0, layout_for=pick)
        procs = own_pg.processes()
        for pid in procs:
            os.kill(pid, signal.SIGSTOP)
        try:
            with pytest.raises(OSError) as err:
                store.create(ROOT_INO, b"during", 0o100644, 0, 0, layout_for=pick)
            assert err.value.errno == errno.EIO
            with pytest.raises(OSError) as err:  # away: refused at once
                store.create(ROOT_INO, b"during", 0o100644, 0, 0, layout_for=pick)
            assert err.value.errno == errno.EIO
        finally:
            for pid in procs:
                os.kill(pid, signal.SIGCONT)

        def works() -> bool:
            try:
                store.create(ROOT_INO, b"after", 0o100644, 0, 0, layout_for=pick)
                return True
            except OSError:
                return False
        assert eventually(works)
        names = {e.name for e in store.readdir(ROOT_INO, 0)}
        assert names == {b"before", b"after"}
    finally:
        store.close()


# A writer that creates b"held" in an open group, then waits for the test's word to
# commit it; it says how the commit ended.
HOLDER = r"""
import sys
from mxfs.meta import MetaStore
from mxfs.meta.inode import ROOT_INO
store = MetaStore.open(sys.argv[1])
store.group_changes(3600)
store.create(ROOT_INO, b"held", 0o100644, 0, 0, layout_for=lambda i, u, w: (u or 65536, 1, 0))
print("holding", flush=True)
sys.stdin.readline()
try:
    store.commit()
    print("committed")
except OSError as e:
    print("lost", e.errno)
"""


def test_a_writer_stopped_inside_a_transaction_does_not_hold_its_rows(pg_cluster: Server) -> None:
    """A process stopped (SIGSTOP) with a group open holds the rows it wrote (here a
    directory entry's name): the server ends its transaction after IDLE_TXN_MS, so
    another writer of that name gets through instead of failing EBUSY after every
    retry, and the woken holder's commit is refused, never applied late."""
    url = pg_cluster.database()
    MetaStore.format(url, "stopped", 65536).close()
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, url], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    store = MetaStore.open(url)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "holding\n"
        os.kill(holder.pid, signal.SIGSTOP)
        try:
            mine = store.create(ROOT_INO, b"held", 0o100644, 0, 0,
                                layout_for=lambda ino, unit, width: (unit or 65536, 1, 0))
            store.commit()
        finally:
            os.kill(holder.pid, signal.SIGCONT)
        out, err = holder.communicate("commit\n", timeout=60)
        assert out.split()[0] == "lost" and int(out.split()[1]) == errno.EIO, (out, err)
        assert store.entry_ino(ROOT_INO, b"held") == mine.ino
        assert problems(store) == []
    finally:
        if holder.poll() is None:
            holder.kill()
        store.close()


def test_a_lost_group_puts_memory_back_and_holds_commits_off(own_pg: Server) -> None:
    import psycopg

    url = own_pg.database()
    store = MetaStore.format(url, "lost", 65536)
    try:
        f = store.create(ROOT_INO, b"f", 0o100644, 0, 0,
                         layout_for=lambda ino, unit, width: (unit or 65536, width or 1, 0))
        store.group_changes(600)
        store.link(f.ino, ROOT_INO, b"g")  # in the open group, not committed
        assert f.nlink == 2
        assert isinstance(store.engine, PgEngine) and store.engine.conn is not None
        with psycopg.connect(own_pg.url("postgres"), autocommit=True) as c:  # drops it
            c.execute("SELECT pg_terminate_backend(%s)", (store.engine.conn.info.backend_pid,))
        with pytest.raises(OSError) as err:
            store.unlink(ROOT_INO, b"f")
        assert err.value.errno == errno.EIO
        assert f.nlink == 1  # memory is back at the last commit
        with pytest.raises(OSError) as err:
            store.commit()  # an fsync now must hear of the loss
        assert err.value.errno == errno.EIO

        def commits() -> bool:
            try:
                store.commit()
                return True
            except OSError:
                return False
        assert eventually(commits)
        assert store.entry_ino(ROOT_INO, b"g") is None
        store.unlink(ROOT_INO, b"f")
        store.commit()
        assert problems(store) == []
    finally:
        store.close()


def test_fsync_after_a_lost_group_is_eio_even_once_the_server_is_back(
        members: list[str], own_pg: Server) -> None:
    """A change the daemon answered, then lost with its group (the server dropped the
    connection before the group's commit): the next fsync on that file says EIO, once,
    even when it comes after the daemon is connected again; never "durable"."""

    import psycopg

    if not HAVE_FUSE:
        pytest.skip("needs root and /dev/fuse")
    url = own_pg.database()
    mkfs(members, "64KiB", "--meta", url)
    with mounted_pool(members) as m, psycopg.connect(url, autocommit=True) as db:
        pid = m.daemon_pid()
        for attempt in range(5):
            path = m.path / f"f{attempt}"
            write_synced(path, b"x")
            ino = os.stat(path).st_ino
            fd = os.open(path, os.O_RDWR)
            try:
                os.fchmod(fd, 0o600)  # answered; its group commits within 50 ms
                os.kill(pid, signal.SIGSTOP)  # ... unless the daemon is held first
                try:
                    db.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                               "WHERE datname = current_database() AND pid <> pg_backend_pid()")
                finally:
                    os.kill(pid, signal.SIGCONT)
                assert eventually(lambda: writes_work(m.path))  # connected again
                row = db.execute("SELECT mode FROM inodes WHERE ino = %s", (ino,)).fetchone()
                assert row is not None
                lost = row[0] & 0o777 != 0o600
                if lost:
                    with pytest.raises(OSError) as err:
                        os.fsync(fd)
                    assert err.value.errno == errno.EIO
                os.fsync(fd)  # heard once: the next one is the usual kind
            finally:
                os.close(fd)
            if lost:
                break
        assert lost, "the group committed before the daemon could be held, five times"
        assert running(pid)
