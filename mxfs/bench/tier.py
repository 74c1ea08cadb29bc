"""The pool as a serving instance sees it: chained chunk keys, and every failure a miss.

An engine must never stop serving because its KV tier did: a pool that is full,
unmounted, or whose daemon died turns lookups and gets into misses and puts into
no-ops, each failure counted and the first of each kind kept for the report.  The
next request tries the pool again, so an instance picks it up once it is back.
"""

from __future__ import annotations

import errno
import logging
import mmap
from collections.abc import Sequence
from typing import Any

from mxfs.errors import MxfsError
from mxfs.kv.keys import ChunkKey, lmcache_hashes
from mxfs.kv.kvstore import KVStore
from mxfs.proto.framing import ProtocolError

log = logging.getLogger("mxfs.bench")

HASH_ALGO = "lmcache-blake3"
FAILURES = (OSError, MxfsError, ProtocolError, ValueError, KeyError, EOFError)
# An instance's claim on the chunks it computes lasts this long (a long prefill, its
# put), and one waits that long at most for another instance's (`wait_for_others`).
CLAIM_S = 30.0
WAIT_S = 30.0


def chunk_keys(tokens: Sequence[int], model_id: str, dtype: str, layout: str,
               chunk_tokens: int) -> list[bytes]:
    """The key of each complete chunk: LMCache's chained hash, bound to what made the bytes
    (model weights, dtype, layout, chunk size), so another model's chunks are misses."""
    return [ChunkKey(model_id, dtype, layout, 0, 1, chunk_tokens, HASH_ALGO, h.hex()).encode()
            for h in lmcache_hashes(tokens, chunk_tokens)]


def _misaligned(nbytes: int) -> memoryview:
    """A buffer whose address is 1 past a page boundary: never read with O_DIRECT."""
    return memoryview(mmap.mmap(-1, nbytes + 4096))[1:1 + nbytes]


def merge_failures(per_request: Any) -> dict[str, dict[str, Any]]:
    """Requests' pool failures added up: per kind, a count and the first reason."""
    out: dict[str, dict[str, Any]] = {}
    for failures in per_request:
        for kind, f in failures.items():
            o = out.setdefault(kind, {"count": 0, "first": f["first"]})
            o["count"] += f["count"]
    return out


class PoolTier:
    """A `KVStore` namespace that fails soft."""

    def __init__(self, mount: str, namespace: str, shared: bool = False) -> None:
        self.mount, self.namespace, self.shared = mount, namespace, shared
        self._kv: KVStore | None = None
        self.failures: dict[str, int] = {}
        self.first_failure: dict[str, str] = {}

    def _store(self) -> KVStore | None:
        if self._kv is None:
            try:
                self._kv = KVStore(self.mount, self.namespace, shared=self.shared)
            except FAILURES as e:
                self._failed("open", e)
        return self._kv

    def _failed(self, what: str, e: BaseException) -> None:
        self.failures[what] = self.failures.get(what, 0) + 1
        if what not in self.first_failure:
            self.first_failure[what] = f"{type(e).__name__}: {e}"
            log.warning("KV pool %s failed (%s); serving on without it", what, e)
        if self._kv is not None and what != "put":  # a refused put leaves the store usable
            try:
                self._kv.close()
            except OSError:
                pass
            self._kv = None

    def prefix(self, keys: Sequence[bytes]) -> int:
        """How many of `keys`, from the first, the pool holds."""
        kv = self._store() if keys else None
        if kv is None:
            return 0
        try:
            return kv.batch_exists(keys)
        except OSError as e:
            if e.errno == errno.ENOENT:
                return 0  # no namespace yet: nobody has put anything, a plain miss
            self._failed("lookup", e)
            return 0
        except FAILURES as e:
            self._failed("lookup", e)
            return 0

    def wait_for_others(self, keys: Sequence[bytes]) -> bool:
        """Claim `keys`, about to be computed and put (`KVStore.claim`); wait, bounded,
        for those another instance is computing.  True if any is stored meanwhile or
        was being computed elsewhere (look the prefix up again)."""
        kv = self._store() if keys else None
        if kv is None:
            return False
        try:
            states = kv.claim(keys, seconds=CLAIM_S)
            busy = [k for k, s in zip(keys, states, strict=True) if s == "busy"]
            if busy:
                kv.wait(busy, seconds=WAIT_S)
            return bool(busy) or "stored" in states
        except FAILURES as e:
            self._failed("claim", e)
            return False

    def get(self, keys: Sequence[bytes], outs: Sequence[Any]) -> int:
        """Read chunks into `outs`; how many from the first arrived whole and checked (a
        chunk failing its checksum is a miss: it and everything after it is recomputed)."""
        kv = self._store() if keys else None
        if kv is None:
            return 0
        try:
            got = kv.batch_get(keys, outs)
        except FAILURES as e:
            self._failed("get", e)
            return 0
        return next((i for i, ok in enumerate(got) if not ok), len(got))

    def put(self, keys: Sequence[bytes], bufs: Sequence[Any]) -> tuple[int, int]:
        """Store chunks (the first writer of a key wins); (chunks stored, refused)."""
        kv = self._store() if keys else None
        if kv is None:
            return 0, len(keys)
        try:
            stored = kv.batch_put(keys, bufs)
        except FAILURES as e:
            self._failed("put", e)
            try:  # (claimed in `wait_for_others`: those waiting on them go on now)
                kv.unclaim(keys)
            except FAILURES:
                pass
            return 0, len(keys)
        return sum(stored), 0

    def warm(self, keys: Sequence[bytes], sizes: Sequence[int]) -> int:
        """Read chunks (of `sizes` bytes) through the page cache, so the next get finds
        them cached; bytes read.  Buffers that cannot line up with the chunk files
        force buffered reads: O_DIRECT, which a cold get uses, would leave no pages."""
        kv = self._store() if keys else None
        if kv is None:
            return 0
        try:
            outs = [_misaligned(nbytes) for nbytes in sizes]
            return sum(nbytes for nbytes, ok in zip(sizes, kv.batch_get(keys, outs),
                                                    strict=True) if ok)
        except FAILURES as e:
            self._failed("get", e)
            return 0

    def close(self) -> None:
        if self._kv is not None:
            self._kv.close()
            self._kv = None
