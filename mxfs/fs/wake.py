"""Prompt wake-ups while requests flow: a CPU latency limit held only while busy.

Every FUSE request and control round trip wakes the daemon's CPU, and every
answer wakes the caller's.  Where idle CPUs sleep deeply (a KVM guest with halt
polling off, bare metal in deep C-states) each wake-up costs tens of
microseconds, most of what a metadata request costs: on the 2-CPU guest of
docs/benchmarks.md, creates ran 2.2-2.7x and unlinks 1.5x faster with the
limit held.  With `-o wake_latency_us=N` the daemon writes N to the kernel's CPU
latency QoS (/dev/cpu_dma_latency) while requests arrive and lets go after
IDLE_S without any, so the CPUs stay out of deep sleep only while the pool is
busy.  The limit is machine-wide and costs power (or, in a guest, host CPU) on
every CPU while held, and any user's requests hold it: so it is off unless the
operator asks for it.
"""

from __future__ import annotations

import errno
import logging
import os
import struct
from collections.abc import Callable

import trio

log = logging.getLogger("mxfs.wake")

QOS_PATH = "/dev/cpu_dma_latency"
CHECK_S = 0.05  # how often the request count is looked at
IDLE_S = 0.2    # the limit goes after this long without a request
MAX_US = (1 << 31) - 1  # the kernel takes a signed 32-bit value
# Errors that say the limit cannot be set here at all; others (EMFILE...) pass.
FOR_GOOD = (errno.ENOENT, errno.ENODEV, errno.EACCES, errno.EPERM, errno.EINVAL)


class WakeLatency:
    """Holds the CPU latency limit `microseconds` while `count()` keeps moving."""

    def __init__(self, microseconds: int, count: Callable[[], int],
                 path: str = QOS_PATH) -> None:
        if not 0 <= microseconds <= MAX_US:
            raise ValueError("wake_latency_us")
        self.microseconds = microseconds
        self.value = struct.pack("=i", microseconds)
        self.count = count
        self.path = path
        self.fd: int | None = None
        self.holds = 0  # times the limit was taken (status shows it)
        self.broken: str | None = None  # why the limit cannot be set (logged once)

    @property
    def held(self) -> bool:
        return self.fd is not None

    def hold(self) -> None:
        if self.fd is not None or self.broken:
            return
        fd = None
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CLOEXEC)
            os.write(fd, self.value)
        except OSError as e:
            if fd is not None:
                os.close(fd)
            if e.errno in FOR_GOOD:
                self.broken = f"{self.path}: {e.strerror}"
                log.warning("wake_latency_us: cannot set the CPU latency limit of %d us (%s);"
                            " the mount runs without it (the daemon needs root for it)",
                            self.microseconds, self.broken)
            return  # (out of descriptors, say: tried again at the next check)
        self.fd = fd
        self.holds += 1

    def release(self) -> None:
        """Let the limit go (closing the descriptor is what removes it)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    async def run(self) -> None:
        """Hold while the count moves, release after IDLE_S of quiet; until cancelled."""
        last, quiet = self.count(), 0.0
        try:
            while not self.broken:
                await trio.sleep(CHECK_S)
                now = self.count()
                try:
                    if now != last:
                        last, quiet = now, 0.0
                        self.hold()
                    else:
                        quiet += CHECK_S
                        if quiet >= IDLE_S:
                            self.release()
                except Exception as e:  # noqa: BLE001 - never the end of the mount
                    self.broken = f"{type(e).__name__}: {e}"
                    log.error("wake_latency_us: %s; the mount runs without the limit",
                              self.broken)
        finally:
            self.release()

    def state(self) -> dict[str, object]:
        """What `mxfs status` shows of it."""
        return {"us": self.microseconds, "held": self.held, "holds": self.holds,
                "broken": self.broken}
