"""Several processes writing and reading distinct and shared files at once."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
from pathlib import Path

from conftest import Mounted

REGION = 256 * 1024 + 512  # unaligned to the stripe unit on purpose
WORKERS = 6


def pattern(worker: int, n: int) -> bytes:
    return hashlib.shake_256(f"{worker}".encode()).digest(n)


def writer(root: str, worker: int) -> str:
    own = Path(root) / f"own{worker}"
    data = pattern(worker, 3 * REGION)
    with open(own, "wb") as f:
        for i in range(0, len(data), 10_000):
            f.write(data[i:i + 10_000])
        f.flush()
        os.fsync(f.fileno())
    fd = os.open(Path(root) / "shared", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, pattern(worker, REGION), worker * REGION)
        os.fsync(fd)
    finally:
        os.close(fd)
    # read back what the others wrote so far, while they still write
    for other in range(WORKERS):
        p = Path(root) / f"own{other}"
        if p.exists():
            got = p.read_bytes()
            assert pattern(other, 3 * REGION).startswith(got[: len(got)]), other
    return hashlib.sha256(own.read_bytes()).hexdigest()


def test_parallel_writers_and_readers(mounted: Mounted) -> None:
    ctx = mp.get_context("fork")
    with ctx.Pool(WORKERS) as pool:
        digests = pool.starmap(writer, [(str(mounted.path), w) for w in range(WORKERS)])
    for w, d in enumerate(digests):
        assert d == hashlib.sha256(pattern(w, 3 * REGION)).hexdigest()
    shared = (mounted.path / "shared").read_bytes()
    assert len(shared) == WORKERS * REGION
    for w in range(WORKERS):
        assert shared[w * REGION:(w + 1) * REGION] == pattern(w, REGION)


def appender(root: str, worker: int) -> None:
    with open(Path(root) / "log", "a") as f:
        for i in range(200):
            f.write(f"{worker:02d}:{i:04d}\n")
            f.flush()


def test_concurrent_appends_interleave_whole_lines(mounted: Mounted) -> None:
    ctx = mp.get_context("fork")
    (mounted.path / "log").write_text("")
    with ctx.Pool(4) as pool:
        pool.starmap(appender, [(str(mounted.path), w) for w in range(4)])
    lines = (mounted.path / "log").read_text().splitlines()
    assert len(lines) == 800
    assert sorted(lines) == sorted(f"{w:02d}:{i:04d}" for w in range(4) for i in range(200))
