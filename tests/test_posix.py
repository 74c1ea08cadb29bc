"""The POSIX surface through a real mount, checked against what Linux filesystems do."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import stat
import time
from pathlib import Path

import pytest
from conftest import Mounted, eventually, mxfs

UNIT = 64 * 1024


@pytest.mark.smoke
@pytest.mark.also_postgres
def test_striped_write_and_read_back_across_members(mounted: Mounted) -> None:
    data = os.urandom(UNIT * 9 + 1234)
    p = mounted.path / "striped"
    p.write_bytes(data)
    assert p.read_bytes() == data
    # the bytes really are spread: every member holds a chunk file of this inode
    ino = p.stat().st_ino
    holders = [m for m in mounted.members
               if os.path.exists(os.path.join(m, "chunks", f"{ino % 256:02x}", str(ino)))]
    assert len(holders) == 4
    # unaligned reads that cross stripe boundaries
    with open(p, "rb") as f:
        for off, n in [(UNIT - 10, 20), (3 * UNIT + 7, 2 * UNIT), (len(data) - 5, 100)]:
            f.seek(off)
            assert f.read(n) == data[off:off + n]


def _dirty_pages(path: str) -> int:
    """Pages of `path` in the page cache not yet written to its disk (cachestat(2),
    Linux 6.5: dirty and under writeback)."""
    libc = ctypes.CDLL(None, use_errno=True)
    span = (ctypes.c_uint64 * 2)(0, 0)  # (offset 0, length 0: to the end)
    stats = (ctypes.c_uint64 * 5)()  # cache, dirty, writeback, evicted, recently evicted
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.syscall(451, fd, span, stats, 0) != 0:
            raise OSError(ctypes.get_errno(), f"cachestat of {path}")
    finally:
        os.close(fd)
    return int(stats[1] + stats[2])


def test_fsync_of_a_file_opened_again_makes_what_was_written_before_durable(
        mounted: Mounted) -> None:
    """fsync(2) promises the file's bytes, whoever wrote them: a file written and closed
    (the daemon's descriptors of its chunk files closed with it, their pages still
    dirty on the members), then opened again read-only and synced (`sync FILE`), has
    every chunk file's pages on disk when the fsync returns.  The reopened file held
    no descriptor of its chunk files, and its fsync synced nothing."""
    p = mounted.path / "written"
    for _ in range(3):  # (dirty until synced; a sync(2) of another program's cleans them)
        p.write_bytes(os.urandom(UNIT * 8))
        ino = p.stat().st_ino
        chunks = [os.path.join(m, "chunks", f"{ino % 256:02x}", str(ino))
                  for m in mounted.members]
        if all(_dirty_pages(c) for c in chunks):
            break
    assert all(_dirty_pages(c) for c in chunks), "the chunk files were written back"
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    assert [_dirty_pages(c) for c in chunks] == [0] * len(chunks)


@pytest.mark.also_postgres
def test_holes_read_as_zeros(mounted: Mounted) -> None:
    p = mounted.path / "sparse"
    with open(p, "wb") as f:
        f.seek(5 * UNIT + 3)
        f.write(b"end")
    data = p.read_bytes()
    assert len(data) == 5 * UNIT + 6
    assert data[:-3] == bytes(5 * UNIT + 3) and data[-3:] == b"end"


@pytest.mark.also_postgres
def test_truncate_down_then_up_reads_zeros(mounted: Mounted) -> None:
    p = mounted.path / "t"
    p.write_bytes(b"x" * (3 * UNIT))
    os.truncate(p, UNIT + 10)
    assert p.read_bytes() == b"x" * (UNIT + 10)
    os.truncate(p, 4 * UNIT)
    assert p.read_bytes() == b"x" * (UNIT + 10) + bytes(4 * UNIT - UNIT - 10)
    with open(p, "r+b") as f:
        f.truncate(5)
        assert os.fstat(f.fileno()).st_size == 5
    assert p.read_bytes() == b"xxxxx"


@pytest.mark.also_postgres
def test_open_flags_trunc_append_excl(mounted: Mounted) -> None:
    p = mounted.path / "f"
    p.write_bytes(b"hello world")
    fd = os.open(p, os.O_WRONLY | os.O_TRUNC)
    os.write(fd, b"abc")
    os.close(fd)
    assert p.read_bytes() == b"abc"
    fd = os.open(p, os.O_WRONLY | os.O_APPEND)
    os.write(fd, b"def")
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, b"ghi")
    os.close(fd)
    assert p.read_bytes() == b"abcdefghi"
    with pytest.raises(FileExistsError):
        os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL)


@pytest.mark.also_postgres
def test_a_shared_mapping_of_an_appending_handle_writes_no_page_at_the_end(
        mounted: Mounted) -> None:
    """Dirty pages of a shared mapping go back through a handle that mapped the file;
    without the writeback cache the daemon places an O_APPEND handle's writes at the
    end of the file, so pages written back through one landed there, not at their
    offset (the file grew a page, offset 0 read zeros).  Such a handle bypasses the
    page cache now: mapped shared and writable it is refused (ENODEV), and pages mapped
    through another handle land where they are mapped while it appends."""
    p = mounted.path / "mapped"
    p.write_bytes(bytes(8192))
    fd = os.open(p, os.O_RDWR | os.O_APPEND)
    try:
        try:
            m = mmap.mmap(fd, 8192, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            assert e.errno == errno.ENODEV, e
        else:
            with m:
                m[0:4] = b"ABCD"
                m.flush()
            assert p.read_bytes()[:4] == b"ABCD" and p.stat().st_size == 8192
        other = os.open(p, os.O_RDWR)
        try:
            with mmap.mmap(other, 8192, mmap.MAP_SHARED,
                           mmap.PROT_READ | mmap.PROT_WRITE) as m:
                m[4096:4100] = b"WXYZ"
                m.flush()
        finally:
            os.close(other)
        os.write(fd, b"tail")
    finally:
        os.close(fd)
    data = p.read_bytes()
    assert len(data) == 8196 and data[4096:4100] == b"WXYZ" and data[8192:] == b"tail"


def test_directories_and_errors(mounted: Mounted) -> None:
    d = mounted.path / "d"
    d.mkdir()
    (d / "sub").mkdir()
    (d / "file").write_text("x")
    assert os.stat(d).st_nlink == 3
    with pytest.raises(OSError) as e:
        os.rmdir(d)
    assert e.value.errno == errno.ENOTEMPTY
    with pytest.raises(NotADirectoryError):
        os.rmdir(d / "file")
    with pytest.raises(IsADirectoryError):
        os.unlink(d / "sub")
    with pytest.raises(FileExistsError):
        os.mkdir(d / "sub")
    with pytest.raises(FileNotFoundError):
        os.stat(d / "nope")
    with pytest.raises(OSError) as e:
        os.mkdir(d / ("n" * 256))
    assert e.value.errno == errno.ENAMETOOLONG
    import subprocess

    listing = subprocess.run(["ls", "-a1", str(d)], capture_output=True, text=True).stdout
    assert listing.split() == [".", "..", "file", "sub"]
    os.rmdir(d / "sub")
    assert os.stat(d).st_nlink == 2
    assert sorted(os.listdir(d)) == ["file"]


@pytest.mark.also_postgres
def test_rename_replace_noreplace_exchange(mounted: Mounted) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)

    def renameat2(a: Path, b: Path, flags: int) -> None:
        if libc.renameat2(-100, os.fsencode(a), -100, os.fsencode(b), flags) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))

    a, b = mounted.path / "a", mounted.path / "b"
    a.write_text("A")
    b.write_text("B")
    with pytest.raises(FileExistsError):
        renameat2(a, b, 1)  # RENAME_NOREPLACE
    renameat2(a, b, 2)  # RENAME_EXCHANGE
    assert (a.read_text(), b.read_text()) == ("B", "A")
    os.rename(a, b)
    assert not a.exists() and b.read_text() == "B"
    # a directory moves into another, nlinks follow
    (mounted.path / "d1").mkdir()
    (mounted.path / "d2").mkdir()
    (mounted.path / "d1" / "x").mkdir()
    os.rename(mounted.path / "d1" / "x", mounted.path / "d2" / "x")
    assert os.stat(mounted.path / "d1").st_nlink == 2
    assert os.stat(mounted.path / "d2").st_nlink == 3
    with pytest.raises(OSError) as e:
        os.rename(mounted.path / "d2", mounted.path / "d2" / "x" / "inside")
    assert e.value.errno == errno.EINVAL
    # a directory replaces an empty one, not a full one
    (mounted.path / "d3").mkdir()
    os.rename(mounted.path / "d2" / "x", mounted.path / "d3")
    assert not (mounted.path / "d2" / "x").exists()
    (mounted.path / "d3" / "f").write_text("f")
    (mounted.path / "d4").mkdir()
    with pytest.raises(OSError) as e:
        os.rename(mounted.path / "d4", mounted.path / "d3")
    assert e.value.errno == errno.ENOTEMPTY


@pytest.mark.also_postgres
def test_hard_links_and_symlinks(mounted: Mounted) -> None:
    a = mounted.path / "a"
    a.write_bytes(b"data" * 50_000)
    os.link(a, mounted.path / "b")
    assert os.stat(a).st_nlink == 2
    assert os.stat(a).st_ino == os.stat(mounted.path / "b").st_ino
    os.unlink(a)
    assert (mounted.path / "b").read_bytes() == b"data" * 50_000
    assert os.stat(mounted.path / "b").st_nlink == 1
    os.symlink("b", mounted.path / "s")
    assert os.readlink(mounted.path / "s") == "b"
    assert (mounted.path / "s").read_bytes() == b"data" * 50_000
    assert os.lstat(mounted.path / "s").st_size == 1
    os.symlink("dangling/" + "x" * 1000, mounted.path / "long")
    assert os.readlink(mounted.path / "long") == "dangling/" + "x" * 1000
    with pytest.raises(OSError) as e:
        os.link(mounted.path, mounted.path / "dirlink")
    assert e.value.errno in (errno.EPERM, errno.EISDIR)


@pytest.mark.also_postgres
def test_mknod_fifo_and_socket(mounted: Mounted) -> None:
    os.mkfifo(mounted.path / "fifo", 0o640)
    assert stat.S_ISFIFO(os.stat(mounted.path / "fifo").st_mode)
    os.mknod(mounted.path / "sock", stat.S_IFSOCK | 0o600)
    assert stat.S_ISSOCK(os.stat(mounted.path / "sock").st_mode)
    os.mknod(mounted.path / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    st = os.stat(mounted.path / "null")
    assert stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(1, 3)


@pytest.mark.also_postgres
def test_chmod_chown_utimens_and_ctime(mounted: Mounted) -> None:
    p = mounted.path / "f"
    p.write_text("x")
    before = os.stat(p)
    time.sleep(0.01)
    os.chmod(p, 0o600)
    st = os.stat(p)
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_ctime_ns > before.st_ctime_ns
    os.chown(p, 1234, 5678)
    st = os.stat(p)
    assert (st.st_uid, st.st_gid) == (1234, 5678)
    os.utime(p, ns=(1_000_000_123, 2_000_000_456))
    st = os.stat(p)
    assert (st.st_atime_ns, st.st_mtime_ns) == (1_000_000_123, 2_000_000_456)
    # setuid bits go when the owner changes
    os.chmod(p, 0o4755)
    os.chown(p, 4321, -1)
    assert not os.stat(p).st_mode & stat.S_ISUID


@pytest.mark.also_postgres
def test_mtime_and_ctime_follow_writes_and_entries(mounted: Mounted) -> None:
    d = mounted.path / "d"
    d.mkdir()
    t0 = os.stat(d).st_mtime_ns
    time.sleep(0.01)
    (d / "f").write_text("1")
    t1 = os.stat(d).st_mtime_ns
    assert t1 > t0
    f_m = os.stat(d / "f").st_mtime_ns
    time.sleep(0.01)
    with open(d / "f", "a") as f:
        f.write("2")
    assert os.stat(d / "f").st_mtime_ns > f_m
    time.sleep(0.01)
    os.unlink(d / "f")
    assert os.stat(d).st_mtime_ns > t1


def test_atime_is_relatime(mounted: Mounted) -> None:
    p = mounted.path / "f"
    p.write_text("x")
    os.utime(p, ns=(1_000_000_000, 2_000_000_000))  # atime before mtime
    p.read_text()
    assert os.stat(p).st_atime_ns > 2_000_000_000


@pytest.mark.also_postgres
def test_xattrs_get_set_list_remove(mounted: Mounted) -> None:
    p = mounted.path / "f"
    p.write_text("x")
    os.setxattr(p, "user.one", b"1")
    os.setxattr(p, "user.two", b"\x00binary\xff")
    assert os.getxattr(p, "user.two") == b"\x00binary\xff"
    assert sorted(os.listxattr(p)) == ["user.one", "user.two"]
    with pytest.raises(FileExistsError):
        os.setxattr(p, "user.one", b"again", os.XATTR_CREATE)
    with pytest.raises(OSError) as e:
        os.setxattr(p, "user.three", b"3", os.XATTR_REPLACE)
    assert e.value.errno == errno.ENODATA
    os.removexattr(p, "user.one")
    assert os.listxattr(p) == ["user.two"]
    with pytest.raises(OSError) as e:
        os.getxattr(p, "user.one")
    assert e.value.errno == errno.ENODATA


def test_statfs_counts_the_inodes_as_they_come_and_go(mounted: Mounted) -> None:
    def used() -> int:
        st = os.statvfs(mounted.path)
        return st.f_files - st.f_ffree
    start = used()
    d = mounted.path / "many"
    d.mkdir()
    for i in range(10):
        (d / f"f{i}").write_bytes(b"x")
    assert used() == start + 11
    for i in range(5):
        (d / f"f{i}").unlink()
    assert eventually(lambda: used() == start + 6)  # (reclaimed after their unlink)


def test_only_the_root_names_the_control_socket(mounted: Mounted) -> None:
    """Clients find the daemon by this xattr, walking up from a path: a folder that
    carried it would send them to a socket of its owner's choosing."""
    from mxfs.client.control import find_socket, mount_root
    d = mounted.path / "a" / "b"
    d.mkdir(parents=True)
    for p in (d, d.parent, d / "f"):
        if p.name == "f":
            p.write_text("x")
        with pytest.raises(OSError) as e:
            os.setxattr(p, "user.mxfs.control", b"/tmp/not-the-daemon.sock")
        assert e.value.errno == errno.EPERM
        with pytest.raises(OSError) as e:
            os.getxattr(p, "user.mxfs.control")
        assert e.value.errno == errno.ENODATA
    assert mount_root(str(d / "f")) == str(mounted.path)
    assert find_socket(str(mounted.path)) == os.getxattr(mounted.path, "user.mxfs.control"
                                                         ).decode()


@pytest.mark.also_postgres
def test_layout_xattr_and_setstripe(mounted: Mounted) -> None:
    d = mounted.path / "models"
    d.mkdir()
    mxfs("setstripe", str(d), "--unit", "256KiB", "--width", "2")
    (d / "w").write_bytes(os.urandom(1 << 20))
    raw = os.getxattr(d / "w", "user.mxfs.layout").decode()
    assert "stripe_unit=262144" in raw and "stripe_width=2" in raw
    (d / "sub").mkdir()
    assert "stripe_unit=262144" in os.getxattr(d / "sub", "user.mxfs.layout").decode()
    out = mxfs("getstripe", "--json", str(d / "w")).stdout
    assert '"stripe_width": 2' in out
    # an existing file with data keeps its layout
    res = mxfs("setstripe", str(d / "w"), "--width", "1", check=False)
    assert res.returncode != 0 and "already holds data" in res.stderr
    res = mxfs("setstripe", str(d), "--unit", "5000", check=False)
    assert res.returncode != 0 and "4 KiB" in res.stderr
    # the virtual xattr is not listed, so cp -a and rsync -X do not copy it
    assert "user.mxfs.layout" not in os.listxattr(d / "w")


def test_statfs_counts_each_members_filesystem_once(mounted: Mounted) -> None:
    st = os.statvfs(mounted.path)
    member = os.statvfs(mounted.members[0])
    # members here share one disk: its space is there once, not four times
    assert abs(st.f_blocks * st.f_frsize - member.f_blocks * member.f_frsize) < 4 << 20
    assert st.f_namemax == 255


def test_statfs_sums_members_on_their_own_devices(loop_pool: Mounted) -> None:
    st = os.statvfs(loop_pool.path)
    total = sum(os.statvfs(m).f_blocks * os.statvfs(m).f_frsize for m in loop_pool.members)
    assert abs(st.f_blocks * st.f_frsize - total) < 4 << 20


@pytest.mark.also_postgres
def test_open_unlinked_file_keeps_data_until_last_close(mounted: Mounted) -> None:
    p = mounted.path / "tmp"
    data = os.urandom(3 * UNIT)
    p.write_bytes(data)
    ino = os.stat(p).st_ino
    chunk = os.path.join(mounted.members[ino % 4], "chunks", f"{ino % 256:02x}", str(ino))
    with open(p, "rb") as f:
        os.unlink(p)
        assert not p.exists()
        assert f.read() == data
        assert os.path.exists(chunk)
    assert eventually(lambda: not os.path.exists(chunk))


@pytest.mark.also_postgres
def test_readdir_is_stable_while_entries_change(mounted: Mounted) -> None:
    d = mounted.path / "d"
    d.mkdir()
    names = {f"f{i:04d}" for i in range(2000)}
    for n in names:
        os.mknod(d / n)
    seen = []
    with os.scandir(d) as it:
        for i, e in enumerate(it):
            seen.append(e.name)
            if i == 100:
                for n in sorted(names)[:50]:
                    if n not in seen:
                        os.unlink(d / n)
                os.mknod(d / "late")
    # every entry that lived throughout was listed exactly once
    assert len(seen) == len(set(seen))
    survivors = set(os.listdir(d)) - {"late"}
    assert survivors <= set(seen)


@pytest.mark.also_postgres
def test_permissions_are_enforced_for_other_users(mounted: Mounted) -> None:
    import subprocess
    import sys

    secret = mounted.path / "secret"
    secret.write_text("root only")
    os.chmod(secret, 0o600)
    os.chmod(mounted.path, 0o755)
    code = ("import os,sys; os.setgid(65534); os.setuid(65534)\n"
            "try:\n open(sys.argv[1]).read(); print('read')\n"
            "except PermissionError: print('denied')\n")
    out = subprocess.run([sys.executable, "-c", code, str(secret)], capture_output=True,
                         text=True).stdout.strip()
    assert out == "denied"
    os.chmod(secret, 0o644)
    out = subprocess.run([sys.executable, "-c", code, str(secret)], capture_output=True,
                         text=True).stdout.strip()
    assert out == "read"


def test_writeback_cache_mode_keeps_appends_times_and_modes(tmp_path: Path,
                                                           members: list[str]) -> None:
    """-o writeback_cache=1: the kernel owns offsets and mtime; nothing may drift."""
    import shutil
    import subprocess

    from conftest import HAVE_FUSE, force_unmount, mkfs

    if not HAVE_FUSE:
        pytest.skip("needs root and /dev/fuse")
    mkfs(members)
    mp = tmp_path / "wb"
    mp.mkdir()
    mxfs("mount", "-o", "writeback_cache=1", members[0], str(mp))
    try:
        data = os.urandom(5 * UNIT + 77)
        (mp / "f").write_bytes(data)
        with open(mp / "f", "ab") as f:
            f.write(b"tail")
        assert (mp / "f").read_bytes() == data + b"tail"
        src = tmp_path / "src"
        src.write_bytes(data)
        os.chmod(src, 0o640)
        os.utime(src, ns=(1_500_000_000_000_000_000,) * 2)
        subprocess.run(["cp", "-a", str(src), str(mp / "copy")], check=True)
        st = os.stat(mp / "copy")
        assert (stat.S_IMODE(st.st_mode), st.st_mtime_ns) == (0o640, 1_500_000_000_000_000_000)
        assert (mp / "copy").read_bytes() == data
        shutil.copyfile(mp / "copy", mp / "copy2")
        assert (mp / "copy2").read_bytes() == data
    finally:
        force_unmount(str(mp))
