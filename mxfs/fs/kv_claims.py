"""Compute claims on KV keys: concurrent misses on one prefix computed once.

Instances that miss the same prefix at once would each compute it and put the same
chunks (the gates found +27% throughput where +142% was there to take, at 16 requests
at once).  So a client that misses claims the keys it is about to compute (`kv_claim`);
each key is its to compute ("yours"), stored already ("stored"), or another client's to
compute ("busy"), and for those a client waits (`kv_wait`, bounded) until they are put,
or their claim ends, then gets what was put and computes the rest.

A claim ends when its key is stored, when its client gives it up (it will not put
the key after all), when its connection closes, or CLAIM_S seconds after it was made
(at most MAX_CLAIM_S, whatever the client asks): a client that dies or never puts
costs the others one bounded wait, never a hang.  Claiming a key again lengthens its
claim, but never past MAX_CLAIM_S from its first grant (its life): a claim renewed
every 50 s held a key (one its claimer had deleted, say) from everyone for good.

A claim that ends unput "cools" its key for its tenant MAX_CLAIM_S from its end when it
lived its whole life, or when another user asked for the key meanwhile (was answered
BUSY, or waited): that tenant's claims on it are then answered YOURS but hold nobody
back (it may compute and put the key; others claim it meanwhile), so the waiters woken
at its end get their turn before the claimer's next claim.  Without the second half a
claimer gave a key up at 59 s and claimed it again at once, keeping others off it for
good, a minute at a time (each waiter bounded by its own wait only); with it one user
holds a key others want MAX_CLAIM_S at most, then others have it for as long.  A user
with `max_kv_claims_per_user` keys cooling is refused new claims (EDQUOT) until some
cool down: the records (a key each, up to 1 KiB) are at most twice that limit a uid,
however fast it gives claims up.  Claims are taken only
in a namespace the caller may write, at most `max_kv_claims_per_user` for all of one
uid's connections (a claim holds its key, up to 1 KiB, in the daemon's memory; root:
no limit), and a wait lasts at most MAX_WAIT_S: a tenant can delay others' computing by
its claims' time, no more.
"""

from __future__ import annotations

import errno
import heapq
import itertools
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import trio

from mxfs.fs.session import Session
from mxfs.vol.kv_index import Namespace

CLAIM_S = 10.0  # how long a claim lasts unless the client says
MAX_CLAIM_S = 60.0
MAX_WAIT_S = 60.0

DROP_BITE = 1024  # run-out claims ended at a call (`drop_run_out`)

YOURS, STORED, BUSY = "yours", "stored", "busy"


@dataclass
class Claim:
    session: Session
    until: float  # trio.current_time() past which it is over
    life: float  # the latest `until` may be: its first grant + MAX_CLAIM_S
    done: trio.Event = field(default_factory=trio.Event)
    wanted: bool = False  # another user asked for its key (BUSY, or waited on it)


class Claims:
    def __init__(self, per_user: int) -> None:
        self.per_user = per_user  # claims one uid may hold at once (root: any number)
        self._held: dict[tuple[str, bytes], Claim] = {}
        self._by_session: dict[int, set[tuple[str, bytes]]] = {}  # id(session): keys
        self._by_uid: Counter[int] = Counter()
        self._by_space: dict[str, set[bytes]] = {}  # namespace: its claimed keys
        # When each claim runs out, soonest first: (until, n, key); a claim lengthened
        # or ended has stale entries, skipped when they come up (and dropped in a
        # rebuild once they outnumber the claims).
        self._expiry: list[tuple[float, int, tuple[str, bytes]]] = []
        self._made = itertools.count()
        # Keys whose claim ended unput that cool (its whole life lived, or another
        # user wanted the key): (namespace, key): (its tenant, when the key cools
        # down), those times soonest first (`drop_run_out`), and each tenant's count.
        self._cooling: dict[tuple[str, bytes], tuple[int, float]] = {}
        self._cool_heap: list[tuple[float, int, tuple[str, bytes]]] = []
        self._cooling_by: Counter[int] = Counter()

    def __len__(self) -> int:
        return len(self._held)

    def in_space(self, name: str) -> int:
        """Claims held now on keys of namespace `name` (some may have run out unseen)."""
        return len(self._by_space.get(name, ()))

    def _live(self, key: tuple[str, bytes]) -> Claim | None:
        claim = self._held.get(key)
        if claim is not None and claim.until <= trio.current_time():
            self._run_out(key, claim)
            return None
        return claim

    def _run_out(self, key: tuple[str, bytes], claim: Claim) -> None:
        """`claim`'s time is over: it ends unput (`_lapse`)."""
        self._lapse(key, claim, claim.until >= claim.life)

    def _lapse(self, key: tuple[str, bytes], claim: Claim, lived: bool = False) -> None:
        """`claim` ends unput (given up, run out, its connection closed): if it `lived`
        its whole life, or another user wanted its key, the key cools for its tenant
        MAX_CLAIM_S from its end (now, or its time's end if that was earlier)."""
        if lived or claim.wanted:
            cool = min(trio.current_time(), claim.until) + MAX_CLAIM_S
            tenant = claim.session.tenant
            old = self._cooling.get(key)
            if old is not None:
                self._uncool(old[0])
            self._cooling[key] = (tenant, cool)
            self._cooling_by[tenant] += 1
            heapq.heappush(self._cool_heap, (cool, next(self._made), key))
        self._end(key)

    def _uncool(self, tenant: int) -> None:
        self._cooling_by[tenant] -= 1
        if self._cooling_by[tenant] <= 0:
            del self._cooling_by[tenant]

    def _cools(self, key: tuple[str, bytes], tenant: int, now: float) -> bool:
        """Whether `key` cools for `tenant` (`_lapse`): its claims hold nobody back."""
        cooling = self._cooling.get(key)
        return cooling is not None and cooling[0] == tenant and cooling[1] > now

    def _end(self, key: tuple[str, bytes]) -> None:
        claim = self._held.pop(key, None)
        if claim is None:
            return
        claim.done.set()
        keys = self._by_space.get(key[0])
        if keys is not None:
            keys.discard(key[1])
            if not keys:
                del self._by_space[key[0]]
        uid = claim.session.tenant  # (a user's subordinate uids share: vol/tenants.py)
        self._by_uid[uid] -= 1
        if self._by_uid[uid] <= 0:
            del self._by_uid[uid]
        mine = self._by_session.get(id(claim.session))
        if mine is not None:
            mine.discard(key)
            if not mine:
                del self._by_session[id(claim.session)]

    def claim(self, space: Namespace, keys: list[bytes], session: Session,
              seconds: float) -> list[str]:
        """Each key's state for `session`: YOURS (claimed now, or already), STORED, or
        BUSY (another connection's claim is live).  `seconds` <= 0 gives the session's
        claims on `keys` up (it will not put them: the waiters go on)."""
        if seconds <= 0:
            for key in keys:
                held = self._held.get((space.name, key))
                if held is not None and held.session is session:
                    self._lapse((space.name, key), held)
            return [STORED if key in space.chunks else BUSY if self._live((space.name, key))
                    else YOURS for key in keys]
        seconds = min(seconds, MAX_CLAIM_S)
        now = trio.current_time()
        until = now + seconds
        mine = self._by_session.get(id(session), set())
        out: list[str] = []
        try:
            for key in keys:
                k = (space.name, key)
                if key in space.chunks:
                    out.append(STORED)
                    continue
                held = self._live(k)
                if held is not None and held.session is not session:
                    held.wanted |= held.session.tenant != session.tenant
                    out.append(BUSY)
                    continue
                if held is None:
                    if self._cools(k, session.tenant, now):
                        out.append(YOURS)  # (its to compute, holding nobody back)
                        continue
                    self._room(session.tenant)
                    held = self._held[k] = Claim(session, until, now + MAX_CLAIM_S)
                    self._by_space.setdefault(space.name, set()).add(key)
                    self._by_uid[session.tenant] += 1
                    mine.add(k)
                else:
                    held.until = min(until, held.life)  # (never past its life)
                heapq.heappush(self._expiry, (held.until, next(self._made), k))
                out.append(YOURS)
        finally:  # (a refusal part way: those made are the session's, given up with it)
            if mine:
                self._by_session[id(session)] = mine
            self._compact()
        return out

    def _room(self, uid: int) -> None:
        """EDQUOT if `uid` holds as many claims as it may, or has as many keys cooling
        (those run out, and cooled down, dropped first)."""
        if uid == 0 or max(self._by_uid[uid], self._cooling_by[uid]) < self.per_user:
            return
        self.drop_run_out()
        if self._by_uid[uid] >= self.per_user:
            raise OSError(errno.EDQUOT, f"uid {uid} holds {self._by_uid[uid]} KV claims, as "
                          "many as it may (max_kv_claims_per_user): put those keys first")
        if self._cooling_by[uid] >= self.per_user:
            raise OSError(errno.EDQUOT, f"uid {uid} let {self._cooling_by[uid]} KV claims "
                          "that others wanted end unput in the last "
                          f"{MAX_CLAIM_S:.0f} s, as many as it may "
                          "(max_kv_claims_per_user): put keys it claims")

    async def wait(self, space: Namespace, keys: list[bytes], session: Session,
                   seconds: float) -> list[bool]:
        """Wait until no other connection's claim on `keys` is live (each put, ended,
        or run out), or `seconds` (at most MAX_WAIT_S) pass; then whether each key is
        stored."""
        deadline = trio.current_time() + min(max(seconds, 0.0), MAX_WAIT_S)
        for key in keys:
            claim = self._live((space.name, key))
            if claim is None or claim.session is session:
                continue
            claim.wanted |= claim.session.tenant != session.tenant
            with trio.move_on_at(min(deadline, claim.until)):
                await claim.done.wait()
            if trio.current_time() >= deadline:
                break
        return [key in space.chunks for key in keys]

    def stored(self, space: Namespace, key: bytes) -> None:
        """`key` was put: its claim is over, its waiters go on."""
        if self._held:
            self._end((space.name, key))

    def claimed_in(self, name: str) -> list[bytes]:
        """The keys of namespace `name` that are claimed (found by its index: a scan of
        every claim, 164,000 of ten users, cost each removal 4-11 ms)."""
        return list(self._by_space.get(name, ()))

    def dropped(self, name: str, keys: Iterable[bytes]) -> None:
        """The namespace was removed: its claims on `keys` are over (the caller ends
        `claimed_in` a bite at a time: 16,384 at once held the thread 20 ms)."""
        for key in keys:
            self._end((name, key))

    def shut_out(self, name: str, keys: Iterable[bytes],
                 may_write: Callable[[Session], bool]) -> None:
        """Of namespace `name`'s claims on `keys`, those of connections that
        `may_write` it no more (its owner shut their users out) are over: their keys
        were told busy to every other writer, and waited on, for up to MAX_CLAIM_S by
        a user who could no longer put them."""
        for key in keys:
            claim = self._held.get((name, key))
            if claim is not None and not may_write(claim.session):
                self._end((name, key))

    def drop_run_out(self, most: int = DROP_BITE) -> bool:
        """End claims whose time ran out, and cooling keys that cooled down: those at
        the head of the expiry heaps, not a scan of every claim; `most` of each at a
        call (16,384 at once held the thread 30 ms).  Whether more are due."""
        now, expiry = trio.current_time(), self._expiry
        for _ in range(most):
            if not expiry or expiry[0][0] > now:
                break
            k = heapq.heappop(expiry)[2]
            claim = self._held.get(k)
            if claim is not None and claim.until <= now:
                self._run_out(k, claim)
        cool = self._cool_heap
        for _ in range(most):
            if not cool or cool[0][0] > now:
                break
            k = heapq.heappop(cool)[2]
            cooling = self._cooling.get(k)
            if cooling is not None and cooling[1] <= now:
                del self._cooling[k]
                self._uncool(cooling[0])
        self._compact()
        return bool(expiry and expiry[0][0] <= now or cool and cool[0][0] <= now)

    def _compact(self) -> None:
        """Rebuild the expiry heap once stale entries (renewals, claims ended before
        their time) outnumber the claims: O(claims), so at most once per as many
        changes."""
        if len(self._expiry) > 2 * len(self._held) + 1024:
            self._expiry = [(c.until, next(self._made), k) for k, c in self._held.items()]
            heapq.heapify(self._expiry)

    def holds(self, session: Session) -> bool:
        """Whether `session` holds a claim (live or run out, not yet dropped)."""
        return id(session) in self._by_session

    def take(self, session: Session) -> list[tuple[str, bytes]]:
        """The connection closed: the keys of its claims, to `end` (at once, or a bite
        at a time: `KVOps.release`).  It holds none from now on."""
        return list(self._by_session.pop(id(session), ()))

    def end(self, session: Session, keys: Iterable[tuple[str, bytes]]) -> None:
        """`session`'s claims on `keys` (namespace, key) are over, their waiters go on
        (a key stored and claimed again meanwhile is another's claim now: kept)."""
        for k in keys:
            claim = self._held.get(k)
            if claim is not None and claim.session is session:
                self._lapse(k, claim)
