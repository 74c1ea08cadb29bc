"""Every control operation's request and reply, defined once for the daemon and its
clients.

An `Op` ties an op's name to the TypedDict of its request fields and of its reply
fields.  Calling it makes a typed request, `client.request(LAYOUT({"path": p}))`,
whose reply is typed too (mypy checks the fields against the op); the daemon
refuses a request field its op does not declare (`Op.unknown`) before any handler
runs, and logs as a bug a reply that strays from its declaration (`Op.stray`).  The
values themselves are still hostile until the daemon's field checks (`fs/fields.py`)
pass them: a TypedDict says what a well-behaved peer sends, not what arrives.

The envelope ("op" and "id" in a request; "id", "ok" and, when refused, "errno" and
"error" in a reply) is the listener's and framing's, not declared per op.  (No
`from __future__ import annotations` here: Python 3.11 reads NotRequired only from
evaluated annotations.)
"""

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, NotRequired, TypedDict, TypeVar, cast

ENVELOPE = frozenset(("op", "id"))


# ---- shapes inside replies ---------------------------------------------------------

class LayoutDesc(TypedDict):
    """How a file stripes (`io.Layout.describe`)."""

    stripe_unit: int
    stripe_width: int
    first_member: int
    pool_members: int


class MemberUsage(TypedDict):
    """Space of one member's filesystem (`Pool.usage`)."""

    index: int
    path: str
    size: int
    free: int
    used: int
    dev: NotRequired[int]  # members sharing a filesystem share it
    failed: NotRequired[str]  # why the member is out of service
    node: NotRequired[str]  # the node that owns it, where that is not this one


class NamespaceStats(TypedDict):
    """One KV namespace (`vol.kv_index.Namespace.stats`)."""

    namespace: str
    uid: int
    gid: int
    mode: str  # octal
    chunks: int
    bytes: int
    capacity: int
    hits: int
    misses: int
    puts: int
    evictions: int
    pinned: int


class QuotaRow(TypedDict):
    uid: int
    bytes: int  # file (4 KiB at least) and link sizes, xattrs, names and KV keys (what
    #             the byte quota counts)
    xattr_bytes: int  # ... of them xattrs' names and values
    name_bytes: int  # ... and the names in its folders and its KV chunks' keys (each
    #                  and its row: usage.NAME_ROW)
    reserved: int  # declared sizes of unpublished files (4 KiB at least)
    held: int  # removed or renewed files' bytes kept a while for their readers
    freeing: int  # removed files' bytes queued to be freed (not held against the quota)
    inodes: int
    bytes_limit: int  # 0: none
    inodes_limit: int
    own: bool  # a quota of its own, not the default


class QuotaLimits(TypedDict):
    bytes_limit: int
    inodes_limit: int


class QuotaReport(TypedDict):
    """What `mxfs quota` shows (`vol.quota.Quotas.report`)."""

    users: list[QuotaRow]
    default: QuotaLimits


class ReadFds(TypedDict):
    """Which member each passed descriptor reads (`Pool.open_for_read`): a buffered one
    per member in `members`, then an O_DIRECT one per member in `direct_members`."""

    members: list[int]
    direct_members: NotRequired[list[int]]


class FileReply(TypedDict):
    """A file as `layout`, `open_read`, `create` and `commit` describe it."""

    ino: int
    size: int
    generation: int
    mode: int
    sealed: bool
    layout: NotRequired[LayoutDesc]  # regular files


class RemoteGrant(TypedDict):
    """Connections to the owner node's chunk service, scoped to the file, that a reading
    node's `open_read` sends in place of chunk files (`fs/remote_reads.py`)."""

    grant: int  # what `close_read` ends
    node: str  # the owner
    addr: str  # its chunk service, "IP:PORT"
    epoch: int  # the owner's, which every answer on them must carry


class RemoteReadsStatus(TypedDict):
    grants: int  # files open for direct reads of other nodes' members
    connections: int  # chunk-service connections those readers hold
    refused: int  # opens sent to the mount instead (a limit was reached)


class KVForwardStatus(TypedDict):
    puts: int  # KV chunks this reading node sent on to the writer (stored or not)
    put_bytes: int
    writing: int  # bytes of chunks callers are writing into this daemon's memory now
    claims: int  # claims and waits sent on to the writer
    pins: int  # pin and unpin requests sent on to the writer (its leases)
    requests: int  # deletes, capacities, evictions, namespaces, lists, stats asked of it
    waiting: int  # waits in progress there now (at most kv_forward.WAITERS)
    sending: int  # requests being sent on now (at most kv_forward.SENDERS)
    queued: int  # ... and waiting for a sender, in their users' turns


class KVViewsStatus(TypedDict):
    tables: int  # namespaces whose presence table a reading node keeps (`kv_view`)
    keys: int  # keys in them
    live: bool  # kept by the change feed now (else lookups ask the metadata store)


class OpenReadReply(FileReply):
    members: list[int]
    direct_members: NotRequired[list[int]]
    remote: NotRequired[RemoteGrant]  # (then every descriptor is one of its connections)


class CreateReply(FileReply):
    members: list[int]  # the member each write descriptor writes


class ChunkReply(TypedDict, total=False):
    """One key of a `kv_get`: its checksums and how to read it, or (only "size") a
    chunk of another size than the caller's buffer."""

    size: int
    sum_unit: int
    sums: str  # base64 of packed xxh3-64 sums, one per sum_unit
    data: str  # base64 of the bytes, for a small chunk
    layout: LayoutDesc
    members: list[int]
    direct_members: list[int]
    ino: int  # read over the reply's `remote` connections (a reading node's)
    chunk: int  # which chunk it is (its inode), for a drop after a failed check


# ---- requests and replies, by op -------------------------------------------------

class Empty(TypedDict):
    pass


class HelloRequest(TypedDict, total=False):
    version: int


class HelloReply(TypedDict):
    version: int
    server: str
    pid: int
    pool_uuid: str
    ops: list[str]
    uid: int


class LeaseStatus(TypedDict):
    """The daemon's lease on the pool (`meta/lease.py`)."""

    host: str
    pid: int
    epoch: int
    ttl: float
    expires_in: float  # by the store's clock, as of its last renewal
    state: str  # "held", "stale" (renewals failing: changes refused), "taken"
    error: str  # why renewals fail, while they do


class NodeStatus(TypedDict):
    """A node of the pool, from its lease row (`meta/lease.py` `nodes`)."""

    name: str
    role: str  # "writer" (owns the members, changes the pool) or "reader"
    host: str
    pid: int
    mountpoint: str
    addr: str  # its chunk service, "IP:PORT" ("": none)
    members: int  # how many it owns
    epoch: int
    state: str  # "alive" or "dead" (its lease ran out), by the store's clock
    expires_in: float


class FeedStatus(TypedDict, total=False):
    """The change feed as a node sees it (`meta/change_feed.py`)."""

    role: str  # "publishes" (the writer) or "follows" (a reading node)
    live: bool  # a follower reads it (while not: the kernel keeps answers 1 s)
    seq: int  # the last row a follower read
    invalidations: int  # kernel entries and inodes a follower invalidated
    pending: int  # ... and those waiting (behind a directory a request holds, say)
    answers_s: float  # how long a follower's kernel keeps names and attributes now
    error: str  # why a follower cannot read it, while it cannot
    published: int  # groups a writer published


class GcStatus(TypedDict):
    """Python's collector in the daemon (`fs/gc_keeper.py`)."""

    frozen: int  # objects a full collection leaves alone
    freezes: int
    thaws: int
    full_collections: int


class StatReply(TypedDict):
    """The pool as `mxfs status` shows it."""

    degraded: bool
    lost_files: int
    lost_examples: list[str]
    pool_uuid: str
    label: str
    stripe_unit: int
    mountpoint: str
    pid: int
    socket: str
    members: list[MemberUsage]
    inodes: int
    open_files: int
    orphans_queued: int  # removed files no longer open, their space still to be freed
    closing: int  # the daemon's descriptors of members' files still closing (a member
                  # that stopped answering holds its own: `pool/closer.py`)
    io_engine: str
    native_engine: str
    io_taken_back: int
    # The daemon's limits (named as the mount options) and how close it is to each.
    limits: dict[str, Any]
    quotas: QuotaReport | None
    wake_latency: dict[str, object] | None
    lease: LeaseStatus | None
    chunk_service: dict[str, Any] | None  # addr, port, connections, served_bytes,
    # scoped_waiting (local readers' requests waiting their turn)
    feed: FeedStatus | None  # the change feed, on a pool on a metadata server
    remote_reads: RemoteReadsStatus | None  # a reading node's direct reads of other nodes
    kv_forward: KVForwardStatus | None  # a reading node's KV puts and claims on the writer
    kv_views: KVViewsStatus | None  # a reading node's presence tables (`fs/kv_views.py`)
    node: str  # this daemon's node ("": a pool of one node)
    config: str  # a reading node's config, its pool opened from ("": the writer)
    nodes: list[NodeStatus]  # every node of a pool on a metadata server
    gc: GcStatus


class MetricsSnapshot(TypedDict):
    """The daemon's counters (`fs.metrics.Metrics.snapshot`)."""

    time: float
    uptime: float
    requests: list[list[Any]]  # [kind, op, count, seconds]
    errors: list[list[Any]]  # [kind, op, errno name, count]
    io: list[list[Any]]  # [member, "read"|"write", bytes, ops]


class MetricsReply(MetricsSnapshot):
    members: list[MemberUsage]


class DfReply(TypedDict):
    members: list[MemberUsage]
    by_use: dict[str, int]


class QuotaRequest(TypedDict, total=False):
    set: bool  # else show
    uid: int
    default: bool  # set the default, not one uid's
    bytes: int  # 0 lifts the limit; absent keeps it
    inodes: int
    clear: bool


class PathRequest(TypedDict):
    path: str  # in the pool, from its root


class OpenReadRequest(PathRequest, total=False):
    odirect: bool
    remote: bool  # the caller takes scoped chunk-service connections (a reading node)


class GrantRequest(TypedDict):
    grant: int


class CreateRequest(PathRequest, total=False):
    size: int
    mode: int
    exclusive: bool
    # The folder's inode the caller holds open: refused (ESTALE) at create and at
    # commit when the path's folder is another one by then.
    dir_ino: int


class InodeRequest(TypedDict):
    ino: int


class SumsFields(TypedDict):
    size: int
    sum_unit: int
    sums: str


class CommitRequest(InodeRequest, SumsFields, total=False):
    replace: bool


class BackupReply(TypedDict):
    path: str


class InNamespace(TypedDict, total=False):
    """What every KV request may carry: its namespace (the default one if absent),
    whether another user's may be joined, and the mode one made by it gets."""

    namespace: str
    shared: bool
    mode: int | None


class KeysRequest(InNamespace):
    keys: list[str]  # base64


class KVDeleteRequest(KeysRequest):
    # One a key (a get's "chunk"): delete it only while it is still that chunk (a reader's
    # drop of one that failed its checksum must not delete another put meanwhile).
    inos: NotRequired[list[int]]


class KVPutRequest(KeysRequest):
    data: list[str]  # base64, one a key


class KVPutReply(TypedDict):
    stored: list[bool]  # False: the key was stored already (the first writer wins)
    evicted: int


class KVCommitReply(TypedDict):
    stored: bool
    evicted: int


class KVCreateRequest(InNamespace):
    key: str
    size: int


class KVCreateReply(TypedDict):
    exists: bool
    ino: NotRequired[int]
    layout: NotRequired[LayoutDesc]
    members: NotRequired[list[int]]


class KVCommitRequest(InNamespace, InodeRequest, SumsFields):
    key: str


class KVGetRequest(KeysRequest, total=False):
    sizes: list[int | None]
    pin: bool
    odirect: bool
    inline_max: int
    remote: bool  # the caller takes scoped chunk-service connections (a reading node)


class KVGetReply(TypedDict):
    chunks: list[ChunkReply | None]
    # Connections to the owner scoped to the chunks with an "ino": the last descriptors.
    remote: NotRequired[RemoteGrant]


class KVExistsReply(TypedDict):
    present: list[bool]


class KVPinReply(TypedDict):
    pinned: list[bool]  # which keys were leased (False: not stored)


class KVViewReply(TypedDict):
    size: int  # bytes of the table the descriptor holds (`proto/presence.py`)


class KVClaimRequest(KeysRequest, total=False):
    ms: int  # how long the claims last (`fs/kv_claims.py`)


class KVClaimReply(TypedDict):
    state: list[str]  # each key: "yours", "stored" or "busy"


class KVWaitRequest(KeysRequest, total=False):
    ms: int  # how long to wait at most


class DeletedReply(TypedDict):
    deleted: int


class KVStatsReply(TypedDict):
    namespaces: list[NamespaceStats]
    claims: int  # compute claims held now: root's in every namespace, others' in those
    # they may read
    node_claimants: int  # other nodes' connections holding claims here (root's; else 0)


class KVListRequest(InNamespace, total=False):
    skip: int  # from the skip-th, least recently used first (at most MAX_LIST_SKIP)
    after: str  # ... or the keys past this one (base64), in key order: a cursor
    limit: int


class KVListReply(TypedDict):
    chunks: list[list[Any]]  # [base64 key, size, pins]


class KVConfigRequest(InNamespace):
    capacity: int


class KVConfigReply(NamespaceStats):
    evicted: int


class KVEvictRequest(InNamespace, total=False):
    keep: int


class EvictedReply(TypedDict):
    evicted: int


class KVNsCreateRequest(TypedDict, total=False):
    namespace: str
    uid: int
    gid: int
    mode: int | None
    capacity: int
    force: bool


class KVNsRemoveRequest(TypedDict):
    namespace: str


class KVNsSetRequest(TypedDict, total=False):
    namespace: str
    gid: int  # its new group (absent: unchanged)
    mode: int  # its new permission bits (absent: unchanged)


# ---- the ops --------------------------------------------------------------------

Req = TypeVar("Req", bound=Mapping[str, Any])
Rep = TypeVar("Rep", bound=Mapping[str, Any])


def _keys(td: Any) -> frozenset[str]:
    return frozenset(td.__required_keys__ | td.__optional_keys__)


@dataclass(frozen=True)
class Op(Generic[Req, Rep]):
    """One operation: its name on the wire, its request's and its reply's fields."""

    name: str
    request: type[Req]
    reply: type[Rep]
    fields: frozenset[str] = field(init=False)
    answers: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "fields", _keys(self.request))
        object.__setattr__(self, "answers", _keys(self.reply))

    def __call__(self, fields: Req | None = None) -> "Request[Req, Rep]":
        """A request of this op with `fields` (typed here, where the op is known)."""
        return Request(self, fields if fields is not None else cast(Req, {}))

    def unknown(self, msg: Mapping[str, object], most: int = 4) -> list[str]:
        """The first `most` fields of a request this op does not take, sorted (a
        request of 20,000 made-up fields had them all sorted on the daemon's thread,
        4 ms, to name four)."""
        return sorted(itertools.islice(
            (k for k in msg if k not in self.fields and k not in ENVELOPE), most))

    def stray(self, reply: Mapping[str, object]) -> str | None:
        """How a reply differs from its declaration (None: it does not)."""
        required: frozenset[str] = self.reply.__required_keys__  # type: ignore[attr-defined]
        extra, missing = set(reply) - self.answers, required - set(reply)
        if not extra and not missing:
            return None
        return f"reply to {self.name}: undeclared {sorted(extra)}, missing {sorted(missing)}"


@dataclass(frozen=True)
class Request(Generic[Req, Rep]):
    """One request to send: its op and its fields (made by calling the op)."""

    op: Op[Req, Rep]
    fields: Req


HELLO = Op("hello", HelloRequest, HelloReply)
STAT = Op("stat", Empty, StatReply)
LAYOUT = Op("layout", PathRequest, FileReply)
OPEN_READ = Op("open_read", OpenReadRequest, OpenReadReply)
CLOSE_READ = Op("close_read", GrantRequest, Empty)
CREATE = Op("create", CreateRequest, CreateReply)
COMMIT = Op("commit", CommitRequest, FileReply)
ABORT = Op("abort", InodeRequest, Empty)
KV_PUT = Op("kv_put", KVPutRequest, KVPutReply)
KV_CREATE = Op("kv_create", KVCreateRequest, KVCreateReply)
KV_COMMIT = Op("kv_commit", KVCommitRequest, KVCommitReply)
KV_GET = Op("kv_get", KVGetRequest, KVGetReply)
KV_PIN = Op("kv_pin", KeysRequest, KVPinReply)
KV_UNPIN = Op("kv_unpin", KeysRequest, Empty)
KV_EXISTS = Op("kv_exists", KeysRequest, KVExistsReply)
KV_VIEW = Op("kv_view", InNamespace, KVViewReply)
KV_CLAIM = Op("kv_claim", KVClaimRequest, KVClaimReply)
KV_WAIT = Op("kv_wait", KVWaitRequest, KVExistsReply)
KV_DELETE = Op("kv_delete", KVDeleteRequest, DeletedReply)
KV_STATS = Op("kv_stats", InNamespace, KVStatsReply)
KV_LIST = Op("kv_list", KVListRequest, KVListReply)
KV_CONFIG = Op("kv_config", KVConfigRequest, KVConfigReply)
KV_EVICT = Op("kv_evict", KVEvictRequest, EvictedReply)
KV_NS_CREATE = Op("kv_ns_create", KVNsCreateRequest, NamespaceStats)
KV_NS_REMOVE = Op("kv_ns_remove", KVNsRemoveRequest, DeletedReply)
KV_NS_SET = Op("kv_ns_set", KVNsSetRequest, NamespaceStats)
META_BACKUP = Op("meta_backup", Empty, BackupReply)
META_SYNC = Op("meta_sync", Empty, Empty)
METRICS = Op("metrics", Empty, MetricsReply)
DF = Op("df", Empty, DfReply)
QUOTA = Op("quota", QuotaRequest, QuotaReport)

# Every op this protocol version serves, by name.
BY_NAME: dict[str, Op[Any, Any]] = {op.name: op for op in (
    HELLO, STAT, LAYOUT, OPEN_READ, CLOSE_READ, CREATE, COMMIT, ABORT, KV_PUT, KV_CREATE,
    KV_COMMIT, KV_GET, KV_PIN, KV_UNPIN, KV_EXISTS, KV_VIEW, KV_CLAIM, KV_WAIT, KV_DELETE, KV_STATS,
    KV_LIST, KV_CONFIG, KV_EVICT, KV_NS_CREATE, KV_NS_REMOVE, KV_NS_SET, META_BACKUP, META_SYNC,
    METRICS, DF, QUOTA)}
OPS = tuple(BY_NAME)
