"""The superblock each member carries: which pool it belongs to and where it sits.

A small JSON file, written atomically (temp file, fsync, rename), with a CRC so
a torn or edited superblock is caught rather than trusted.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from dataclasses import asdict, dataclass, field

from mxfs.errors import MxfsError
from mxfs.pool.safe_file import write_new

SUPERBLOCK_NAME = "mxfs.superblock"
MAGIC = "mxfs-superblock"
FORMAT_VERSION = 1


# A pool's label names its mount (fsname=mxfs:LABEL): a ',' in it would add mount
# options (suid, dev) after the ones given, so it holds none of FUSE's separators.
LABEL = re.compile(r"[A-Za-z0-9._-]{1,64}")


def check_label(label: str) -> None:
    """MxfsError unless `label` is empty (no label) or fits LABEL."""
    if label and not LABEL.fullmatch(label):
        raise MxfsError(f"label {label!r} is not one",
                        "use letters, digits, '.', '_' and '-' (at most 64)")


class SuperblockError(Exception):
    """The superblock is missing, unreadable or damaged (message says which)."""


@dataclass(frozen=True)
class Superblock:
    pool_uuid: str
    member_index: int
    member_count: int
    stripe_unit: int
    label: str
    members: list[str] = field(default_factory=list)  # paths at mkfs time, by index
    meta_member: int = 0
    format_version: int = FORMAT_VERSION
    created: str = ""
    # Where the metadata lives when not on the metadata member: a server's URL, never
    # with a password (libpq's own places give credentials).  Left out when empty, so
    # pools with the embedded store read as before.
    meta: str = ""

    def to_bytes(self) -> bytes:
        body = asdict(self)
        if not body["meta"]:
            del body["meta"]
        body["magic"] = MAGIC
        text = json.dumps(body, sort_keys=True)
        return json.dumps({"superblock": body, "crc32": zlib.crc32(text.encode())},
                          sort_keys=True, indent=1).encode() + b"\n"

    @classmethod
    def from_bytes(cls, raw: bytes) -> Superblock:
        try:
            outer = json.loads(raw)
            body = outer["superblock"]
            crc = outer["crc32"]
        except (ValueError, KeyError, TypeError) as e:
            raise SuperblockError("the superblock is not valid JSON") from e
        if zlib.crc32(json.dumps(body, sort_keys=True).encode()) != crc:
            raise SuperblockError("the superblock checksum does not match (damaged or edited)")
        if body.pop("magic", None) != MAGIC:
            raise SuperblockError("the file is not an mxfs superblock")
        if body.get("format_version") != FORMAT_VERSION:
            raise SuperblockError(
                f"superblock format {body.get('format_version')} is not supported "
                f"(this mxfs reads format {FORMAT_VERSION})")
        try:
            return cls(**body)
        except TypeError as e:
            raise SuperblockError(f"the superblock has unexpected fields ({e})") from e


def superblock_path(member: str) -> str:
    return os.path.join(member, SUPERBLOCK_NAME)


def read_superblock(member: str) -> Superblock:
    """Read a member's superblock; FileNotFoundError if it has none."""
    with open(superblock_path(member), "rb") as f:
        return Superblock.from_bytes(f.read())


def write_superblock(member: str, sb: Superblock) -> None:
    """Replace the superblock atomically and durably."""
    write_new(superblock_path(member), sb.to_bytes(), 0o644)  # (a fresh temp: safe_file.py)
