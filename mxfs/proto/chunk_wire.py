"""The chunk service's wire format: how one node reads another node's member ranges.

A TCP connection starts with a mutual proof of the pool key (a secret every node of the
pool holds, root's alone: `Pool.key`), so a host that is not a node of the pool can ask
nothing, and a node never talks to an impostor.  What follows is neither encrypted nor
authenticated message by message: a host on the path between two nodes can read the
bytes they move and inject requests into a connection, so the nodes' network must be
one only they reach (a storage fabric, a VLAN), or be carried encrypted (WireGuard,
IPsec); kernel TLS, which keeps sendfile's zero copy, would lift it:

    client -> server   HELLO  b"MXCH", version, pool uuid, client nonce
    server -> client   CHALLENGE  b"MXCH", version, server nonce, server proof, epoch
    client -> server   PROOF  client proof
    server -> client   b"MXOK" (or the connection closes: a wrong key, another pool)

A service holding as many connections as it may answers the HELLO with BUSY (b"MXBZ",
in the challenge's place) and closes: the peer is a node told to try again (an idle
connection of its own, or a new one in a moment), not one told the service is gone.

A proof is HMAC-SHA256 of the key over a role, the pool uuid and both nonces; fresh
nonces on both sides make a recorded exchange worthless.  The server's epoch (its lease's,
`meta/lease.py`) rides in the challenge and in every reply, so a reader can refuse
bytes from a node that is no longer the pool's.

Then requests, one at a time, each a 4-byte tag and its body: READ (inode, member,
offset in the member's chunk file, length), answered by a header (0 or an errno, the
epoch, how many bytes follow) and those bytes, sent from the chunk file with sendfile.
A range past the chunk file's end is short; a chunk file never written reads as no
bytes (the reader fills zeros, as the direct path does).

SCOPE (the uid of the reader it is for, a count, then that many (inode, generation)
pairs, at most MAX_SCOPE), answered by a header with no bytes, narrows a connection for
good to those files (a file a reader opened, or the chunks of one KV get), whose
requests then take that uid's turn among the scoped connections of every reader: it
then reads those inodes only,
each only while it keeps its generation and a link (ESTALE once it is removed, EPERM
for any other inode or a second SCOPE), for at most SCOPE_S.  A reading node's daemon
proves the key, scopes the connection, and hands it to a local reader that may read
those files (`fs/remote_reads.py`): the reader moves the bytes itself but holds no key
and can reach nothing else.

KPUT (the caller's uid, gid and groups, the namespace's mode for a first put (0:
private), flags (KPUT_SHARED), then the namespace, the key and `size` bytes of chunk)
stores a KV chunk a reading node's user put: the owner judges it as a put of that
caller on its own control socket (nodes vouch for their users, as NFS clients do).
The answer is 0 (stored), EEXIST (the key was stored already: first wins) or the
errno of a refusal, followed by as many bytes of a line saying why.

KCLM and KWAI (the caller as for KPUT, flags, the claim's or the wait's milliseconds,
a holder: 16 bytes the reading node drew for one of its connections; then the
namespace and the keys, each after its length) claim keys to compute and wait for
others' claims (`fs/kv_claims.py`) as that caller's connection on the owner would: the
answer's bytes are one a key (KCLM: 0 yours, 1 stored, 2 busy; KWAI: 1 stored), or a
line saying why not.  KCLM with KEYS_RELEASE ends every claim and pin of the holder
(its connection closed).

KPIN and KUNP (as KCLM, the milliseconds unused; after the keys NODE: the pinning
node's epoch and name) take and end read leases on keys (`KVStore.pin`): the answer's
bytes are one a key (KPIN: 1 leased, 0 not stored; KUNP: 1 each).  The owner holds a
holder's pins until KUNP, KCLM with KEYS_RELEASE, or the node's lease under that epoch
running out: a node that dies never says it let them go.

KREQ (the caller as for KPUT, then a control op's name and its request as JSON, at
most MAX_KREQ bytes) runs one of the writer's KV requests that change or list its
index (FORWARDED_OPS: deletes, capacities, evictions, namespaces, lists, stats), or
a direct write, or a write through the asking node's mount, of a file on its own
members (NODE_FILE_OPS: the request names the node and its epoch;
`fs/node_files.py`), as
that caller's on its control socket; the answer's bytes are its reply as JSON, or a
line saying why not.  Only a node's own connections put, claim, wait, pin or ask: a
scoped connection that tries is closed.

WRIT, SYNC, TRUN, REMV and RENW (each CHUNK_OP: the writer's epoch, the inode, the member,
an offset and a length) change the chunk files of this node's own members for the
pool's writer node, which places a file's stripes on other nodes' members and writes
them through their owners: WRIT writes `length` bytes that follow at `offset` (the
chunk file made if it is not there), SYNC makes the chunk file durable (offset 1:
its data only), TRUN cuts it to `offset` bytes if it is longer (with `length`
CUT_BACK, only where no caller of the node holds the file open for writing: the
writer cutting back what a node never told, not a truncate), REMV removes it (one
never written is fine; `offset` is the file's owner, its tenant's uid: a chunk file
the node's readers or writers hold is kept as hers, in her limits; 0 from older
writers: root's); RENW makes the chunk file anew where this node's readers or writers
hold it (`Held.renew`: a rights-taking chmod or chown on the writer; `offset` the
owner, as for REMV; `length` what the owner's byte quota has left, NO_ROOM none), so
what their descriptors read ends at what it held.  The owner does it only under the
epoch of the writer's lease it knows (ESTALE otherwise: a writer declared dead that
wakes up changes nothing) and only on a member it holds in service (EREMOTE: another
node's); the answer is 0 or the
errno, then a line saying why.  A scoped connection that tries is closed.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import uuid

MAGIC = b"MXCH"
VERSION = 2  # (2: SCOPE names the reader's uid)
NONCE = 16
KEY_BYTES = 32
MAX_READ = 64 << 20  # bytes one READ may ask for
SCOPE_S = 600.0  # a scoped connection serves this long at most, then is closed

HELLO = struct.Struct("!4sH16s16s")  # magic, version, pool uuid, client nonce
CHALLENGE = struct.Struct("!4sH16s32sQ")  # magic, version, server nonce, proof, epoch
PROOF = struct.Struct("!32s")
ACCEPT = b"MXOK"
BUSY = b"MXBZ"  # (in CHALLENGE's place) no room now: try again
TAG = 4  # bytes of a request's tag
READ = struct.Struct("!4sQIQQ")  # b"READ", inode, member, offset, length
READ_BODY = struct.Struct("!QIQQ")  # (READ past its tag)
SCOPE = struct.Struct("!4sII")  # b"SCOP", the reader's uid, how many (inode, generation)
SCOPE_COUNT = struct.Struct("!II")  # (SCOPE past its tag)               pairs follow
SCOPE_ITEM = struct.Struct("!QQ")  # inode, generation
MAX_SCOPE = 4096  # files one connection may be scoped to
ANSWER = struct.Struct("!iQQ")  # 0 or errno, epoch, bytes that follow
# b"KPUT", uid, gid, mode, flags, groups, namespace bytes, key bytes, chunk bytes; then
# the groups (GROUP each), the namespace, the key and the chunk
KPUT = struct.Struct("!4sIIIIHHHQ")
KPUT_BODY = struct.Struct("!IIIIHHHQ")  # (KPUT past its tag)
GROUP = struct.Struct("!I")
KPUT_SHARED = 1  # the caller asked to use a namespace another user owns
MAX_KPUT_GROUPS = 65535  # a caller's other groups (the field's most: Linux allows 65536)
MAX_KPUT_NAME = 4096  # bytes of a namespace or a key
MAX_KPUT = MAX_READ  # bytes of one chunk
MAX_WHY = 4096  # bytes of the line a refused KPUT is answered with
# (KCLM, KWAI past their tags) uid, gid, flags, groups, namespace bytes, keys, ms, holder
KEYS_BODY = struct.Struct("!IIIHHHI16s")
KEY_LEN = struct.Struct("!H")
KEYS_RELEASE = 2  # (KCLM) every claim and pin of the holder ends
MAX_KEYS = 1024  # keys one KCLM, KWAI, KPIN or KUNP names
NODE = struct.Struct("!QH")  # (KPIN, KUNP, after the keys) the node's epoch, name bytes
MAX_NODE_NAME = 63  # bytes of a node's name (`mxfs node add --name`)
KEY_TAGS = (b"KCLM", b"KWAI", b"KPIN", b"KUNP")  # requests of KEYS_BODY
# (KREQ past its tag) uid, gid, groups, op name bytes, request bytes; then the groups,
# the op's name and the request (JSON)
KREQ_BODY = struct.Struct("!IIHHI")
MAX_KREQ = 1 << 20  # bytes of a KREQ's request, and of its answer
# (WRIT, SYNC, TRUN, REMV, RENW past their tags) the writer's epoch, inode, member,
# offset (REMV, RENW: the file's owner), length (WRIT: the bytes that follow; RENW: the
# bytes the owner's quota has left for the copies kept, NO_ROOM: no bound)
CHUNK_OP = struct.Struct("!QQIQQ")
NO_ROOM = (1 << 64) - 1
CUT_BACK = 1  # (TRUN's length) bytes the writer never took: not where the file is open
              # for writing on the node (its first open there cut them; the rest are its)
CHUNK_OPS = (b"WRIT", b"SYNC", b"TRUN", b"REMV", b"RENW")
MAX_WRITE = MAX_READ  # bytes one WRIT carries
FORWARDED_OPS = ("kv_delete", "kv_config", "kv_evict", "kv_ns_create", "kv_ns_remove",
                 "kv_ns_set", "kv_list", "kv_stats")
# (KREQ, to the writer) a node's direct writes on its own members (`fs/node_files.py`)
NODE_FILE_OPS = ("node_create", "node_commit", "node_abort", "node_open", "node_written",
                 "node_setattr", "node_mkdir", "node_symlink", "node_link", "node_unlink",
                 "node_rmdir", "node_rename", "node_hold", "node_setxattr",
                 "node_removexattr", "node_mknod", "node_room")
CLAIM_STATES = ("yours", "stored", "busy")  # KCLM's answer bytes, by value


class WireError(Exception):
    """The peer broke the protocol or failed the proof: the connection is dropped."""


def proof(key: bytes, role: bytes, pool_uuid: str, client_nonce: bytes,
          server_nonce: bytes) -> bytes:
    return hmac.new(key, role + uuid.UUID(pool_uuid).bytes + client_nonce + server_nonce,
                    hashlib.sha256).digest()


def check_proof(expected: bytes, got: bytes) -> None:
    if not hmac.compare_digest(expected, got):
        raise WireError("the peer does not hold this pool's key")


def check_magic(magic: bytes, version: int) -> None:
    if magic != MAGIC:
        raise WireError("not an mxfs chunk service peer")
    if version != VERSION:
        raise WireError(f"chunk protocol version {version} is not supported (this is {VERSION})")
