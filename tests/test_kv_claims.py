"""Compute claims (`fs/kv_claims.py`) in trio's own clock: what each key's state is to
whom, what ends a claim, how long a wait lasts, and what one connection may hold."""

from __future__ import annotations

import errno

import pytest
import trio
import trio.testing

from mxfs.fs.kv_claims import BUSY, DROP_BITE, MAX_CLAIM_S, MAX_WAIT_S, STORED, YOURS, Claims
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
        space.chunks[b"k1"] = Chunk(ino=5, size=1, atime=0, sum_unit=1, sums=b"", tenant=0)
        claims.stored(space, b"k1")
        assert claims.claim(space, [b"k1"], b, 10) == [STORED]
        assert claims.claim(space, [b"k3"], b, 0) == [YOURS]  # given up: free
        assert claims.claim(space, [b"k3"], a, 10) == [YOURS]
        assert claims.claim(space, [b"k3"], b, 0) == [BUSY]  # (a's, not b's to give up)
        claims.end(a, claims.take(a))  # a's connection closed: k2 is free
        assert claims.claim(space, [b"k2"], b, 10) == [YOURS]
        assert claims.claim(space, [b"k4"], a, 1) == [YOURS]
        await trio.sleep(1.5)  # it ran out
        assert claims.claim(space, [b"k4"], b, 10) == [YOURS]
        other = Namespace("m", 0, 0, 0o777, 0)
        assert claims.claim(other, [b"k4"], a, 10) == [YOURS]
        claims.dropped("n", claims.claimed_in("n"))  # (its claims alone end)
        assert len(claims) == 1 and claims.claim(other, [b"k4"], b, 10) == [BUSY]
        claims.dropped("m", claims.claimed_in("m"))
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
            space.chunks[b"p"] = Chunk(ino=6, size=1, atime=0, sum_unit=1, sums=b"", tenant=0)
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


def test_claims_made_before_a_refusal_end_with_their_connection() -> None:
    """A batch refused part way (EDQUOT at the uid's limit) had claimed the keys before
    it, tied to no connection: its close left them holding others back till they ran
    out.  They are the connection's, and end with it."""
    async def main() -> None:
        space = Namespace("n", 0, 0, 0o777, 0)
        claims = Claims(per_user=2)
        a, b = _session(1000), _session(1001)
        with pytest.raises(OSError) as e:
            claims.claim(space, [b"x", b"y", b"z"], a, 50)
        assert e.value.errno == errno.EDQUOT
        assert claims.claim(space, [b"x", b"y"], b, 50) == [BUSY, BUSY]
        claims.end(a, claims.take(a))  # (its connection closed)
        assert claims.claim(space, [b"x", b"y"], b, 50) == [YOURS, YOURS]
    _run(main)


def test_a_closed_connections_claims_end_later_without_ending_anothers() -> None:
    """A closed connection's claims are taken at once and ended later (a bite at a time,
    by `KVOps.let_go`): a key stored and claimed by another connection meanwhile stays
    that connection's claim."""
    async def main() -> None:
        space = Namespace("n", 0, 0, 0o777, 0)
        claims = Claims(per_user=8)
        a, b = _session(), _session()
        claims.claim(space, [b"k1", b"k2"], a, 10)
        taken = claims.take(a)
        assert sorted(taken) == [("n", b"k1"), ("n", b"k2")] and not claims.holds(a)
        assert claims.claim(space, [b"k2"], b, 10) == [BUSY]  # (not ended yet)
        claims.stored(space, b"k1")
        assert claims.claim(space, [b"k1"], b, 10) == [YOURS]
        claims.end(a, taken)
        assert claims.claim(space, [b"k1", b"k2"], a, 10) == [BUSY, YOURS]  # k1 b's still
    _run(main)


def test_claims_run_out_in_order_of_their_time() -> None:
    """Claims run out by their own time (the soonest first, one lengthened by a renewal
    kept), and renewals do not pile up behind them."""
    async def main() -> None:
        space = Namespace("n", 0, 0, 0o777, 0)
        claims = Claims(per_user=10_000)
        a = _session()
        claims.claim(space, [b"short"], a, 1)
        claims.claim(space, [b"long"], a, 3)
        claims.claim(space, [b"short"], a, 5)  # renewed: longer than "long" now
        for _ in range(3000):  # renewals, each an entry in the expiry heap
            claims.claim(space, [b"long"], a, 3)
        assert len(claims._expiry) <= 2 * 2 + 1024  # (rebuilt as they pile up)
        await trio.sleep(2)
        claims.drop_run_out()
        assert len(claims) == 2
        await trio.sleep(2)
        claims.drop_run_out()
        assert len(claims) == 1 and claims.claim(space, [b"short"], _session(), 1) == [BUSY]
        await trio.sleep(2)
        claims.drop_run_out()
        assert len(claims) == 0
    _run(main)


def test_claims_run_out_are_ended_a_bite_at_a_time() -> None:
    """16,384 claims run out were ended at once, 30 ms of the daemon's one thread,
    by the next claim of a user at her bound or by the second's sweep: now DROP_BITE
    at a call, which says whether more are due."""
    async def main() -> None:
        space = Namespace("n", 0, 0, 0o777, 0)
        claims = Claims(per_user=10_000)
        a = _session()
        n = 2 * DROP_BITE + 10
        claims.claim(space, [b"%d" % i for i in range(n)], a, 1)
        await trio.sleep(2)
        assert claims.drop_run_out() and len(claims) == n - DROP_BITE
        assert claims.drop_run_out() and len(claims) == 10
        assert not claims.drop_run_out() and len(claims) == 0
    _run(main)


def test_a_claim_renewed_again_and_again_ends_at_its_life() -> None:
    """A claimer that renews a key's claim every 50 s without putting holds it
    MAX_CLAIM_S from its first grant, no longer: a waiter then goes on and claims it,
    and the claimer's next claims on it (while it cools) hold nobody back."""
    async def main() -> None:
        space = Namespace("n", 0, 0, 0o777, 0)
        claims = Claims(per_user=8)
        bob, alice = _session(1001), _session(1000)
        first = trio.current_time()
        assert claims.claim(space, [b"hot"], bob, MAX_CLAIM_S) == [YOURS]
        await trio.sleep(50)
        assert claims.claim(space, [b"hot"], bob, MAX_CLAIM_S) == [YOURS]  # renewed
        assert claims.claim(space, [b"hot"], alice, 10) == [BUSY]
        assert await claims.wait(space, [b"hot"], alice, MAX_WAIT_S) == [False]
        assert trio.current_time() - first == pytest.approx(MAX_CLAIM_S)  # (not 110 s)
        # Bob claims again at once, as a hostile claimer would: it holds nobody back.
        assert claims.claim(space, [b"hot"], bob, MAX_CLAIM_S) == [YOURS]
        assert claims.claim(space, [b"hot"], alice, 10) == [YOURS]  # her turn
        assert claims.claim(space, [b"hot"], bob, 10) == [BUSY]
        claims.end(alice, claims.take(alice))
        # Cooled down, bob claims it as anyone would.
        await trio.sleep(MAX_CLAIM_S)
        claims.drop_run_out()
        assert not claims._cooling
        assert claims.claim(space, [b"hot"], bob, 10) == [YOURS]
        assert claims.claim(space, [b"hot"], alice, 10) == [BUSY]
    _run(main)


def test_a_claim_held_less_than_its_life_is_renewed_as_asked() -> None:
    """An instance computing a long prefix renews its claim: granted as asked while
    within its life; one that ran out short of its life cools nothing unless another
    user wanted the key."""
    async def main() -> None:
        space = Namespace("n", 0, 0, 0o777, 0)
        claims = Claims(per_user=8)
        a, b = _session(1000), _session(1001)
        claims.claim(space, [b"hot"], a, 10)
        for _ in range(4):
            await trio.sleep(8)
            assert claims.claim(space, [b"hot"], a, 10) == [YOURS]
        await trio.sleep(9)
        assert claims.claim(space, [b"hot"], b, 10) == [BUSY]  # (41 s in, held to 42)
        await trio.sleep(2)
        assert claims.claim(space, [b"hot"], b, 10) == [YOURS]  # (ran out short of its
        claims.end(b, claims.take(b))  # life; b wanted it: a's next holds nobody back)
        assert claims.claim(space, [b"hot"], a, 10) == [YOURS]
        assert claims.claim(space, [b"hot"], b, 10) == [YOURS]
        claims.claim(space, [b"cold"], a, 10)  # nobody else wants this one
        await trio.sleep(11)
        assert claims.claim(space, [b"cold"], b, 10) == [YOURS]
        claims.end(b, claims.take(b))
        assert claims.claim(space, [b"cold"], a, 10) == [YOURS]
        assert claims.claim(space, [b"cold"], b, 10) == [BUSY]
    _run(main)


def test_a_claim_others_wanted_ends_unput_and_its_key_is_theirs_for_a_while() -> None:
    """A claimer that gives a key up just short of MAX_CLAIM_S (or lets its claim run out,
    or closes its connection) and claims it again at once holds nobody back: the user
    who waited claims it.  Without this, a claim given up at 59 s and made again kept a
    waiter off the key for good, each of its waits bounded by its own bound only."""
    async def main() -> None:
        space = Namespace("n", 0, 0, 0o777, 0)
        claims = Claims(per_user=8)
        for end in ("give up", "close", "run out"):
            bob, alice = _session(1001), _session(1000)
            key = end.encode()
            assert claims.claim(space, [key], bob, 59) == [YOURS]
            assert claims.claim(space, [key], alice, 10) == [BUSY]  # she wants it
            await trio.sleep(58.9)
            if end == "give up":
                claims.claim(space, [key], bob, 0)
            elif end == "close":
                claims.end(bob, claims.take(bob))
                bob = _session(1001)  # (a new connection of his)
            else:
                await trio.sleep(0.2)
            assert claims.claim(space, [key], bob, 59) == [YOURS]  # at once, as a hog would
            assert claims.claim(space, [key], alice, 10) == [YOURS], end  # her turn
            assert claims.claim(space, [key], bob, 10) == [BUSY]
            claims.end(alice, claims.take(alice))
            claims.end(bob, claims.take(bob))
        # Another connection of the claimer's own user that waited cools nothing.
        a1, a2 = _session(1000), _session(1000)
        assert claims.claim(space, [b"own"], a1, 10) == [YOURS]
        assert claims.claim(space, [b"own"], a2, 10) == [BUSY]
        claims.claim(space, [b"own"], a1, 0)
        assert claims.claim(space, [b"own"], a1, 10) == [YOURS]
        assert claims.claim(space, [b"own"], a2, 10) == [BUSY]
    _run(main)


def test_keys_a_user_let_cool_count_against_its_claims() -> None:
    """Each key cooling is a record (up to 1 KiB): a user who gives up claims others want
    as fast as it can holds at most `per_user` of them, then is refused new claims
    until they cool down."""
    async def main() -> None:
        space = Namespace("n", 0, 0, 0o777, 0)
        claims = Claims(per_user=4)
        bob, alice = _session(1001), _session(1000)
        for i in range(4):
            key = b"k%d" % i
            claims.claim(space, [key], bob, 10)
            claims.claim(space, [key], alice, 10)  # BUSY: wanted
            claims.claim(space, [key], bob, 0)
        with pytest.raises(OSError) as e:
            claims.claim(space, [b"more"], bob, 10)
        assert e.value.errno == errno.EDQUOT and "others wanted" in str(e.value)
        assert claims.claim(space, [b"more"], alice, 10) == [YOURS]  # (hers are hers)
        await trio.sleep(MAX_CLAIM_S)
        assert claims.claim(space, [b"more2"], bob, 10) == [YOURS]
        assert len(claims._cooling) == 0
    _run(main)
