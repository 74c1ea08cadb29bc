"""vLLM KV offloading to mxfs: a secondary tier, and a spec that installs it.

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "MxfsOffloadingSpec",
        "spec_module_path": "mxfs.kv.adapters.vllm", "cpu_bytes_to_use": 8589934592,
        "mxfs": {"mount": "/mnt/kv", "namespace": "vllm"}}}'

vLLM's tiering manager (its `lookup`, `prepare_load`, `touch`, `complete_load`,
`prepare_store`, `complete_store`) keeps hot chunks in CPU memory and hands cold
ones to secondary tiers; `MxfsTier` is that tier.  Its jobs run on a worker
thread, so the scheduler never blocks: rows of the CPU buffer go to and from
mxfs chunks keyed by vLLM's offload key (the chained block hash of the chunk's
last block, and the KV group).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterable
from typing import Any

from vllm.v1.kv_offload.base import LookupResult, Medium, RequestOffloadingContext
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from mxfs.kv.store import KVStore, default_namespace

log = logging.getLogger("mxfs.kv.vllm")


class MxfsTier(SecondaryTierManager):
    medium = Medium.STORAGE

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector: Any = None, mount: str = "",
                 namespace: str = "", capacity: int | None = None, shared: bool = False,
                 **_: Any) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        if not mount:
            raise ValueError("mxfs vLLM tier: set \"mount\" in the tier config")
        self.store = KVStore(mount, namespace or default_namespace("vllm"), capacity=capacity,
                             shared=shared)
        self._rows = primary_kv_view.cast("B")  # view[c] is refused: slice bytes instead
        self._jobs: queue.Queue[tuple[str, TransferJob] | None] = queue.Queue()
        self._done: list[JobResult] = []
        self._lock = threading.Lock()
        self._busy = 0
        self._worker = threading.Thread(target=self._serve, name="mxfs-vllm-tier", daemon=True)
        self._worker.start()

    def _row(self, chunk: int) -> memoryview:
        size = self.block_size_bytes
        return self._rows[chunk * size:(chunk + 1) * size]

    def lookup(self, key: Any, req_context: Any) -> LookupResult:
        return LookupResult.HIT if self.store.exists(bytes(key)) else LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit("store", job_metadata)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit("load", job_metadata)

    def _submit(self, kind: str, job: TransferJob) -> None:
        with self._lock:
            self._busy += 1
        self._jobs.put((kind, job))

    def _serve(self) -> None:
        while (item := self._jobs.get()) is not None:
            kind, job = item
            start = time.monotonic()
            keys = [bytes(k) for k in job.keys]
            rows = [self._row(int(c)) for c in job.chunk_ids]
            ok: list[bool]
            try:
                if kind == "store":
                    self.store.batch_put(keys, rows)
                    ok = [True] * len(keys)
                else:
                    ok = [bool(x) for x in self.store.batch_get(keys, rows)]
            except OSError as e:
                log.warning("mxfs vLLM tier: %s of %d chunks failed: %s", kind, len(keys), e)
                ok = [False] * len(keys)
            good = [k for k, o in zip(job.keys, ok, strict=True) if o]
            result = JobResult(job.job_id, all(ok), successful_keys=good,
                               transfer_time=time.monotonic() - start,
                               transfer_bytes=len(good) * self.block_size_bytes)
            with self._lock:
                self._done.append(result)
                self._busy -= 1

    def get_finished_jobs(self) -> Iterable[JobResult]:
        with self._lock:
            done, self._done = self._done, []
        return done

    def has_pending_work(self) -> bool:
        with self._lock:
            return self._busy > 0

    def on_new_request(self, req_context: Any) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def drain_jobs(self) -> None:
        while self.has_pending_work():
            time.sleep(0.001)

    def shutdown(self) -> None:
        self._jobs.put(None)
        self._worker.join(timeout=30)
        self.store.close()


class MxfsOffloadingSpec(TieringOffloadingSpec):
    """vLLM's tiering spec with an mxfs tier behind its CPU tier (config key "mxfs")."""

    def __init__(self, config: Any) -> None:
        extra = config.extra_config
        tiers = list(extra.get("secondary_tiers") or [])
        if not any(t.get("type") == "MxfsTier" for t in tiers):
            tiers.append({"type": "MxfsTier", "module_path": __name__, **extra.get("mxfs", {})})
            extra["secondary_tiers"] = tiers
        super().__init__(config)
