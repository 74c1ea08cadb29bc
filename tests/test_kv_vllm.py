"""The vLLM offloading tier on vLLM's real base classes, created by vLLM's own factories.

Skips without vLLM (not in the test extras); how it was installed is in
tests/test_kv_adapters.py.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import Mounted

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
