"""SGLang HiCache storage backend on mxfs (`--hicache-storage-backend dynamic`).

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
      '{"backend_name": "mxfs", "module_path": "mxfs.kv.adapters.sglang",
        "class_name": "MxfsHiCacheStorage", "interface_v1": 1,
        "mount": "/mnt/kv", "namespace": "sglang", "prefill_tokens_per_s": 20000}'

Keys are SGLang's page hashes with the model and parallel shard appended exactly as
its own file backend (HiCacheFile) does: tensor, pipeline, attention context and
decode context parallel ranks, so ranks and models never share chunks by mistake,
and a hybrid model's extra pools (Mamba, SWA, DSA...) are stored as `key.{pool}`
through the v2 interface.

With "prefill_tokens_per_s" (the instance's prefill rate, tokens a second), a lookup
reports only the hit pages that read faster than they compute, by the store's reuse
policy (`mxfs.kv.reuse_policy`: the read rate measured from this backend's gets), so
a slow pool never makes a request slower than recomputing it: SGLang loads what
`batch_exists` reports and prefills the rest. Computing a page is taken to cost the
same at any position (the rate given), which underestimates long contexts'
attention: the policy then leans to recomputing, never to a read that loses.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from typing import TYPE_CHECKING, Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from mxfs.kv.kvstore import KVStore, default_namespace, page_cache_option
from mxfs.kv.reuse_policy import per_token_policy, prefill_rate

if TYPE_CHECKING:
    from sglang.srt.mem_cache.hicache_storage import PoolTransfer, PoolTransferResult

log = logging.getLogger("mxfs.kv.sglang")

# At most this many bytes of pages (staging rows or page copies) go in one store call.
STAGE_BYTES = 64 << 20


def storage_suffixes(config: HiCacheStorageConfig) -> tuple[str, str]:
    """(config_suffix, tp_config_suffix) as SGLang's HiCacheFile makes them.

    config_suffix goes on KV keys (MLA KV is replicated across TP ranks, so it has no
    TP rank); tp_config_suffix on TP-sharded state (Mamba) even under MLA.  Fields that
    older SGLang versions lack take their defaults."""
    tp_rank, tp_size = config.tp_rank, config.tp_size
    pp_rank, pp_size = getattr(config, "pp_rank", 0), getattr(config, "pp_size", 1)
    cp_rank, cp_size = getattr(config, "attn_cp_rank", 0), getattr(config, "attn_cp_size", 1)
    model = "-".join(config.model_name.split("/")) if config.model_name else ""
    shard = f"_{pp_size}_{pp_rank}" if pp_size > 1 else ""
    if cp_size > 1:  # each context-parallel rank holds its own slice of every page
        shard += f"_cp{cp_rank}_{cp_size}"
    tp_suffix = f"_{model}_{tp_rank}_{tp_size}{shard}"
    suffix = f"_{model}{shard}" if getattr(config, "is_mla_model", False) else tp_suffix
    dcp_size = getattr(config, "dcp_size", 1) or 1
    if dcp_size > 1:
        dcp = (f"_tp{tp_size}_dcp{getattr(config, 'dcp_rank', 0)}_{dcp_size}"
               f"_page{getattr(config, 'logical_page_size', None)}")
        suffix += dcp
        tp_suffix += dcp
    return suffix, tp_suffix


def layout_part(pool: Any, default: str) -> str:
    """What a host pool's pages are, for their keys: the order of their bytes (its
    layout: layer first, page first, page first for direct transfers) and their logical
    dtype (the device pool's: fp8 pools store as uint8)."""
    layout = getattr(pool, "layout", None)
    dtype = getattr(getattr(pool, "device_pool", None), "dtype", None) or \
        getattr(pool, "dtype", None)
    if layout is None:
        return default
    return f"_{layout}" + (f"_{str(dtype).removeprefix('torch.')}" if dtype is not None
                           else "")


def _storages(pool: Any) -> set[int]:
    """Where the host pool's own buffers live (their storages' addresses)."""
    ptrs = set()
    for value in vars(pool).values():
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                if storage.nbytes():
                    ptrs.add(storage.data_ptr())
    return ptrs


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
                             shared=bool(extra.get("shared")),
                             page_cache=page_cache_option(extra.get("page_cache")))
        self.prefill_rate = prefill_rate(extra.get("prefill_tokens_per_s"),
                                         "mxfs HiCache backend")
        self.config_suffix, self.tp_config_suffix = storage_suffixes(storage_config)
        self.suffix = self.config_suffix
        # The bytes' order and dtype, on every key (`layout_part`): HiCacheFile's suffixes
        # name neither, and a page stored by a page-first pool read into a layer-first one
        # (or fp16 into bf16) was a hit, its bytes permuted, without a word.
        self.layout_part = "_page_first" if getattr(storage_config, "is_page_first_layout",
                                                    False) else "_layer_first"
        self._parts: dict[str, str] = {}  # extra pools' (`register_mem_host_pool_v2`)
        self.mem_pool_host: Any = None
        self._direct: dict[int, tuple[Any, bool]] = {}  # id(pool) -> (pool, pages are views)
        self._local = threading.local()  # each thread's staging pages

    # ---- keys, as HiCacheFile makes them ----------------------------------------------

    def _get_suffixed_key(self, key: str) -> str:
        # Mamba state is TP-sharded even when the model's MLA KV is replicated.
        part = self._parts.get(key.rpartition(".")[2], self.layout_part) if "." in key \
            else self.layout_part  # (an extra pool's pages: that pool's layout)
        if key.endswith(".mamba"):
            return key + self.tp_config_suffix + part
        return key + self.config_suffix + part

    _k = _get_suffixed_key

    @staticmethod
    def _log_key(pool_name: Any, key: str) -> str:
        return key if pool_name == "kv" else f"{key}.{pool_name}"

    def _get_component_key(self, key: str, component_name: Any = None) -> str:
        if component_name is None or component_name in ("__default__", "kv"):
            return self._get_suffixed_key(key)
        return self._get_suffixed_key(self._log_key(component_name, key))

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
        return all(self._put([self._k(k) for k in keys], list(values)))

    def _put(self, keys: list[str], values: list[Any]) -> list[bool]:
        """One store call; True for each page in storage after it (stored, or already there)."""
        try:
            self.store.batch_put(keys, values)
            return [True] * len(keys)
        except OSError as e:
            log.warning("mxfs HiCache: %d pages not stored: %s", len(keys), e)
            return [False] * len(keys)

    def exists(self, key: str) -> bool:
        return self.store.exists(self._k(key))

    def batch_exists(self, keys: list[str],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """The hit pages from the first; with a prefill rate, only those worth reading."""
        stored = [self._k(k) for k in keys]
        policy = self.store.policy
        if policy is None:
            return self.store.batch_exists(stored)
        held = extra_info.prefix_keys if extra_info is not None else None
        have = len(held or ()) * policy.chunk_tokens  # (the instance holds those pages)
        return self.store.prefix_to_read(stored, have + len(keys) * policy.chunk_tokens, have)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = str(getattr(host_pool_name, "value", host_pool_name))
        self._parts[name] = layout_part(host_pool, self.layout_part)

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """The host pool, whose pages say what a page holds: its tokens and bytes, the
        reuse policy's units."""
        super().register_mem_pool_host(mem_pool_host)
        self.layout_part = layout_part(mem_pool_host, self.layout_part)
        if self.prefill_rate is not None:
            page = mem_pool_host.get_dummy_flat_data_page()
            self.store.policy = per_token_policy(
                int(mem_pool_host.page_size), page.numel() * page.element_size(),
                self.prefill_rate)

    # ---- host pool pages ----------------------------------------------------------------

    def _pages_are_views(self, pool: Any, index: int) -> bool:
        """Whether the pool's flat pages are contiguous views of its own buffers (page-first
        layouts), so chunks can be read straight into them."""
        known = self._direct.get(id(pool))
        if known is None or known[0] is not pool:
            page = pool.get_data_page(index, flat=True)
            direct = (isinstance(page, torch.Tensor) and page.device.type == "cpu"
                      and page.numel() > 0 and page.is_contiguous()
                      and page.untyped_storage().data_ptr() in _storages(pool))
            known = self._direct[id(pool)] = (pool, direct)
        return known[1]

    def _staging(self, like: torch.Tensor, rows: int) -> torch.Tensor:
        stage = getattr(self._local, "stage", None)
        if (stage is None or stage.dtype != like.dtype or stage.device != like.device
                or stage.shape[1] != like.numel() or stage.shape[0] < rows):
            stage = self._local.stage = torch.empty((rows, like.numel()), dtype=like.dtype,
                                                    device=like.device)
        return stage

    def _get_into(self, keys: list[str], outs: list[Any]) -> list[bool]:
        try:
            return [bool(ok) for ok in self.store.batch_get(keys, outs)]
        except (OSError, ValueError) as e:
            log.warning("mxfs HiCache: %d pages not read: %s", len(keys), e)
            return [False] * len(keys)

    def _read_pages(self, pool: Any, keys: list[str], offsets: list[int]) -> list[bool]:
        """Chunks `keys` (stored keys) into the pool's pages at `offsets`."""
        if not keys:
            return []
        if self._pages_are_views(pool, offsets[0]):  # zero-copy: into the pool itself
            return self._get_into(keys, [pool.get_data_page(o, flat=True) for o in offsets])
        dummy = pool.get_dummy_flat_data_page()
        step = max(1, min(len(keys), STAGE_BYTES // max(1, dummy.numel() * dummy.element_size())))
        stage = self._staging(dummy, step)
        results: list[bool] = []
        for start in range(0, len(keys), step):
            part = keys[start:start + step]
            got = self._get_into(part, list(stage[:len(part)]))
            for j, ok in enumerate(got):
                if ok:
                    pool.set_from_flat_data_page(offsets[start + j], stage[j])
            results += got
        return results

    def _write_pages(self, pool: Any, keys: list[str], offsets: list[int]) -> list[bool]:
        """The pool's pages at `offsets` stored under `keys`, one result per page."""
        results: list[bool] = []
        part_keys: list[str] = []
        part_pages: list[torch.Tensor] = []
        size = 0
        for key, offset in zip(keys, offsets, strict=True):
            page = pool.get_data_page(offset, flat=True).contiguous()
            nbytes = page.numel() * page.element_size()
            if part_keys and size + nbytes > STAGE_BYTES:
                results += self._put(part_keys, part_pages)
                part_keys, part_pages, size = [], [], 0
            part_keys.append(key)
            part_pages.append(page)
            size += nbytes
        if part_keys:
            results += self._put(part_keys, part_pages)
        return results

    @staticmethod
    def _offsets(keys: list[str], host_indices: torch.Tensor | None, page_size: int,
                 what: str, name: Any) -> list[int] | None:
        expected = len(keys) * page_size
        got = host_indices.numel() if host_indices is not None else 0
        if host_indices is None or got != expected:
            log.error("%s indices length mismatch for %s: expected %s, got %s",
                      what, name, expected, got)
            return None
        return [int(host_indices[i * page_size]) for i in range(len(keys))]

    # ---- the zero-copy (host pool page) interface -------------------------------------

    def _v1_offsets(self, keys: list[str], host_indices: torch.Tensor, what: str
                    ) -> list[int] | None:
        # Each key's tokens in host_indices (the logical page, also under DCP).
        per_page = host_indices.numel() // len(keys) if keys else 0
        return self._offsets(keys, host_indices, max(1, per_page), what, "kv")

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        offsets = self._v1_offsets(keys, host_indices, "batch_get_v1")
        if offsets is None:
            return [False] * len(keys)
        return self._read_pages(self.mem_pool_host, [self._k(k) for k in keys], offsets)

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        offsets = self._v1_offsets(keys, host_indices, "batch_set_v1")
        if offsets is None:
            return [False] * len(keys)
        return self._write_pages(self.mem_pool_host, [self._k(k) for k in keys], offsets)

    # ---- the hybrid-model (several host pools) interface ----------------------------

    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None
                        ) -> PoolTransferResult:
        from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransferResult

        transfers = pool_transfers or []
        wanted = [self._get_component_key(k) for k in keys]
        for t in transfers:
            wanted += [self._get_component_key(k, t.name) for k in keys]
        wanted = list(dict.fromkeys(wanted))
        present = {k for k, p in zip(wanted, self.store.exists_many(wanted), strict=True) if p}

        def has(i: int, name: Any) -> bool:
            return self._get_component_key(keys[i], name) in present

        # Longest contiguous KV prefix present in storage.
        kv_pages = next((i for i in range(len(keys)) if not has(i, None)), len(keys))
        hit_count: dict[str, int] = {PoolName.KV: kv_pages} if kv_pages else {}
        restorable = list(range(1, kv_pages + 1))
        for t in transfers:
            if not restorable:
                break
            name = t.name
            if t.hit_policy == "all_pages":
                boundary = next((i for i in range(kv_pages) if not has(i, name)), kv_pages)
                pool_restorable = set(range(1, boundary + 1))
            elif t.hit_policy == "trailing_pages":
                trailing = max(1, len(t.keys) if t.keys else 1)
                pool_restorable = {n for n in range(1, kv_pages + 1)
                                   if all(has(i, name) for i in range(max(0, n - trailing), n))}
                boundary = max(pool_restorable, default=0)
            else:
                raise ValueError(f"Unsupported pool hit policy: {t.hit_policy}")
            if boundary:
                hit_count[name] = boundary
            restorable = [p for p in restorable if p in pool_restorable]
        return PoolTransferResult(restorable[-1] if restorable else 0, hit_count, restorable)

    def _batch_io_v2(self, transfers: list[PoolTransfer], write: bool) -> dict[str, list[bool]]:
        what = "batch_set_v2" if write else "batch_get_v2"
        results: dict[str, list[bool]] = {}
        for t in transfers:
            keys = t.keys or []
            pool = getattr(self, "registered_pools", {}).get(t.name)
            if pool is None:
                log.error("%s: no host pool registered for %s", what, t.name)
                results[t.name] = [False] * len(keys)
                continue
            page_size = getattr(pool, "page_size", 1) or 1
            offsets = self._offsets(keys, t.host_indices, page_size, what, t.name)
            if offsets is None:
                results[t.name] = [False] * len(keys)
                continue
            stored = [self._get_suffixed_key(self._log_key(t.name, k)) for k in keys]
            results[t.name] = (self._write_pages if write else self._read_pages)(
                pool, stored, offsets)
        return results

    def batch_get_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        return self._batch_io_v2(transfers, write=False)

    def batch_set_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        return self._batch_io_v2(transfers, write=True)

    def clear(self) -> None:
        self.store.clear()

    def get_stats(self) -> dict[str, Any]:
        """The namespace's stats from the daemon (zeros before the first put)."""
        try:
            return dict(self.store.usage())
        except OSError as e:
            if e.errno != errno.ENOENT:
                raise
            return {"namespace": self.store.namespace, "chunks": 0, "bytes": 0, "hits": 0,
                    "misses": 0, "puts": 0, "evictions": 0}

    def close(self) -> None:
        self.store.close()
