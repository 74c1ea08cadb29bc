"""The KV stores an inference engine would use instead of mxfs, through the engines' own
interfaces, beside mxfs's adapters for the same interfaces.  Used by tools/bench_kv.py.

Every arm stores the same chunks in the same batches, then looks them up and reads
them back; each batch's bytes are put into the engine's memory (host pool pages, memory
objects, offload-region rows) before its clock starts and compared with what was
stored after it stops, so the figures are the engines' storage calls alone and every
chunk is checked byte for byte.

  SGLang HiCache     StorageBackendFactory backends on a host pool (page-first pages):
                     mxfs's "dynamic" backend with interface_v1 (batch_set_v1 /
                     batch_get_v1 straight into the pool, as the cache controller calls
                     it); HiCacheFile ("file") through the controller's generic path
                     (batch_set of flat pages; batch_get into dummy pages, then
                     set_from_flat_data_page); both looked up with batch_exists
  LMCache            mxfs's L2 adapter and LMCache's "fs" L2 adapter, built by its
                     adapter registry from the --l2-adapter JSON, driven through tasks
                     and event descriptors (store, lookup-and-lock + unlock, load);
                     LMCache's LocalDiskBackend (the engine's local_disk storage
                     backend: batched_submit_put_task, contains, batched_get_blocking)
  vLLM               the tiering offload spec with mxfs's tier or vLLM's file-system
                     tier ("fs") behind its CPU tier: stores cascade from the CPU rows;
                     a fresh engine's lookups promote chunks back (its "get": lookup
                     until every key hits, the reads included)

An arm whose engine or class does not import is skipped with the reason.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import select
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from mxfs.kv import KVStore

POLL = 0.0002  # seconds between polls of an engine's completions
TOKENS = 64  # tokens in an SGLang page (the page's bytes are the chunk's)
MODEL = "Qwen/Qwen2.5-32B"


def quiet() -> None:
    """The engines' INFO logging off, unless asked for (before they are imported)."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")


@dataclass
class Ctx:
    """What every arm of one chunk size and round shares."""

    size: int  # bytes a chunk
    count: int  # chunks
    batch: int  # chunks a call
    variants: list[torch.Tensor]  # uint8 contents; chunk c holds variants[c % len]
    mount: str
    folder: str  # this arm's own folder (plain arms) or scratch
    namespace: str  # this arm's own KV namespace (mxfs arms)
    tag: int  # this round: keeps keys apart across rounds

    def content(self, c: int) -> torch.Tensor:
        return self.variants[c % len(self.variants)]

    def batches(self) -> list[list[int]]:
        return [list(range(b, min(b + self.batch, self.count)))
                for b in range(0, self.count, self.batch)]


class Failed(Exception):
    """An arm's call reported failure, or read back other bytes."""


_DIGESTS: dict[int, tuple[torch.Tensor, int]] = {}


def holds(got: Any, want: torch.Tensor) -> bool:
    """Whether `got` (a tensor or a buffer) holds exactly the bytes of `want`.

    By xxh3 (15 GB/s here, against 2 GB/s for a byte compare of a memoryview): the
    checks run between timed calls, and while they run a capped rig's block-I/O
    throttle keeps adding to the budget of the next call, so a slow check would
    make every arm look faster than its drives."""
    view = got.reshape(-1).view(torch.uint8).numpy().data if isinstance(got, torch.Tensor) \
        else memoryview(got).cast("B")
    if id(want) not in _DIGESTS:  # (the tensor is held, so its id is not reused)
        _DIGESTS[id(want)] = (want, xxhash.xxh3_64_intdigest(want.numpy().data))
    return len(view) == want.numel() and \
        xxhash.xxh3_64_intdigest(view) == _DIGESTS[id(want)][1]


def differ(what: str, c: int, got: torch.Tensor, want: torch.Tensor) -> None:
    if not holds(got, want):
        raise Failed(f"{what}: chunk {c} read back other bytes")


class Driver:
    """One arm on one chunk size: puts, lookups, gets of a batch of chunk ids, each
    returning the seconds of the engine's own calls."""

    def put(self, chunks: list[int]) -> float:
        raise NotImplementedError

    def exists(self, chunks: list[int]) -> float | None:
        return None  # None: the engine has no separate lookup

    def begin_get(self) -> None:
        """Before a pass of gets (untimed)."""

    def get(self, chunks: list[int]) -> float:
        raise NotImplementedError

    def close(self) -> None:
        pass


@dataclass
class Arm:
    key: str
    engine: str
    label: str
    mxfs: bool
    needs: tuple[str, ...]  # modules that must import
    make: Callable[[Ctx], Driver]

    def missing(self) -> str | None:
        """Why the arm cannot run here, or None."""
        import importlib

        for mod in self.needs:
            try:
                importlib.import_module(mod)
            except Exception as e:  # noqa: BLE001 - any failure to import skips the arm
                return f"{mod} does not import: {type(e).__name__}: {e}"
        return None


def evict(mount: str, namespace: str) -> None:
    """Drop an mxfs arm's chunks (its namespace) for the next round."""
    with KVStore(mount, namespace) as kv:
        kv.clear()


# ---- SGLang ------------------------------------------------------------------------------


class HostPool:
    """The fields and methods of SGLang's host KV pools (HostKVCache) that the storage
    paths use, on one page-first buffer: a page is a contiguous run of `TOKENS` rows, so
    its flat page is a view, as in MHATokenToKVPoolHost's page-first layouts."""

    def __init__(self, pages: int, page_bytes: int) -> None:
        self.page_size, self.layout = TOKENS, "page_first"
        self.width = page_bytes // (TOKENS * 2)
        self.kv_buffer = torch.zeros((pages * TOKENS, self.width), dtype=torch.bfloat16)
        self.pages = self.kv_buffer.view(torch.uint8).view(pages, page_bytes)

    # (an index is a 0-d tensor where SGLang's controllers index a tensor of slots)
    def _page(self, index: int | torch.Tensor) -> torch.Tensor:
        i = int(index)
        return self.kv_buffer[i:i + self.page_size]

    def get_data_page(self, index: int | torch.Tensor, flat: bool = True) -> torch.Tensor:
        return self._page(index).flatten() if flat else self._page(index)

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(self.page_size * self.width, dtype=self.kv_buffer.dtype)

    def set_from_flat_data_page(self, index: int | torch.Tensor, page: torch.Tensor) -> None:
        view = self._page(index)
        view[...] = page.view(view.shape)


def sglang_config(extra: dict[str, Any]) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name=MODEL, extra_config=extra)


class SGLang(Driver):
    def __init__(self, ctx: Ctx, ours: bool) -> None:
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

        from mxfs.kv.keys import sglang_hashes

        self.ctx, self.ours = ctx, ours
        os.environ.pop("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", None)
        if ours:
            extra = {"backend_name": "mxfs", "module_path": "mxfs.kv.adapters.sglang",
                     "class_name": "MxfsHiCacheStorage", "interface_v1": 1,
                     "mount": ctx.mount, "namespace": ctx.namespace}
            self.backend = StorageBackendFactory.create_backend(
                "dynamic", sglang_config(extra), None)
        else:
            self.backend = StorageBackendFactory.create_backend(
                "file", sglang_config({"file_storage_path": ctx.folder}), None)
        self.pool = HostPool(2 * ctx.batch, ctx.size)
        self.backend.register_mem_pool_host(self.pool)
        tokens = list(range(ctx.tag * 10**7, ctx.tag * 10**7 + ctx.count * TOKENS))
        self.keys = sglang_hashes(tokens, TOKENS)

    def _indices(self, first_slot: int, n: int) -> torch.Tensor:
        return torch.arange(first_slot * TOKENS, (first_slot + n) * TOKENS)

    def put(self, chunks: list[int]) -> float:
        for j, c in enumerate(chunks):
            self.pool.pages[j].copy_(self.ctx.content(c))
        keys = [self.keys[c] for c in chunks]
        idx = self._indices(0, len(chunks))
        start = time.perf_counter()
        if self.ours:  # HiCacheController._page_set_zero_copy
            ok = all(self.backend.batch_set_v1(keys, idx))
        else:  # HiCacheController._generic_page_set
            pages = [self.pool.get_data_page(idx[i * TOKENS]) for i in range(len(keys))]
            ok = self.backend.batch_set(keys, pages)
        took = time.perf_counter() - start
        if not ok:
            raise Failed("batch set failed")
        return took

    def exists(self, chunks: list[int]) -> float:
        keys = [self.keys[c] for c in chunks]
        start = time.perf_counter()
        hits = self.backend.batch_exists(keys)
        took = time.perf_counter() - start
        if hits != len(keys):
            raise Failed(f"batch_exists: {hits} of {len(keys)}")
        return took

    def get(self, chunks: list[int]) -> float:
        b = self.ctx.batch
        self.pool.pages[b:].zero_()
        keys = [self.keys[c] for c in chunks]
        idx = self._indices(b, len(chunks))
        start = time.perf_counter()
        if self.ours:  # HiCacheController._page_get_zero_copy
            results = self.backend.batch_get_v1(keys, idx)
            got = next((i for i, ok in enumerate(results) if not ok), len(keys))
        else:  # HiCacheController._generic_page_get
            dummy = [self.pool.get_dummy_flat_data_page() for _ in keys]
            data = self.backend.batch_get(keys, dummy)
            got = 0
            for i in range(len(keys)):
                if data is None or data[i] is None:
                    break
                self.pool.set_from_flat_data_page(idx[i * TOKENS], data[i])
                got += 1
        took = time.perf_counter() - start
        if got != len(keys):
            raise Failed(f"batch get: {got} of {len(keys)} pages")
        for j, c in enumerate(chunks):
            differ("get", c, self.pool.pages[b + j], self.ctx.content(c))
        return took

    def close(self) -> None:
        if self.ours:
            self.backend.clear()
        close = getattr(self.backend, "close", None)
        if close is not None:
            try:
                close()
            except AttributeError:  # HiCacheFile has nothing to close
                pass


# ---- LMCache -----------------------------------------------------------------------------


def lmcache_adapter(spec: dict[str, Any]) -> Any:
    """An L2 adapter as `lmcache server --l2-adapter JSON` builds it."""
    from lmcache.v1.distributed.l2_adapters import create_l2_adapter_from_registry
    from lmcache.v1.distributed.l2_adapters.config import (
        add_l2_adapters_args,
        parse_args_to_l2_adapters_config,
    )

    parser = argparse.ArgumentParser()
    add_l2_adapters_args(parser)
    args = parser.parse_args(["--l2-adapter", json.dumps(spec)])
    return create_l2_adapter_from_registry(parse_args_to_l2_adapters_config(args).adapters[0])


def chunk_shape(size: int) -> tuple[int, int, int]:
    """A chunk as LMCache lays out KV (K and V, 256 tokens, the rest), in bf16."""
    return (2, 256, size // (2 * 256 * 2))


def wait_for(fd: int, poll: Callable[[], Any]) -> Any:
    """The result `poll` gives once the adapter signals `fd` (LMCache's controllers
    wait on these descriptors)."""
    from lmcache.v1.platform.event_notifier import consume_fd

    deadline = time.monotonic() + 600
    while True:
        got = poll()
        if got is not None:
            return got
        if time.monotonic() > deadline:
            raise Failed("no result in 600 s")
        if select.select([fd], [], [], 0.05)[0]:
            consume_fd(fd)


class LMCacheL2(Driver):
    def __init__(self, ctx: Ctx, ours: bool) -> None:
        from lmcache.v1.distributed.api import ObjectKey
        from lmcache.v1.memory_management import MemoryObjMetadata, TensorMemoryObj

        from mxfs.kv.keys import lmcache_hashes

        self.ctx = ctx
        spec = ({"type": "plugin", "module_path": "mxfs.kv.adapters.lmcache",
                 "class_name": "MxfsL2Adapter",
                 "adapter_params": {"mount": ctx.mount, "namespace": ctx.namespace}}
                if ours else {"type": "fs", "base_path": ctx.folder})
        self.adapter = lmcache_adapter(spec)
        self.buf = torch.zeros((2 * ctx.batch, *chunk_shape(ctx.size)), dtype=torch.bfloat16)
        self.slots = self.buf.view(torch.uint8).view(2 * ctx.batch, ctx.size)
        self.objs = [TensorMemoryObj(t, MemoryObjMetadata(t.shape, t.dtype, 0, ctx.size, 1),
                                     None) for t in self.buf]
        tokens = list(range(ctx.tag * 10**7, ctx.tag * 10**7 + ctx.count * 256))
        self.keys = [ObjectKey(h, MODEL, 0x01000100) for h in lmcache_hashes(tokens)]
        self._stored: dict[int, Any] = {}

    def _store_result(self, task: int) -> Any:
        self._stored.update(self.adapter.pop_completed_store_tasks())
        return self._stored.pop(task, None)

    def put(self, chunks: list[int]) -> float:
        for j, c in enumerate(chunks):
            self.slots[j].copy_(self.ctx.content(c))
        keys = [self.keys[c] for c in chunks]
        start = time.perf_counter()
        task = self.adapter.submit_store_task(keys, self.objs[:len(chunks)])
        result = wait_for(self.adapter.get_store_event_fd(), lambda: self._store_result(task))
        took = time.perf_counter() - start
        if not result.is_successful():
            raise Failed("store task failed")
        return took

    def exists(self, chunks: list[int]) -> float:
        keys = [self.keys[c] for c in chunks]
        start = time.perf_counter()
        task = self.adapter.submit_lookup_and_lock_task(keys, {})
        bits = wait_for(self.adapter.get_lookup_and_lock_event_fd(),
                        lambda: self.adapter.query_lookup_and_lock_result(task))
        self.adapter.submit_unlock(keys)
        took = time.perf_counter() - start
        hits = sum(bits.test(i) for i in range(len(keys)))
        if hits != len(keys):
            raise Failed(f"lookup: {hits} of {len(keys)}")
        return took

    def get(self, chunks: list[int]) -> float:
        b = self.ctx.batch
        self.slots[b:].zero_()
        keys = [self.keys[c] for c in chunks]
        start = time.perf_counter()
        task = self.adapter.submit_load_task(keys, self.objs[b:b + len(chunks)])
        bits = wait_for(self.adapter.get_load_event_fd(),
                        lambda: self.adapter.query_load_result(task))
        took = time.perf_counter() - start
        hits = sum(bits.test(i) for i in range(len(keys)))
        if hits != len(keys):
            raise Failed(f"load: {hits} of {len(keys)}")
        for j, c in enumerate(chunks):
            differ("load", c, self.slots[b + j], self.ctx.content(c))
        return took

    def close(self) -> None:
        self.adapter.close()


class LMCacheDisk(Driver):
    """LMCache's LocalDiskBackend (`local_disk: file://...`, its defaults: buffered files,
    4 I/O threads), with a LocalCPUBackend allocating the read buffers, as in its tests."""

    def __init__(self, ctx: Ctx) -> None:
        from lmcache.utils import CacheEngineKey
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.memory_allocators.ad_hoc_memory_allocator import AdHocMemoryAllocator
        from lmcache.v1.memory_management import MemoryFormat
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
        from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

        from mxfs.kv.keys import lmcache_hashes

        self.ctx = ctx
        gib = max(1.0, 2 * ctx.size * ctx.count / 2**30)
        config = LMCacheEngineConfig.from_defaults(
            chunk_size=256, local_disk=ctx.folder, max_local_disk_size=gib, local_cpu=False,
            max_local_cpu_size=0.1, lmcache_instance_id=f"bench-{uuid.uuid4().hex[:8]}")
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.alloc = AdHocMemoryAllocator(device="cpu")
        self.cpu = LocalCPUBackend(config, memory_allocator=self.alloc, dst_device="cpu")
        self.disk = LocalDiskBackend(config, self.loop, self.cpu, dst_device="cpu")
        shape = torch.Size(chunk_shape(ctx.size))
        self.objs = [self.alloc.allocate(shape, torch.bfloat16, fmt=MemoryFormat.KV_2LTD)
                     for _ in range(ctx.batch)]
        tokens = list(range(ctx.tag * 10**7, ctx.tag * 10**7 + ctx.count * 256))
        self.keys = [CacheEngineKey(MODEL, 1, 0, int.from_bytes(h[:8], "little"),
                                    torch.bfloat16) for h in lmcache_hashes(tokens)]

    @staticmethod
    def _bytes(obj: Any) -> torch.Tensor:
        return obj.tensor.reshape(-1).view(torch.uint8)

    def put(self, chunks: list[int]) -> float:
        for j, c in enumerate(chunks):
            self._bytes(self.objs[j]).copy_(self.ctx.content(c))
        keys = [self.keys[c] for c in chunks]
        done = threading.Semaphore(0)
        start = time.perf_counter()
        self.disk.batched_submit_put_task(keys, self.objs[:len(chunks)],
                                          on_complete_callback=lambda _k: done.release())
        for _ in keys:
            if not done.acquire(timeout=600):
                raise Failed("put tasks did not complete")
        return time.perf_counter() - start

    def exists(self, chunks: list[int]) -> float:
        keys = [self.keys[c] for c in chunks]
        start = time.perf_counter()
        hits = sum(self.disk.contains(k, pin=True) for k in keys)  # the engine's lookup
        self.disk.touch_cache()
        for k in keys:
            self.disk.unpin(k)
        took = time.perf_counter() - start
        if hits != len(keys):
            raise Failed(f"contains: {hits} of {len(keys)}")
        return took

    def get(self, chunks: list[int]) -> float:
        keys = [self.keys[c] for c in chunks]
        start = time.perf_counter()
        got = self.disk.batched_get_blocking(keys)
        took = time.perf_counter() - start
        try:
            for c, obj in zip(chunks, got, strict=True):
                if obj is None:
                    raise Failed(f"get: chunk {c} missing")
                differ("get", c, self._bytes(obj), self.ctx.content(c))
        finally:
            for obj in got:
                if obj is not None:
                    obj.ref_count_down()
        return took

    def close(self) -> None:
        self.disk.close()
        for obj in self.objs:
            obj.ref_count_down()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


# ---- vLLM --------------------------------------------------------------------------------


class VllmEngine:
    """One serving instance's scheduler side: vLLM's offloading spec and its tiering
    manager (CPU rows in a shared offload region, the secondary tier behind them)."""

    def __init__(self, ctx: Ctx, extra: dict[str, Any]) -> None:
        from vllm.v1.kv_offload.config import (
            OffloadingCacheConfig,
            OffloadingConfig,
            OffloadingGroupConfig,
            OffloadingModelConfig,
            OffloadingParallelConfig,
        )
        from vllm.v1.kv_offload.factory import OffloadingSpecFactory

        layers = tuple(f"model.layers.{i}.self_attn.attn" for i in range(2))
        config = OffloadingConfig(
            groups=(OffloadingGroupConfig(16, layers, 0),), worker_kv_bytes_per_block=ctx.size,
            enable_kv_cache_events=False,
            extra_config={"cpu_bytes_to_use": 2 * ctx.batch * ctx.size, **extra},
            engine_id=f"mxfs-bench-{uuid.uuid4().hex[:12]}",
            model=OffloadingModelConfig(MODEL, "bfloat16"), cache=OffloadingCacheConfig(16, 1),
            parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, True),
            replicated_layout=False, canonical_layout=False, kv_cache_layout=None)
        self.spec = OffloadingSpecFactory.create_spec(config)
        self.manager: Any = self.spec.get_manager()
        self.row = self.spec.kv_bytes_per_chunk

    def step(self) -> None:
        from vllm.v1.kv_offload.base import ScheduleEndContext

        self.manager.on_schedule_end(ScheduleEndContext((), ()))

    @contextmanager
    def region(self) -> Iterator[memoryview]:
        """The CPU tier's rows as bytes, released afterwards (vLLM closes the region at
        shutdown, which fails while a view of it is left)."""
        with self.manager.primary_tier.get_kv_memoryview().cast("B") as flat:
            yield flat

    def shutdown(self) -> None:
        self.manager.shutdown()


class Vllm(Driver):
    def __init__(self, ctx: Ctx, ours: bool) -> None:
        from vllm.v1.kv_offload.base import make_offload_key

        from mxfs.kv.keys import vllm_hashes

        self.ctx = ctx
        self.extra: dict[str, Any] = (
            {"spec_name": "MxfsOffloadingSpec", "spec_module_path": "mxfs.kv.adapters.vllm",
             "mxfs": {"mount": ctx.mount, "namespace": ctx.namespace}} if ours else
            {"spec_name": "TieringOffloadingSpec",
             "secondary_tiers": [{"type": "fs", "root_dir": ctx.folder}]})
        self.writer = VllmEngine(ctx, self.extra)
        if self.writer.row != ctx.size:
            raise Failed(f"vLLM rows of {self.writer.row} bytes, not {ctx.size}")
        self.reader: VllmEngine | None = None
        tokens = list(range(ctx.tag * 10**7, ctx.tag * 10**7 + ctx.count * 16))
        self.keys = [make_offload_key(h, 0) for h in vllm_hashes(tokens)]

    def _request(self) -> Any:
        from vllm.v1.kv_offload.base import ReqContext

        return ReqContext(req_id=uuid.uuid4().hex)

    def put(self, chunks: list[int]) -> float:
        """As a request that computed these chunks: its GPU rows copied to CPU rows
        (untimed), then complete_store and the manager's cascade to the tier."""
        eng, keys = self.writer, [self.keys[c] for c in chunks]
        ctx = self._request()
        eng.manager.on_new_request(ctx)
        out = eng.manager.prepare_store(keys, ctx)
        if out is None or list(out.keys_to_store) != keys:
            raise Failed("prepare_store did not take every chunk")
        with eng.region() as flat:
            for chunk_id, c in zip(out.store_spec.chunk_ids, chunks, strict=True):
                at = int(chunk_id) * eng.row
                flat[at:at + self.ctx.size] = self.ctx.content(c).numpy().data
        start = time.perf_counter()
        eng.manager.complete_store(keys, ctx)
        eng.manager.on_request_finished(ctx)
        while True:
            eng.step()
            if not eng.manager.has_pending_work():
                break
            time.sleep(POLL)
        return time.perf_counter() - start

    def begin_get(self) -> None:
        """A fresh engine: its CPU tier is empty, so every chunk comes from the tier."""
        if self.reader is not None:
            self.reader.shutdown()
        self.reader = VllmEngine(self.ctx, self.extra)

    def get(self, chunks: list[int]) -> float:
        from vllm.v1.kv_offload.base import LookupResult

        eng, keys = self.reader, [self.keys[c] for c in chunks]
        assert eng is not None
        ctx = self._request()
        start = time.perf_counter()
        eng.manager.on_new_request(ctx)
        while True:
            found = [eng.manager.lookup(k, ctx) for k in keys]
            eng.step()
            if all(r in (LookupResult.HIT, LookupResult.MISS) for r in found):
                break
            time.sleep(POLL)
        took = time.perf_counter() - start
        if any(r != LookupResult.HIT for r in found):
            raise Failed(f"lookup: {found.count(LookupResult.HIT)} of {len(keys)} hit")
        spec = eng.manager.prepare_load(keys, ctx)
        with eng.region() as flat:
            for chunk_id, c in zip(spec.chunk_ids, chunks, strict=True):
                at = int(chunk_id) * eng.row
                if not holds(flat[at:at + self.ctx.size], self.ctx.content(c)):
                    raise Failed(f"load: chunk {c} read back other bytes")
        eng.manager.complete_load(keys, ctx)
        eng.manager.on_request_finished(ctx)
        return took

    def close(self) -> None:
        for eng in (self.writer, self.reader):
            if eng is not None:
                eng.shutdown()


# ---- the arms ----------------------------------------------------------------------------

SGL = ("sglang.srt.mem_cache.hicache_storage", "sglang.srt.mem_cache.storage.backend_factory")
LMC = ("lmcache.v1.distributed.l2_adapters.base",)
VLLM = ("vllm.v1.kv_offload.tiering.base", "vllm.v1.kv_offload.tiering.spec")

ARMS = [
    Arm("sgl_mxfs", "SGLang", "mxfs HiCache backend (interface_v1)", True,
        (*SGL, "mxfs.kv.adapters.sglang"), lambda ctx: SGLang(ctx, True)),
    Arm("sgl_file", "SGLang", "HiCacheFile", False, SGL, lambda ctx: SGLang(ctx, False)),
    Arm("lmc_mxfs", "LMCache", "mxfs L2 adapter", True,
        (*LMC, "mxfs.kv.adapters.lmcache"), lambda ctx: LMCacheL2(ctx, True)),
    Arm("lmc_fs", "LMCache", "fs L2 adapter", False,
        (*LMC, "lmcache.v1.distributed.l2_adapters.fs_l2_adapter"),
        lambda ctx: LMCacheL2(ctx, False)),
    Arm("lmc_disk", "LMCache", "LocalDiskBackend", False,
        ("lmcache.v1.storage_backend.local_disk_backend",), LMCacheDisk),
    Arm("vllm_mxfs", "vLLM", "MxfsOffloadingSpec (mxfs tier)", True,
        (*VLLM, "mxfs.kv.adapters.vllm"), lambda ctx: Vllm(ctx, True)),
    Arm("vllm_fs", "vLLM", "TieringOffloadingSpec, fs tier", False,
        (*VLLM, "vllm.v1.kv_offload.tiering.fs.manager"), lambda ctx: Vllm(ctx, False)),
]


def clean(arm: Arm, ctx: Ctx) -> None:
    """What the arm stored, gone before the next one runs."""
    if arm.mxfs:
        evict(ctx.mount, ctx.namespace)
    shutil.rmtree(ctx.folder, ignore_errors=True)
