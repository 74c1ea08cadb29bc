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
node.
"""

from __future__ import annotations

import errno
from collections import Counter

import trio

from mxfs.fs.accept_rate import AcceptRate

XATTR_BURST, XATTR_PER_S = 4 << 20, 4 << 20
XATTR_WAITING = 4  # a tenant's setxattrs waiting at once; past them EBUSY


class XattrPace:
    """Each tenant's xattr bytes against XATTR_PER_S, and her calls waiting on it."""

    def __init__(self) -> None:
        self.rate = AcceptRate(XATTR_BURST, XATTR_PER_S)
        self._waiting: Counter[int] = Counter()

    async def turn(self, tenant: int, nbytes: int) -> None:
        """Return once `tenant` may set `nbytes` more (at once within her burst);
        EBUSY where XATTR_WAITING of her calls wait already."""
        now = trio.current_time()
        wait = self.rate.wait(str(tenant), nbytes, now)
        if not wait:
            return
        if self._waiting[tenant] >= XATTR_WAITING:
            self.rate.wait(str(tenant), -nbytes, now)  # (refused: nothing taken)
            raise OSError(errno.EBUSY, f"tenant {tenant} sets xattrs past "
                          f"{XATTR_PER_S >> 20} MiB/s")
        self._waiting[tenant] += 1
        try:
            await trio.sleep(wait)
        finally:
            self._waiting[tenant] -= 1
            if not self._waiting[tenant]:
                del self._waiting[tenant]
