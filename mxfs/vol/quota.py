"""Per-user quotas: how many bytes and inodes a user may own, enforced by the daemon.

A quota is a tenant's (`vol/tenants.py`): it bounds what a user's uid and her
subordinate uids (/etc/subuid: her rootless containers) own together.  Counted apart,
each of her 65,536 uids had the whole quota, and a file her container's root gave to
another of her uids left it.  Limits are looked up for the tenant: her own (`quota.UID`
of her uid) in the metadata store's settings, else `quota.default`; a subordinate uid
has none of its own (`mxfs quota` refuses to set one; one set before /etc/subuid gave
the uid to a user is kept, not looked at).  They survive remounts and travel with
dumps; `mxfs quota` sets them through the daemon and shows a line a tenant.

What a tenant owns is the store's tally (`meta/usage.py`: its uids' inodes, their
regular files' sizes, KV chunks among them, a block at least for one holding any byte,
their inodes' extended attributes, the names in their directories and their chunks'
keys) plus what its unpublished direct writes and KV chunks declared, and the shares
of it reserved for nodes writing its files through their mounts (`reserved`:
`fs/node_writes.Rooms`): a direct writer is charged its declared size when it creates
the file, and its chunk files are cut back to that size (`fs/session.py`), so
descriptors a writer holds cannot take it past its quota either.
The tally keeps each tenant's total as it moves (`Usage.grouped`), grouped again from
every uid only when /etc/subuid changes: a check reads one total, however many uids
she has.

Growth is checked where it happens: a create, a write or truncate past the end of a
file (charged to the file's owner, as quotas are), a new or longer name (charged to
the owner of the directory it lands in: `room_for_entry`, `room_for_rename`), a direct
or KV create, a KV put, and a chown that gives a file to another tenant
(`room_for_owner`).  Root is counted but never refused, as on any filesystem.
"""

from __future__ import annotations

import errno
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from mxfs.meta import Inode, MetaStore
from mxfs.meta.store import Owned
from mxfs.meta.usage import NAME_ROW, Group, file_cost
from mxfs.proto.messages import QuotaReport, QuotaRow
from mxfs.units import format_size
from mxfs.vol.tenants import TENANTS, tenant_of

PREFIX = "quota."
DEFAULT = "default"  # the limits of every tenant without its own


@dataclass(frozen=True)
class Quota:
    bytes: int = 0  # 0: no limit
    inodes: int = 0

    def __bool__(self) -> bool:
        return bool(self.bytes or self.inodes)

    def text(self) -> str:
        return f"{self.bytes} {self.inodes}"

    @classmethod
    def parse(cls, text: str) -> Quota:
        b, i = (int(x) for x in text.split())
        return cls(max(b, 0), max(i, 0))


NONE = Quota()


class Freeing:
    """Bytes and inodes, by tenant (`vol/tenants.py`: a user with her subordinate
    uids), of orphans queued to be freed (no longer open; the daemon frees them within
    a round; a crash's only their owners: `add_uncredited`): kept as they are queued
    and dropped, so a quota check reads one total, not the queue nor every owner in it
    (one user's mass removal of files owned by her 65,536 subordinate uids made each
    check walk them all)."""

    def __init__(self) -> None:
        # ino -> (uid, tenant, bytes credited, inodes credited: 1, or 0 for a crash's)
        self._queued: dict[int, tuple[int, int, int, int]] = {}
        self.bytes: Counter[int] = Counter()  # by tenant
        self.inodes: Counter[int] = Counter()

    def add(self, node: Inode) -> None:
        self.add_row(node.ino, node.uid, file_cost(node.size) if node.is_reg else 0)

    def add_row(self, ino: int, uid: int, nbytes: int) -> None:
        """Orphan `ino` of `uid`, holding `nbytes`, queued."""
        if ino in self._queued:
            return
        tenant = tenant_of(uid)
        self._queued[ino] = (uid, tenant, nbytes, 1)
        self.bytes[tenant] += nbytes
        self.inodes[tenant] += 1

    def add_uncredited(self, ino: int, uid: int) -> None:
        """Orphan `ino` of `uid` queued, its owner kept (`owner`) but nothing credited:
        a crash's orphans, freed over minutes while their owners write, count against
        them until freed, or one could write their size again while the pool holds it."""
        self._queued.setdefault(ino, (uid, tenant_of(uid), 0, 0))

    def drop(self, inos: Iterable[int]) -> None:
        for ino in inos:
            queued = self._queued.pop(ino, None)
            if queued is None or not queued[3]:
                continue
            _, tenant, nbytes, _ = queued
            self.bytes[tenant] -= nbytes
            self.inodes[tenant] -= 1
            if not self.inodes[tenant]:
                del self.inodes[tenant], self.bytes[tenant]

    def of(self, tenant: int) -> tuple[int, int]:
        """Bytes and inodes queued of the uids of `tenant` (as they were grouped when
        queued)."""
        return self.bytes[tenant], self.inodes[tenant]

    def owner(self, ino: int) -> int:
        """The uid owning queued orphan `ino` (0 if not queued)."""
        return self._queued.get(ino, (0, 0, 0, 0))[0]


class Quotas:
    def __init__(self, store: MetaStore,
                 freeing: Callable[[int], tuple[int, int]] = lambda tenant: (0, 0),
                 held: Callable[[int], int] = lambda tenant: 0) -> None:
        self.store = store
        # Bytes and inodes of a tenant's orphans that wait to be freed (reclaim runs every
        # few milliseconds): not held against it, so a write right after an unlink fits.
        self.freeing = freeing
        # Bytes of a tenant's removed or renewed files kept for their readers a while
        # (`pool/revoke.py`): held against it.
        self.held = held
        # Declared by unpublished files, by uid (released by the uid that reserved)
        self.reserved: Counter[int] = Counter()
        self.limits: dict[str, Quota] = {}
        for key, value in store.settings(PREFIX):
            try:
                self.limits[key[len(PREFIX):]] = Quota.parse(value)
            except ValueError:
                continue  # (not one of ours: never written by `set`)

    def of(self, uid: int) -> Quota:
        """The limits that hold for `uid`: its tenant's own, else the default."""
        return self.limits.get(str(tenant_of(uid))) or self.limits.get(DEFAULT, NONE)

    def _tenants(self) -> dict[int, Group]:
        """The tally by tenant, kept as it moves (`Usage.grouped`): grouped again only
        when /etc/subuid changed."""
        return self.store.count_usage().grouped(tenant_of, TENANTS.generation)

    def owned(self, tenant: int) -> tuple[int, int]:
        """Bytes (what a byte quota counts: `Usage.owned_bytes`) and inodes the tally
        counts of `tenant`'s uids."""
        group = self._tenants().get(tenant)
        return (group.owned_bytes(), group.inodes) if group is not None else (0, 0)

    def reserved_of(self, tenant: int) -> int:
        """Bytes reserved for `tenant`'s uids (few uids reserve at once: unpublished
        files, writes in flight, nodes' shares)."""
        return sum(n for u, n in self.reserved.items() if tenant_of(u) == tenant)

    def left(self, uid: int) -> int | None:
        """Bytes `uid`'s tenant may still come to own (None: no byte limit holds)."""
        quota = self.of(uid) if uid != 0 and self.limits else None
        if not quota or not quota.bytes:
            return None
        tenant = tenant_of(uid)
        owned = self.owned(tenant)[0] + self.reserved_of(tenant) + self.held(tenant)
        return max(0, quota.bytes - owned + self.freeing(tenant)[0])

    def room(self, uid: int, nbytes: int = 0, inodes: int = 0) -> None:
        """EDQUOT if `uid`'s tenant owning `nbytes` and `inodes` more would pass its
        quota."""
        if uid == 0 or not self.limits:
            return
        quota = self.of(uid)
        if not quota or not (quota.bytes and nbytes > 0 or quota.inodes and inodes > 0):
            return
        tenant = tenant_of(uid)
        who = f"uid {uid}" if tenant == uid else \
            f"uid {tenant} (with its subordinate uid {uid})"
        owned_bytes, owned_inodes = self.owned(tenant)
        if quota.bytes and nbytes > 0:
            owned = owned_bytes + self.reserved_of(tenant) + self.held(tenant)
            if owned + nbytes > quota.bytes:
                owned -= self.freeing(tenant)[0]
            if owned + nbytes > quota.bytes:
                raise OSError(errno.EDQUOT, f"{who} owns {format_size(owned)} of its "
                              f"{format_size(quota.bytes)} quota and this needs "
                              f"{format_size(nbytes)} more: remove files, or ask root to "
                              "raise it (mxfs quota)")
        if quota.inodes and inodes > 0:
            owned = owned_inodes
            if owned + inodes > quota.inodes:
                owned -= self.freeing(tenant)[1]
            if owned + inodes > quota.inodes:
                raise OSError(errno.EDQUOT, f"{who} owns {owned} of its {quota.inodes} "
                              "inodes (files, folders and KV chunks): remove some, or ask "
                              "root to raise its quota (mxfs quota)")

    def room_for_owner(self, node: Inode, uid: int, caller: int,
                       owned: Owned | None = None) -> None:
        """EDQUOT if `node` given to `uid` by `caller` would take `uid`'s tenant past
        its quota: a namespace's root may chown to any uid it maps.  Root is never
        refused; among one tenant's uids nothing it owns changes.  `owned`: its xattrs'
        and names' bytes as measured off the thread (`MetaStore.owned`)."""
        if caller == 0 or uid == 0 or not self.limits or tenant_of(uid) == tenant_of(node.uid):
            return
        self.room(uid, self.store.charged_bytes(node, owned), 1)

    def room_for_entry(self, caller: int, dir_owner: int, name: bytes, nbytes: int = 0,
                       inodes: int = 0) -> None:
        """EDQUOT if `caller`'s new entry `name` may not be charged to `dir_owner`, the
        owner of the directory it lands in (`MetaStore._charge_name`), or a new inode
        of `caller`'s, `inodes` 1, and its `nbytes` (a link's target, a declared size)
        to `caller`; checked together where one tenant pays both.  Root is never
        refused, in anyone's directory."""
        cost = len(name) + NAME_ROW
        if caller == 0:
            return
        if tenant_of(caller) == tenant_of(dir_owner):
            self.room(caller, cost + nbytes, inodes)
        else:
            self.room(dir_owner, cost)
            self.room(caller, nbytes, inodes)

    def room_for_rename(self, caller: int, old_owner: int, old: bytes, new_owner: int,
                        new: bytes, replaces: bool) -> None:
        """EDQUOT if `new_owner`, who owns the directory `caller`'s rename lands in, may
        not be charged name `new` while `old_owner` (of the directory it leaves) is
        credited `old`; `replaces`: an entry `new` there goes, its name credited too.
        Root is never refused."""
        if caller == 0:
            return
        cost = len(new) + NAME_ROW
        if tenant_of(old_owner) == tenant_of(new_owner):
            cost -= len(old) + NAME_ROW
        if replaces:
            cost -= len(new) + NAME_ROW
        if cost > 0:
            self.room(new_owner, cost)

    def reserve(self, uid: int, nbytes: int) -> None:
        self.reserved[uid] += nbytes

    def release(self, uid: int, nbytes: int) -> None:
        self.reserved[uid] -= nbytes
        if self.reserved[uid] <= 0:
            del self.reserved[uid]

    def set(self, who: str, quota: Quota) -> None:
        """Set (or with an empty quota, clear) the limits of a uid ("1001") or the
        default; written through to the store at once."""
        if quota:
            self.store.set_setting(PREFIX + who, quota.text())
            self.limits[who] = quota
            self.store.count_usage()  # (counted now, not on a tenant's next write)
        else:
            self.store.drop_setting(PREFIX + who)
            self.limits.pop(who, None)

    def report(self, uid: int | None = None, most: int = 1000) -> QuotaReport:
        """What `mxfs quota` shows: each tenant's usage, its uids' together, against its
        limits (only `uid`'s tenant's when given; else every tenant with a quota of its
        own or anything owned, the `most` largest by bytes), and the default."""
        groups = self._tenants()
        if uid is not None:
            tenants = [tenant_of(uid)]
        else:
            named = {tenant_of(int(k)) for k in self.limits if k != DEFAULT}
            owners = sorted({t for t, g in groups.items() if g.inodes or g.owned_bytes()}
                            | {tenant_of(u) for u in self.reserved},
                            key=lambda t: -self.owned(t)[0])
            tenants = sorted(named | set(owners[:most]))
        rows: list[QuotaRow] = []
        for t in tenants:
            quota = self.of(t) if t != 0 else NONE
            group = groups.get(t) or Group()
            owned, inodes = group.owned_bytes(), group.inodes
            rows.append({"uid": t, "bytes": owned,
                         "xattr_bytes": group.xattrs,
                         "name_bytes": group.names,
                         "reserved": self.reserved_of(t), "held": self.held(t),
                         "freeing": self.freeing(t)[0],
                         "inodes": inodes, "bytes_limit": quota.bytes,
                         "inodes_limit": quota.inodes,
                         "own": str(t) in self.limits})
        default = self.limits.get(DEFAULT, NONE)
        return {"users": rows, "default": {"bytes_limit": default.bytes,
                                           "inodes_limit": default.inodes}}
