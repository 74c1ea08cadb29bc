"""`KVStore`: KV-cache chunks on the pool, shared by every process on the node.

A chunk is an immutable, sealed object under a key in a namespace.  `put`
writes it straight to the members' chunk files (the direct write path) and
publishes it atomically; the first writer of a key wins and later puts of the
same key are cheap no-ops.  `get` reads it straight into the caller's buffer,
every member at once, and checks each block's xxh3 before saying "hit": a
damaged chunk is a miss (logged, and dropped from the index), so wrong bytes
never reach the engine.  The index, LRU order and capacity live in the
daemon, so they hold across processes and restarts.
"""

from __future__ import annotations

import base64
import ctypes
import errno
import hashlib
import logging
import os
import resource
import threading
import time
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from typing import Any

from mxfs.client.control import ControlClient, ControlError, mount_root
from mxfs.client.direct import DIO_ALIGN, DirectFile, address_of, aligned_like
from mxfs.client.remote_file import Run, fetch
from mxfs.client.writer import DirectWriter
from mxfs.errors import MxfsError
from mxfs.io import Layout, read_batch, write_batch
from mxfs.io.checksum import block_sums, pack_sums
from mxfs.io.chunk_client import ChunkClient
from mxfs.io.memory import has_spare
from mxfs.kv.key_view import KeyViews
from mxfs.kv.reuse_policy import ReusePolicy
from mxfs.proto import MAX_FDS
from mxfs.proto.constants import MAX_KEY
from mxfs.proto.messages import (
    CLOSE_READ,
    KV_CLAIM,
    KV_COMMIT,
    KV_CONFIG,
    KV_CREATE,
    KV_DELETE,
    KV_EVICT,
    KV_EXISTS,
    KV_GET,
    KV_LIST,
    KV_PIN,
    KV_PUT,
    KV_STATS,
    KV_UNPIN,
    KV_VIEW,
    KV_WAIT,
    ChunkReply,
    InNamespace,
    KVDeleteRequest,
    KVGetRequest,
    NamespaceStats,
    Rep,
    Request,
)

log = logging.getLogger("mxfs.kv")

# Chunks this small travel inside the request and reply (one round trip, no descriptors):
# on a reading node, whose other path is a connection to the writer or a memfd, ...
INLINE = 256 << 10
# ... and on the node that holds the chunks, where a chunk file's descriptor costs
# less than base64 in JSON past a few KiB (puts with each size's faster path,
# measured on the writer: 16 KiB inline 1,650/s against 1,360/s direct, 64 KiB 963
# against 1,279; gets: 4 KiB inline 13,172/s against 10,978, 16 KiB 6,112 against
# 11,087).
INLINE_PUT_LOCAL = 32 << 10
INLINE_GET_LOCAL = 8 << 10
_INLINE_BATCH = 512 << 10  # raw bytes per inline request (base64 grows it by a third)
GATHER = 64  # puts `put_nowait` gathers into one request
STAGING_MAX = 64 << 20  # the most of one get that goes through a store's staging buffer
PUT_CONNECTIONS = 4  # a reading node's connections a group of large puts is split over
PIN_BATCH = 1024  # keys one pin request leases (a reading node sends on MAX_KEYS at most)
REMOTE_BATCH = 64  # keys one lookup asks for on a reading node (its reply's checksums
                   # stay well inside a message)
# The daemon's default bound on a connection's unpublished files (`max_pending` in
# mxfs/fs/limits.py), for a daemon that does not report its own.
MAX_PENDING = 256
Key = bytes | str


def default_namespace(engine: str) -> str:
    """An engine adapter's namespace when none is configured: one per engine and user,
    so service users never collide on a name (and none is someone else's to plant)."""
    return f"{engine}-uid{os.getuid()}"


def page_cache_option(value: Any) -> bool | None:
    """An engine config's "page_cache": absent (None) is the rule of `KVStore`; else
    true or false."""
    return None if value is None else bool(value)


def key_bytes(key: Key | Any) -> bytes:
    """A key as the index stores it: bytes, at most MAX_KEY long (longer ones hashed)."""
    if hasattr(key, "encode") and not isinstance(key, str):
        key = key.encode()  # a ChunkKey
    raw = key.encode() if isinstance(key, str) else bytes(key)
    if not raw:
        raise ValueError("a KV key cannot be empty")
    if len(raw) > MAX_KEY:
        return b"sha256:" + hashlib.sha256(raw).digest()
    return raw


def _b64(key: Key | Any) -> str:
    return base64.b64encode(key_bytes(key)).decode()


def _fd_room() -> int | None:
    """Descriptors a store may hold at once: a quarter of the process's open-file
    limit (a descriptor that does not fit is lost in transit); None: no limit."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return None if soft == resource.RLIM_INFINITY else soft // 4


def put_group(stat: Mapping[str, Any], members: int) -> int:
    """How many direct puts one group holds unpublished at once.

    No more than the daemon lets a connection hold (the `max_pending` its `stat`
    reports, else the default), so a batch of any length never meets that limit; and
    each put holds a descriptor per member until its commit, within `_fd_room`.
    """
    pending = int((stat.get("limits") or {}).get("max_pending") or MAX_PENDING)
    room = _fd_room()
    return max(1, pending if room is None else min(pending, room // max(1, members)))


def get_part(members: int) -> int:
    """How many keys one lookup of a get asks for: a buffered and an O_DIRECT
    descriptor for each member a chunk is on, within one reply and `_fd_room`."""
    each = 2 * max(1, members)
    room = _fd_room()
    return max(1, MAX_FDS // each if room is None else min(MAX_FDS, room) // each)


def _nbytes(buf: Any) -> int:
    """The size in bytes of a buffer or a tensor (on any device), without touching it."""
    if hasattr(buf, "data_ptr") and hasattr(buf, "element_size"):
        return int(buf.numel() * buf.element_size())
    return memoryview(buf).nbytes


def _on_device(buf: Any) -> bool:
    """A torch tensor on an accelerator (its bytes go through pinned host memory)."""
    device = getattr(buf, "device", None)
    return device is not None and getattr(device, "type", "cpu") != "cpu" \
        and hasattr(buf, "data_ptr")


def _view(buf: Any, writable: bool) -> tuple[memoryview, Any]:
    """(byte view, the host copy it views or None) of a buffer or a tensor; a device
    tensor is copied to the host to be read (gets into one go through `_DeviceHost`)."""
    if hasattr(buf, "data_ptr") and hasattr(buf, "element_size"):  # a torch tensor
        if not buf.is_contiguous():
            raise ValueError("KV buffers must be contiguous tensors")
        copy = None
        if buf.device.type != "cpu":
            assert not writable, "a device buffer is written through _DeviceHost"
            copy = buf = buf.to("cpu")
        n = buf.numel() * buf.element_size()
        return memoryview((ctypes.c_char * n).from_address(buf.data_ptr())).cast("B"), copy
    view = memoryview(buf).cast("B")
    if writable and view.readonly:
        raise ValueError("the output buffer is read-only")
    return view, None


class _Inline:
    """A small chunk whose bytes came in the reply."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.size = len(data)

    def close(self) -> None:
        pass


class _RemoteChunk:
    """A chunk another node holds, read over the connections to it that the get sent
    (scoped to the get's chunks: a reading node's direct path)."""

    def __init__(self, entry: ChunkReply) -> None:
        self.size = int(entry["size"])
        self.ino = int(entry["ino"])
        self.layout = Layout.from_description(entry["layout"])

    def runs(self, view: memoryview) -> list[Run]:
        return [(self.ino, p.member, p.chunk_offset, [view[o:o + n] for o, n in p.spans])
                for p in self.layout.plan(0, self.size)]

    def close(self) -> None:
        pass


Chunk = DirectFile | _Inline | _RemoteChunk


class _Staging:
    """A page-aligned buffer, touched once and kept (one a thread), that cold chunks are
    read into with O_DIRECT when the caller's buffer is not page-aligned (a bytearray,
    a CPU tensor: O_DIRECT refuses those), then copied out.  One copy out of it costs less
    than the buffered read they would get instead (page-cache folios allocated,
    filled, copied; and the chunk then held twice, in the cache and the engine)."""

    def __init__(self) -> None:
        self.buf: memoryview | None = None

    def take(self, reads: list[tuple[DirectFile, memoryview]]) -> list[memoryview | None]:
        """A piece of the buffer for each read that needs one: a buffer that is not
        aligned, for a chunk mostly not cached, with direct descriptors; at most
        STAGING_MAX bytes in all (the rest read in place, through the cache)."""
        spots: list[tuple[int, int] | None] = []  # (offset in the buffer, length)
        total = 0
        for f, view in reads:
            n = -(-len(view) // DIO_ALIGN) * DIO_ALIGN
            if (f.direct_fds and address_of(view) % DIO_ALIGN and total + n <= STAGING_MAX
                    and f.cached_fraction() < 0.5):
                spots.append((total, len(view)))
                f.odirect = "always"  # judged just now: plan_reads need not look again
                total += n
            else:
                spots.append(None)
        if not total:
            return [None] * len(reads)
        if self.buf is None or len(self.buf) < total:
            self.buf = aligned_like(max(total, min(STAGING_MAX, 2 * len(self.buf or b""))), 0)
            self.buf[:] = bytes(len(self.buf))  # touched now, not on every read
        buf = self.buf
        return [None if spot is None else buf[spot[0]:spot[0] + spot[1]] for spot in spots]


class _DeviceHost:
    """Pinned host memory that chunks got into device buffers land in, then go on to
    the device from a side stream (one a thread, grown as batches need, kept): pinning
    memory for every get cost more than its copy (warm gets into an H200 ran at 0.66x
    plain files reading into one pinned buffer)."""

    def __init__(self) -> None:
        self.buf: Any = None  # a uint8 host tensor, pinned
        self.used = 0

    def begin(self) -> None:
        self.used = 0

    def view(self, tensor: Any) -> tuple[memoryview, tuple[Any, Any]]:
        """A page-aligned piece for `tensor`'s bytes: (its view, (tensor, piece))."""
        import torch

        if not tensor.is_contiguous():
            raise ValueError("KV buffers must be contiguous tensors")
        n = tensor.numel() * tensor.element_size()
        need = self.used + -(-n // DIO_ALIGN) * DIO_ALIGN
        if self.buf is None or len(self.buf) < need:
            grown = max(need, 2 * (0 if self.buf is None else len(self.buf)))
            raw = torch.empty(grown + DIO_ALIGN, dtype=torch.uint8, pin_memory=True)
            skip = -raw.data_ptr() % DIO_ALIGN
            self.buf, self.used = raw[skip:skip + grown], 0  # (earlier pieces keep theirs)
            need = -(-n // DIO_ALIGN) * DIO_ALIGN
        piece = self.buf[self.used:self.used + n]
        self.used = need
        view = memoryview((ctypes.c_char * n).from_address(piece.data_ptr())).cast("B")
        return view, (tensor, piece)

    @staticmethod
    def land(copies: list[tuple[Any, Any]]) -> None:
        """Copy each piece to its device tensor on a side stream, and wait for them."""
        if not copies:
            return
        import torch

        dev = copies[0][0].device
        accel = getattr(torch, dev.type, None)
        if accel is None or not hasattr(accel, "Stream"):
            for tensor, piece in copies:
                tensor.view(-1).view(torch.uint8).copy_(piece)
            return
        side = accel.Stream(dev)
        # (after the work queued on the caller's stream: a fill of the tensors, or a
        # kernel whose freed memory the allocator handed back as one, landed after the
        # copy, and the get said True over bytes that were not the chunk's)
        side.wait_stream(accel.current_stream(dev))
        with accel.stream(side):
            for tensor, piece in copies:
                tensor.view(-1).view(torch.uint8).copy_(piece, non_blocking=True)
        side.synchronize()


class KVStore:
    """Chunks of one namespace of the pool mounted at (or holding) `mount`."""

    def __init__(self, mount: str, namespace: str = "default", *,
                 capacity: int | None = None, shared: bool = False,
                 mode: int | None = None, page_cache: bool | None = None,
                 policy: ReusePolicy | None = None) -> None:
        """`namespace` is made on the first put, private to this user (or with `mode`,
        e.g. 0o750 to let its group read).  A namespace another user owns is used
        only with `shared=True`: chunks are trusted as their writers are.

        Gets read through the page cache while the node has memory to spare (a
        quarter of it available, `io/memory.py`): a chunk read again while it stays
        cached is a memory copy.  When it has not, cold chunks are read with O_DIRECT:
        the engine's own host tier is the cache, and the chunk is not held twice.
        `page_cache=True` or `False` makes either the rule.

        `policy` (`mxfs.kv.reuse_policy`): every get tells it the pool's read rate, and
        `prefix_to_read` asks it how much of a prefix hit is worth reading."""
        root = mount_root(mount)
        if root is None:
            raise MxfsError(f"{mount} is not on an mxfs mount",
                            "give the mount point of a pool: mxfs mount POOL MOUNTPOINT")
        # A connection of its own: read leases and unpublished puts belong to it.
        self.client = ControlClient(root)
        self.namespace = namespace
        # Sent with every request: which namespace, and whether another's may be joined.
        self._ns: InNamespace = {"namespace": namespace, "shared": shared}
        if mode is not None:
            self._ns["mode"] = mode
        stat = self.client.stat()
        self.members = len(stat["members"])
        self.page_cache = page_cache
        # Keys a lookup asks for at once.  On a reading node (every member another
        # node's) a get sends a few connections whatever its keys, not descriptors a
        # chunk: its lookups take REMOTE_BATCH keys.
        remote = all(m.get("node") for m in stat["members"])
        self.batch = REMOTE_BATCH if remote else get_part(self.members)
        # A reading node sends each chunk on to the writer at its commit, one commit of
        # a connection at a time: its puts go over connections of their own, in parallel.
        self._put_conns: list[ControlClient] | None = [] if remote else None
        self._put_threads: ThreadPoolExecutor | None = None  # (their senders, once made)
        self.inline_put = INLINE if remote else INLINE_PUT_LOCAL  # (see INLINE)
        self.inline_get = INLINE if remote else INLINE_GET_LOCAL
        self._local = threading.local()  # each thread's staging buffer: threads share stores
        self.put_group = put_group(stat, self.members)
        # Misses by reason: "absent" (not stored, or no namespace yet), "checksum" (damaged,
        # dropped), "smaller"/"larger" (a chunk of another size than its buffer).  The
        # daemon counts the last three as hits: it found the key.
        self.misses: Counter[str] = Counter()
        self.policy = policy
        # Exists answered from the daemon's table of the namespace's keys (`kv/key_view.py`).
        self.views = KeyViews(self._ask_view)
        # Puts sent without waiting (`put_nowait`) since the last `flush`: how many were
        # stored, and the first refusal among them.
        self._sent_stored = 0
        self._sent_refusal: OSError | None = None
        self._gathering = threading.Lock()  # (threads share stores)
        self._gathered: list[tuple[str, str]] = []  # (key, data), base64, not sent yet
        self._gathered_bytes = 0
        self.client.before_request = self._send_gathered
        if capacity is not None:
            self.client.request(KV_CONFIG({"namespace": namespace, "capacity": capacity}))

    def close(self) -> None:
        """End the store's connections; puts sent without waiting are answered first
        (their refusals, if any, are not raised: call `flush` to see them)."""
        with suppress(OSError):
            self._send_gathered()
            self.client.settle()
        self.client.close()
        for c in self._put_conns or ():
            c.close()
        if self._put_threads is not None:
            self._put_threads.shutdown()

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _ask(self, req: Request[Any, Rep]) -> Rep:
        """A request (its fields beside `_ns`), refusals raised as ControlError."""
        return self.client.request(req)

    # ---- writing ------------------------------------------------------------------

    def put(self, key: Key, buffer: Any) -> bool:
        """Store `buffer` under `key`; False if the key was already stored (first wins)."""
        return self.batch_put([key], [buffer])[0]

    def put_nowait(self, key: Key, buffer: Any) -> None:
        """Put `buffer` under `key` without waiting for the daemon: a stream of small
        puts runs at the daemon's pace, in batches, not one round trip each.

        The bytes are taken at once (the buffer may be reused).  Puts are gathered and
        sent GATHER at a time (or `_INLINE_BATCH` bytes), and before any other request
        of this store, which the daemon serves after them: this store's gets see the
        chunk at once, its `exists` (answered from the daemon's table) and other
        processes once sent, at the latest at `flush` or `close`.  `flush` sends what is
        gathered, waits for every put, and raises the first refusal among them.  A
        chunk larger than `inline_put` (written through descriptors) is put before
        this returns, its refusal kept for `flush` the same way."""
        view, _copy = _view(buffer, writable=False)
        if len(view) > self.inline_put:
            try:
                stored = self.batch_put([key], [view])[0]  # (answers gathered puts first)
            except OSError as e:
                with self.client.lock:
                    self._sent_refusal = self._sent_refusal or e
                return
            with self.client.lock:
                self._sent_stored += stored
            return
        with self._gathering:
            self._gathered.append((_b64(key), base64.b64encode(view).decode()))
            self._gathered_bytes += len(view)
            full = len(self._gathered) >= GATHER or self._gathered_bytes >= _INLINE_BATCH
        if full:
            self._send_gathered()

    def _send_gathered(self) -> None:
        """Post the puts `put_nowait` gathered, in one request (also called by the
        client before each request that waits: see `ControlClient.before_request`),
        under the client's lock: no other thread's request goes between."""
        with self.client.lock, self._gathering:
            items, self._gathered, self._gathered_bytes = self._gathered, [], 0
            if items:
                self.client.post(KV_PUT({**self._ns, "keys": [k for k, _ in items],
                                         "data": [d for _, d in items]}), self._sent)

    def _sent(self, got: Mapping[str, Any] | ControlError) -> None:
        """A reply to puts `put_nowait` sent (read under the client's lock)."""
        if isinstance(got, ControlError):
            self._sent_refusal = self._sent_refusal or OSError(
                got.errno, f"KV put: {got.strerror}")
        else:
            self._sent_stored += sum(map(bool, got["stored"]))

    def flush(self) -> int:
        """Send the puts `put_nowait` gathered and wait for every one since the last
        flush: how many of them stored their chunk (the others' keys were stored
        already).  Raises the first refusal among them (OSError: ENOSPC, EDQUOT, ...)
        once all are answered; a refused request's earlier chunks, and other
        requests', are stored all the same."""
        with self.client.lock:
            self._send_gathered()
            self.client.settle()
            stored, refusal = self._sent_stored, self._sent_refusal
            self._sent_stored, self._sent_refusal = 0, None
        if refusal is not None:
            raise refusal
        return stored

    def batch_put(self, keys: Sequence[Key], buffers: Sequence[Any]) -> list[bool]:
        """Store each buffer under its key, chunks' bytes written in parallel batches.

        Any number of keys: large chunks go in groups of `put_group`, each group's bytes
        in one batch, so a call never holds more unpublished files than the daemon
        allows a connection.  Raises OSError(ENOSPC) at once when the pool is short of
        space (eviction is then making room): the engine should go on without caching
        these (a failing group's chunks are not stored; earlier groups' are).
        """
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys for {len(buffers)} buffers")
        stored = [False] * len(keys)
        small: list[tuple[int, str, memoryview]] = []
        large: list[tuple[int, str, memoryview]] = []
        held = []  # host copies of device tensors: the views point into them
        for i, (key, buf) in enumerate(zip(keys, buffers, strict=True)):
            view, copy = _view(buf, writable=False)
            held.append(copy)
            (small if len(view) <= self.inline_put else large).append((i, _b64(key), view))
        batch: list[tuple[int, str, memoryview]] = []
        for item in small + [(-1, "", memoryview(b""))]:
            if batch and (item[0] < 0 or sum(len(v) for _, _, v in batch) + len(item[2])
                          > _INLINE_BATCH):
                reply = self._checked(KV_PUT({
                    **self._ns, "keys": [k for _, k, _ in batch],
                    "data": [base64.b64encode(v).decode() for _, _, v in batch]}))
                for (i, _, _), ok in zip(batch, reply["stored"], strict=True):
                    stored[i] = bool(ok)
                batch = []
            if item[0] >= 0:
                batch.append(item)
        for start in range(0, len(large), self.put_group):
            self._put_large(large[start:start + self.put_group], stored)
        return stored

    def _checked(self, req: Request[Any, Rep]) -> Rep:
        """`_ask`, a refusal raised as the OSError it is, naming the op."""
        try:
            return self._ask(req)
        except ControlError as e:
            raise OSError(e.errno, f"KV {req.op.name.removeprefix('kv_')}: {e.strerror}"
                          ) from None

    def _put_large(self, items: list[tuple[int, str, memoryview]], stored: list[bool]) -> None:
        """A group of large chunks: on a reading node split over PUT_CONNECTIONS
        connections at once (each commit there waits for the writer to store its chunk),
        else in one batch on the store's connection."""
        if self._put_conns is None or len(items) < 2:
            self._put_group(self.client, items, stored)
            return
        n = min(PUT_CONNECTIONS, len(items))
        while len(self._put_conns) < n - 1:
            self._put_conns.append(ControlClient(self.client.mountpoint))
        if self._put_threads is None:
            self._put_threads = ThreadPoolExecutor(PUT_CONNECTIONS - 1,
                                                   thread_name_prefix="mxfs-kv-put")
        conns = [self.client, *self._put_conns[:n - 1]]
        parts = [self._put_threads.submit(self._put_group, c, items[i::n], stored)
                 for i, c in enumerate(conns[1:], 1)]
        first: BaseException | None = None
        try:
            self._put_group(conns[0], items[0::n], stored)
        except BaseException as e:
            first = e
        failed = [f.exception() for f in parts]  # (each part ends before this returns)
        for err in [first, *failed]:
            if err is not None:
                raise err

    def _put_group(self, client: ControlClient, items: list[tuple[int, str, memoryview]],
                   stored: list[bool]) -> None:
        """Direct writes: hidden files, every chunk's bytes in one parallel batch, commits."""
        writers: list[tuple[int, DirectWriter, str, int]] = []
        try:
            # The group's creates, then its commits, each sent back to back: about two
            # round trips a group instead of two a chunk.
            made = client.request_many([KV_CREATE({**self._ns, "key": k,
                                                    "size": len(view)})
                                        for _, k, view in items])
            refused: ControlError | None = None
            ops = []
            for (i, k, view), got in zip(items, made, strict=True):
                if isinstance(got, ControlError):
                    refused = refused or got
                    continue
                reply, fds = got
                if reply["exists"]:
                    for fd in fds:
                        os.close(fd)
                    continue
                w = DirectWriter(f"kv:{self.namespace}", client, reply, fds, len(view),
                                 direct=True)
                writers.append((i, w, k, len(view)))
                if refused is None:
                    ops += w.plan_writes(0, view)
            if refused is not None:  # (the others made are aborted below)
                raise OSError(refused.errno, f"KV put: {refused.strerror}")
            write_batch(ops)
            commits = [KV_COMMIT({**self._ns, **w.finish_request(size, sync=False)[1],
                                  "key": k}) for _, w, k, size in writers]
            for (i, w, _, _), done in zip(writers, client.request_many(commits),
                                          strict=True):
                if isinstance(done, ControlError):
                    refused = refused or done
                    continue
                w.done = True
                stored[i] = done[0]["stored"]
            if refused is not None:
                raise OSError(refused.errno, f"KV put: {refused.strerror}")
        finally:
            for _, w, _, _ in writers:
                if not w.done:
                    w.abort()

    # ---- reading ------------------------------------------------------------------

    def get(self, key: Key, out: Any = None) -> Any:
        """The chunk's bytes (into `out` when given, returning True), or None on a miss
        (also when `out` is not exactly the chunk's size)."""
        return self.batch_get([key], None if out is None else [out])[0]

    def batch_get(self, keys: Sequence[Key], outs: Sequence[Any] | None = None) -> list[Any]:
        """Each chunk read into its buffer (or new bytes), all at once; None for misses.

        A miss is per key, the rest served: a key not stored, a chunk failing its
        checksum, or a buffer that is not exactly its chunk's size (counted in `misses`)."""
        results: list[Any] = []
        start_s = time.perf_counter()
        for start in range(0, len(keys), self.batch):
            part = list(keys[start:start + self.batch])
            results += self._get_some(part, None if outs is None else
                                      list(outs[start:start + self.batch]))
        if self.policy is not None:
            got = [r if outs is None else outs[i] for i, r in enumerate(results) if r is not None]
            self.policy.observe_read(sum(_nbytes(b) for b in got), time.perf_counter() - start_s)
        return results

    def _get_some(self, keys: list[Key], outs: list[Any] | None) -> list[Any]:
        wire = [_b64(k) for k in keys]
        # The buffers' sizes go along: a chunk that does not fit its buffer is a miss the
        # daemon counts as one (and opens nothing for).
        get: KVGetRequest = {**self._ns, "keys": wire, "inline_max": self.inline_get,
                             "odirect": not self._buffered(), "remote": True}
        sizes = [] if outs is None else [_nbytes(o) for o in outs]
        if outs is not None:
            get["sizes"] = list(sizes)
        # No lease needed: the descriptors keep a chunk's bytes even if it is evicted.
        found = self._lookup(KV_GET(get))
        if found is None:
            self.misses["absent"] += len(keys)
            return [None] * len(keys)
        reply, fds = found
        entries = reply["chunks"]
        misfits = set()
        for i, entry in enumerate(entries):
            if entry is not None and "sums" not in entry:  # {"size": N}: not its buffer's
                self.misses["smaller" if entry["size"] < sizes[i] else "larger"] += 1
                entries[i] = None
                misfits.add(i)
        files, rest = self._chunk_files(entries, fds)
        grant = reply.get("remote")
        conns = [ChunkClient.adopt(fd, grant["addr"], grant["epoch"]) for fd in rest] \
            if grant is not None else []
        try:
            views, copies = self._read_into(keys, files, outs, misfits, conns)
            results: list[Any] = []
            bad, bad_inos = [], []
            landing: list[tuple[Any, Any]] = []  # device buffers' pieces to copy over
            for i, (view, entry) in enumerate(zip(views, entries, strict=True)):
                if view is None or entry is None:
                    results.append(None)
                    continue
                want = base64.b64decode(entry["sums"])
                if pack_sums(block_sums(view, int(entry["sum_unit"]))) != want:
                    log.warning("KV chunk %r of namespace %s fails its checksum: dropped, "
                                "counted as a miss", key_bytes(keys[i])[:64], self.namespace)
                    self.misses["checksum"] += 1
                    bad.append(wire[i])
                    bad_inos.append(entry.get("chunk", entry.get("ino")))
                    results.append(None)
                    continue
                if copies[i] is not None:
                    landing.append(copies[i])
                results.append(True if outs is not None else bytes(view))
            _DeviceHost.land(landing)
            if bad:  # (dropped for the next reader, if it is still that chunk: one who
                # may only read is refused, and its get is its miss all the same)
                drop = KVDeleteRequest(**self._ns, keys=bad)
                inos = [i for i in bad_inos if isinstance(i, int)]
                if len(inos) == len(bad):
                    drop["inos"] = inos
                with suppress(ControlError):
                    self._ask(KV_DELETE(drop))
        finally:
            for f in files:
                if f is not None:
                    f.close()
            for c in conns:
                c.close()
            if grant is not None:  # (a daemon gone took its grants along)
                with suppress(ControlError, OSError):
                    self.client.request(CLOSE_READ({"grant": grant["grant"]}))
        return results

    def _buffered(self) -> bool:
        """Whether this get reads through the page cache (see `__init__`)."""
        return self.page_cache if self.page_cache is not None else has_spare()

    def _chunk_files(self, entries: list[ChunkReply | None], fds: list[int]
                     ) -> tuple[list[Chunk | None], list[int]]:
        """Each reply entry as something to read from (None: a miss), and the
        descriptors left after theirs (the reply's connections); takes `fds`."""
        files: list[Chunk | None] = []
        try:
            for entry in entries:
                if entry is None:
                    files.append(None)
                elif "data" in entry:
                    files.append(_Inline(base64.b64decode(entry["data"])))
                elif "ino" in entry:
                    files.append(_RemoteChunk(entry))
                else:
                    n = len(entry["members"]) + len(entry.get("direct_members", []))
                    mine, fds = fds[:n], fds[n:]
                    files.append(DirectFile(f"kv:{self.namespace}", self.client,
                                            (entry, mine)))
        except BaseException:
            for f in files:
                if f is not None:
                    f.close()
            for fd in fds:
                os.close(fd)
            raise
        return files, fds

    def _read_into(self, keys: list[Key], files: list[Chunk | None],
                   outs: list[Any] | None, misfits: Collection[int] = (),
                   conns: list[ChunkClient] | None = None
                   ) -> tuple[list[memoryview | None], list[Any]]:
        """Every found chunk read, all members at once: (its bytes' view, device copy-back)
        per key; no view where the key missed, or its buffer is not exactly the chunk's
        size (a shorter chunk would leave the buffer's tail stale, a longer one not fit)."""
        views: list[memoryview | None] = [None] * len(files)
        copies: list[Any] = [None] * len(files)
        self._device_host().begin()
        reads: list[tuple[DirectFile, memoryview]] = []
        runs: list[Run] = []  # another node's chunks' runs, and the key of each
        run_of: list[int] = []
        for i, f in enumerate(files):
            if f is None:
                if i not in misfits:  # (those were counted by their size)
                    self.misses["absent"] += 1
                continue
            if outs is None:
                view, copy = memoryview(bytearray(f.size)), None
            elif _on_device(outs[i]):
                view, copy = self._device_host().view(outs[i])
            else:
                view, copy = _view(outs[i], writable=True)
                if len(view) != f.size:
                    reason = "smaller" if f.size < len(view) else "larger"
                    self.misses[reason] += 1
                    log.debug("KV chunk %r of namespace %s is %d bytes, its buffer %d: a miss",
                              key_bytes(keys[i])[:64], self.namespace, f.size, len(view))
                    continue
            views[i], copies[i] = view, copy
            if isinstance(f, _Inline):
                view[:] = f.data
            elif isinstance(f, _RemoteChunk):
                for run in f.runs(view):
                    runs.append(run)
                    run_of.append(i)
            else:
                reads.append((f, view))
        for i, failed in zip(run_of, fetch(conns or [], runs), strict=True):
            if failed is not None and views[i] is not None:
                log.info("KV chunk %r of namespace %s not read from its node: %s",
                         key_bytes(keys[i])[:64], self.namespace, failed)
                self.misses["gone"] += 1  # (evicted since the lookup, or its node away)
                views[i] = None
        if not hasattr(self._local, "staging"):
            self._local.staging = _Staging()
        staged = self._local.staging.take(reads)
        ops = []
        for (f, view), stage in zip(reads, staged, strict=True):
            ops += f.plan_reads([(0, view if stage is None else stage)])
        read_batch(ops)
        for (_, view), stage in zip(reads, staged, strict=True):
            if stage is not None:
                view[:] = stage
        return views, copies

    def _device_host(self) -> _DeviceHost:
        if not hasattr(self._local, "device_host"):
            self._local.device_host = _DeviceHost()
        host: _DeviceHost = self._local.device_host
        return host

    def _lookup(self, req: Request[Any, Rep]) -> tuple[Rep, list[int]] | None:
        """A lookup request (`kv_get`, `kv_exists`) of keys; None when the namespace does
        not exist: nobody stored anything in it yet, so every key is a miss."""
        try:
            return self.client.request_with_fds(req)
        except ControlError as e:
            if e.errno == errno.ENOENT:
                return None
            raise OSError(e.errno, f"KV {req.op.name.removeprefix('kv_')}: {e.strerror}"
                          ) from None

    # ---- the index ----------------------------------------------------------------

    def exists(self, key: Key) -> bool:
        return self.exists_many([key])[0]

    def batch_exists(self, keys: Sequence[Key]) -> int:
        """How many of `keys`, from the first, are stored without a gap (a prefix hit)."""
        present = self.exists_many(keys)
        return next((i for i, p in enumerate(present) if not p), len(present))

    def prefix_to_read(self, keys: Sequence[Key], prompt_tokens: int, have_tokens: int = 0
                       ) -> int:
        """How many of `keys` (the chunks of a prompt of `prompt_tokens` after the
        `have_tokens` the caller holds already), from the first, to get: the prefix hit,
        cut by the store's `policy` to what reads faster than it computes."""
        found = self.batch_exists(keys)
        if not found or self.policy is None:
            return found
        return self.policy.plan(prompt_tokens, found, have_tokens).read_chunks

    def exists_many(self, keys: Sequence[Key]) -> list[bool]:
        """Whether each key is stored (none are while the namespace does not exist):
        from the namespace's key table where the daemon keeps one, else asked."""
        seen = self.views.present([key_bytes(k) for k in keys])
        if seen is None:
            return self._exists(keys)
        unsure = [k for k, there in zip(keys, seen, strict=True) if there is None]
        asked = iter(self._exists(unsure) if unsure else [])  # (past the table's bound)
        return [next(asked) if there is None else there for there in seen]

    def _exists(self, keys: Sequence[Key]) -> list[bool]:
        found = self._lookup(KV_EXISTS({**self._ns, "keys": [_b64(k) for k in keys]}))
        return [False] * len(keys) if found is None else list(found[0]["present"])

    def _ask_view(self) -> tuple[int, int]:
        reply, fds = self.client.request_with_fds(KV_VIEW(self._ns))
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise ControlError(errno.EPROTO, "kv_view answered without its table")
        return fds[0], int(reply["size"])

    # ---- computing a miss once ------------------------------------------------------

    def claim(self, keys: Sequence[Key], seconds: float = 10.0) -> list[str]:
        """Claim the missing `keys` this caller is about to compute and put, so that
        others missing them at once wait for its puts (`wait`) instead of computing them
        too.  Each key: "yours" (claimed: compute and put it), "stored" (get it), or
        "busy" (another is computing it: `wait`, then get what was put).  A claim ends
        at its key's put, at this store's close, or after `seconds` (at most 60)."""
        return list(self._ask(KV_CLAIM({**self._ns, "keys": [_b64(k) for k in keys],
                                        "ms": int(seconds * 1000)}))["state"])

    def unclaim(self, keys: Sequence[Key]) -> None:
        """Give up this store's claims on `keys` (they will not be put after all): those
        waiting on them go on at once."""
        self._ask(KV_CLAIM({**self._ns, "keys": [_b64(k) for k in keys], "ms": 0}))

    def wait(self, keys: Sequence[Key], seconds: float = 10.0) -> list[bool]:
        """Wait until no one else's claim on `keys` is live (each put, given up or run
        out), at most `seconds` (at most 60); then whether each key is stored."""
        got = self._lookup(KV_WAIT({**self._ns, "keys": [_b64(k) for k in keys],
                                    "ms": int(seconds * 1000)}))
        return [False] * len(keys) if got is None else list(got[0]["present"])

    def delete(self, key: Key) -> bool:
        return self._ask(KV_DELETE({**self._ns, "keys": [_b64(key)]}))["deleted"] == 1

    def pin(self, keys: Sequence[Key]) -> list[bool]:
        """A read lease on each stored key: eviction skips it until `unpin` (or until this
        store's connection ends).  Which keys were leased: True for each, False for keys
        not stored; a caller that says "found" should say it of exactly these.

        Keys the namespace's table (`kv/key_view.py`) says are not stored are answered
        without asking; the rest are asked `batch` keys at a time (the daemon passes a
        descriptor per member a chunk is on); if a later request fails, the leases
        taken are given back and it raises.  A lease costs the daemon no descriptor
        (`kv_pin`): up to PIN_BATCH keys a request."""
        seen = self.views.present([key_bytes(k) for k in keys])
        if seen is None:
            return self._pin(keys)
        maybe = [there is not False for there in seen]  # (None: the table cannot tell)
        leased = iter(self._pin([k for k, there in zip(keys, maybe, strict=True) if there]))
        return [there and next(leased) for there in maybe]

    def _pin(self, keys: Sequence[Key]) -> list[bool]:
        leased: list[bool] = []
        try:
            for start in range(0, len(keys), PIN_BATCH):
                part = [_b64(k) for k in keys[start:start + PIN_BATCH]]
                found = self._lookup(KV_PIN({**self._ns, "keys": part}))
                leased += [False] * len(part) if found is None else found[0]["pinned"]
        except BaseException:
            taken = [k for k, ok in zip(keys, leased, strict=False) if ok]
            if taken:
                try:
                    self.unpin(taken)
                except OSError:
                    pass  # the connection broke: its leases ended with it
            raise
        return leased

    def unpin(self, keys: Sequence[Key]) -> None:
        self._ask(KV_UNPIN({**self._ns, "keys": [_b64(k) for k in keys]}))

    def usage(self) -> NamespaceStats:
        """Chunks, bytes, capacity, hits, misses, puts, evictions of this namespace
        (ENOENT before anything was put into it)."""
        return self._ask(KV_STATS(self._ns))["namespaces"][0]

    def clear(self) -> int:
        """Evict every chunk of this namespace that no reader holds (an engine's "flush
        the cache"); how many went.  A namespace nothing was put into yet has nothing to
        clear."""
        return self.evict(0)

    def evict(self, keep: int) -> int:
        """Evict least recently used chunks no reader holds until the namespace holds at
        most `keep` bytes; how many went (0 in a namespace nothing was put into)."""
        try:
            return self._ask(KV_EVICT({**self._ns, "keep": keep}))["evicted"]
        except ControlError as e:
            if e.errno == errno.ENOENT:
                return 0
            raise

    def list_chunks(self, skip: int = 0, limit: int = 1000, after: bytes | None = None
                    ) -> list[tuple[bytes, int, int]]:
        """(key, size, pins) of the namespace's chunks from the `skip`th least recently
        used, or past the key `after` in key order (a cursor: the way to page through
        many), at most `limit` (the daemon answers at most 1000 a request)."""
        ask: dict[str, Any] = {**self._ns, "limit": limit}
        if after is not None:
            ask["after"] = base64.b64encode(after).decode()
        else:
            ask["skip"] = skip
        page = self._ask(KV_LIST(ask))["chunks"]  # type: ignore[arg-type]
        return [(base64.b64decode(k), int(size), int(pins)) for k, size, pins in page]

    def set_capacity(self, capacity: int) -> int:
        """Bound the namespace (0: the pool only); returns how many chunks were evicted."""
        return self._ask(KV_CONFIG({**self._ns, "capacity": capacity}))["evicted"]
