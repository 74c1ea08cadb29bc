"""The xattr pace (mxfs.fs.xattr_pace) on trio's mock clock: the pool's rate is shared
evenly by the tenants setting large xattrs, so one within her share never waits behind
others who keep theirs full, while all of them together stay within the pool's rate and
burst; a tenant alone has the whole of it, and one gone quiet gives her share back."""

from __future__ import annotations

import errno

import pytest
import trio
import trio.testing

from mxfs.fs.xattr_pace import (
    ACTIVE_S,
    POOL_BURST,
    POOL_PER_S,
    POOL_WAIT_S,
    SMALL,
    XATTR_BURST,
    XATTR_PER_S,
    FairShare,
    XattrPace,
)

VALUE = 64000  # a large xattr's bytes


def run(fn: object) -> None:
    trio.run(fn, clock=trio.testing.MockClock(autojump_threshold=0))  # type: ignore[arg-type]


async def _hog(pace: XattrPace, tenant: int, until: float, done: list[int]) -> None:
    """As a tenant's flood: setxattrs back to back, a refused one tried again."""
    while trio.current_time() < until:
        try:
            await pace.turn(tenant, VALUE)
        except OSError as e:
            assert e.errno == errno.EBUSY
            await trio.sleep(0.001)
            continue
        done[tenant] += 1


def test_a_tenant_within_her_share_never_waits_behind_tenants_who_fill_theirs() -> None:
    hogs, seconds = 4, 10.0
    waits: list[float] = []
    done = [0] * (hogs + 1)

    async def main() -> None:
        pace = XattrPace()
        async with trio.open_nursery() as nursery:
            for t in range(hogs):
                for _ in range(4):  # (a tenant's threads)
                    nursery.start_soon(_hog, pace, t, seconds, done)
            await trio.sleep(2.0)  # (the hogs' shares in debt)
            for _ in range(20):  # hers: 64 KB every 250 ms, far within 1/5 of the pool
                start = trio.current_time()
                await pace.turn(hogs, VALUE)
                waits.append(trio.current_time() - start)
                await trio.sleep(0.25)

    run(main)
    # Her first call waits for her share to fill (what the others left of the pool's
    # burst: nothing), a 64 KB xattr at a fifth of the rate; none after.
    assert waits[0] <= VALUE * (hogs + 1) / POOL_PER_S + 1e-6, waits
    assert waits[1:] == [0.0] * 19, waits
    took = sum(done) * VALUE
    assert took <= POOL_BURST + POOL_PER_S * seconds + hogs * 4 * VALUE, took
    assert took >= POOL_PER_S * (seconds - 2), took  # (the pool's rate was theirs)


def test_a_tenant_alone_has_the_whole_pool_and_one_gone_quiet_gives_hers_back() -> None:
    share = FairShare(POOL_BURST, POOL_PER_S)
    assert share.take(1, POOL_BURST / 2, 0.0) == 0.0  # alone: the pool's burst is hers
    # A second: her share fills from what is left past the first's (cut to half the
    # burst, which she has not spent): nothing, and at half the rate.
    assert share.take(2, VALUE, 0.0) == pytest.approx(VALUE / (POOL_PER_S / 2))
    assert share.take(1, POOL_BURST / 2, 0.0) == 0.0  # (the first's half, hers still)
    assert share.take(1, POOL_PER_S / 2, 0.0) == pytest.approx(1.0)  # ... half the rate
    assert len(share) == 2
    # Their last turns came at 1.0; quiet ACTIVE_S past them, their shares go.
    later = 1.0 + ACTIVE_S + 0.01
    assert share.take(2, 0, later) == 0.0 and len(share) == 1
    assert share.take(2, POOL_BURST, later + 1.0) == 0.0  # (the whole burst hers again)


def test_tenants_arriving_one_after_another_take_the_burst_once_together() -> None:
    """Each newcomer's share came full on top of the others' (left to be cut at their
    next calls): ten tenants a millisecond apart took 28 MiB at once, 1 + 1/2 + ...
    + 1/10 bursts, past the WAL room the pool's burst stands for."""
    share = FairShare(POOL_BURST, POOL_PER_S)
    at_once = 0.0
    for t in range(10):
        now = t * 0.001
        while share.take(t, VALUE, now) == 0.0:  # (all she may take without a wait)
            at_once += VALUE
    # (each one's last take goes into debt: a share not in debt is never refused)
    assert at_once <= POOL_BURST + POOL_PER_S * 0.01, at_once / (1 << 20)


def test_hundreds_of_tenants_each_get_their_xattrs_set() -> None:
    """With 400 tenants a share is smaller than one 64 KB xattr: refusing a call that
    would wait past POOL_WAIT_S refused everyone's, the first call of each too.  A
    share not in debt goes into it; one in debt past the wait is refused, with nothing
    taken and her share counted no longer than before."""
    share = FairShare(POOL_BURST, POOL_PER_S)
    waits = [share.take(t, VALUE, 0.0, POOL_WAIT_S) for t in range(400)]
    assert None not in waits
    assert max(w for w in waits if w is not None) <= 400 * VALUE / POOL_PER_S + 1e-9
    assert share.take(7, VALUE, 0.0, POOL_WAIT_S) is not None  # (her share, cut
    until = share.until(7)                                      # to 1/400: in debt)
    assert share.take(7, VALUE, 0.0, POOL_WAIT_S) is None  # (in debt: refused)
    assert share.until(7) == until and len(share) == 400
    share.give_back(7, VALUE, None)  # (a call refused by her own pace: as if never)
    assert share.until(7) is None and len(share) == 399


def test_a_quiet_tenant_stops_counting_whatever_the_order_of_turns() -> None:
    share = FairShare(POOL_BURST, POOL_PER_S)
    share.take(1, POOL_BURST + POOL_PER_S * 1.9, 0.0)  # a long wait: counted till 2.9
    share.take(2, VALUE, 0.1)  # no wait: counted till 1.1
    assert share.take(3, VALUE, 2.5) == 0.0
    assert len(share) == 2  # (1 and 3; 2 went quiet, though 1 took her turn first)


def test_a_tenant_alone_is_held_to_her_own_rate_and_small_ones_not_to_the_pools() -> None:
    async def main() -> None:
        pace = XattrPace()
        start = trio.current_time()
        for _ in range((XATTR_BURST + 2 * XATTR_PER_S) // VALUE):
            await pace.turn(1, VALUE)
        # (mock time, the pace's own sums: her 4 MiB/s binds, not the pool's 8 alone)
        assert trio.current_time() - start == pytest.approx(2.0, abs=0.05)
        # Tags of SMALL bytes by three tenants, each within her own burst, past the
        # pool's together: none waits on it.
        for t in (2, 3, 4):
            for _ in range(3 * (1 << 20) // SMALL):
                before = trio.current_time()
                await pace.turn(t, SMALL)
                assert trio.current_time() == before
        assert POOL_BURST < 9 * (1 << 20)

    run(main)
