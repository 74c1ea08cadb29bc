"""LMCache L2 adapter on mxfs (`lmcache server --l2-adapter ...`).

    --l2-adapter '{"type": "plugin", "module_path": "mxfs.kv.adapters.lmcache",
                   "class_name": "MxfsL2Adapter",
                   "adapter_params": {"mount": "/mnt/kv", "namespace": "lmcache"}}'

LMCache's controller threads submit tasks and wait on three event descriptors; the
adapter runs each task on its worker threads, so submitting never blocks, and
signals the matching descriptor when a result is ready.  Objects are keyed by
every field of LMCache's ObjectKey as its connectors write them (model, kv_rank,
object group, chunk hash, cache salt).  "Lock" is mxfs's read lease (`pin`): a key
reported found is locked exactly once, until LMCache's one `submit_unlock` of it,
on every path; mxfs's eviction skips locked chunks, and so does `delete`.  The
capacity is mxfs's to enforce (LMCache is told of none, so its own eviction never
deletes for space); stores, loads and deletes are reported to LMCache's listeners
as its own adapters report them.

With "prefill_tokens_per_s" (the instance's prefill rate) and "chunk_tokens"
(LMCache's chunk_size; 256 by default, as LMCache's), a lookup reports found only the
chunks from a request's first that the pool, at the rate this adapter's loads
measured, delivers faster than the instance computes them
(`mxfs.kv.reuse_policy.per_token_policy`); LMCache computes the rest.  A request's
keys come row by row (one row of chunks per object group); a chunk position counts as
found when every row holds it.  Chunks LMCache's L1 holds are asked here too and
counted as reads, which leans to computing, never to a read that loses.  The keys
cut are unlocked at once: only keys reported found are LMCache's to unlock.
"""

from __future__ import annotations

import errno
import itertools
import logging
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import AdapterUsage, L2AdapterInterface
from lmcache.v1.platform import create_event_notifier

from mxfs.errors import MxfsError
from mxfs.kv.keys import lmcache_object_key
from mxfs.kv.kvstore import KVStore, default_namespace, page_cache_option
from mxfs.kv.reuse_policy import per_token_policy, prefill_rate

log = logging.getLogger("mxfs.kv.lmcache")

# Objects per put: what stored before a failure is still reported to LMCache's listeners.
PUT_SLICE = 64
UNPIN_SLICE = 1024  # keys per unpin request
DEFAULT_CHUNK_TOKENS = 256  # LMCache's default chunk_size


def object_key(key: Any) -> bytes:
    """An LMCache ObjectKey as an mxfs key: `model@kv_rank@group@hash[@salt]`."""
    return lmcache_object_key(key.chunk_hash, key.model_name, key.kv_rank,
                              key.object_group_id, key.cache_salt).encode()


def _row_of(key: Any) -> tuple[Any, ...]:
    """Which row of a request's keys `key` is in: everything but its chunk."""
    return (key.model_name, key.kv_rank, key.object_group_id, key.cache_salt)


def _bits(flags: list[bool]) -> Any:
    """An LMCache bitmap with bit i set where flags[i] is true."""
    bits = Bitmap(len(flags))
    for i, flag in enumerate(flags):
        if flag:
            bits.set(i)
    return bits


class MxfsL2Adapter(L2AdapterInterface):
    def __init__(self, params: Any, l1_memory_desc: Any = None) -> None:
        conf = params if isinstance(params, dict) else vars(params)
        super().__init__()  # no capacity for LMCache: mxfs evicts, sparing locked chunks
        if not conf.get("mount"):
            raise ValueError("mxfs L2 adapter: set \"mount\" in adapter_params")
        self.capacity = int(conf.get("capacity", 0) or 0)
        try:
            self.store = KVStore(conf["mount"],
                                 conf.get("namespace") or default_namespace("lmcache"),
                                 capacity=self.capacity or None, shared=bool(conf.get("shared")),
                                 page_cache=page_cache_option(conf.get("page_cache")))
        except MxfsError as e:
            raise OSError(errno.ENODEV, f"mxfs L2 adapter: {e}") from None
        self._events = {kind: create_event_notifier() for kind in ("store", "lookup", "load")}
        self._results: dict[str, dict[int, Any]] = {kind: {} for kind in self._events}
        self._ids = itertools.count(1)
        self._pool = ThreadPoolExecutor(4, thread_name_prefix="mxfs-l2")
        self._lock = threading.Lock()  # guards results and the leases below
        # Leases this adapter holds on the store's connection (which one: _connection).
        self._held: Counter[bytes] = Counter()
        self._connection = self.store.client.connections
        self._pinning = threading.Lock()  # a delete never races a lock of the same key
        self.prefill_rate = prefill_rate(conf.get("prefill_tokens_per_s"), "mxfs L2 adapter")
        try:
            self.chunk_tokens = int(conf.get("chunk_tokens", DEFAULT_CHUNK_TOKENS))
        except (TypeError, ValueError):
            self.chunk_tokens = 0
        if self.chunk_tokens <= 0:
            raise ValueError(f"mxfs L2 adapter: \"chunk_tokens\" is "
                             f"{conf.get('chunk_tokens')!r}: give LMCache's chunk_size")

    # ---- the pool ---------------------------------------------------------------------

    def _leases_current(self) -> None:
        """Forget the leases of a connection that ended (under self._lock).

        The store's client connects again by itself after its connection broke (a
        daemon restart, a lost request); the leases went with the old connection, so
        unlocking them must not end leases taken since on the new one."""
        now = self.store.client.connections
        if now != self._connection:
            self._held.clear()
            self._connection = now

    # ---- tasks ------------------------------------------------------------------------

    def get_store_event_fd(self) -> int:
        return int(self._events["store"].fileno())

    def get_lookup_and_lock_event_fd(self) -> int:
        return int(self._events["lookup"].fileno())

    def get_load_event_fd(self) -> int:
        return int(self._events["load"].fileno())

    def _run(self, kind: str, fn: Callable[[], Any], failed: Callable[[], Any]) -> int:
        task = next(self._ids)

        def job() -> None:
            try:
                out = fn()
            except Exception as e:  # noqa: BLE001 - a failed task is a result, not a crash
                log.warning("mxfs L2 %s task %d failed: %s", kind, task, e)
                out = failed()
            with self._lock:
                self._results[kind][task] = out
            self._events[kind].notify()

        self._pool.submit(job)
        return task

    def _take(self, kind: str, task: int) -> Any:
        with self._lock:
            return self._results[kind].pop(task, None)

    def submit_store_task(self, keys: list[Any], objects: list[Any]) -> int:
        def store() -> Any:
            wire = [object_key(k) for k in keys]
            bufs = [o.byte_array for o in objects]
            kv = self.store
            stored, sizes, ok = [], [], True
            for start in range(0, len(wire), PUT_SLICE):
                end = start + PUT_SLICE
                try:
                    new = kv.batch_put(wire[start:end], bufs[start:end])
                except OSError as e:  # ENOSPC (the pool is full), EFBIG, a lost daemon...
                    log.warning("mxfs L2: %d of %d objects not stored: %s",
                                len(wire) - start, len(wire), e)
                    ok = False
                    break
                for k, buf, fresh in zip(keys[start:end], bufs[start:end], new, strict=True):
                    if fresh:  # False: stored already (the first writer won)
                        stored.append(k)
                        sizes.append(len(buf))
            if stored:
                self._notify_keys_stored(stored, sizes)
            return L2StoreResult(ok, sum(sizes))

        return self._run("store", store, lambda: L2StoreResult(False, 0))

    def pop_completed_store_tasks(self) -> dict[int, Any]:
        with self._lock:
            done, self._results["store"] = self._results["store"], {}
        return done

    def submit_lookup_and_lock_task(self, keys: list[Any], group_layout_descs: Any) -> int:
        def lookup() -> Any:
            wire = [object_key(k) for k in keys]
            found = [False] * len(wire)
            kv = self.store
            for start in range(0, len(wire), kv.batch):  # a failed part fails alone
                part = wire[start:start + kv.batch]
                with self._pinning:
                    try:
                        leased = kv.pin(part)  # False for each absent key (or namespace)
                    except OSError as e:
                        log.warning("mxfs L2: %d keys not looked up: %s", len(part), e)
                        continue
                    with self._lock:  # counted before the result is seen: unlocks find them
                        self._leases_current()
                        for w, ok in zip(part, leased, strict=True):
                            if ok:
                                self._held[w] += 1
                found[start:start + len(part)] = leased
            cut = self._not_worth_reading(keys, found)
            if cut:
                self._drop_leases([wire[i] for i in cut])
                for i in cut:
                    found[i] = False
            return _bits(found)

        return self._run("lookup", lookup, lambda: Bitmap(len(keys)))

    def query_lookup_and_lock_result(self, task_id: int) -> Any:
        return self._take("lookup", task_id)

    def _not_worth_reading(self, keys: list[Any], found: list[bool]) -> list[int]:
        """The found keys that the reuse policy says to compute rather than read (none
        without a policy, or rows of unequal length, which this cannot line up)."""
        policy = self.store.policy
        if policy is None:
            return []
        rows: dict[tuple[Any, ...], list[int]] = {}
        for i, k in enumerate(keys):
            rows.setdefault(_row_of(k), []).append(i)
        width = len(next(iter(rows.values()), []))
        if any(len(r) != width for r in rows.values()):
            return []
        whole = next((c for c in range(width) if not all(found[r[c]] for r in rows.values())),
                     width)
        if not whole:
            return []
        read = policy.plan(width * self.chunk_tokens, whole).read_chunks
        return [r[c] for r in rows.values() for c in range(read, whole)]

    def _drop_leases(self, wire: list[bytes]) -> None:
        """Unpin `wire` (each locked once more by this adapter), as LMCache's unlock
        would."""
        mine = []
        with self._lock:
            self._leases_current()
            for w in wire:
                if self._held[w] > 0:
                    self._held[w] -= 1
                    if not self._held[w]:
                        del self._held[w]
                    mine.append(w)
        if mine:
            self._pool.submit(self._unpin, mine)

    def submit_unlock(self, keys: list[Any]) -> None:
        """Ends the leases of keys this adapter locked (others it never reported found).

        An unpin that fails leaves no lease behind: either the connection broke (its
        leases ended with it) or the namespace is gone (with its chunks)."""
        self._drop_leases([object_key(k) for k in keys])

    def _unpin(self, wire: list[bytes]) -> None:
        try:
            for start in range(0, len(wire), UNPIN_SLICE):
                self.store.unpin(wire[start:start + UNPIN_SLICE])
        except Exception as e:  # noqa: BLE001 - see submit_unlock
            log.warning("mxfs L2: unlock of %d keys failed: %s", len(wire), e)

    def submit_load_task(self, keys: list[Any], objects: list[Any]) -> int:
        def load() -> Any:
            wire = [object_key(k) for k in keys]
            bufs = [o.byte_array for o in objects]
            hits: list[bool] = []
            kv = self.store
            if self.prefill_rate is not None and kv.policy is None and bufs:
                # the policy's unit: a chunk position, an object of every row
                columns = len(keys) // max(1, len({_row_of(k) for k in keys}))
                kv.policy = per_token_policy(
                    self.chunk_tokens, max(1, sum(len(b) for b in bufs) // max(1, columns)),
                    self.prefill_rate)
            for start in range(0, len(wire), kv.batch):  # a failed part fails alone
                end = start + kv.batch
                try:  # a chunk of another size than its buffer is a miss, the rest served
                    hits += [bool(g) for g in kv.batch_get(wire[start:end], bufs[start:end])]
                except OSError as e:
                    log.warning("mxfs L2: %d objects not loaded: %s", len(wire[start:end]), e)
                    hits += [False] * len(wire[start:end])
            loaded = [k for k, hit in zip(keys, hits, strict=True) if hit]
            if loaded:
                self._notify_keys_accessed(loaded)
            return _bits(hits)

        return self._run("load", load, lambda: Bitmap(len(keys)))

    def query_load_result(self, task_id: int) -> Any:
        return self._take("load", task_id)

    # ---- eviction, usage, status ------------------------------------------------------

    def delete(self, keys: list[Any]) -> None:
        """Delete keys, but not those this adapter holds locked (LMCache's eviction
        does not know L2 locks)."""
        pairs = [(k, object_key(k)) for k in keys]
        gone = []
        with self._pinning:
            with self._lock:
                self._leases_current()
                free = [(k, w) for k, w in pairs if not self._held[w]]
            try:
                gone = [k for k, w in free if self.store.delete(w)]
            except OSError as e:
                log.warning("mxfs L2: delete of %d keys failed: %s", len(free), e)
        if len(free) < len(pairs):
            log.debug("mxfs L2: %d locked keys not deleted", len(pairs) - len(free))
        if gone:  # sizes unknown here; the usage LMCache sees is the pool's own
            self._notify_keys_deleted(gone, [0] * len(gone))

    def get_usage(self) -> Any:
        """The namespace's bytes and capacity (every process's chunks), from the daemon."""
        try:
            u = self.store.usage()
        except OSError as e:
            if e.errno != errno.ENOENT:
                log.warning("mxfs L2: no usage: %s", e)
            return AdapterUsage(0, self.capacity)
        return AdapterUsage(int(u["bytes"]), int(u["capacity"]))

    def report_status(self) -> dict[str, Any]:
        status: dict[str, Any] = {"is_healthy": self.store.client.alive(), "backend": "mxfs",
                                  "namespace": self.store.namespace}
        try:
            status.update(self.store.usage())
        except OSError as e:
            status["error"] = str(e)
        return status

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.store.close()  # leases end with the connection
        for e in self._events.values():
            e.close()
