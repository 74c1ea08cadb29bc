"""The checkpoint writer as a separate process, for trainers whose GIL must stay free.

The parent sends each save as a `Job` over a socket as its staging into named
shared memory begins; the worker attaches to the memory and runs
`write_snapshot` (the same code the writer thread runs).  Before writing a
range it asks how far staging has got (`("wait", end)`); the parent answers
once the range is staged (`("ready", staged)`, after the CUDA copies into it
have landed) or, if staging failed, `("abort", reason)`, and the worker drops
its file.  Progress and the result (with its warnings) come back the same way.  If the worker
dies, the save fails with that reason and the next save starts a new one.
"""

from __future__ import annotations

import errno
import os
import socket
import subprocess
from collections.abc import Callable
from multiprocessing import resource_tracker, shared_memory
from multiprocessing.connection import Connection
from typing import Any

from mxfs.ckpt.host_buffer import Staging, StagingFailed
from mxfs.ckpt.writing import Job, write_snapshot
from mxfs.proc import python_module


class WriterProcess:
    """The parent's handle on one worker process (started on first use)."""

    def __init__(self) -> None:
        self.proc: Any = None
        self.conn: Connection | None = None

    def _start(self) -> Connection:
        """A fresh interpreter (`python -m mxfs.ckpt.worker`), not multiprocessing's
        spawn, which would import the trainer's own script again."""
        if self.proc is None or self.proc.poll() is not None:
            ours, theirs = socket.socketpair()
            self.proc = subprocess.Popen(
                python_module("mxfs.ckpt.worker"), pass_fds=[theirs.fileno()],
                env={**os.environ, "MXFS_WRITER_FD": str(theirs.fileno())})
            theirs.close()
            self.conn = Connection(ours.detach())
        assert self.conn is not None
        return self.conn

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def run(self, job: Job, staging: Staging, progress: Callable[[str, int, int], None],
            ready: Callable[[int], int]) -> list[str]:
        """Have the worker write `job` from `staging`, each range once `ready(end)` says it
        is staged; its warnings (`write_snapshot`), or raise what it raised (or what
        `ready` raised: staging failed)."""
        conn = self._start()
        failed: StagingFailed | None = None
        try:
            conn.send((job, staging.name))
            while True:
                msg = conn.recv()
                if msg[0] == "progress":
                    progress(*msg[1:])
                elif msg[0] == "wait":
                    try:
                        conn.send(("ready", ready(msg[1])))
                    except StagingFailed as e:
                        failed = e
                        conn.send(("abort", str(e)))
                elif msg[0] == "done":
                    return list(msg[1])
                else:
                    if failed is not None:
                        raise failed
                    _, code, text = msg
                    raise OSError(code, text) if code else RuntimeError(text)
        except (EOFError, ConnectionError, BrokenPipeError):
            code = self.proc.wait() if self.proc is not None else None
            self.proc = None
            raise RuntimeError(f"the checkpoint writer process died (exit code {code})"
                               ) from None

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        if self.proc is not None:
            self.proc.wait(timeout=30)  # it exits when its end of the socket closes
            self.proc = None


def main(conn: Connection) -> None:
    """The worker: serve jobs until the parent goes away."""
    import torch  # noqa: F401 - loaded once, before the first job

    attached: dict[str, shared_memory.SharedMemory] = {}
    packed = Staging()
    while True:
        try:
            job, name = conn.recv()
        except (EOFError, OSError):
            return
        shm = attached.get(name)
        if shm is None:
            for old in attached.values():
                old.close()
            attached = {name: (shm := shared_memory.SharedMemory(name=name))}
            # The parent owns (and unlinks) it; do not let this process's tracker do so.
            resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
        assert shm.buf is not None  # None only once closed
        base = memoryview(shm.buf)
        skip = (-address_of(base)) % 4096
        image = base[skip:skip + -(-job.plan.size // 4096) * 4096]
        staged = 0

        def ready(end: int) -> None:
            """Wait for the parent to say bytes [0, end) are staged."""
            nonlocal staged
            if end > staged:
                conn.send(("wait", end))
                msg = conn.recv()
                if msg[0] == "abort":
                    raise StagingFailed(msg[1])
                staged = msg[1]

        try:
            warnings = write_snapshot(
                job, image, packed,
                lambda state, done, total: conn.send(("progress", state, done, total)), ready)
            conn.send(("done", warnings))
        except OSError as e:
            conn.send(("error", e.errno or errno.EIO, e.strerror or str(e)))
        except Exception as e:  # noqa: BLE001 - reported to the parent's wait()
            conn.send(("error", 0, f"{type(e).__name__}: {e}"))
        finally:
            image.release()
            base.release()


def address_of(view: memoryview) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(view))


if __name__ == "__main__":
    main(Connection(int(os.environ["MXFS_WRITER_FD"])))
