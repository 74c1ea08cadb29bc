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
    assert waits == [0.0] * 20, waits
    took = sum(done) * VALUE
    assert took <= POOL_BURST + POOL_PER_S * seconds + hogs * 4 * VALUE, took
    assert took >= POOL_PER_S * (seconds - 2), took  # (the pool's rate was theirs)


def test_a_tenant_alone_has_the_whole_pool_and_one_gone_quiet_gives_hers_back() -> None:
    share = FairShare(POOL_BURST, POOL_PER_S)
    assert share.wait(1, POOL_BURST, 0.0) == 0.0  # alone: the whole burst
    assert share.wait(1, POOL_PER_S, 0.0) == pytest.approx(1.0)  # ... and the rate
    assert share.wait(2, POOL_BURST / 2, 0.5) == 0.0  # a second: half the burst
    assert share.wait(2, POOL_PER_S / 2, 0.5) == pytest.approx(1.0)  # ... half the rate
    assert len(share) == 2
    # The first one's last turn came at 1.0; quiet ACTIVE_S past it, her share goes.
    later = 1.5 + ACTIVE_S + 0.01
    assert share.wait(2, 0, later) == 0.0 and len(share) == 1
    assert share.wait(2, POOL_BURST, later) == 0.0  # (the whole burst hers again)


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
        assert 9 * (1 << 20) > POOL_BURST

    run(main)
