"""Calls into members' filesystems (`fs/member_calls.py`): a member whose call has not
come back is left out of new ones until it does; a busy member is not."""

from __future__ import annotations

import functools
import threading
import time

import pytest
import trio
import trio.testing

from mxfs.fs import member_calls
from mxfs.fs.member_calls import MemberCalls


def test_a_member_is_left_out_while_a_call_hangs_and_back_once_it_returns() -> None:
    calls = MemberCalls(2)
    release = threading.Event()
    started = threading.Event()

    def hang() -> str:
        started.set()
        release.wait(30)
        return "late"

    stuck = threading.Thread(target=calls.guarded, args=(0, hang))
    stuck.start()
    try:
        assert started.wait(10)
        assert calls.guarded(0, lambda: "busy") == "busy"  # (one call out: merely busy)
        time.sleep(member_calls.WAIT_S + 0.1)
        assert calls.guarded(0, lambda: "asked") is None  # out past WAIT_S: left out
        assert calls.guarded(1, lambda: "other") == "other"  # other members answer
    finally:
        release.set()
        stuck.join(10)
    assert calls.guarded(0, lambda: "again") == "again"  # back once it came back


def test_one_users_slow_calls_on_a_member_leave_another_a_place_on_it() -> None:
    """A member's places go by uid in turn: alice's six slow calls on member 0 hold 3
    of its 4 and wait for each other, and bob's call runs while all of hers are still
    out (first come, first served, hers took all 4 and his waited behind them)."""
    calls = MemberCalls(1)
    release, order = threading.Event(), []

    def slow(who: str) -> str:
        order.append(who)
        release.wait(30)
        return who

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for _ in range(6):
                nursery.start_soon(calls.run_whole, functools.partial(slow, "alice"),
                                   1001, (0,))
            await trio.testing.wait_all_tasks_blocked()
            with trio.fail_after(20):
                while len(order) < member_calls.PER_MEMBER * 3 // 4:
                    await trio.sleep(0.01)
            assert await calls.run_whole(lambda: "bob", 1002, (0,)) == "bob"
            assert order == ["alice"] * 3  # (all of hers still out, the rest waiting)
            release.set()
        assert order == ["alice"] * 6

    trio.run(main)


def test_calls_given_up_on_hold_their_uids_threads_until_they_return(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Alice's calls hang past WAIT_S twice over (the requests answered without them),
    and bob's call still finds a thread while none of hers has returned: hers hold 12
    of the 16 at most, her later calls waiting behind her own.  (Before, a call given
    up let go of its uid's turn while its thread ran on: her second round took the
    last four threads, and bob's call waited and was given up too.)"""
    monkeypatch.setattr(member_calls, "WAIT_S", 0.2)
    calls = MemberCalls(1)
    release, lock = threading.Event(), threading.Lock()
    began, ended = [], []

    def stuck() -> str:
        with lock:
            began.append("alice")
        release.wait(30)
        with lock:
            ended.append("alice")
        return "late"

    async def main() -> None:
        answers: list[str | None] = []

        async def alice() -> None:
            answers.append(await calls.run(stuck, 1001))
        try:
            for _ in range(2):  # (the second round asked once the first was given up)
                async with trio.open_nursery() as nursery:
                    for _ in range(member_calls.THREADS):
                        nursery.start_soon(alice)
            bob = await calls.run(lambda: "bob", 1002)
            with lock:
                assert (bob, len(began), ended) == \
                    ("bob", member_calls.THREADS * 3 // 4, [])
            assert answers == [None] * 2 * member_calls.THREADS
        finally:
            release.set()
        with trio.fail_after(10):  # (hers end, their threads and turns given back)
            while len(ended) < len(began):
                await trio.sleep(0.01)
        assert await calls.run(lambda: "alice", 1001) == "alice"

    trio.run(main)
