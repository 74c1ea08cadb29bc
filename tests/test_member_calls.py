"""Calls into members' filesystems (`fs/member_calls.py`): a member whose call has not
come back is left out of new ones until it does; a busy member is not."""

from __future__ import annotations

import threading
import time

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
