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
its runs (another user's p99 17.7 ms; `tools/bench_fair.py` arm `xattr_tenants`).  A
call that would wait past POOL_WAIT_S for the others' bytes is refused EBUSY (a wait
that long outlived a reading node's wait for the writer's answer, and the pool's debt
grew with the number of tenants).  An xattr of SMALL bytes or fewer neither waits on
the others' nor counts in them: a tool tagging files is not held behind tenants
setting large values, and cannot run the pool into debt (small ones cost the daemon's
thread more than the WAL, as 4 KB symbolic links do).
"""

from __future__ import annotations

import errno
from collections import Counter

import trio

from mxfs.fs.accept_rate import AcceptRate

XATTR_BURST, XATTR_PER_S = 4 << 20, 4 << 20
XATTR_WAITING = 4  # a tenant's setxattrs waiting at once; past them EBUSY
# every tenant's together: half the 1,000 WAL pages the checkpointer copies each 250 ms
POOL_BURST, POOL_PER_S = 8 << 20, 8 << 20
SMALL = 4096  # an xattr's bytes (name and value) that never wait on other tenants'
POOL_WAIT_S = 2.0  # the longest a call waits for other tenants' bytes; past it EBUSY


class XattrPace:
    """Each tenant's xattr bytes against XATTR_PER_S, all of them against
    POOL_PER_S, and each tenant's calls waiting on them."""

    def __init__(self) -> None:
        self.rate = AcceptRate(XATTR_BURST, XATTR_PER_S)
        self.pool = AcceptRate(POOL_BURST, POOL_PER_S)
        self._waiting: Counter[int] = Counter()

    async def turn(self, tenant: int, nbytes: int) -> None:
        """Return once `tenant` may set `nbytes` more (at once within her burst and
        the pool's); EBUSY where XATTR_WAITING of her calls wait already."""
        now = trio.current_time()
        pooled = nbytes > SMALL
        wait = self.rate.wait(str(tenant), nbytes, now)
        pool_wait = self.pool.wait("", nbytes, now) if pooled else 0.0
        if not max(wait, pool_wait):
            return
        busy = None
        if self._waiting[tenant] >= XATTR_WAITING:
            busy = f"tenant {tenant} sets xattrs past {XATTR_PER_S >> 20} MiB/s"
        elif pool_wait > POOL_WAIT_S:
            busy = f"the pool's tenants set xattrs past {POOL_PER_S >> 20} MiB/s together"
        if busy is not None:
            self.rate.wait(str(tenant), -nbytes, now)  # (refused: nothing taken)
            if pooled:
                self.pool.wait("", -nbytes, now)
            raise OSError(errno.EBUSY, busy)
        wait = max(wait, pool_wait)
        self._waiting[tenant] += 1
        try:
            await trio.sleep(wait)
        finally:
            self._waiting[tenant] -= 1
            if not self._waiting[tenant]:
                del self._waiting[tenant]
