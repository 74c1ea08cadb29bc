"""A tenant's extended-attribute bytes, paced.

Xattr values live in the metadata store: a tenant setting 64 KB values as fast as she
could grew the store's WAL 1,000 pages between two checkpointer runs, and the commit
that crossed them checkpointed on the daemon's one thread (another user's p99 25 ms).
Past XATTR_BURST her setxattrs wait for XATTR_PER_S, the thread free meanwhile; a
waiting call holds one of the FUSE tasks (or chunk-service connections) every user
shares, so with XATTR_WAITING of hers waiting the next is refused EBUSY (the kernel
answers a setxattr's EAGAIN as EOPNOTSUPP).

Each daemon paces its own mount's callers; the writer paces again what every node
forwards (`fs/node_files.py`), in the same buckets as its own mount's, so a tenant
setting xattrs through several nodes at once gets one rate at the store, not one a
node.  Every tenant's bytes together are paced too, to POOL_PER_S: six tenants each
within her own rate grew the WAL 32 MB/s, past what the checkpointer copies between
its runs (another user's p99 17.7 ms; `tools/bench_fair.py` arm `xattr_tenants`).  The
pool's rate and burst are shared evenly among the tenants setting large xattrs
(`FairShare`: each her 1/n, n those who set one in the last ACTIVE_S), so a tenant
within her share never waits behind the others: one bucket for all made her wait up
to POOL_WAIT_S, or refused her EBUSY, while three others kept it full.  A call whose
share is in debt already and would wait past POOL_WAIT_S is refused EBUSY (a wait that
long outlived a reading node's wait for the writer's answer); one whose share is not
goes into debt, however small the share (with hundreds of tenants one is smaller than
a 64 KB xattr).  An xattr of SMALL bytes or fewer
neither waits on the pool's pace nor counts in it: a tool tagging files is never held,
and cannot run a share into debt (small ones cost the daemon's thread more than the
WAL, as 4 KB symbolic links do).
"""

from __future__ import annotations

import errno
import math
from collections import Counter
from dataclasses import dataclass

import trio

from mxfs.fs.accept_rate import AcceptRate

XATTR_BURST, XATTR_PER_S = 4 << 20, 4 << 20
XATTR_WAITING = 4  # a tenant's setxattrs waiting at once; past them EBUSY
# every tenant's together: half the 1,000 WAL pages the checkpointer copies each 250 ms
POOL_BURST, POOL_PER_S = 8 << 20, 8 << 20
SMALL = 4096  # an xattr's bytes (name and value) that never wait on other tenants'
POOL_WAIT_S = 2.0  # the longest a call waits for its share of the pool; past it EBUSY
ACTIVE_S = 1.0  # a tenant has a share of the pool's pace this long after her last turn


@dataclass(slots=True)
class _Share:
    tokens: float
    at: float  # when `tokens` was counted
    until: float  # when her last call's turn comes: she has a share ACTIVE_S past it


def _fill(share: _Share, rate: float, cap: float, now: float) -> _Share:
    """`share` filled at `rate` up to `now`, holding `cap` at most."""
    share.tokens = min(cap, share.tokens + max(0.0, now - share.at) * rate)
    share.at = now
    return share


class FairShare:
    """A rate and a burst shared evenly by the tenants who used them lately: each
    one's bucket fills at `per_s / n` and holds `burst / n`, n counting those whose
    last turn was within `active_s` (her too), so together they stay within the rate
    and the burst while one alone has all of it.  `now`: trio's clock."""

    def __init__(self, burst: int, per_s: int, active_s: float = ACTIVE_S) -> None:
        self.burst, self.per_s, self.active_s = burst, per_s, active_s
        self._shares: dict[int, _Share] = {}
        self._n = 1  # how many shared them when the shares were last cut to size
        self._all = _Share(float(burst), 0.0, 0.0)  # every share's takes, as one bucket

    def __len__(self) -> int:
        return len(self._shares)

    def until(self, tenant: int) -> float | None:
        """When `tenant`'s last call's turn comes (None: she has no share now)."""
        share = self._shares.get(tenant)
        return None if share is None else share.until

    def take(self, tenant: int, n: float, now: float, most: float = math.inf
             ) -> float | None:
        """Take `n` from `tenant`'s share, into debt where it holds less: how many
        seconds she waits before she goes on (0: at once); None, nothing taken, where
        that is past `most` and her share was in debt already.  (A share that is
        not goes into debt whatever `n`: with hundreds of tenants a share is smaller
        than one large xattr, and refusing those refused everyone's.)"""
        # Those quiet since go (their debts were paid by then), whatever the order
        # their turns came in; n tenants a call here, a few at most.
        for t in [t for t, s in self._shares.items() if s.until < now - self.active_s]:
            del self._shares[t]
        k = len(self._shares) + (tenant not in self._shares)
        rate, cap = self.per_s / k, self.burst / k
        if k != self._n:  # every share cut to the new size, filled at the old rate first
            old = self.per_s / self._n
            for s in self._shares.values():
                _fill(s, old, cap, now)
            self._n = k
        whole = _fill(self._all, self.per_s, self.burst, now)
        share = self._shares.get(tenant)
        if share is None:
            # A newcomer's share fills only from what is left of the pool's burst past
            # the others' shares: a full one on top of theirs let tenants arriving one
            # after another take it 1 + 1/2 + ... + 1/n times over.
            left = whole.tokens - sum(max(0.0, s.tokens) for s in self._shares.values())
            share = _Share(min(cap, max(0.0, left)), now, now)
        else:
            _fill(share, rate, cap, now)
        wait = max(0.0, (n - share.tokens) / rate)
        if wait > most and share.tokens < 0:
            return None
        share.tokens -= n
        whole.tokens -= n
        share.until = max(share.until, now + wait)
        self._shares[tenant] = share
        return wait

    def give_back(self, tenant: int, n: float, until: float | None) -> None:
        """Undo a `take` of `n` whose call was refused after all: her share as before
        it (`until`, from `until()` then; None: she had none)."""
        share = self._shares.get(tenant)
        if share is None:
            return
        self._all.tokens += n
        if until is None:
            del self._shares[tenant]
        else:
            share.tokens, share.until = share.tokens + n, until


class XattrPace:
    """Each tenant's xattr bytes against XATTR_PER_S and her share of POOL_PER_S,
    and each tenant's calls waiting on them."""

    def __init__(self) -> None:
        self.rate = AcceptRate(XATTR_BURST, XATTR_PER_S)
        self.pool = FairShare(POOL_BURST, POOL_PER_S)
        self._waiting: Counter[int] = Counter()

    async def turn(self, tenant: int, nbytes: int) -> None:
        """Return once `tenant` may set `nbytes` more (at once within her burst and
        the pool's); EBUSY where XATTR_WAITING of her calls wait already."""
        now = trio.current_time()
        pooled = nbytes > SMALL
        wait = self.rate.wait(str(tenant), nbytes, now)
        until = self.pool.until(tenant) if pooled else None
        pool_wait = self.pool.take(tenant, nbytes, now, POOL_WAIT_S) if pooled else 0.0
        busy = None
        if pool_wait is None:  # (nothing taken from her share)
            busy = (f"tenant {tenant} sets xattrs past her share of the pool's "
                    f"{POOL_PER_S >> 20} MiB/s (shared by {len(self.pool)} tenants)")
        elif not max(wait, pool_wait):
            return
        elif self._waiting[tenant] >= XATTR_WAITING:
            busy = f"tenant {tenant} sets xattrs past {XATTR_PER_S >> 20} MiB/s"
            if pooled:
                self.pool.give_back(tenant, nbytes, until)
        if busy is not None:
            self.rate.wait(str(tenant), -nbytes, now)  # (refused: nothing taken)
            raise OSError(errno.EBUSY, busy)
        assert pool_wait is not None
        wait = max(wait, pool_wait)
        self._waiting[tenant] += 1
        try:
            await trio.sleep(wait)
        finally:
            self._waiting[tenant] -= 1
            if not self._waiting[tenant]:
                del self._waiting[tenant]
