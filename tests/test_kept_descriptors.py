"""Descriptors the daemon hands out (`open_read`, KV gets, hidden files' writes) as a
hostile user keeps them: past exec, or turned into ones the kernel's lease counts miss.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator

import pytest
from conftest import HAVE_FUSE, Mounted, module_pool

from mxfs.client import ControlClient

pytestmark = pytest.mark.skipif(not HAVE_FUSE, reason="needs root and /dev/fuse")


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mounted]:
    with module_pool(tmp_path_factory) as m:
        yield m


def test_descriptors_a_client_receives_are_not_inherited_across_exec(pool: Mounted) -> None:
    """Received without MSG_CMSG_CLOEXEC, a client's descriptors went to every program
    it ran: a child kept a hidden file's write descriptors (its commit refused, EBUSY,
    until that exited), and a root launcher's went to what it ran as anyone."""
    path = pool.path / "read-by-a-launcher"
    path.write_bytes(os.urandom(1 << 20))
    with ControlClient(str(pool.path)) as c:
        _, read = c.call_with_fds("open_read", path=c.pool_path(str(path)))
        made, write = c.call_with_fds("create", path="/written-by-a-launcher", size=4096)
        try:
            flags = [fcntl.fcntl(fd, fcntl.F_GETFD) for fd in read + write]
            assert read and write and all(f & fcntl.FD_CLOEXEC for f in flags), flags
        finally:
            for fd in read + write:
                os.close(fd)
            c.call("abort", ino=made["ino"])
