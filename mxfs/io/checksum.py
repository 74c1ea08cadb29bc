"""Block checksums: xxh3-64 of each fixed-size block, as sealed files record them."""

from __future__ import annotations

import struct

import xxhash


def block_sums(buf: memoryview | bytes, unit: int) -> list[int]:
    """xxh3-64 of each `unit` bytes of `buf` (the last block may be short)."""
    view = memoryview(buf)
    return [xxhash.xxh3_64_intdigest(view[o:o + unit]) for o in range(0, len(view), unit)]


def pack_sums(sums: list[int]) -> bytes:
    """Sums as the metadata store keeps them: little-endian 8-byte words."""
    return struct.pack(f"<{len(sums)}Q", *sums)


def unpack_sums(raw: bytes) -> tuple[int, ...]:
    return struct.unpack(f"<{len(raw) // 8}Q", raw)
