"""Opens of chosen files held in the kernel for as long as a test wants, whoever makes
them (the daemon's threads included), with no help from the daemon.

A fanotify group (root's) marks the files for FAN_OPEN_PERM: each open of one waits
until the group answers it.  The test takes the opens one by one (`next`: which
file) and lets each go (`allow`) in the order it wants, or lets every later one
through at once (`let_all`).  An open waiting there already counts as one for the
kernel's leases (a write-lease probe of the file is refused meanwhile), and so would
the descriptor of the file each event brings: it is replaced at once by one of
/dev/null, keeping its number (the answer names the open by it).
"""

from __future__ import annotations

import ctypes
import os
import queue
import select
import struct
import threading
from dataclasses import dataclass
from types import TracebackType

_FAN_CLOEXEC, _FAN_CLASS_CONTENT = 0x1, 0x4
_FAN_MARK_ADD, _FAN_OPEN_PERM, _FAN_ALLOW = 0x1, 0x10000, 0x1
_AT_FDCWD = -100
_EVENT = struct.Struct("IBBHQii")  # fanotify_event_metadata
_ANSWER = struct.Struct("iI")  # fanotify_response


@dataclass(frozen=True)
class Opening:
    """One open waiting: `ino` is the file's inode number."""
    number: int  # (the event's descriptor number: what the answer names)
    ino: int


class OpenGate:
    def __init__(self, paths: list[str]) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.fanotify_mark.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint64,
                                       ctypes.c_int, ctypes.c_char_p]
        self._fd = libc.fanotify_init(_FAN_CLOEXEC | _FAN_CLASS_CONTENT, os.O_RDONLY)
        if self._fd < 0:
            raise OSError(ctypes.get_errno(), "fanotify_init")
        for path in paths:
            if libc.fanotify_mark(self._fd, _FAN_MARK_ADD, _FAN_OPEN_PERM, _AT_FDCWD,
                                  path.encode()) < 0:
                os.close(self._fd)
                raise OSError(ctypes.get_errno(), f"fanotify_mark {path}")
        self._waiting: queue.Queue[Opening] = queue.Queue()
        self._lock = threading.Lock()
        self._all = False
        self._given: set[int] = set()  # (numbers of the opens `next` gave, not let go)
        self._stop = False
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def next(self, timeout: float = 30.0) -> Opening:
        """The next open waiting (queue.Empty if none came in `timeout`)."""
        opening = self._waiting.get(timeout=timeout)
        self._given.add(opening.number)
        return opening

    def allow(self, opening: Opening) -> None:
        """Let `opening` go on."""
        os.write(self._fd, _ANSWER.pack(opening.number, _FAN_ALLOW))
        self._given.discard(opening.number)
        os.close(opening.number)

    def let_all(self) -> None:
        """Every open from now on goes through, and those waiting that `next` did not
        give yet (those it gave are the test's to allow)."""
        with self._lock:
            self._all = True
            while not self._waiting.empty():
                self.allow(self._waiting.get_nowait())

    def _read(self) -> None:
        while not self._stop:
            if not select.select([self._fd], [], [], 0.1)[0]:
                continue
            try:
                buf = os.read(self._fd, 4096)
            except OSError:
                return
            at = 0
            while at < len(buf):
                size, _, _, _, _, number, _ = _EVENT.unpack_from(buf, at)
                at += size
                ino = os.fstat(number).st_ino
                null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
                os.dup2(null, number, inheritable=False)  # (the file: no longer held here)
                os.close(null)
                with self._lock:
                    if self._all:
                        self.allow(Opening(number, ino))
                    else:
                        self._waiting.put(Opening(number, ino))

    def __enter__(self) -> OpenGate:
        return self

    def __exit__(self, kind: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        """Every open goes through again (closing the group answers those still
        waiting, the test's too)."""
        self.let_all()
        self._stop = True
        self._thread.join()
        os.close(self._fd)
        for number in self._given:
            os.close(number)
