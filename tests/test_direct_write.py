"""The direct write path: hidden files, atomic commits, seals, and writers that die."""

from __future__ import annotations

import errno
import json
import mmap
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import xxhash
from conftest import (
    CRASH,
    Mounted,
    check_pool,
    chunk_files,
    eventually,
    kill_daemon,
    mkfs,
    mounted_pool,
    xfs_image,
)

from mxfs.client import ControlClient
from mxfs.client.writer import create_file
from mxfs.vol.volume import Volume


def aligned(data: bytes) -> mmap.mmap:
    """A page-aligned buffer holding `data`, padded to 4 KiB (what O_DIRECT needs)."""
    buf = mmap.mmap(-1, max(4096, -(-len(data) // 4096) * 4096))
    buf[:len(data)] = data
    return buf


def write_file(path: str, data: bytes, **kw: object) -> list[int]:
    with create_file(path, len(data), **kw) as w:  # type: ignore[arg-type]
        w.write_at(0, memoryview(aligned(data)), valid=len(data))
        return w.commit(len(data))


@pytest.mark.smoke
@pytest.mark.also_postgres
def test_commit_publishes_whole_sealed_file_at_once(mounted: Mounted) -> None:
    p = str(mounted.path / "model.bin")
    assert not os.path.exists(p)  # the kernel now caches "no such name"
    data = os.urandom(1_000_001)
    with create_file(p, len(data)) as w:
        assert w.direct  # ext4 members take O_DIRECT
        w.write_at(0, memoryview(aligned(data)), valid=len(data))
        assert not os.path.exists(p) and os.listdir(mounted.path) == []
        sums = w.commit(len(data))
    assert Path(p).read_bytes() == data  # visible at once: the cached absence was dropped
    unit = w.sum_unit
    assert sums == [xxhash.xxh3_64_intdigest(data[o:o + unit]) for o in range(0, len(data), unit)]
    with ControlClient(str(mounted.path)) as c:
        assert c.layout(p)["sealed"] is True
    # sealed files are immutable through the mount, but may be renamed and removed
    for how in (lambda: os.open(p, os.O_RDWR), lambda: os.open(p, os.O_WRONLY | os.O_TRUNC),
                lambda: os.truncate(p, 5)):
        with pytest.raises(PermissionError):
            how()
    os.chmod(p, 0o600)
    os.rename(p, p + ".old")
    mounted.umount()
    vol = Volume.open(mounted.members[0])
    try:
        node = vol.store.lookup(1, b"model.bin.old")
        seal = vol.store.seal_of(node.ino)
        assert seal is not None and seal[0] == unit and len(seal[1]) == 8 * len(sums)
        assert vol.problems() == []
    finally:
        vol.store.close()


@pytest.mark.also_postgres
def test_replace_is_atomic_and_exclusive_commits_let_the_first_writer_win(
        mounted: Mounted) -> None:
    p = str(mounted.path / "latest")
    (mounted.path / "latest").write_bytes(b"old")
    write_file(p, b"new" * 5000)
    assert Path(p).read_bytes() == b"new" * 5000
    a, b = create_file(p + ".k", 5), create_file(p + ".k", 5)
    for w, text in ((a, b"first"), (b, b"later")):
        w.write_at(0, memoryview(aligned(text)), valid=5)
    a.commit(5, replace=False)
    with pytest.raises(FileExistsError):
        b.commit(5, replace=False)
    # Refused after its files were synced: the daemon's syncing kept no descriptor for
    # writing them, which made it a writer of its own file, and a commit that replaces
    # was refused EBUSY for good.
    b.commit(5, replace=True)
    assert Path(p + ".k").read_bytes() == b"later"
    with pytest.raises(FileExistsError):
        create_file(p + ".k", 5, exclusive=True)


def test_unaligned_buffers_fall_back_to_buffered_writes(mounted: Mounted) -> None:
    p = str(mounted.path / "odd")
    data = os.urandom(300_000)
    with create_file(p, len(data)) as w:
        w.write_at(0, memoryview(bytearray(b"x" + data))[1:])
        assert not w.direct
        w.commit(len(data))
    assert Path(p).read_bytes() == data


def test_a_commit_waits_a_moment_for_a_writer_letting_go(mounted: Mounted) -> None:
    """A commit refused for a writer that still holds the file is tried again 50 and
    250 ms later: a writer's last reference may leave the kernel a moment after her
    close, and CI saw commits refused as if a writer remained.  One kept open is
    still refused."""
    data = memoryview(bytearray(b"x" * 4096))
    w = create_file(str(mounted.path / "a"), 4096)
    w.write_at(0, data)
    kept = os.dup(next(iter(w.fds.values())))
    threading.Timer(0.02, os.close, [kept]).start()
    w.commit(4096)
    assert (mounted.path / "a").read_bytes() == bytes(data)
    w = create_file(str(mounted.path / "b"), 4096)
    w.write_at(0, data)
    kept = os.dup(next(iter(w.fds.values())))
    try:
        with pytest.raises(OSError) as e:
            w.commit(4096)
        assert e.value.errno == errno.EBUSY
    finally:
        os.close(kept)
    assert not (mounted.path / "b").exists()


def test_a_block_not_written_whole_refuses_the_commit(mounted: Mounted) -> None:
    p = str(mounted.path / "holey")
    with create_file(p, 200_000) as w:
        w.write_at(0, memoryview(bytearray(65536)))
        with pytest.raises(ValueError, match="not written in one piece"):
            w.commit(200_000)
    assert not os.path.exists(p)


def test_a_commit_naming_a_checksum_block_over_the_limit_is_refused(mounted: Mounted) -> None:
    """A sparse file committed as one checksum block of (at least) its whole size, the
    block scrub and readers hold whole: refused EINVAL, for a file and a KV chunk alike;
    the same file commits in blocks up to the limit."""
    import base64

    from mxfs.client.control import ControlError
    from mxfs.io.checksum import MAX_SUM_UNIT, block_sums, pack_sums

    size = 8 << 20

    def sums(data: bytes, unit: int) -> str:
        return base64.b64encode(pack_sums(block_sums(data, unit))).decode()
    with ControlClient(str(mounted.path)) as c:
        made, fds = c.call_with_fds("create", path="/sparse.bin", size=size)
        for fd in fds:
            os.close(fd)  # (nothing written: it reads zeros)
        over = MAX_SUM_UNIT + made["layout"]["stripe_unit"]
        with pytest.raises(ControlError) as e:
            c.call("commit", ino=made["ino"], size=size, sum_unit=over, sums="AAAAAAAAAAA=")
        assert e.value.errno == errno.EINVAL
        assert f"sum_unit {over} is over the largest checksum block" in e.value.strerror
        c.call("commit", ino=made["ino"], size=size, sum_unit=MAX_SUM_UNIT,
               sums=sums(bytes(size), MAX_SUM_UNIT))
        key = base64.b64encode(b"k").decode()
        c.call("kv_ns_create", namespace="ns", capacity=1 << 30)
        made, fds = c.call_with_fds("kv_create", namespace="ns", key=key, size=3)
        os.pwrite(fds[0], b"abc", 0)
        for fd in fds:
            os.close(fd)
        unit = made["layout"]["stripe_unit"]
        commit = {"namespace": "ns", "ino": made["ino"], "key": key, "size": 3}
        with pytest.raises(ControlError) as e:
            c.call("kv_commit", **commit, sum_unit=MAX_SUM_UNIT + unit, sums=sums(b"abc", unit))
        assert e.value.errno == errno.EINVAL and "largest checksum block" in e.value.strerror
        assert c.call("kv_commit", **commit, sum_unit=unit, sums=sums(b"abc", unit))["stored"]
        assert c.layout(str(mounted.path / "sparse.bin"))["sealed"] is True
    assert Path(mounted.path / "sparse.bin").read_bytes() == bytes(size)


WRITER = r"""
import os, sys, mmap, time
from mxfs.client.writer import create_file
w = create_file(sys.argv[1], 8 << 20)
buf = mmap.mmap(-1, 8 << 20)
buf[:] = os.urandom(8 << 20)
w.write_at(0, memoryview(buf))
print(w.ino, flush=True)
time.sleep(600)
"""


def test_writer_killed_before_commit_leaves_nothing_and_space_returns(
        mounted: Mounted) -> None:
    before = len(chunk_files(mounted.members))
    p = subprocess.Popen([sys.executable, "-c", WRITER, str(mounted.path / "ckpt")],
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    int(p.stdout.readline())
    assert len(chunk_files(mounted.members)) == before + 4
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert eventually(lambda: len(chunk_files(mounted.members)) == before)
    assert os.listdir(mounted.path) == []
    mounted.umount()
    check_pool(mounted.members)


@pytest.mark.also_postgres
@pytest.mark.daemon_log(CRASH)
def test_daemon_killed_with_a_file_half_written_reclaims_it_at_mount(mounted: Mounted) -> None:
    write_file(str(mounted.path / "kept"), b"k" * 100_000)
    w = create_file(str(mounted.path / "half"), 1 << 20)
    w.write_at(0, memoryview(aligned(os.urandom(1 << 20))))
    kill_daemon(mounted)
    mounted.remount()
    assert sorted(os.listdir(mounted.path)) == ["kept"]
    assert (mounted.path / "kept").read_bytes() == b"k" * 100_000
    mounted.umount()
    check_pool(mounted.members)  # no chunk file of the half-written one is left


CREATOR = r"""
import json, os, sys, mmap
from mxfs.client.writer import create_file  # before dropping root: Python may live in /root
os.setgroups([]); os.setgid(65534); os.setuid(65534)
out = {}
for p in sys.argv[1:]:
    try:
        w = create_file(p, 10)
        buf = mmap.mmap(-1, 4096)
        w.write_at(0, memoryview(buf), valid=10)
        w.commit(10)
        out[p] = "ok"
    except OSError as e:
        out[p] = e.errno
print(json.dumps(out))
"""


def test_a_non_root_caller_may_create_only_where_the_mount_lets_it(mounted: Mounted) -> None:
    os.chmod(mounted.path, 0o755)
    mine = mounted.path / "mine"
    mine.mkdir()
    os.chown(mine, 65534, 65534)
    paths = [str(mounted.path / "root-owned"), str(mine / "ok")]
    res = subprocess.run([sys.executable, "-c", CREATOR, *paths], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out[paths[0]] == errno.EACCES and out[paths[1]] == "ok"
    st = os.stat(paths[1])
    assert (st.st_uid, st.st_gid, st.st_size) == (65534, 65534, 10)


def test_space_a_writer_reserves_past_its_files_end_is_taken_back(mounted: Mounted) -> None:
    """fallocate(KEEP_SIZE) reserves blocks no size check sees: a file declared 4 KiB
    held 64 MiB a chunk file after its commit (its quota charged 4 KiB). A commit now
    frees them, and a dropped file whose writer kept its descriptor refuses them (the
    member's file system keeps an immutable flag) or has them cut each second."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    keep_size = 1

    def reserve(fd: int) -> int:
        return libc.fallocate(fd, keep_size, 0, 64 << 20)

    def blocks(ino: int) -> int:
        return sum(os.stat(p).st_blocks * 512 for p in chunk_files(mounted.members)
                   if os.path.basename(p) == str(ino))

    p = str(mounted.path / "small.bin")
    with create_file(p, 4096) as w:
        w.write_at(0, memoryview(aligned(b"a" * 4096)), valid=4096)
        assert all(reserve(fd) == 0 for fd in w.fds.values())
        ino = w.ino
        assert blocks(ino) >= 64 << 20
        w.commit(4096)
    assert Path(p).read_bytes() == b"a" * 4096
    assert blocks(os.stat(p).st_ino) < 1 << 20
    # Within the slack left to file systems' own blocks past a file's end (4 MiB a
    # chunk file): freed at the commit all the same, charged to nobody else.
    with create_file(str(mounted.path / "slack.bin"), 4096) as w:
        w.write_at(0, memoryview(aligned(b"b" * 4096)), valid=4096)
        assert all(libc.fallocate(fd, keep_size, 0, 3 << 20) == 0 for fd in w.fds.values())
        w.commit(4096)
    assert blocks(os.stat(mounted.path / "slack.bin").st_ino) <= 64 << 10
    # Committed longer than what was written (the rest reads zeros): the commit must
    # not grow the chunk file and keep what was reserved past its old end.
    import base64

    from mxfs.io.checksum import block_sums, pack_sums
    with ControlClient(str(mounted.path)) as c:
        made, fds = c.call_with_fds("create", path="/short.bin", size=8192)
        try:
            fd = dict(zip(made["members"], fds, strict=True))[made["layout"]["first_member"]]
            os.pwrite(fd, b"s" * 1024, 0)  # (its first stripe: all 8 KiB of it)
            assert reserve(fd) == 0
        finally:
            for fd in fds:
                os.close(fd)
        unit = made["layout"]["stripe_unit"]
        body = b"s" * 1024 + bytes(8192 - 1024)
        c.call("commit", ino=made["ino"], size=8192, sum_unit=unit,
               sums=base64.b64encode(pack_sums(block_sums(body, unit))).decode())
    assert blocks(made["ino"]) < 1 << 20
    # Dropped with its descriptors kept: moved aside, cut, and refused more.
    w2 = create_file(str(mounted.path / "dropped.bin"), 4096)
    kept = [os.dup(fd) for fd in w2.fds.values()]  # type: ignore[attr-defined]
    w2.abort()
    try:
        if _keeps_immutable(mounted.members[0]):
            assert all(reserve(fd) != 0 and ctypes.get_errno() == errno.EPERM
                       for fd in kept)
        for fd in kept:
            reserve(fd)
        time.sleep(2.5)  # (past the daemon's next sweep: what it did not refuse, it cut)
        assert all(os.fstat(fd).st_blocks * 512 < 1 << 20 for fd in kept)
    finally:
        for fd in kept:
            os.close(fd)
    assert not os.path.exists(mounted.path / "dropped.bin")


@pytest.mark.daemon_log(r"cut \d+ chunk files of unpublished files")
def test_space_reserved_past_its_end_by_a_writer_that_never_commits_is_taken_back(
        mounted: Mounted) -> None:
    """A writer that reserved a member's space past its file's declared end
    (fallocate KEEP_SIZE: no size check sees it) and kept its descriptors, never
    committing, held it outside every quota for as long as it liked: a file declared
    4 KiB held 64 MiB a chunk file.  Its file is held as a dropped one now: the blocks
    cut, more refused where the member keeps an immutable flag, its commit refused."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]

    def reserve(fd: int) -> int:
        return libc.fallocate(fd, 1, 0, 64 << 20)  # (FALLOC_FL_KEEP_SIZE)

    with create_file(str(mounted.path / "hog.bin"), 4096) as w:
        w.write_at(0, memoryview(aligned(b"h" * 4096)), valid=4096)
        fds = list(w.fds.values())
        assert all(reserve(fd) == 0 for fd in fds)
        assert sum(os.fstat(fd).st_blocks * 512 for fd in fds) >= 64 << 20
        assert eventually(lambda: all(os.fstat(fd).st_blocks * 512 < 1 << 20 for fd in fds),
                          timeout=10), "the reserved blocks stay while the writer holds them"
        if _keeps_immutable(mounted.members[0]):  # (the flag goes on after the cut: a
            # reserve between them is cut again, a second later, and the flag put back)
            assert eventually(lambda: all(reserve(fd) != 0 and ctypes.get_errno() ==
                                          errno.EPERM for fd in fds), timeout=10)
        with pytest.raises(OSError) as e:
            w.commit(4096)
        assert e.value.errno == errno.EFBIG
    assert not (mounted.path / "hog.bin").exists()


def _keeps_immutable(folder: str) -> bool:
    """Whether `folder`'s file system keeps the immutable flag (ext4 and XFS do)."""
    from mxfs.pool.revoke import set_immutable

    path = os.path.join(folder, ".immutable-probe")
    os.close(os.open(path, os.O_RDONLY | os.O_CREAT, 0o600))
    try:
        return set_immutable(path, True) and set_immutable(path, False)
    finally:
        set_immutable(path, False)
        os.unlink(path)


def test_a_buffered_writers_file_on_xfs_outlives_a_cut_back_round(tmp_path: Path) -> None:
    """XFS reserves blocks past the end of a file written buffered (its speculative
    preallocation: about 200 MiB past a 300 MiB file), which looked like a writer's
    fallocate(KEEP_SIZE): a direct writer whose buffers are not page-aligned (so it
    writes buffered) and who held its descriptors over a cut-back round had its file
    held and its commit refused.  Only an inode XFS marks fallocated counts now."""
    with xfs_image(tmp_path, "x0") as member:
        mkfs([member])
        with mounted_pool([member]) as m:
            piece = bytearray(os.urandom((1 << 20) + 1))[1:]  # (not page-aligned)
            size = 160 << 20
            with create_file(str(m.path / "f"), size) as w:
                for k in range(size >> 20):
                    w.write_at(k << 20, memoryview(piece))
                chunk = Path(member, "chunks", f"{w.ino % 256:02x}", str(w.ino))
                st = chunk.stat()
                assert st.st_blocks * 512 > size + (16 << 20), st  # (XFS's, past the end)
                time.sleep(2.5)  # (the daemon looks at unpublished files once a second)
                w.commit(size)
            assert (m.path / "f").stat().st_size == size
            with open(m.path / "f", "rb") as f:
                f.seek(size - (1 << 20))
                assert f.read() == bytes(piece)
