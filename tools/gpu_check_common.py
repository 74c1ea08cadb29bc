"""What the GPU check's parts share: timing that waits for the device, byte checks, medians."""

from __future__ import annotations

import errno
import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch


def sync(dev: torch.device) -> None:
    """Wait for the device's queued work, so a clock read after it counts that work."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn: Callable[[], Any], dev: torch.device) -> tuple[float, Any]:
    """(seconds, result) of `fn`, device work included."""
    sync(dev)
    start = time.perf_counter()
    out = fn()
    sync(dev)
    return time.perf_counter() - start, out


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def same_bytes(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Same names, and every tensor equal byte for byte (NaNs and -0.0 included)."""
    return sorted(a) == sorted(b) and all(
        a[k].dtype == b[k].dtype and torch.equal(as_bytes(a[k]), as_bytes(b[k].to(a[k].device)))
        for k in a)


def median(values: list[float]) -> float:
    return statistics.median(values)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def raw_reads(paths: list[str], bufs: list[memoryview], threads: int = 16) -> int:
    """Each file read whole with O_DIRECT into its page-aligned buffer, `threads` at once:
    the members' ceiling for the same bytes."""
    def one(path: str, buf: memoryview) -> int:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError as e:  # a filesystem without O_DIRECT: the ceiling is buffered
            if e.errno != errno.EINVAL:
                raise
            fd = os.open(path, os.O_RDONLY)
        done = 0
        try:
            while n := os.preadv(fd, [buf[done:]], done):
                done += n
                if done >= len(buf) or n % 4096:
                    break
        finally:
            os.close(fd)
        return done
    with ThreadPoolExecutor(min(threads, max(1, len(paths)))) as ex:
        return sum(ex.map(one, paths, bufs))


def describe(e: BaseException) -> str:
    """One line for a failure: its type and message."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")
