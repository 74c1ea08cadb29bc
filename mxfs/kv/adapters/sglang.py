"""SGLang HiCache storage backend on mxfs (`--hicache-storage-backend dynamic`).

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
      '{"backend_name": "mxfs", "module_path": "mxfs.kv.adapters.sglang",
        "class_name": "MxfsHiCacheStorage", "interface_v1": 1,
        "mount": "/mnt/kv", "namespace": "sglang"}'

Keys are SGLang's page hashes with the model and tensor-parallel shard appended
(as its own file backend does), so ranks and models never share chunks by mistake.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from mxfs.kv.store import KVStore, default_namespace

log = logging.getLogger("mxfs.kv.sglang")


class MxfsHiCacheStorage(HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None
                 ) -> None:
        extra = storage_config.extra_config or {}
        mount = extra.get("mount") or os.environ.get("MXFS_KV_MOUNT")
        if not mount:
            raise ValueError("mxfs HiCache backend: set \"mount\" in "
                             "--hicache-storage-backend-extra-config (or MXFS_KV_MOUNT)")
        capacity = extra.get("capacity")
        self.store = KVStore(mount, extra.get("namespace") or default_namespace("sglang"),
                             capacity=int(capacity) if capacity is not None else None,
                             shared=bool(extra.get("shared")))
        model = "-".join((storage_config.model_name or "").split("/"))
        shard = f"_{storage_config.pp_size}_{storage_config.pp_rank}" \
            if storage_config.pp_size > 1 else ""
        self.suffix = (f"_{model}{shard}" if storage_config.is_mla_model
                       else f"_{model}_{storage_config.tp_rank}_{storage_config.tp_size}{shard}")
        self.mem_pool_host: Any = None

    def _k(self, key: str) -> str:
        return key + self.suffix

    # ---- the generic (flat page tensor) interface -------------------------------------

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None
            ) -> torch.Tensor | None:
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        if target_locations is None:
            return [None if b is None else torch.frombuffer(bytearray(b), dtype=torch.uint8)
                    for b in self.store.batch_get([self._k(k) for k in keys])]
        got = self.store.batch_get([self._k(k) for k in keys], list(target_locations))
        return [t if ok else None for t, ok in zip(target_locations, got, strict=True)]

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        try:
            self.store.batch_put([self._k(k) for k in keys], list(values))
            return True  # stored, or already there: either way the pages are in storage
        except OSError as e:
            log.warning("mxfs HiCache: %d pages not stored: %s", len(keys), e)
            return False

    def exists(self, key: str) -> bool:
        return self.store.exists(self._k(key))

    def batch_exists(self, keys: list[str],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        return self.store.batch_exists([self._k(k) for k in keys])

    # ---- the zero-copy (host pool page) interface -------------------------------------

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        pool = self.mem_pool_host
        size = pool.page_size
        pages = [torch.empty_like(pool.get_dummy_flat_data_page()) for _ in keys]
        got = self.store.batch_get([self._k(k) for k in keys], pages)
        for i, ok in enumerate(got):
            if ok:
                pool.set_from_flat_data_page(int(host_indices[i * size]), pages[i])
        return [bool(ok) for ok in got]

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        pool = self.mem_pool_host
        pages = [pool.get_data_page(int(host_indices[i * pool.page_size]), flat=True)
                 .contiguous() for i in range(len(keys))]
        return [self.batch_set(keys, pages)] * len(keys)

    def clear(self) -> None:
        self.store._call("kv_evict", keep=0)

    def get_stats(self) -> dict[str, Any]:
        return self.store.usage()

    def close(self) -> None:
        self.store.close()
