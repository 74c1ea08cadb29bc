"""KV keys and chained chunk hashes: equal to the engines' own, stable across processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mxfs.kv.keys import (
    ChunkKey,
    VllmRun,
    lmcache_hashes,
    lmcache_kv_rank,
    lmcache_object_key,
    sglang_hashes,
    vllm_hashes,
)

VECTORS = json.loads((Path(__file__).parent / "data" / "kv_hash_vectors.json").read_text())
TOKENS = [(i * 7919) % 151000 for i in range(600)]


def test_hashes_equal_what_each_engine_computes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert sglang_hashes(TOKENS[:512], 64) == VECTORS["sglang64"]
    assert [h.hex() for h in lmcache_hashes(TOKENS, 256)] == VECTORS["lmcache256"]
    assert [h.hex() for h in vllm_hashes(TOKENS[:592], 16)] == VECTORS["vllm16"]


def test_hashes_are_the_same_in_processes_with_other_hash_seeds() -> None:
    code = ("from mxfs.kv.keys import *; t = list(range(1000)); "
            "print(sglang_hashes(t)[-1], lmcache_hashes(t)[-1].hex(), hash(str(t)))")
    outs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}, check=True).stdout.split()
            for seed in ("1", "2")]
    assert outs[0][:2] == outs[1][:2]
    assert outs[0][2] != outs[1][2]  # what Python's own hash() would have given: not stable


@given(st.lists(st.integers(0, 2**32 - 1), min_size=128, max_size=400), st.integers(0, 127))
def test_a_changed_token_changes_its_chunk_and_every_later_one(tokens: list[int],
                                                               at: int) -> None:
    changed = list(tokens)
    changed[at] = (changed[at] + 1) % 2**32
    a, b = sglang_hashes(tokens, 64), sglang_hashes(changed, 64)
    first = at // 64
    assert a[:first] == b[:first]
    assert all(x != y for x, y in zip(a[first:], b[first:], strict=True))
    assert len(sglang_hashes(tokens, 64, partial=True)) == -(-len(tokens) // 64)


def test_chunk_keys_round_trip_and_refuse_foreign_bytes() -> None:
    k = ChunkKey("Qwen/Qwen2.5-32B", "bfloat16", "layer_first", 1, 4, 256, "lmcache-blake3",
                 "ab" * 32)
    assert ChunkKey.decode(k.encode()) == k
    assert k.encode() != ChunkKey(*(list(vars(k).values())[:3] + [2, 4, 256, "lmcache-blake3",
                                                                   "ab" * 32])).encode()
    with pytest.raises(ValueError):
        ChunkKey.decode(b'["other", 1]')
    with pytest.raises(ValueError, match="32 bits"):
        sglang_hashes([2**32], 1)


def test_vllm_seed_set_to_nothing_is_a_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    default = vllm_hashes(TOKENS[:16])
    monkeypatch.setenv("PYTHONHASHSEED", "")  # vLLM seeds with "", not its default
    assert vllm_hashes(TOKENS[:16]) != default


def test_vllm_run_names_collapse_only_parallelism_agnostic_runs() -> None:
    key = bytes(range(32)) + (2).to_bytes(4, "big")
    base = dict(model="Qwen/Qwen3-8B", dtype="bfloat16", tokens_per_hash=16,
                blocks_per_chunk=1, groups=((16, ("l0", "l1")),))
    shared = {VllmRun(**base, tp_size=tp, rank=r, agnostic=True).name(key)
              for tp, r in ((1, 0), (2, 1), (8, 5))}
    assert len(shared) == 1  # the same bytes under any topology: one name
    own = {VllmRun(**base, tp_size=tp, rank=r).name(key) for tp, r in ((1, 0), (2, 0), (2, 1))}
    assert len(own) == 3
    name = VllmRun(**base, agnostic=True).name(key)
    assert name.startswith("vllm/Qwen_Qwen3-8B_") and name.endswith(
        f"_r0/000/10_g2/{bytes(range(32)).hex()}.bin")


def test_lmcache_object_keys_and_kv_rank_packing() -> None:
    rank = lmcache_kv_rank(world_size=8, global_rank=5, local_world_size=4, local_rank=1)
    assert rank == 0x08050401  # LMCache's own example: TP=4, PP=2, worker 1 of node 1
    h = bytes.fromhex("ab" * 32)
    assert lmcache_object_key(h, "Qwen/Qwen3-8B", rank) == f"Qwen/Qwen3-8B@08050401@0@{'ab' * 32}"
    assert lmcache_object_key(h, "m", rank, 3, "tenant-a").endswith("@3@" + "ab" * 32 + "@tenant-a")
