"""The loop watch: steps that hold the daemon's one thread are caught and placed."""

from __future__ import annotations

import time
import types
from collections.abc import Generator

import trio

from mxfs.fs.loop_watch import LoopWatch, where


def test_a_step_that_holds_the_loop_is_counted_and_placed() -> None:
    watch = LoopWatch(0.25)  # (far above what a busy machine takes from a step)

    async def polite() -> None:
        for _ in range(20):
            await trio.sleep(0.005)  # (waits, holding nothing)

    async def rude() -> None:
        await trio.sleep(0.01)
        time.sleep(0.5)  # (a blocking call on the loop)
        await trio.sleep(0)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(polite)
            nursery.start_soon(rude, name="rude-task")

    trio.run(main, instruments=[watch])
    assert watch.long_steps == 1
    held, what = watch.longest
    assert held >= 0.5
    assert what.startswith("rude-task from ")
    assert "rude" in what.split(" to ")[1]
    # (and the call it was in then, seen from the watch's own thread)
    assert "test_loop_watch.py" in what.split("; in it: ")[1].split(" > ")[-1]


def test_where_names_the_innermost_frame_of_an_await_chain() -> None:
    @types.coroutine
    def trap() -> Generator[str, None, None]:
        yield "parked"  # (where a task waits, as trio's own traps do)

    async def inner() -> None:
        await trap()

    async def outer() -> None:
        await inner()

    coro = outer()
    assert coro.send(None) == "parked"
    try:
        assert where(coro).endswith(" trap")
        assert "test_loop_watch.py:" in where(coro)
    finally:
        coro.close()
