# The native I/O engine's interface (native/engine.c, built by setup.py where liburing is).
from collections.abc import Sequence

from typing_extensions import Buffer

def run(ops: Sequence[tuple[int, int, Buffer]], write: bool = ..., depth: int = ...,
        stall_ms: int = ..., /) -> int:
    """Run every (fd, offset, buffer) transfer through io_uring; the bytes transferred.
    A request without a completion for `stall_ms` is cancelled and done on this thread."""

def taken_back() -> int:
    """Requests this process's rings cancelled after a stall and did on a thread."""

def probe() -> None:
    """Raise OSError if io_uring cannot be used here."""
