"""Stable KV keys and the chained token-chunk hashes of three serving engines.

A KV chunk is only reusable by a request whose whole prefix matches, so every
engine hashes tokens chunk by chunk, each hash covering the previous one.  The
hashes must be the same in every process and on every machine: cryptographic
hashes over a fixed byte encoding, never Python's `hash()` (salted per process).

Conventions reproduced here (checked against the engines' own code):

- **LMCache** (server / L2 path, 256-token chunks): `blake3(prev || tokens as
  big-endian uint32)`, 32-byte digests; the chain starts from
  `blake3(12 zero bytes)`; only complete chunks are hashed.
- **SGLang** (HiCache, 64-token pages by default): `sha256(prev || tokens as
  little-endian uint32)`, hex digests; the first page has no predecessor.
- **vLLM** (prefix caching, 16-token blocks, `--prefix-caching-hash-algo sha256`):
  `sha256(pickle((parent, tuple(tokens), extra_keys), protocol 5))`; the chain
  starts from `sha256(pickle("vllm-none-hash"))` unless PYTHONHASHSEED is set
  (then that seed); only complete blocks are hashed.

Where a chunk is stored, each engine names it by more than its hash:

- **vLLM's storage tiers** (`FileMapper`, used by its fs and obj tiers) put the
  offload key (block hash + KV group) under a folder named by the model and a
  digest of the run: tokens per hash, blocks per chunk, TP/PP/prefill-CP/decode-CP
  sizes, dtype, the KV groups' block sizes and layers, and the layout (replicated,
  canonical format); rank and sizes collapse when the bytes are parallelism-agnostic.
  `VllmRun.name` is that name.
- **LMCache's L2** (`ObjectKey`) keys by model, `kv_rank` (world size, global
  rank, local world size and local rank packed one byte each), object group,
  chunk hash and cache salt; `lmcache_object_key` is its connectors' string.

`ChunkKey` binds a chunk hash to everything that makes its bytes what they
are (model, dtype, KV layout, tensor-parallel rank and size, chunk size, hash
algorithm), so two deployments never read each other's chunks by mistake.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import struct
from collections.abc import Sequence
from dataclasses import astuple, dataclass

LMCACHE_CHUNK = 256
SGLANG_PAGE = 64
VLLM_BLOCK = 16
_U32_MAX = (1 << 32) - 1


@dataclass(frozen=True)
class ChunkKey:
    """A KV chunk's identity: what produced its bytes, and the chained hash of its prefix."""

    model: str
    dtype: str
    kv_layout: str  # e.g. "layer_first", "page_first", "mla"
    tp_rank: int
    tp_size: int
    chunk_tokens: int
    hash_algo: str  # "lmcache-blake3", "sglang-sha256", "vllm-sha256", ...
    chunk_hash: str  # hex

    def encode(self) -> bytes:
        """The key as stored: a versioned JSON array (unambiguous, any characters allowed)."""
        return json.dumps(["mxfs-kv/1", *astuple(self)], separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> ChunkKey:
        tag, *fields = json.loads(raw)
        if tag != "mxfs-kv/1":
            raise ValueError(f"not an mxfs chunk key: {raw[:40]!r}")
        return cls(*fields)


def _u32(tokens: Sequence[int], order: str) -> bytes:
    if any(t < 0 or t > _U32_MAX for t in tokens):
        raise ValueError("token ids must fit in 32 bits")
    return struct.pack(f"{order}{len(tokens)}I", *tokens)


def _chunks(tokens: Sequence[int], size: int, partial: bool) -> list[Sequence[int]]:
    if size <= 0:
        raise ValueError("chunk size must be positive")
    end = len(tokens) if partial else len(tokens) - len(tokens) % size
    return [tokens[i:i + size] for i in range(0, end, size)]


def lmcache_hashes(tokens: Sequence[int], chunk_tokens: int = LMCACHE_CHUNK) -> list[bytes]:
    """LMCache's chained chunk hashes (blake3, 32 bytes each), complete chunks only."""
    import blake3  # an mxfs dependency, imported here so other helpers need nothing

    prev = blake3.blake3(bytes(12)).digest()  # LMCache's NONE_HASH
    out = []
    for chunk in _chunks(tokens, chunk_tokens, partial=False):
        prev = blake3.blake3(prev + _u32(chunk, ">")).digest()
        out.append(prev)
    return out


def sglang_hashes(tokens: Sequence[int], page_tokens: int = SGLANG_PAGE,
                  prior: str | None = None, partial: bool = False) -> list[str]:
    """SGLang's chained page hashes (sha256 hex), as HiCache keys its storage."""
    out, prev = [], bytes.fromhex(prior) if prior else b""
    for page in _chunks(tokens, page_tokens, partial):
        h = hashlib.sha256(prev + _u32(page, "<")).hexdigest()
        out.append(h)
        prev = bytes.fromhex(h)
    return out


def vllm_none_hash() -> bytes:
    seed = os.environ.get("PYTHONHASHSEED")  # set, even to "", it is the seed (as vLLM)
    return hashlib.sha256(pickle.dumps("vllm-none-hash" if seed is None else seed,
                                       protocol=5)).digest()


def vllm_hashes(tokens: Sequence[int], block_tokens: int = VLLM_BLOCK,
                extra_keys: tuple[object, ...] | None = None) -> list[bytes]:
    """vLLM's chained block hashes for the default sha256 algorithm (32 bytes each).

    `extra_keys` (LoRA, multimodal, cache salt) go with the first block only here,
    as vLLM does for the cache salt; plain text prompts have none.
    """
    prev, out = vllm_none_hash(), []
    for i, block in enumerate(_chunks(tokens, block_tokens, partial=False)):
        keys = extra_keys if i == 0 else None
        prev = hashlib.sha256(pickle.dumps((prev, tuple(block), keys), protocol=5)).digest()
        out.append(prev)
    return out


@dataclass(frozen=True)
class VllmRun:
    """What vLLM's storage tiers name a run's chunks by (its `FileMapper`).

    `agnostic` is FileMapper's effective parallel_agnostic (the bytes are the same
    under any topology, or replicated): sizes become 1 and the rank 0.  `replicated`
    and `canonical_format` enter the digest only when set, as there.  `layout`, the
    device's KV layout (NHD, HND) where chunks hold its bytes as they are (not
    canonical), enters it too, where FileMapper's names leave it out: a run of one
    layout read another's chunks, their bytes permuted, as hits.
    """

    model: str
    dtype: str
    tokens_per_hash: int
    blocks_per_chunk: int
    tp_size: int = 1
    pp_size: int = 1
    pcp_size: int = 1
    dcp_size: int = 1
    rank: int = 0
    groups: tuple[tuple[int, tuple[str, ...]], ...] = ()  # (tokens per block, layer names)
    agnostic: bool = False
    replicated: bool = False
    canonical_format: str | None = None
    layout: str | None = None

    def fields(self) -> dict[str, object]:
        """The run's identity, as FileMapper hashes it (and writes it to config.json)."""
        one = self.agnostic
        fields: dict[str, object] = {
            "model_name": self.model, "tokens_per_hash": self.tokens_per_hash,
            "blocks_per_file": self.blocks_per_chunk,
            "tp_size": 1 if one else self.tp_size, "pp_size": 1 if one else self.pp_size,
            "pcp_size": 1 if one else self.pcp_size, "dcp_size": 1 if one else self.dcp_size,
            "dtype": str(self.dtype),
            "kv_cache_groups": [{"tokens_per_block": t, "layer_names": list(layers)}
                                for t, layers in self.groups],
            "inference_engine": "vllm"}
        if not one:
            fields["parallel_agnostic"] = False
        if self.replicated:
            fields["replicated_layout"] = True
        if self.canonical_format is not None:
            fields["canonical_format"] = self.canonical_format
        elif self.layout is not None:
            fields["kv_cache_layout"] = self.layout
        return fields

    def base(self, root: str = "vllm") -> str:
        canonical = json.dumps(self.fields(), sort_keys=True, separators=(",", ":"))
        digest = hashlib.sha256(canonical.encode()).hexdigest()[:12]
        return f"{root}/{self.model.replace('/', '_')}_{digest}"

    def name(self, offload_key: bytes, root: str = "vllm") -> str:
        """The name of the chunk under vLLM's offload key (block hash, then 4-byte group)."""
        block, group = offload_key[:-4].hex(), int.from_bytes(offload_key[-4:], "big")
        rank = 0 if self.agnostic else self.rank
        return f"{self.base(root)}_r{rank}/{block[:3]}/{block[3:5]}_g{group}/{block}.bin"


def lmcache_kv_rank(world_size: int, global_rank: int, local_world_size: int,
                    local_rank: int) -> int:
    """LMCache's `ObjectKey.kv_rank`: the four numbers packed one byte each."""
    return (world_size << 24) | (global_rank << 16) | (local_world_size << 8) | local_rank


def lmcache_object_key(chunk_hash: bytes, model: str, kv_rank: int, group: int = 0,
                       salt: str = "") -> str:
    """An LMCache ObjectKey as its connectors write it (`model@rank@group@hash[@salt]`).

    LMCache forbids "@" in the model and the salt, so the fields never run together."""
    base = f"{model}@{kv_rank:08x}@{group:x}@{bytes(chunk_hash).hex()}"
    return f"{base}@{salt}" if salt else base
