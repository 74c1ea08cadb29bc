"""The I/O lanes of files on other nodes (mxfs.fs.fair.Lanes), with real worker
threads: a set of nodes keeps its lane while it has I/O in flight, and an idle lane
goes to the next set, so files touched once after mount hold none for good."""

from __future__ import annotations

import threading

import pytest
import trio
import trio.testing

from mxfs.fs.fair import Lanes, RoundRobin

alice, bob, carol = 1001, 1002, 1003


@pytest.mark.unit
def test_a_slow_node_holds_only_its_lane_after_every_lane_was_used() -> None:
    """Soon after mount alice reads files striped over eight node subsets, once each;
    then node x stops answering while alice and bob read files on it, filling their
    lane's threads.  carol's reads of files on other nodes go on.  Before, the eight
    first sets held their lanes for the life of the mount: x's files and carol's shared
    the rest's lane, and her reads waited on x (x's lane, busy, must stay x's too:
    handed to one of carol's sets, her reads would wait on it as well)."""
    lanes = Lanes(4, 64)
    stuck = threading.Event()

    async def main() -> None:
        for n in range(Lanes.MAX_FAR_LANES):
            await lanes.of((f"n{n}",)).run(alice, lambda: None)
        async with trio.open_nursery() as nursery:
            for uid in (alice, alice, alice, bob):  # (one uid holds 3 of 4 threads)
                nursery.start_soon(lanes.of(("x",)).run, uid, stuck.wait, 30)
            await trio.testing.wait_all_tasks_blocked()
            try:
                with trio.fail_after(10):  # (a hang guard: each read is at once)
                    for n in range(2 * Lanes.MAX_FAR_LANES):
                        await lanes.of(("y", f"m{n}")).run(carol, lambda: None)
            finally:
                stuck.set()

    trio.run(main)


@pytest.mark.unit
def test_a_write_already_answered_lands_ahead_of_its_writers_other_io() -> None:
    """A write answered before it landed (write-behind) is what another user's read or
    close of the file waits for: it takes its writer's next turn, ahead of her own
    calls waiting.  Queued behind them, bob's read of a file alice wrote waited for
    every read and fsync alice had queued."""
    turns = RoundRobin(1)
    order: list[str] = []

    async def call(name: str, first: bool = False) -> None:
        async with turns.slot(alice, first):
            order.append(name)
            await trio.lowlevel.checkpoint()

    async def main() -> None:
        held = await turns.take(alice)
        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(call, f"read{i}")
                await trio.testing.wait_all_tasks_blocked()
            for i in range(2):  # (answered writes among themselves: in the order they
                nursery.start_soon(call, f"landing{i}", True)  # came, not newest first)
                await trio.testing.wait_all_tasks_blocked()
            turns.give(held)

    trio.run(main)
    assert order == ["landing0", "landing1", "read0", "read1", "read2"]
