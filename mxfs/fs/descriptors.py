"""The descriptors the daemon holds for its tenants: one account, a reserve, a share each.

Every descriptor the daemon keeps open past a request on a tenant's behalf is in
it: the chunk files of files open through the mount and of unpublished files
(charged at the open or create, as many as the file may open here: its members on
this node), and, counted where they are kept, control and chunk service connections
and KV presence tables.  A reserve of the limit stays free for the daemon's own work
(the store and its WAL, the log, the FUSE device, sockets, root's requests,
cut-backs, renews): what it cannot open there fails every tenant at once.  What
remains is the tenants' budget, and one user holds at most `max_fds_per_user` of it,
and a quarter at most, so that others keep room.  Past either a request is refused
(EMFILE: her share; ENFILE: the budget; root's only past half the reserve too, the
other half the store's and the log's), never another's I/O failed: one user's 3,100
open one-byte files took every descriptor of a daemon allowed 3,000, and every
tenant's create, read and fsync, and `mxfs status`, failed.  The limit is read at
each charge (a syscall, no listing of /proc/self/fd): an operator's `prlimit` on the
running daemon counts at once.
"""

from __future__ import annotations

import errno
from collections import Counter
from collections.abc import Callable

from mxfs.fs.limits import Limits, fd_limit

RESERVE_PART = 8  # the reserve: an eighth of the limit (Limits.fd_reserve at least)
USER_PART = 4  # one user's share: a quarter of the budget at most


def fd_reserve(limit: int, floor: int) -> int:
    """Descriptors of `limit` kept for the daemon's own work."""
    return max(floor, limit // RESERVE_PART)


class Descriptors:
    """The account (on trio's thread): what is charged to each tenant, and the
    descriptors other services count themselves (`elsewhere`)."""

    def __init__(self, limits: Limits | None = None) -> None:
        self.limits = limits or Limits()
        self.by_tenant: Counter[int] = Counter()
        self.charged = 0  # their sum
        self.elsewhere: list[Callable[[], int]] = []  # connections and views, by service
        # Open files charged, by (tenant, ino): [handles, descriptors charged].  The
        # handles of one file share its descriptors, so a file is charged once a tenant.
        self.files: dict[tuple[int, int], list[int]] = {}

    def held(self) -> int:
        return self.charged + sum(count() for count in self.elsewhere)

    def reserve(self) -> int:
        return fd_reserve(fd_limit(), self.limits.fd_reserve)

    def budget(self) -> int:
        """Descriptors the tenants may hold in all: the limit less the reserve."""
        limit = fd_limit()
        return limit - fd_reserve(limit, self.limits.fd_reserve)

    def share(self) -> int:
        """Descriptors one user (not root) may hold."""
        return min(self.limits.max_fds_per_user, self.budget() // USER_PART)

    def room(self, n: int = 1, root: bool = False) -> bool:
        """Whether `n` descriptors more stay within the budget (root's requests: within
        the limit less half the reserve, the other half the store's and the log's)."""
        limit = fd_limit()
        reserve = fd_reserve(limit, self.limits.fd_reserve)
        return self.held() + n <= limit - (reserve // 2 if root else reserve)

    def refusal(self, tenant: int, n: int) -> OSError | None:
        """Why `n` more descriptors for `tenant` are refused, or None."""
        if n <= 0:
            return None
        if not self.room(n, root=not tenant):
            return OSError(errno.ENFILE, f"the daemon holds {self.held()} descriptors for "
                           f"its users, all its limit of {fd_limit()} allows less the "
                           f"{self.reserve()} it keeps for itself (raise its LimitNOFILE); "
                           "try again later")
        if tenant and self.by_tenant[tenant] + n > (share := self.share()):
            return OSError(errno.EMFILE, f"uid {tenant} holds {self.by_tenant[tenant]} of "
                           f"the daemon's descriptors (its open and unpublished files' chunk "
                           f"files), the limit of {share} (mount option max_fds_per_user, "
                           f"and a quarter of its limit less its reserve); close some")
        return None

    def take(self, tenant: int, n: int) -> None:
        """Charge `n` descriptors to `tenant`; EMFILE or ENFILE past the limits."""
        err = self.refusal(tenant, n)
        if err is not None:
            raise err
        self.by_tenant[tenant] += n
        self.charged += n

    def give(self, tenant: int, n: int) -> None:
        """Descriptors charged to `tenant` let go."""
        self.charged -= n
        self.by_tenant[tenant] -= n
        if self.by_tenant[tenant] <= 0:
            del self.by_tenant[tenant]

    def opened(self, tenant: int, ino: int, n: int) -> None:
        """One more handle of `tenant`'s on file `ino`, which opens up to `n` chunk
        files here: charged at the tenant's first (EMFILE, ENFILE past the limits)."""
        held = self.files.get((tenant, ino))
        if held is None:
            self.take(tenant, n)
            held = self.files[tenant, ino] = [0, n]
        held[0] += 1

    def closed(self, tenant: int, ino: int) -> None:
        """One handle fewer (its charge let go with the tenant's last)."""
        held = self.files.get((tenant, ino))
        if held is None:
            return
        held[0] -= 1
        if held[0] <= 0:
            del self.files[tenant, ino]
            self.give(tenant, held[1])
