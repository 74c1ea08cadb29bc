"""LMCache L2 adapter on mxfs (`lmcache server --l2-adapter ...`).

    --l2-adapter '{"type": "plugin", "module_path": "mxfs.kv.adapters.lmcache",
                   "class_name": "MxfsL2Adapter",
                   "adapter_params": {"mount": "/mnt/kv", "namespace": "lmcache"}}'

LMCache's controller threads submit tasks and wait on three event descriptors;
the adapter runs each task on its own worker threads, so submitting never blocks,
and signals the matching descriptor when a result is ready.  "Lock" is mxfs's read
lease (`pin`): eviction skips locked chunks until `submit_unlock`.
"""

from __future__ import annotations

import itertools
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import AdapterUsage, L2AdapterInterface
from lmcache.v1.platform import create_event_notifier

from mxfs.kv.store import KVStore, default_namespace

log = logging.getLogger("mxfs.kv.lmcache")


def object_key(key: Any) -> bytes:
    """An LMCache ObjectKey as an mxfs key: model, rank, group, chunk hash, salt."""
    return (f"{key.model_name}@{key.kv_rank:08x}@{key.object_group_id:x}@"
            f"{bytes(key.chunk_hash).hex()}@{key.cache_salt}").encode()


def _bits(flags: list[Any]) -> Any:
    """An LMCache bitmap with bit i set where flags[i] is true."""
    bits = Bitmap(len(flags))
    for i, flag in enumerate(flags):
        if flag:
            bits.set(i)
    return bits


class MxfsL2Adapter(L2AdapterInterface):
    def __init__(self, params: Any, l1_memory_desc: Any = None) -> None:
        conf = params if isinstance(params, dict) else vars(params)
        capacity = int(conf.get("capacity", 0) or 0)
        super().__init__(max_capacity_bytes=capacity)
        if not conf.get("mount"):
            raise ValueError("mxfs L2 adapter: set \"mount\" in adapter_params")
        self.store = KVStore(conf["mount"], conf.get("namespace") or default_namespace("lmcache"),
                             capacity=capacity or None, shared=bool(conf.get("shared")))
        self._store_lock = threading.Lock()  # KVStore requests go one at a time
        self._events = [create_event_notifier() for _ in range(3)]
        self._ids = itertools.count(1)
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="mxfs-l2")
        self._lock = threading.Lock()
        self._stored: dict[int, Any] = {}
        self._looked: dict[int, Any] = {}
        self._loaded: dict[int, Any] = {}

    def get_store_event_fd(self) -> int:
        return self._events[0].fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._events[1].fileno()

    def get_load_event_fd(self) -> int:
        return self._events[2].fileno()

    def _run(self, results: dict[int, Any], event: Any, fn: Any, failed: Any) -> int:
        task = next(self._ids)

        def job() -> None:
            try:
                with self._store_lock:
                    out = fn()
            except Exception as e:  # noqa: BLE001 - a failed task is a result, not a crash
                log.warning("mxfs L2 task %d failed: %s", task, e)
                out = failed()
            with self._lock:
                results[task] = out
            event.notify()

        self._pool.submit(job)
        return task

    def submit_store_task(self, keys: list[Any], objects: list[Any]) -> int:
        def store() -> Any:
            self.store.batch_put([object_key(k) for k in keys],
                                 [o.byte_array for o in objects])
            return L2StoreResult(True, sum(o.get_size() for o in objects))

        return self._run(self._stored, self._events[0], store,
                         lambda: L2StoreResult(False, 0))

    def pop_completed_store_tasks(self) -> dict[int, Any]:
        with self._lock:
            done, self._stored = self._stored, {}
        return done

    def submit_lookup_and_lock_task(self, keys: list[Any], group_layout_descs: Any) -> int:
        def lookup() -> Any:
            wire = [object_key(k) for k in keys]
            present = self.store.exists_many(wire)
            hits = [w for w, p in zip(wire, present, strict=True) if p]
            if hits:
                self.store.pin(hits)
            return _bits(present)

        return self._run(self._looked, self._events[1], lookup, lambda: Bitmap(len(keys)))

    def query_lookup_and_lock_result(self, task_id: int) -> Any:
        with self._lock:
            return self._looked.pop(task_id, None)

    def submit_unlock(self, keys: list[Any]) -> None:
        def unlock() -> None:
            self.store.unpin([object_key(k) for k in keys])

        self._pool.submit(lambda: self._locked(unlock))

    def _locked(self, fn: Any) -> None:
        try:
            with self._store_lock:
                fn()
        except Exception as e:  # noqa: BLE001 - leases also end when the connection closes
            log.warning("mxfs L2 unlock failed: %s", e)

    def submit_load_task(self, keys: list[Any], objects: list[Any]) -> int:
        def load() -> Any:
            return _bits(self.store.batch_get([object_key(k) for k in keys],
                                              [o.byte_array for o in objects]))

        return self._run(self._loaded, self._events[2], load, lambda: Bitmap(len(keys)))

    def query_load_result(self, task_id: int) -> Any:
        with self._lock:
            return self._loaded.pop(task_id, None)

    def delete(self, keys: list[Any]) -> None:
        with self._store_lock:
            for k in keys:
                self.store.delete(object_key(k))

    def get_usage(self) -> Any:
        with self._store_lock:
            u = self.store.usage()
        return AdapterUsage(int(u["bytes"]), int(u["capacity"]), {})

    def report_status(self) -> dict[str, Any]:
        return {"is_healthy": True, "backend": "mxfs", **self.store.usage()}

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.store.close()
        for e in self._events:
            close = getattr(e, "close", None)
            if close is not None:
                close()
