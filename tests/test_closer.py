"""The closer (`pool/closer.py`): descriptors handed over are closed off the caller's
thread, and a look for a file's holders waits for the process's own still closing.

Plain files in a temporary folder: no mount, no root.
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
import time
from pathlib import Path

import pytest

from mxfs.pool.closer import LINGER_S, Closer, close_later, fdinfo
from mxfs.pool.revoke import writers_remain


def _open(fd: int, ino: int | None = None) -> bool:
    """Whether `fd` is open (on inode `ino`: the number may be another thread's
    since, an earlier test's threads of this process opening files)."""
    try:
        fcntl.fcntl(fd, fcntl.F_GETFD)
        return ino is None or os.fstat(fd).st_ino == ino
    except OSError as e:
        assert e.errno == errno.EBADF
        return False


def test_descriptors_handed_over_are_all_closed_and_counted_until_then(
        tmp_path: Path) -> None:
    closer = Closer()
    paths = [tmp_path / f"f{i}" for i in range(200)]
    fds = [os.open(p, os.O_RDWR | os.O_CREAT, 0o600) for p in paths]
    inos = [os.fstat(fd).st_ino for fd in fds]
    closer.close(fds)
    assert closer.drain(10), f"{closer.pending} still closing"
    assert closer.pending == 0
    assert not any(_open(fd, ino) for fd, ino in zip(fds, inos, strict=True))
    assert closer.closes == len(fds)


def test_fdinfo_names_the_mount_and_inode_without_asking_the_filesystem(
        tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x")
    fd = os.open(path, os.O_RDONLY)
    try:
        mount, ino = fdinfo(fd)
        assert ino == os.fstat(fd).st_ino
        assert mount > 0
    finally:
        os.close(fd)


def test_a_look_for_writers_waits_for_the_processs_own_closing_descriptors(
        tmp_path: Path) -> None:
    """A writable descriptor this process gave up (as the daemon gives up its copy of
    one it sent) is no writer once closed: the look waits for it, and a descriptor
    kept open is still one."""
    path = tmp_path / "chunk"
    path.write_bytes(b"x" * 4096)
    mine = os.open(path, os.O_WRONLY)
    assert writers_remain([str(path)])
    close_later([mine])  # (the process's closer, which the looks wait for)
    assert not writers_remain([str(path)])
    kept = os.open(path, os.O_WRONLY)
    try:
        assert writers_remain([str(path)])  # (a holder that is not closing)
    finally:
        os.close(kept)


def test_wait_closed_says_whether_a_look_is_worth_taking_again(tmp_path: Path) -> None:
    closer = Closer()
    path = tmp_path / "f"
    path.write_bytes(b"x")
    probe = os.open(path, os.O_RDONLY)
    try:
        file, since = fdinfo(probe), closer.closes
        assert not closer.wait_closed(file, 1.0, since)  # (nothing of it closing)
        closer.close([os.open(path, os.O_WRONLY)])
        assert closer.wait_closed(file, 10.0, since)  # (its own copy, now closed)
    finally:
        os.close(probe)


class _SlowCloses:
    """Closes that wait for a permit, as a slow member's do (then close for real)."""

    def __init__(self) -> None:
        self.permits = threading.Semaphore(0)

    def __call__(self, fd: int) -> None:
        self.permits.acquire()
        os.close(fd)


def test_a_look_waits_for_its_files_closes_as_long_as_they_move(tmp_path: Path) -> None:
    """A file's descriptor queued behind slow closes of its mount (a loaded daemon's):
    the wait outlasts its timeout while they go on; where none moves for the timeout
    (a member that stopped answering) it gives up."""
    slow = _SlowCloses()
    closer = Closer(slow)
    path = tmp_path / "f"
    path.write_bytes(b"x")
    probe = os.open(path, os.O_RDONLY)
    try:
        file, since = fdinfo(probe), closer.closes
        closer.close([os.open(path, os.O_WRONLY) for _ in range(16)])
        assert not closer.wait_closed(file, 0.3, since)  # (none closed: given up)

        def one_by_one() -> None:
            for _ in range(16):
                time.sleep(0.1)
                slow.permits.release()
        threading.Thread(target=one_by_one, daemon=True).start()
        assert closer.wait_closed(file, 1.0, since)  # (1.6 s in all)
        assert closer.pending == 0 and not writers_remain([str(path)])
    finally:
        slow.permits.release(16)
        os.close(probe)


def test_a_look_gives_up_on_a_hung_close_while_other_mounts_close(tmp_path: Path) -> None:
    """A file's close that hangs (its member stopped answering) while descriptors of
    other mounts are handed over and closed all the time: the look gives up (it took
    their sorting for its own file's progress and waited for good)."""
    hung, stuck = threading.Event(), set()

    def close(fd: int) -> None:
        if fd in stuck:
            hung.wait()
        os.close(fd)
    closer = Closer(close)
    path = tmp_path / "f"
    path.write_bytes(b"x")
    probe = os.open(path, os.O_RDONLY)
    stop = threading.Event()

    def others() -> None:  # (/dev/null: another mount's)
        while not stop.is_set():
            closer.close([os.open("/dev/null", os.O_RDONLY)])
            time.sleep(0.05)
    handing = threading.Thread(target=others)
    try:
        file, since = fdinfo(probe), closer.closes
        stuck.add(fd := os.open(path, os.O_WRONLY))
        closer.close([fd])
        handing.start()
        assert not closer.wait_closed(file, 0.3, since)
    finally:
        stop.set()
        if handing.is_alive():
            handing.join()
        hung.set()
        os.close(probe)
    assert closer.drain(10)


def _threads_of(closer: Closer) -> list[threading.Thread]:
    return [t for t in threading.enumerate()
            if getattr(getattr(t, "_target", None), "__self__", None) is closer]


@pytest.mark.parametrize("n", [1, 64])
def test_threads_end_once_idle(tmp_path: Path, n: int) -> None:
    """An idle closer holds no thread (each ends LINGER_S after its last descriptor)."""
    closer = Closer()
    closer.close([os.open(tmp_path / f"f{i}", os.O_RDWR | os.O_CREAT, 0o600)
                  for i in range(n)])
    assert closer.drain(10)
    assert _threads_of(closer)  # (lingering a moment for more)
    deadline = time.monotonic() + LINGER_S + 10
    while _threads_of(closer) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _threads_of(closer)
