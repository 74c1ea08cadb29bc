"""vLLM KV offloading to mxfs: a secondary tier, and a spec that installs it.

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "MxfsOffloadingSpec",
        "spec_module_path": "mxfs.kv.adapters.vllm", "cpu_bytes_to_use": 8589934592,
        "mxfs": {"mount": "/mnt/kv", "namespace": "vllm", "prefill_tokens_per_s": 20000}}}'

vLLM's tiering manager keeps hot chunks in its CPU tier (one shared offload region,
a row per chunk holding every worker's bytes) and hands them to secondary tiers;
`MxfsTier` is one, run in the scheduler as vLLM's own fs tier is: lookups batched
once per step on a thread (`AsyncLookupManager`), loads and stores on threads of
their own, rows moved straight between the region and the pool.  Chunks are named
exactly as vLLM's storage tiers name them (`FileMapper`: model, run digest, rank,
block hash, KV group), so runs that differ in anything that shapes the bytes never
share a chunk.  Errors become failed jobs and misses, never exceptions in vLLM.

With "prefill_tokens_per_s" (the instance's prefill rate), a request's lookups report
only the hit chunks that the pool, at the rate this tier's loads measured, delivers
faster than the instance computes them (`mxfs.kv.reuse_policy.per_token_policy`); the
others are misses to vLLM, which computes them.  The tokens before a request's first
key asked here (held by vLLM's own tiers) are taken from the positions vLLM's
scheduler records for its keys.
"""

from __future__ import annotations

import copy
import dataclasses
import errno
import logging
import queue
import threading
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from mxfs.errors import MxfsError
from mxfs.kv.keys import VllmRun
from mxfs.kv.kvstore import KVStore, default_namespace
from mxfs.kv.reuse_policy import ReusePolicy, per_token_policy, prefill_rate

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.config import OffloadingConfig
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

log = logging.getLogger("mxfs.kv.vllm")

PUT_SLICE = 64  # chunks per put: bounds the unpublished files and descriptors it holds
LOOKUP_SLICE = 1024  # keys per exists request


def storage_run(spec: OffloadingSpec) -> VllmRun:
    """The run as vLLM's fs tier names it: `FileMapper.from_offloading_spec(...,
    blocks_per_file=spec.blocks_per_chunk, parallel_agnostic=True)`."""
    config = spec.config
    parallel = config.parallel
    canonical = None
    if config.canonical_layout:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import (
            canonical_format_id,
        )

        canonical = canonical_format_id(str(config.kv_cache_layout))
    return VllmRun(
        model=config.model.name, dtype=str(config.model.dtype),
        tokens_per_hash=config.cache.tokens_per_hash, blocks_per_chunk=spec.blocks_per_chunk,
        tp_size=parallel.tp_size, pp_size=parallel.pp_size, pcp_size=parallel.pcp_size,
        dcp_size=parallel.dcp_size, rank=parallel.rank,
        groups=tuple((g.tokens_per_block, tuple(g.layer_names)) for g in config.groups),
        agnostic=parallel.is_parallelism_agnostic or config.replicated_layout,
        replicated=config.replicated_layout, canonical_format=canonical,
        layout=None if canonical is not None or not config.kv_cache_layout
        else str(config.kv_cache_layout))


class _Lookups(AsyncLookupManager):
    """vLLM's batched lookups, asking the daemon once per step and request."""

    def __init__(self, tier: MxfsTier, tier_type: str) -> None:
        super().__init__(tier_type=tier_type)
        self._tier = tier

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        present = self._tier.present([self._tier.chunk_key(k) for k in keys])
        return self._tier.worth_reading(keys, present, req_context)


class MxfsTier(SecondaryTierManager):
    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(self, offloading_spec: OffloadingSpec, primary_kv_view: memoryview,
                 tier_type: str, mount: str = "", namespace: str = "",
                 capacity: int | None = None, shared: bool = False,
                 enable_kv_events: bool = False, locality: str | None = None,
                 backpressure_detector: BackpressureDetector | None = None,
                 page_cache: bool | None = None, prefill_tokens_per_s: Any = None) -> None:
        """The tier config's fields; a mount that is not there refuses to start (as
        vLLM's fs tier does with a root it cannot make), a pool lost later fails jobs."""
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        if not mount:
            raise ValueError("mxfs vLLM tier: set \"mount\" in the tier config")
        self.locality = Locality(locality) if locality is not None else None
        self.run = storage_run(offloading_spec)
        self._args = (mount, namespace or default_namespace("vllm"), capacity, shared,
                      page_cache)
        self._conn = threading.Lock()  # guards replacing a broken store
        rate = prefill_rate(prefill_tokens_per_s, "mxfs vLLM tier")
        cache = offloading_spec.config.cache
        self.chunk_tokens = cache.tokens_per_hash * cache.blocks_per_chunk
        self.policy: ReusePolicy | None = None if rate is None else \
            per_token_policy(self.chunk_tokens, self.block_size_bytes, rate)
        self.store = self._open()
        self.events: list[OffloadingEvent] | None = None
        if enable_kv_events and offloading_spec.kv_events_config.enable_kv_cache_events:
            self.events = []
        # Job state, shared with the workers: guarded by _cond.
        self._cond = threading.Condition()
        self._busy = 0
        self._done: list[tuple[JobResult, bool, list[OffloadKey]]] = []
        self._lookups = _Lookups(self, tier_type)
        self._queues: dict[str, queue.SimpleQueue[TransferJob | None]] = {
            "load": queue.SimpleQueue(), "store": queue.SimpleQueue()}
        self._workers = [threading.Thread(target=self._serve, args=(kind,), daemon=True,
                                          name=f"mxfs-vllm-{kind}") for kind in self._queues]
        for w in self._workers:
            w.start()

    # ---- the pool ---------------------------------------------------------------------

    def _open(self) -> KVStore:
        mount, namespace, capacity, shared, page_cache = self._args
        try:
            return KVStore(mount, namespace, capacity=capacity, shared=shared,
                           page_cache=page_cache, policy=self.policy)
        except MxfsError as e:
            raise OSError(errno.ENODEV, f"mxfs vLLM tier: {e}") from None

    def _kv(self) -> KVStore:
        """The store, connected again if its connection broke (a daemon restart)."""
        with self._conn:
            client = self.store.client
            if client.broken or client.sock.fileno() < 0:  # failed mid-request, or to reconnect
                old, self.store = self.store, self._open()
                old.close()
            return self.store

    def chunk_key(self, key: OffloadKey) -> bytes:
        return self.run.name(bytes(key)).encode()

    def present(self, names: list[bytes]) -> list[bool]:
        """Which chunks the pool holds (none while the namespace is not made yet)."""
        out: list[bool] = []
        try:
            for start in range(0, len(names), LOOKUP_SLICE):
                out += self._kv().exists_many(names[start:start + LOOKUP_SLICE])
        except OSError as e:
            if e.errno != errno.ENOENT:
                raise
            return [False] * len(names)
        return out

    def worth_reading(self, keys: list[OffloadKey], present: list[bool],
                      req_context: ReqContext) -> list[bool]:
        """`present` cut by the reuse policy: in each run of one request's keys in
        prefix order (a KV group's, as vLLM's scheduler asks them), the hit from the
        run's first key is reported only as far as reading it beats computing it (vLLM
        stops at the first miss).  Without a policy, `present` as it is."""
        if self.policy is None:
            return present
        out = list(present)
        positions = [req_context.get_offload_key_position(k) for k in keys]
        for start, end in _runs(positions):
            first = positions[start]
            have = max(0, first - self.chunk_tokens) if first is not None else 0
            found = next((i for i in range(start, end) if not present[i]), end) - start
            if found:
                read = self.policy.plan(have + (end - start) * self.chunk_tokens, found,
                                        have).read_chunks
                out[start + read:start + found] = [False] * (found - read)
        return out

    # ---- the scheduler's calls --------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit("store", job_metadata)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit("load", job_metadata)

    def _submit(self, kind: str, job: TransferJob) -> None:
        with self._cond:
            self._busy += 1
        self._queues[kind].put(job)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        with self._cond:
            done, self._done = self._done, []
        results = []
        for result, promotion, keys in done:
            if promotion:  # keys that did not load: misses from now on, not retried
                self._lookups.mark_miss(keys)
            elif self.events is not None and keys:
                self.events.append(OffloadingEvent(keys=keys, medium=self.medium,
                                                   removed=False, locality=self.locality))
            results.append(result)
        return results

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self.events is not None:
            yield from self.events
            self.events.clear()

    def has_pending_work(self) -> bool:
        with self._cond:
            return self._busy > 0

    def drain_jobs(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._busy == 0)

    def shutdown(self) -> None:
        """Stop the lookups and workers (queued jobs finish first), then the connection.

        No view of vLLM's offload region outlives a job, so vLLM can close it next."""
        self._lookups.shutdown()
        for q in self._queues.values():
            q.put(None)
        for w in self._workers:
            w.join()
        self.store.close()

    # ---- the workers ------------------------------------------------------------------

    def _serve(self, kind: str) -> None:
        while (job := self._queues[kind].get()) is not None:
            start = time.monotonic()
            keys = list(job.keys)
            try:
                ok = self._move(kind, job)
            except Exception as e:  # noqa: BLE001 - a job that fails is a result, never a crash
                log.warning("mxfs vLLM tier: %s of %d chunks failed: %s", kind, len(keys), e)
                ok = [False] * len(keys)
            good = [k for k, o in zip(keys, ok, strict=True) if o]
            result = JobResult(job.job_id, len(good) == len(keys),
                               successful_keys=None if len(good) == len(keys) else tuple(good),
                               transfer_time=time.monotonic() - start,
                               transfer_bytes=len(good) * self.block_size_bytes)
            promotion = job.is_promotion
            noted = [k for k, o in zip(keys, ok, strict=True) if not o] if promotion else good
            with self._cond:
                self._done.append((result, promotion, noted))
                self._busy -= 1
                self._cond.notify_all()

    def _move(self, kind: str, job: TransferJob) -> list[bool]:
        """One job's rows to or from the pool; True for each chunk moved."""
        keys = list(job.keys)
        names = [self.chunk_key(k) for k in keys]
        size = self.block_size_bytes
        ok = [False] * len(keys)
        # Views of the region live only for this job, each released after it:
        # vLLM closes the region's mmap at shutdown, refused while one is exported.
        with self._primary_kv_view.cast("B") as flat:
            rows = [flat[int(c) * size:(int(c) + 1) * size] for c in job.chunk_ids]
            try:
                if kind == "store":
                    self._store(names, rows, ok)
                else:
                    self._load(names, rows, ok)
            finally:
                for row in rows:
                    row.release()
        return ok

    def _store(self, names: list[bytes], rows: list[memoryview], ok: list[bool]) -> None:
        for start in range(0, len(names), PUT_SLICE):
            end = start + PUT_SLICE
            try:
                self._kv().batch_put(names[start:end], rows[start:end])
            except OSError as e:  # ENOSPC (the pool is full), EFBIG, a lost daemon...
                log.warning("mxfs vLLM tier: %d of %d chunks not stored: %s",
                            len(names) - start, len(names), e)
                return
            ok[start:end] = [True] * len(names[start:end])  # stored, or stored already

    def _load(self, names: list[bytes], rows: list[memoryview], ok: list[bool]) -> None:
        step = self.store.batch
        for start in range(0, len(names), step):
            end = start + step
            try:
                got = self._kv().batch_get(names[start:end], rows[start:end])
            except (OSError, ValueError) as e:  # ValueError: a chunk larger than a row
                log.warning("mxfs vLLM tier: %d chunks not loaded: %s", len(names[start:end]),
                            e)
                continue
            ok[start:end] = [bool(g) for g in got]


def _runs(positions: list[int | None]) -> list[tuple[int, int]]:
    """[start, end) of each run of rising token positions (a key with none: a run of
    its own)."""
    runs, start = [], 0
    for i in range(1, len(positions) + 1):
        prev = positions[i - 1]
        if i == len(positions) or prev is None or positions[i] is None \
                or positions[i] <= prev:  # type: ignore[operator]
            runs.append((start, i))
            start = i
    return runs


def with_mxfs_tier(extra: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `extra` whose secondary tiers end with the mxfs tier (from "mxfs").

    A copy: vLLM keeps the caller's config, and its tiering spec writes resolved
    backpressure settings into the tier configs it is given."""
    out = copy.deepcopy(dict(extra))
    tiers = list(out.get("secondary_tiers") or [])
    if not any(isinstance(t, dict) and t.get("type") == "MxfsTier" for t in tiers):
        tiers.append({"type": "MxfsTier", "module_path": __name__, **out.get("mxfs", {})})
    out["secondary_tiers"] = tiers
    return out


class MxfsOffloadingSpec(TieringOffloadingSpec):
    """vLLM's tiering spec with an mxfs tier behind its CPU tier (config key "mxfs")."""

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        defined: dict[str, Any] = super().build_metric_definitions(
            with_mxfs_tier(extra_config))
        return defined

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(dataclasses.replace(
            config, extra_config=with_mxfs_tier(config.extra_config)))
