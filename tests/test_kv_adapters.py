"""The SGLang backend on SGLang's real base classes, loaded and driven the way SGLang does.

Each engine test skips where its engine is not installed (the engines are not in the
test extras: SGLang alone pulls ~1 GB of triton).  `make test` runs them again in the
engines' virtualenv, `.venv-engines` (tools/install_engines.sh: vLLM's CPU build 0.32.0
with its dependencies, SGLang 0.5.23 and LMCache 0.5.6 with `--no-deps` plus what their
KV storage code imports, pinned by tools/engines-constraints.txt), where nothing may skip.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import Mounted


class HostPool:
    """The methods and fields of SGLang's host pools (HostKVCache) the storage paths use.

    page_first: a page is a contiguous run of the pool's buffer, so its flat page is a
    view (as MHATokenToKVPoolHost's page-first layouts); layer_first: a page spans every
    layer, so its flat page is a copy and restoring takes set_from_flat_data_page."""

    def __init__(self, page_size: int = 64, pages: int = 8, width: int = 32,
                 layout: str = "page_first", dtype: torch.dtype = torch.bfloat16) -> None:
        self.page_size, self.layout, self.width = page_size, layout, width
        self.kv_buffer = torch.zeros((pages * page_size, width) if layout == "page_first"
                                     else (2, pages * page_size, width), dtype=dtype)
        self.restored = 0  # pages put back through set_from_flat_data_page

    def _page(self, index: int) -> torch.Tensor:
        if self.layout == "page_first":
            return self.kv_buffer[index:index + self.page_size]
        return self.kv_buffer[:, index:index + self.page_size]

    def page(self, n: int) -> torch.Tensor:  # page n, for the tests
        return self._page(n * self.page_size)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        return self._page(index).flatten() if flat else self._page(index)

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(self._page(0).numel(), dtype=self.kv_buffer.dtype)

    def set_from_flat_data_page(self, index: int, page: torch.Tensor) -> None:
        self.restored += 1
        view = self._page(index)
        view[...] = page.view(view.shape)


def sglang_config(mount: Mounted | None = None, *, tp_rank: int = 0, tp_size: int = 2,
                  **fields: object) -> object:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    base: dict[str, object] = dict(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
        attn_cp_size=1, is_mla_model=False, enable_storage_metrics=False,
        is_page_first_layout=False, model_name="Qwen/Qwen2.5-32B")
    base.update(fields)
    if mount is not None:
        base["extra_config"] = {
            "backend_name": "mxfs", "module_path": "mxfs.kv.adapters.sglang",
            "class_name": "MxfsHiCacheStorage", "interface_v1": 1,
            "mount": str(mount.path), "namespace": "sgl"}
    return HiCacheStorageConfig(**base)


def sglang_backend(mount: Mounted, **fields: object) -> object:
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    return StorageBackendFactory.create_backend("dynamic", sglang_config(mount, **fields), None)


def test_sglang_backend_loaded_by_the_dynamic_factory(mounted: Mounted) -> None:
    pytest.importorskip("sglang.srt.mem_cache.hicache_storage")
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    from mxfs.kv.adapters.sglang import MxfsHiCacheStorage
    from mxfs.kv.keys import sglang_hashes

    backend = sglang_backend(mounted, tp_rank=0)
    other_rank = sglang_backend(mounted, tp_rank=1)
    assert isinstance(backend, MxfsHiCacheStorage)
    keys = sglang_hashes(list(range(64 * 6)), 64)
    # the generic path: one flat tensor per page
    pages = [torch.full((4096,), i, dtype=torch.bfloat16) for i in range(6)]
    assert backend.batch_set(keys[:4], pages[:4]) is True
    assert backend.batch_exists(keys, HiCacheStorageExtraInfo(prefix_keys=[])) == 4
    assert other_rank.batch_exists(keys) == 0  # another tensor-parallel shard's chunks
    outs = [torch.empty(4096, dtype=torch.bfloat16) for _ in range(5)]
    got = backend.batch_get(keys[:5], outs)
    assert all(torch.equal(got[i], pages[i]) for i in range(4)) and got[4] is None

    # the zero-copy path: pages of the registered host pool, by token index
    pool = HostPool()
    pool.kv_buffer[2 * 64:4 * 64] = torch.randn(2 * 64, 32).bfloat16()
    backend.register_mem_pool_host(pool)
    idx = torch.arange(2 * 64, 4 * 64)
    assert backend.batch_set_v1(keys[4:6], idx) == [True, True]
    want = pool.kv_buffer[2 * 64:4 * 64].clone()
    pool.kv_buffer.zero_()
    assert backend.batch_get_v1(keys[4:6], torch.arange(5 * 64, 7 * 64)) == [True, True]
    assert torch.equal(pool.kv_buffer[5 * 64:7 * 64], want)
    assert backend.get_stats()["chunks"] == 6
    backend.close()
    other_rank.close()


def test_sglang_clear_and_stats_before_and_after_the_first_put(mounted: Mounted) -> None:
    """SGLang calls clear() when a user flushes the cache, also before anything was
    stored: the namespace is then empty, not an error; after puts, clear() empties it."""
    pytest.importorskip("sglang.srt.mem_cache.hicache_storage")
    from mxfs.kv.keys import sglang_hashes

    backend = sglang_backend(mounted, tp_rank=0)
    backend.clear()
    assert backend.get_stats()["chunks"] == 0
    keys = sglang_hashes(list(range(64 * 3)), 64)
    pages = [torch.full((4096,), i, dtype=torch.bfloat16) for i in range(3)]
    assert backend.batch_set(keys, pages) is True
    assert backend.batch_exists(keys) == 3
    backend.clear()
    assert backend.batch_exists(keys) == 0 and backend.get_stats()["chunks"] == 0
    backend.close()


def test_sglang_config_reads_through_the_page_cache_when_asked(mounted: Mounted) -> None:
    pytest.importorskip("sglang.srt.mem_cache.hicache_storage")
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    for asked in (False, True, None):  # (None: not set, the store's own rule)
        config = sglang_config(mounted)
        if asked is not None:
            config.extra_config["page_cache"] = asked
        backend = StorageBackendFactory.create_backend("dynamic", config, None)
        assert backend.store.page_cache is asked
        backend.close()


def test_sglang_reports_only_the_hits_that_read_faster_than_they_compute(
        mounted: Mounted) -> None:
    """With the instance's prefill rate given, a lookup reports the hit pages that the
    pool, at the rate this backend's gets measured, delivers faster than the instance
    would compute them: all of them for a slow instance, none for an instance that
    computes faster than anything reads (but one in 16 lookups, to see the pool again),
    every hit before any get measured the pool; a rate that is not one is refused."""
    pytest.importorskip("sglang.srt.mem_cache.hicache_storage")
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from mxfs.kv.keys import sglang_hashes
    from mxfs.kv.reuse_policy import PROBE_EVERY

    keys = sglang_hashes(list(range(64 * 4)), 64)
    seen = {}
    for name, rate in (("slow", 1e-3), ("fast", 1e15)):
        config = sglang_config(mounted)
        config.extra_config["prefill_tokens_per_s"] = rate
        backend = StorageBackendFactory.create_backend("dynamic", config, None)
        pool = HostPool()
        backend.register_mem_pool_host(pool)
        pool.kv_buffer.normal_()
        if name == "slow":
            assert backend.batch_set_v1(keys, torch.arange(0, 4 * 64)) == [True] * 4
        assert backend.batch_exists(keys) == 4  # the pool not measured yet: every hit
        assert backend.batch_get_v1(keys, torch.arange(0, 4 * 64)) == [True] * 4
        held = HiCacheStorageExtraInfo(prefix_keys=keys[:1])  # (one page held already)
        seen[name] = [backend.batch_exists(keys[1:], held) for _ in range(PROBE_EVERY)]
        backend.close()
    assert seen["slow"] == [3] * PROBE_EVERY
    assert seen["fast"] == [0] * (PROBE_EVERY - 1) + [1]
    for bad in ("fast", 0, -5, float("inf")):
        config = sglang_config(mounted)
        config.extra_config["prefill_tokens_per_s"] = bad
        with pytest.raises(ValueError, match="prefill_tokens_per_s"):
            StorageBackendFactory.create_backend("dynamic", config, None)


def test_sglang_lookups_before_any_store_are_misses(mounted: Mounted) -> None:
    pytest.importorskip("sglang.srt.mem_cache.hicache_storage")
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from mxfs.kv.keys import sglang_hashes

    config = sglang_config(mounted)
    config.extra_config["namespace"] = "sgl-fresh"  # nobody has stored in it: no namespace
    backend = StorageBackendFactory.create_backend("dynamic", config, None)
    keys = sglang_hashes(list(range(64 * 3)), 64)
    assert backend.exists(keys[0]) is False and backend.batch_exists(keys) == 0
    hit = backend.batch_exists_v2(keys, [PoolTransfer(PoolName.INDEXER)])
    assert (hit.kv_hit_pages, hit.extra_pool_hit_pages) == (0, {})
    assert backend.batch_get(keys[:2], [torch.empty(4096, dtype=torch.bfloat16)] * 2) == \
        [None, None]
    backend.register_mem_pool_host(HostPool())
    assert backend.batch_get_v1(keys[:2], torch.arange(0, 128)) == [False, False]
    # a page of another size than its target is a miss, the others served
    pages = [torch.full((4096,), i, dtype=torch.bfloat16) for i in range(3)]
    assert backend.batch_set(keys, pages) is True
    outs = [torch.empty(4096, dtype=torch.bfloat16), torch.empty(4097, dtype=torch.bfloat16),
            torch.empty(4096, dtype=torch.bfloat16)]
    got = backend.batch_get(keys, outs)
    assert torch.equal(got[0], pages[0]) and got[1] is None and torch.equal(got[2], pages[2])
    backend.close()


def test_sglang_key_suffixes_match_hicache_file(mounted: Mounted, tmp_path: object,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("sglang.srt.mem_cache.hicache_storage")
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile

    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(tmp_path))
    cases: list[dict[str, object]] = [
        dict(tp_rank=1, tp_size=2),                                      # plain TP
        dict(tp_rank=0, tp_size=1, model_name=None),                     # no model name
        dict(tp_rank=1, tp_size=2, pp_rank=1, pp_size=2),                # pipeline stages
        dict(tp_rank=0, tp_size=1, attn_cp_rank=1, attn_cp_size=2),      # attention CP
        dict(tp_rank=1, tp_size=2, pp_rank=1, pp_size=4, attn_cp_rank=3, attn_cp_size=4),
        dict(tp_rank=1, tp_size=4, is_mla_model=True),                   # MLA
        dict(tp_rank=1, tp_size=2, is_mla_model=True, attn_cp_rank=1, attn_cp_size=2),
        dict(tp_rank=3, tp_size=4, is_mla_model=True, dcp_size=2, dcp_rank=1,
             logical_page_size=64),                                      # MLA with DCP
        dict(tp_rank=2, tp_size=4, is_mla_model=True, dcp_size=2, dcp_rank=0,
             logical_page_size=128, pp_rank=0, pp_size=2),
    ]
    suffixes = set()
    for fields in cases:
        ours = sglang_backend(mounted, **fields)
        ref = HiCacheFile(sglang_config(None, **fields))
        assert (ours.config_suffix, ours.tp_config_suffix) == \
            (ref.config_suffix, ref.tp_config_suffix), fields
        for key in ("0a1b2c", "0a1b2c.mamba", "0a1b2c.swa", "0a1b2c.indexer"):
            # (HiCacheFile's, and the pages' layout: `layout_part`)
            assert ours._get_suffixed_key(key) == ref._get_suffixed_key(key) + \
                ours.layout_part, (fields, key)
            assert ours._get_component_key("0a1b2c", key.partition(".")[2] or None) == \
                ref._get_component_key("0a1b2c", key.partition(".")[2] or None) + \
                ours.layout_part
        suffixes.add(ours.config_suffix)
        ours.close()
    assert len(suffixes) == len(cases)  # no two of these shards share a key


def test_sglang_v1_pages_round_trip_in_place_or_staged(mounted: Mounted,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("sglang.srt.mem_cache.hicache_storage")
    from mxfs.kv.adapters import sglang as adapter
    from mxfs.kv.keys import sglang_hashes

    keys = sglang_hashes(list(range(16 * 5)), 16)
    for layout in ("page_first", "layer_first"):  # (one model: a layout's pages are
        backend = sglang_backend(mounted, tp_rank=0, model_name="m/one")  # its own)
        pool = HostPool(page_size=16, pages=10, width=24, layout=layout)
        pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape).bfloat16())
        backend.register_mem_pool_host(pool)
        want = [pool.page(n).clone() for n in range(4)]
        assert backend.batch_set_v1(keys[:4], torch.arange(0, 4 * 16)) == [True] * 4
        pool.kv_buffer.zero_()
        if layout == "page_first":  # read straight into the pool's pages: no staging
            monkeypatch.setattr(pool, "get_dummy_flat_data_page", None)
        else:  # two pages a store call, through the one staging buffer
            monkeypatch.setattr(adapter, "STAGE_BYTES", 2 * 16 * 24 * 2 * 2)
        # pages 5..9 of the pool get keys 0..4; key 4 was never stored
        got = backend.batch_get_v1(keys[:5], torch.arange(5 * 16, 10 * 16))
        assert got == [True, True, True, True, False], layout
        for n in range(4):
            assert torch.equal(pool.page(5 + n), want[n]), (layout, n)
        assert not any(pool.page(n).any() for n in (0, 1, 2, 3, 4, 9))
        assert pool.restored == (0 if layout == "page_first" else 4)
        monkeypatch.undo()
        backend.close()


def test_sglang_v1_set_results_per_page(mounted: Mounted, monkeypatch: pytest.MonkeyPatch,
                                        caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("sglang.srt.mem_cache.hicache_storage")
    from mxfs.kv.adapters import sglang as adapter
    from mxfs.kv.keys import sglang_hashes

    keys = sglang_hashes(list(range(8 * 6)), 8)
    backend = sglang_backend(mounted, tp_rank=0)
    pool = HostPool(page_size=8, pages=6, width=16)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape).bfloat16())
    backend.register_mem_pool_host(pool)
    assert backend.batch_set_v1(keys[:2], torch.arange(0, 16)) == [True, True]
    # pages already stored count as stored, one result for each page
    assert backend.batch_set_v1(keys[:4], torch.arange(0, 32)) == [True] * 4

    # a page a store call; the call holding key 4 fails (say the pool is out of space)
    monkeypatch.setattr(adapter, "STAGE_BYTES", 1)
    put = backend.store.batch_put
    bad = backend._k(keys[4])

    def failing_put(ks: list[str], bufs: list[object]) -> list[bool]:
        if bad in ks:
            raise OSError(28, "No space left on device")
        return put(ks, bufs)

    monkeypatch.setattr(backend.store, "batch_put", failing_put)
    with caplog.at_level("WARNING", logger="mxfs.kv.sglang"):
        assert backend.batch_set_v1(keys[3:6], torch.arange(24, 48)) == [True, False, True]
    assert "1 pages not stored" in caplog.text
    assert backend.store.exists_many([backend._k(k) for k in keys]) == [True] * 4 + [False, True]
    with caplog.at_level("ERROR", logger="mxfs.kv.sglang"):  # indices not a page a key
        assert backend.batch_set_v1(keys[:2], torch.arange(0, 13)) == [False, False]
    assert "length mismatch" in caplog.text
    backend.close()


def test_sglang_v2_extra_pools_match_hicache_file(mounted: Mounted, tmp_path: object,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("sglang.srt.mem_cache.hicache_storage")
    from sglang.srt.mem_cache.hicache_storage import (
        HiCacheFile,
        PoolHitPolicy,
        PoolName,
        PoolTransfer,
    )

    from mxfs.kv.keys import sglang_hashes

    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(tmp_path))
    # MLA: KV keys shared across TP ranks, the Mamba state sharded by TP rank
    fields: dict[str, object] = dict(tp_rank=1, tp_size=2, is_mla_model=True)
    keys = sglang_hashes(list(range(8 * 6)), 8)
    ours, ref = sglang_backend(mounted, **fields), HiCacheFile(sglang_config(None, **fields))
    runs = []
    for backend in (ours, ref):
        kv = HostPool(page_size=8, pages=8, width=16)
        indexer = HostPool(page_size=8, pages=8, width=4, layout="layer_first",
                           dtype=torch.float32)                       # a DSA-like pool
        mamba = HostPool(page_size=1, pages=8, width=40, layout="layer_first",
                         dtype=torch.uint8)                           # a state a page
        torch.manual_seed(0)
        for p in (kv, indexer, mamba):
            p.kv_buffer.copy_(torch.randint(0, 100, p.kv_buffer.shape).to(p.kv_buffer.dtype))
        backend.register_mem_pool_host(kv)
        backend.register_mem_host_pool_v2(kv, PoolName.KV)
        backend.register_mem_host_pool_v2(indexer, PoolName.INDEXER)
        backend.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
        # KV for pages 0..5, the indexer for pages 0..3, Mamba states after pages 2 and 5
        sets = backend.batch_set_v2([
            PoolTransfer(PoolName.KV, torch.arange(0, 48), keys=keys[:6]),
            PoolTransfer(PoolName.INDEXER, torch.arange(0, 32), keys=keys[:4]),
            PoolTransfer(PoolName.MAMBA, torch.tensor([2, 5]), keys=[keys[2], keys[5]],
                         hit_policy=PoolHitPolicy.TRAILING_PAGES),
        ])
        trailing = PoolTransfer(PoolName.MAMBA, keys=[keys[5]],
                                hit_policy=PoolHitPolicy.TRAILING_PAGES)
        hits = [backend.batch_exists_v2(keys[:n], [PoolTransfer(PoolName.INDEXER), trailing])
                for n in (6, 3, 2)]
        hits.append(backend.batch_exists_v2(keys, [trailing]))
        hits.append(backend.batch_exists_v2(keys[:6], [PoolTransfer(PoolName.INDEXER)]))
        hits.append(backend.batch_exists_v2(keys[1:], None))
        want = (kv.page(2).clone(), indexer.page(1).clone(), mamba.page(5).clone())
        for p in (kv, indexer, mamba):
            p.kv_buffer.zero_()
        with caplog.at_level("ERROR"):
            gets = backend.batch_get_v2([
                PoolTransfer(PoolName.KV, torch.arange(56, 64), keys=[keys[2]]),
                PoolTransfer(PoolName.INDEXER, torch.arange(48, 64), keys=[keys[1], keys[4]]),
                PoolTransfer(PoolName.MAMBA, torch.tensor([6, 7]), keys=[keys[5], keys[3]]),
                PoolTransfer(PoolName.SWA, None, keys=[keys[0]]),
            ] if backend is ours else [
                PoolTransfer(PoolName.KV, torch.arange(56, 64), keys=[keys[2]]),
                PoolTransfer(PoolName.INDEXER, torch.arange(48, 64), keys=[keys[1], keys[4]]),
                PoolTransfer(PoolName.MAMBA, torch.tensor([6, 7]), keys=[keys[5], keys[3]]),
            ])
            bad = backend.batch_get_v2([PoolTransfer(PoolName.MAMBA, torch.arange(3),
                                                     keys=[keys[2], keys[5]])])
        got = (kv.page(7), indexer.page(6), mamba.page(6))
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), backend
        assert not mamba.page(7).any() and not indexer.page(7).any()
        runs.append((sets, hits, gets, bad))
    (sets, hits, gets, bad), ref_run = runs
    assert (sets, hits, bad) == (ref_run[0], ref_run[1], ref_run[3])
    assert gets == {**ref_run[2], PoolName.SWA: [False]}  # no SWA pool registered
    assert sets == {PoolName.KV: [True] * 6, PoolName.INDEXER: [True] * 4,
                    PoolName.MAMBA: [True, True]}
    # all pages: the indexer stops at 4; trailing: a Mamba state after page 3 or 6 only
    assert [(h.kv_hit_pages, h.extra_pool_hit_pages, h.restorable_prefix_pages)
            for h in hits] == [
        (3, {PoolName.KV: 6, PoolName.INDEXER: 4, PoolName.MAMBA: 6}, [3]),
        (3, {PoolName.KV: 3, PoolName.INDEXER: 3, PoolName.MAMBA: 3}, [3]),
        (0, {PoolName.KV: 2, PoolName.INDEXER: 2}, []),
        (6, {PoolName.KV: 6, PoolName.MAMBA: 6}, [3, 6]),
        (4, {PoolName.KV: 6, PoolName.INDEXER: 4}, [1, 2, 3, 4]),
        (5, {PoolName.KV: 5}, [1, 2, 3, 4, 5]),
    ]
    assert gets[PoolName.KV] == [True] and gets[PoolName.INDEXER] == [True, False]
    assert gets[PoolName.MAMBA] == [True, False]
    assert bad == {PoolName.MAMBA: [False, False]} and "length mismatch" in caplog.text
    # the Mamba states are this TP rank's own; the KV pages every rank's
    other = sglang_backend(mounted, **{**fields, "tp_rank": 0})
    other.register_mem_pool_host(HostPool(page_size=8, pages=8, width=16))
    other.register_mem_host_pool_v2(HostPool(page_size=1, pages=8, width=40,
                                             layout="layer_first", dtype=torch.uint8),
                                    PoolName.MAMBA)
    h = other.batch_exists_v2(keys[:6], [trailing])
    assert (h.kv_hit_pages, h.extra_pool_hit_pages) == (0, {PoolName.KV: 6})
    other.close()
    ours.close()


def test_sglang_pages_are_shared_by_the_nodes_of_a_pool(tmp_path: Path,
                                                        pg_cluster: Any) -> None:
    """SGLang instances on two nodes of one pool: pages one sets (on the writer or on a
    reading node) are hits for the other, through SGLang's own storage interface (a
    reading node's lookups from the table its change feed keeps: the writer's puts
    show there once the feed row is read)."""
    pytest.importorskip("sglang.srt.mem_cache.hicache_storage")
    from conftest import eventually
    from test_nodes import _reading_node, _writer_node

    from mxfs.kv.keys import sglang_hashes

    url = pg_cluster.database()
    with _writer_node(tmp_path, url) as (net, a, members), \
            _reading_node(tmp_path, url, net, members) as b:
        on_a, on_b = sglang_backend(a, tp_rank=0), sglang_backend(b, tp_rank=0)
        keys = sglang_hashes(list(range(64 * 4)), 64)
        for setter, getter, half in ((on_b, on_a, keys[:2]), (on_a, on_b, keys[2:])):
            pool, other = (HostPool(pages=4, width=4096) for _ in range(2))  # 512 KiB pages
            setter.register_mem_pool_host(pool)
            getter.register_mem_pool_host(other)
            pool.kv_buffer.copy_(torch.randn(4 * 64, 4096).bfloat16())
            assert setter.batch_set_v1(half, torch.arange(0, 2 * 64)) == [True, True]
            assert eventually(lambda g=getter, h=half: g.batch_exists(h) == 2, 10)
            assert getter.batch_get_v1(half, torch.arange(2 * 64, 4 * 64)) == [True, True]
            assert torch.equal(other.kv_buffer[2 * 64:4 * 64], pool.kv_buffer[:2 * 64])
        assert on_a.batch_exists(keys) == 4 and on_b.batch_exists(keys) == 4
        on_a.close()
        on_b.close()

