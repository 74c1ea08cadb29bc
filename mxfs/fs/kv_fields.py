"""The fields of KV requests that carry keys and buffer sizes, checked once for every
service that takes them (`fs/kv_ops.py`, `fs/kv_follow.py`)."""

from __future__ import annotations

import errno

from mxfs.fs.fields import BadField, Msg, from_b64
from mxfs.vol.kv_index import check_key

MAX_BATCH = 4096  # keys in one request
INLINE_REPLY = 512 << 10  # chunk bytes one kv_get reply may carry inline


def keys_field(msg: Msg) -> list[bytes]:
    raw = msg.get("keys")
    if not isinstance(raw, list) or not all(isinstance(k, str) for k in raw):
        raise BadField(msg, "needs 'keys': a list of base64 strings")
    if len(raw) > MAX_BATCH:
        raise BadField(msg, f"at most {MAX_BATCH} keys a request", errno.E2BIG)
    try:
        return [check_key(from_b64(k)) for k in raw]
    except ValueError:
        raise BadField(msg, "a key is not base64") from None


def sizes_field(msg: Msg, n: int) -> list[int | None]:
    """The sizes of the caller's buffers, one a key (None: any size), from "sizes"."""
    raw = msg.get("sizes")
    if raw is None:
        return [None] * n
    if not isinstance(raw, list) or len(raw) != n or not all(
            s is None or isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= 1 << 62
            for s in raw):
        raise BadField(msg, "'sizes' holds one buffer size (or null) a key")
    return raw
