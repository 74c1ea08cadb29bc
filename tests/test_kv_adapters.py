"""Engine backends on the real base classes, loaded and driven the way each engine does.

Each test needs its engine installed and skips without it (the engines are not in
the test extras: SGLang alone pulls ~1 GB of triton, vLLM ~900 MB).  They were run in
separate virtualenvs, each with torch==2.13.0, `pip install -e . --no-deps` plus mxfs's
own dependencies and pytest, and:

  sglang 0.5.23:  pip install --no-deps sglang; pip install orjson psutil pybase64
                  requests triton packaging pillow starlette msgspec pydantic pyzmq
                  tqdm IPython aiohttp
  lmcache 0.5.6:  pip install --no-deps lmcache; pip install sortedcontainers numba
                  prometheus_client py-cpuinfo psutil aiohttp requests cachetools
                  pyyaml cryptography blake3
  vllm 0.33.0:    pip install --no-deps vllm; pip install packaging numpy msgspec
"""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import Mounted

from mxfs.kv import KVStore


def test_sglang_backend_loaded_by_the_dynamic_factory(mounted: Mounted) -> None:
    pytest.importorskip("sglang.srt.mem_cache.hicache_storage")
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, HiCacheStorageExtraInfo
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from mxfs.kv.adapters.sglang import MxfsHiCacheStorage
    from mxfs.kv.keys import sglang_hashes

    def config(rank: int) -> HiCacheStorageConfig:
        return HiCacheStorageConfig(
            tp_rank=rank, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
            is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
            model_name="Qwen/Qwen2.5-32B", extra_config={
                "backend_name": "mxfs", "module_path": "mxfs.kv.adapters.sglang",
                "class_name": "MxfsHiCacheStorage", "interface_v1": 1,
                "mount": str(mounted.path), "namespace": "sgl"})

    backend = StorageBackendFactory.create_backend("dynamic", config(0), None)
    other_rank = StorageBackendFactory.create_backend("dynamic", config(1), None)
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
    class HostPool:  # the two methods and the field the v1 path uses of SGLang's host pools
        page_size = 64

        def __init__(self) -> None:
            self.buf = torch.zeros(8, 64, 32, dtype=torch.bfloat16)

        def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
            return self.buf[index // 64].flatten()

        def get_dummy_flat_data_page(self) -> torch.Tensor:
            return torch.empty(64 * 32, dtype=torch.bfloat16)

        def set_from_flat_data_page(self, index: int, page: torch.Tensor) -> None:
            self.buf[index // 64] = page.view(64, 32)

    pool = HostPool()
    pool.buf[2:4] = torch.randn(2, 64, 32).bfloat16()
    backend.register_mem_pool_host(pool)
    idx = torch.arange(2 * 64, 4 * 64)
    assert backend.batch_set_v1(keys[4:6], idx) == [True, True]
    want = pool.buf[2:4].clone()
    pool.buf.zero_()
    assert backend.batch_get_v1(keys[4:6], torch.arange(5 * 64, 7 * 64)) == [True, True]
    assert torch.equal(pool.buf[5:7], want)
    assert backend.get_stats()["chunks"] == 6
    backend.close()
    other_rank.close()


def test_lmcache_l2_adapter_built_from_the_plugin_flag(mounted: Mounted) -> None:
    pytest.importorskip("lmcache.v1.distributed.l2_adapters.base")
    from lmcache.v1.distributed.api import ObjectKey
    from lmcache.v1.distributed.l2_adapters import (
        create_l2_adapter_from_registry,
    )
    from lmcache.v1.distributed.l2_adapters.config import (
        add_l2_adapters_args,
        parse_args_to_l2_adapters_config,
    )
    from lmcache.v1.memory_management import MemoryObjMetadata, TensorMemoryObj

    from mxfs.kv.adapters.lmcache import MxfsL2Adapter
    from mxfs.kv.keys import lmcache_hashes

    parser = argparse.ArgumentParser()
    add_l2_adapters_args(parser)
    args = parser.parse_args(["--l2-adapter", json.dumps({
        "type": "plugin", "module_path": "mxfs.kv.adapters.lmcache",
        "class_name": "MxfsL2Adapter",
        "adapter_params": {"mount": str(mounted.path), "namespace": "lmc"}})])
    conf = parse_args_to_l2_adapters_config(args)
    adapter = create_l2_adapter_from_registry(conf.adapters[0])
    assert isinstance(adapter, MxfsL2Adapter)
    fds = {adapter.get_store_event_fd(), adapter.get_lookup_and_lock_event_fd(),
           adapter.get_load_event_fd()}
    assert len(fds) == 3

    def obj(t: torch.Tensor) -> TensorMemoryObj:
        return TensorMemoryObj(t, MemoryObjMetadata(t.shape, t.dtype, 0, t.numel() * 2, 1),
                               None)

    def wait(fd: int) -> None:
        assert select.select([fd], [], [], 30)[0], "no event"

    hashes = lmcache_hashes(list(range(256 * 3)))
    keys = [ObjectKey(h, "qwen", 0x01000100) for h in hashes]
    data = [torch.randn(2, 256, 64).bfloat16() for _ in keys]
    task = adapter.submit_store_task(keys[:2], [obj(t) for t in data[:2]])
    wait(adapter.get_store_event_fd())
    done = adapter.pop_completed_store_tasks()
    assert done[task].is_successful()
    task = adapter.submit_lookup_and_lock_task(keys, {})
    wait(adapter.get_lookup_and_lock_event_fd())
    bits = adapter.query_lookup_and_lock_result(task)
    assert bits is not None and adapter.query_lookup_and_lock_result(task) is None  # once
    assert [bits.test(i) for i in range(3)] == [True, True, False]
    assert adapter.store.usage()["pinned"] == 2  # locked: eviction must skip them
    outs = [torch.zeros(2, 256, 64, dtype=torch.bfloat16) for _ in keys]
    task = adapter.submit_load_task(keys, [obj(t) for t in outs])
    wait(adapter.get_load_event_fd())
    loaded = adapter.query_load_result(task)
    assert [loaded.test(i) for i in range(3)] == [True, True, False]
    assert torch.equal(outs[0], data[0]) and torch.equal(outs[1], data[1])
    adapter.submit_unlock(keys[:2])
    adapter.close()
    with KVStore(str(mounted.path), "lmc") as kv:
        assert kv.usage()["pinned"] == 0 and kv.usage()["chunks"] == 2


SECOND_PROCESS = r"""
import sys
from mxfs.kv import KVStore
kv = KVStore(sys.argv[1], "vllm")
print(kv.exists(bytes.fromhex(sys.argv[2])))
"""


def test_vllm_tier_created_by_the_tier_factory(mounted: Mounted) -> None:
    pytest.importorskip("vllm.v1.kv_offload.tiering.base")
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory
    from vllm.v1.kv_offload.tiering.base import TransferJob
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    from mxfs.kv.adapters.vllm import MxfsOffloadingSpec, MxfsTier
    from mxfs.kv.keys import vllm_hashes

    assert OffloadingSpecFactory.get_spec_cls({
        "spec_name": "MxfsOffloadingSpec", "spec_module_path": "mxfs.kv.adapters.vllm"}) \
        is MxfsOffloadingSpec
    rows = np.zeros((8, 4096), dtype=np.uint8)
    tier = SecondaryTierFactory.create_secondary_tier(
        {"type": "MxfsTier", "module_path": "mxfs.kv.adapters.vllm",
         "mount": str(mounted.path), "namespace": "vllm"}, memoryview(rows), None)
    assert isinstance(tier, MxfsTier)
    ctx = ReqContext(req_id="r1")
    keys = [make_offload_key(h, 0) for h in vllm_hashes(list(range(16 * 3)))]
    rows[0:3] = np.random.default_rng(0).integers(0, 255, (3, 4096), dtype=np.uint8)
    want = rows[0:3].copy()
    assert tier.lookup(keys[0], ctx) == LookupResult.MISS
    tier.submit_store(TransferJob(1, keys, np.array([0, 1, 2]), False, ctx))
    tier.drain_jobs()
    [result] = list(tier.get_finished_jobs())
    assert result.job_id == 1 and result.success and len(result.successful_keys) == 3
    assert tier.lookup(keys[2], ctx) == LookupResult.HIT
    out = subprocess.run([sys.executable, "-c", SECOND_PROCESS, str(mounted.path),
                          bytes(keys[1]).hex()], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"  # another serving instance sees it
    tier.submit_load(TransferJob(2, keys, np.array([5, 6, 7]), False, ctx))
    tier.drain_jobs()
    [result] = list(tier.get_finished_jobs())
    assert result.success and np.array_equal(rows[5:8], want)
    tier.shutdown()
    os.sync()
