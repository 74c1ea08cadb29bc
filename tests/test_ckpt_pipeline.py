"""Checkpoint pipelining: the writer writes each staged range while later ones are staged.

Staging is held at one tensor (a tensor subclass whose copy into the staging buffer
waits, only here in the tests) until the writer has written a range, so what the
pipeline does is seen, not timed.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import Mounted, assert_same, check_pool

import mxfs.ckpt as ck
from mxfs.ckpt import writing
from mxfs.ckpt.host_buffer import StagingFailed, Watermark

MiB = 1 << 20


class Held(torch.Tensor):
    """A tensor whose copy into staging first waits (up to 20 s) until `cond()` is true;
    `seen` says whether it was (False: it gave up, and the test fails)."""

    cond: Callable[[], bool]
    seen: list[bool]

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if func is torch.Tensor.copy_ and len(args) > 1 and isinstance(args[1], Held):
            src, end = args[1], time.monotonic() + 20
            while not (ok := src.cond()) and time.monotonic() < end:
                time.sleep(0.005)
            src.seen.append(ok)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def held(t: torch.Tensor, cond: Callable[[], bool]) -> Held:
    h = t.as_subclass(Held)
    h.cond, h.seen = cond, []
    return h


def saver_for(kind: str) -> ck.Checkpointer:
    return ck.Checkpointer(writer=kind, overlap=True)


@pytest.fixture(params=["thread", "process"])
def saver(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
          ) -> Any:
    monkeypatch.setattr(writing, "WRITE_STEP", MiB)  # ranges of 1 MiB: many in 16 MiB
    s = ck.Checkpointer(writer=request.param, overlap=True)  # the default, off on 2 CPUs
    yield s
    s.close()
    s.staging.release()


def four(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(MiB, generator=g) for k in "abcd"}  # 4 MiB each, image order


def test_ranges_are_written_while_later_tensors_are_still_being_staged(
        saver: ck.Checkpointer, mounted: Mounted) -> None:
    plain = four(1)
    last: list[tuple[int, int]] = []

    def written() -> bool:  # the save in flight has written a range: note how far it got
        snap = saver._last
        if snap is None or snap.written == 0:
            return False
        last.append((snap.watermark.queued, snap.written))
        return True

    d = held(plain["d"], written)  # d comes last in the image
    snap = saver.save({**plain, "d": d}, str(mounted.path / "s"))
    snap.staged()
    snap.wait()
    assert d.seen == [True], "the writer wrote nothing while staging was held"
    queued, done = last[-1]
    d_start = snap.total - 4 * MiB
    assert 0 < done <= queued <= d_start  # ranges before d's slot written, d not yet staged
    assert_same(plain, ck.load(str(mounted.path / "s")))


def test_a_staging_failure_midway_leaves_nothing_and_the_previous_checkpoint(
        saver: ck.Checkpointer, mounted: Mounted) -> None:
    root = mounted.path / "run"
    prev = four(2)
    saver.save(prev, str(root / "step-1")).wait()
    bad: dict[str, Any] = four(3)
    # Staging passes b once the writer has begun, and fails at c.
    bad["b"] = held(bad["b"], lambda: saver._last is not None and saver._last.written > 0)
    bad["c"] = torch.empty(MiB, device="meta")
    with pytest.raises(ValueError, match="meta device"):
        saver.save(bad, str(root / "step-2"))
    assert bad["b"].seen == [True]  # the writer was writing when staging failed
    assert [e.name for e in ck.list_checkpoints(str(root))] == ["step-1"]
    assert (root / "latest").read_text().strip() == "step-1"
    assert sorted(os.listdir(root)) == ["latest", "step-1"]  # no partial folder left
    assert_same(prev, ck.load(str(root / "step-1")))
    saver.wait()  # the failure was raised by save; it is not raised again
    good = four(4)
    saver.save(good, str(root / "step-3")).wait()  # the writer (and its process) go on
    assert_same(good, ck.load(str(root / "step-3")))
    saver.close()
    mounted.umount()
    check_pool(mounted.members)  # the aborted data file left no chunk behind


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_compressed_saves_wait_for_the_whole_image_and_load_equal(
        kind: str, tmp_path: Path) -> None:
    saver = saver_for(kind)
    try:
        plain = four(5)
        snap = saver.save(plain, str(tmp_path / "z"), compress="zstd")
        snap.wait()
        assert snap.times["staged"] <= snap.times["done"]
        assert_same(plain, ck.load(str(tmp_path / "z")))
    finally:
        saver.close()
        saver.staging.release()


@pytest.mark.unit
def test_watermark_waits_for_staging_and_fails_its_waiters() -> None:
    mark = Watermark(100)
    got: list[Any] = []

    def writer() -> None:
        got.append(mark.wait_until(10))
        try:
            mark.wait_until(100)
        except StagingFailed as e:
            got.append(str(e))

    t = threading.Thread(target=writer)
    t.start()
    mark.advance(4)
    mark.advance(30)  # the writer wakes with everything staged so far
    t.join(0.05)
    mark.fail(ValueError("tensor x is on the meta device"))
    t.join(10)
    assert got == [30, "staging failed: tensor x is on the meta device"]
    full = Watermark(8)
    full.advance(8)
    assert full.wait_until(8) == 8 and full.final_at is not None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["thread", "process"])
def test_cuda_tensors_are_written_as_their_copies_land(kind: str, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(writing, "WRITE_STEP", 8 * MiB)
    dev = torch.device("cuda")
    state = {f"t{i}": torch.randn(4 * MiB, device=dev) for i in range(8)}  # 128 MiB
    state["cpu"] = torch.arange(MiB, dtype=torch.float32)
    want = {k: v.to("cpu", copy=True) for k, v in state.items()}  # .cpu() aliases "cpu"
    saver = saver_for(kind)
    try:
        snap = saver.save(state, str(tmp_path / "g"))
        snap.staged()
        for v in state.values():
            v.add_(1)  # training goes on once staged
        snap.wait()
        assert_same(want, ck.load(str(tmp_path / "g")))
    finally:
        saver.close()
        saver.staging.release()


def test_overlap_false_writes_only_once_everything_is_staged(mounted: Mounted,
                                                             monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    monkeypatch.setattr(writing, "WRITE_STEP", MiB)
    saver = ck.Checkpointer(overlap=False)
    try:
        plain = four(6)
        at_d: list[int] = []

        def note() -> bool:  # when d's copy starts, after a moment for the writer to act
            time.sleep(0.2)
            at_d.append(saver._last.written)  # type: ignore[union-attr]
            return True

        saver.save({**plain, "d": held(plain["d"], note)}, str(mounted.path / "o")).wait()
        assert at_d == [0]
        assert_same(plain, ck.load(str(mounted.path / "o")))
    finally:
        saver.close()
        saver.staging.release()
