"""Compute claims (`fs/kv_claims.py`) in trio's own clock: what each key's state is to
whom, what ends a claim, how long a wait lasts, and what one connection may hold."""

from __future__ import annotations

import errno

import pytest
import trio
import trio.testing

from mxfs.fs.kv_claims import BUSY, MAX_WAIT_S, STORED, YOURS, Claims
from mxfs.fs.session import Session
from mxfs.vol.access import Caller
from mxfs.vol.kv_index import Chunk, Namespace

pytestmark = pytest.mark.unit


def _session(uid: int = 1000) -> Session:
    return Session(Caller(1, uid, uid, frozenset({uid})))


def _run(fn: object) -> None:
    trio.run(fn, clock=trio.testing.MockClock(autojump_threshold=0))  # type: ignore[arg-type]


def test_states_and_what_ends_a_claim() -> None:
    async def main() -> None:
        space = Namespace("n", 0, 0, 0o777, 0)
        claims = Claims(per_user=8)
        a, b = _session(), _session()
        assert claims.claim(space, [b"k1", b"k2"], a, 10) == [YOURS, YOURS]
        assert claims.claim(space, [b"k1", b"k3"], b, 10) == [BUSY, YOURS]
        space.chunks[b"k1"] = Chunk(ino=5, size=1, atime=0, sum_unit=1, sums=b"")
        claims.stored(space, b"k1")
        assert claims.claim(space, [b"k1"], b, 10) == [STORED]
        assert claims.claim(space, [b"k3"], b, 0) == [YOURS]  # given up: free
        assert claims.claim(space, [b"k3"], a, 10) == [YOURS]
        assert claims.claim(space, [b"k3"], b, 0) == [BUSY]  # (a's, not b's to give up)
        claims.release(a)  # a's connection closed: k2 is free
        assert claims.claim(space, [b"k2"], b, 10) == [YOURS]
        assert claims.claim(space, [b"k4"], a, 1) == [YOURS]
        await trio.sleep(1.5)  # it ran out
        assert claims.claim(space, [b"k4"], b, 10) == [YOURS]
        claims.dropped("n")
        assert len(claims) == 0
    _run(main)


def test_a_wait_ends_with_the_claim_or_its_bound() -> None:
    async def main() -> None:
        space = Namespace("n", 0, 0, 0o777, 0)
        claims = Claims(per_user=8)
        a, b = _session(), _session()
        claims.claim(space, [b"k"], a, 5)
        start = trio.current_time()
        assert await claims.wait(space, [b"k"], b, 30) == [False]
        assert trio.current_time() - start == pytest.approx(5)  # (the claim ran out)
        claims.claim(space, [b"k"], a, 50)
        start = trio.current_time()
        assert await claims.wait(space, [b"k"], b, 2) == [False]
        assert trio.current_time() - start == pytest.approx(2)  # (the wait's bound)
        claims.claim(space, [b"j"], a, 600)  # asked for long: held MAX_WAIT_S at most
        start = trio.current_time()
        assert await claims.wait(space, [b"j"], b, 600) == [False]
        assert trio.current_time() - start <= MAX_WAIT_S + 0.01
        start = trio.current_time()
        async with trio.open_nursery() as n:  # a put wakes the waiter
            claims.claim(space, [b"p"], a, 50)
            got: list[list[bool]] = []

            async def waiter() -> None:
                got.append(await claims.wait(space, [b"p"], b, 50))
            n.start_soon(waiter)
            await trio.sleep(1)
            space.chunks[b"p"] = Chunk(ino=6, size=1, atime=0, sum_unit=1, sums=b"")
            claims.stored(space, b"p")
        assert got == [[True]] and trio.current_time() - start == pytest.approx(1)
    _run(main)


def test_one_uid_holds_at_most_its_limit() -> None:
    async def main() -> None:
        space = Namespace("n", 0, 0, 0o777, 0)
        claims = Claims(per_user=2)
        a, a2 = _session(1000), _session(1000)
        claims.claim(space, [b"a"], a, 10)
        claims.claim(space, [b"b"], a2, 1)
        assert claims.claim(space, [b"a"], a, 10) == [YOURS]  # (renewing is not more)
        with pytest.raises(OSError) as e:  # (its two connections together)
            claims.claim(space, [b"c"], a, 10)
        assert e.value.errno == errno.EDQUOT
        assert claims.claim(space, [b"c"], _session(1001), 10) == [YOURS]
        assert claims.claim(space, [b"d", b"e", b"f"], _session(0), 10) == [YOURS] * 3
        await trio.sleep(2)  # a2's claim ran out: room again
        assert claims.claim(space, [b"c2"], a, 10) == [YOURS]
    _run(main)
