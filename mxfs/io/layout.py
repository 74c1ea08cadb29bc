"""Stripe math: where each byte of a file lives among the pool's members.

Byte `o` of a file with stripe unit U, width W and first member s is in stripe
k = o // U, on member (s + k mod W) mod N (N = members in the pool), at chunk
offset (k // W) * U + o mod U.  Each member holds one chunk file per file.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from mxfs.proto.messages import LayoutDesc

PAGE = 4096
DEFAULT_STRIPE_UNIT = 1 << 20


@dataclass(frozen=True, slots=True)
class Piece:
    """One member's share of a byte range: a contiguous chunk range, scattered in the buffer."""

    member: int
    chunk_offset: int
    spans: tuple[tuple[int, int], ...]  # (offset in the caller's buffer, length)

    @property
    def length(self) -> int:
        return sum(n for _, n in self.spans)


@dataclass(frozen=True, slots=True)
class Layout:
    """A file's stripe layout; `members` is the pool size the member numbers refer to."""

    unit: int
    width: int
    first: int
    members: int

    def __post_init__(self) -> None:
        if self.unit <= 0 or self.unit % PAGE:
            raise ValueError(f"stripe unit {self.unit} is not a positive multiple of {PAGE}")
        if not 1 <= self.width <= self.members:
            raise ValueError(f"stripe width {self.width} is not within 1..{self.members}")
        if not 0 <= self.first < self.members:
            raise ValueError(f"first member {self.first} is not within 0..{self.members - 1}")

    def member_of_stripe(self, stripe: int) -> int:
        return (self.first + stripe % self.width) % self.members

    def slot(self, member: int) -> int | None:
        """Position of `member` within this file's stripe set, or None if unused."""
        s = (member - self.first) % self.members
        return s if s < self.width else None

    def used_members(self) -> list[int]:
        return [self.member_of_stripe(k) for k in range(self.width)]

    def holding(self, size: int) -> set[int]:
        """The members that hold bytes of a file of `size` bytes."""
        stripes = -(-size // self.unit)
        return {self.member_of_stripe(k) for k in range(min(self.width, stripes))}

    def locate(self, offset: int) -> tuple[int, int]:
        """(member, chunk offset) of file byte `offset`."""
        k, within = divmod(offset, self.unit)
        return self.member_of_stripe(k), (k // self.width) * self.unit + within

    def file_offset(self, member: int, chunk_offset: int) -> int:
        """Inverse of `locate`."""
        slot = self.slot(member)
        if slot is None:
            raise ValueError(f"member {member} holds no part of this layout")
        row, within = divmod(chunk_offset, self.unit)
        return (row * self.width + slot) * self.unit + within

    def chunk_length(self, member: int, size: int) -> int:
        """Bytes the chunk file on `member` spans for a file of `size` bytes."""
        slot = self.slot(member)
        if slot is None or size <= 0:
            return 0
        last = (size - 1) // self.unit
        if slot > last:
            return 0
        row = (last - slot) // self.width
        if row * self.width + slot < last:
            return (row + 1) * self.unit
        return row * self.unit + (size - 1) % self.unit + 1

    def plan(self, offset: int, length: int) -> list[Piece]:
        """Split [offset, offset+length) into one contiguous chunk range per member."""
        spans: dict[int, list[tuple[int, int]]] = {}
        starts: dict[int, int] = {}
        pos, end = offset, offset + length
        while pos < end:
            member, chunk_off = self.locate(pos)
            n = min(end - pos, self.unit - pos % self.unit)
            if member not in spans:
                spans[member] = []
                starts[member] = chunk_off
            spans[member].append((pos - offset, n))
            pos += n
        return [Piece(m, starts[m], tuple(s)) for m, s in spans.items()]

    def describe(self) -> LayoutDesc:
        return {"stripe_unit": self.unit, "stripe_width": self.width, "first_member": self.first,
                "pool_members": self.members}

    @classmethod
    def from_description(cls, d: LayoutDesc | Mapping[str, int]) -> Layout:
        return cls(d["stripe_unit"], d["stripe_width"], d["first_member"], d["pool_members"])
