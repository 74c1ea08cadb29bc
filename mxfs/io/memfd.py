"""Memory files the daemon hands its users (KV copies and put buffers), freed off the
caller's thread.

A memfd's pages are freed when it is cut to nothing, whoever still holds it: the
caller's own descriptor kept them otherwise.  Cutting a GiB of pages takes tens of
milliseconds, which on the daemon's one trio thread every user waited for; here one
thread of its own does it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import mmap
import os
from collections.abc import Callable

_FREEING = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mxfs-memfd-free")


def _free(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
    os.close(fd)


def free_later(fd: int) -> concurrent.futures.Future[None]:
    """Cut `fd` to nothing and close it, on the freeing thread (the caller reads
    nothing more of it); done in the order asked."""
    return _FREEING.submit(_free, fd)


def fill_mapped(fd: int, size: int, fill: Callable[[memoryview], None]) -> None:
    """`fill` the first `size` bytes of `fd` through a mapping of them.  A failure
    leaves the mapping to the garbage collector: its traceback can hold slices of it
    (a remote read's views, in frames that refer to one another through their
    exceptions), and a close while they lived raised BufferError in its place."""
    m = mmap.mmap(fd, size)
    with memoryview(m) as view:
        fill(view)
    m.close()
