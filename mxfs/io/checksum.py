"""Block checksums: xxh3-64 of each fixed-size block, as sealed files record them."""

from __future__ import annotations

import struct

import xxhash

# The largest checksum block a file may be sealed with (or its stripe unit, where that is
# larger: a block is a whole number of stripe units).  The writers here hash by the
# stripe unit (1 MiB by default), or by a multiple of it once a file has over 65,536
# stripes (`client/writer.py`: a commit carries at most that many sums), so 64 MiB
# seals files up to 4 TiB at a 1 MiB unit.  A block is what a reader that verifies it
# holds in memory at once (`ckpt/reader.py` reads whole blocks): unbounded, a tenant's
# sparse file committed as one block of its whole size made root's `mxfs scrub`
# allocate twice that (MemoryError, or the node out of memory).
MAX_SUM_UNIT = 64 << 20


def max_sum_unit(stripe_unit: int) -> int:
    """The largest checksum block of a file striped in units of `stripe_unit`."""
    return max(MAX_SUM_UNIT, stripe_unit)


def block_sums(buf: memoryview | bytes, unit: int) -> list[int]:
    """xxh3-64 of each `unit` bytes of `buf` (the last block may be short)."""
    view = memoryview(buf)
    return [xxhash.xxh3_64_intdigest(view[o:o + unit]) for o in range(0, len(view), unit)]


def pack_sums(sums: list[int]) -> bytes:
    """Sums as the metadata store keeps them: little-endian 8-byte words."""
    return struct.pack(f"<{len(sums)}Q", *sums)


def unpack_sums(raw: bytes) -> tuple[int, ...]:
    return struct.unpack(f"<{len(raw) // 8}Q", raw)
