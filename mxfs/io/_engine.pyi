# The native I/O engine's interface (native/engine.c, built by setup.py where liburing is).
from collections.abc import Sequence

from typing_extensions import Buffer

def run(ops: Sequence[tuple[int, int, Buffer]], write: bool = ..., depth: int = ..., /) -> int:
    """Run every (fd, offset, buffer) transfer through io_uring; the bytes transferred."""

def probe() -> None:
    """Raise OSError if io_uring cannot be used here."""
