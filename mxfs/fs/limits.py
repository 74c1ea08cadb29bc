"""What one tenant may hold of the daemon: connections, unpublished files, leases, time.

A node runs hundreds of engine processes, each with a few control
connections, so the defaults are generous; but each is a bound, so that one
user's processes, however many and however hostile, cannot exhaust the
daemon's descriptors or memory while others are served.  Mount options
change them (`-o max_conns=N,...`); `mxfs status` shows how close the daemon
is to each.
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass, fields

from mxfs.pool.revoke import READ_GRACE_S
from mxfs.vol.overdrafts import PENALTY_S
from mxfs.vol.volume import MAX_HELD_PER_USER


@dataclass(frozen=True)
class Limits:
    max_conns: int = 4096           # control connections in total
    max_conns_per_user: int = 512   # of one uid
    max_pending: int = 256          # unpublished (created, uncommitted) files a connection holds
    max_pending_per_user: int = 1024  # ... and all connections of one uid together
    max_pins: int = 65536           # KV read leases a connection holds
    max_namespaces_per_user: int = 1024  # KV namespaces one uid owns (each a row, in memory)
    max_active_per_user: int = 8    # requests of one uid in service at once (fs/fair.py)
    fuse_tasks: int = 512           # FUSE requests read at once, waiting their turns inside
                                    # (fs/fuse_conn.py: fewer, and one user's fill them)
    max_open_per_user: int = 4096   # files one uid holds open through the mount (each a
                                    # descriptor of the daemon's a member it touches)
    max_fds_in_flight_per_user: int = 4096  # descriptors sent to one uid, not yet received
    max_fds_per_user: int = 65536   # descriptors the daemon holds for one uid (its open and
                                    # unpublished files' chunk files), a quarter of its
                                    # limit less the reserve at most (fs/descriptors.py)
    max_buffered_per_user: int = 64 << 20  # bytes of one uid's control requests arriving
                                    # and replies unsent, all connections (fs/buffered.py)
    max_held_per_user: int = MAX_HELD_PER_USER  # bytes of one user's removed or renewed
                                    # files kept for their readers (pool/revoke.py)
    read_grace_s: int = READ_GRACE_S  # s: ... kept readable so long, then cut to nothing
    node_grace_s: int = 10          # s: the writer's: a node's lease gone so long (not back)
                                    # drops its files, holds and grants (fs/node_files.py)
    max_held_files_per_user: int = 4096  # chunk files of one user's dropped files whose
                                    # write descriptors she keeps (each held, cut, looked
                                    # at: pool/revoke.py); past it her creates are refused
    overdraft_penalty_s: int = PENALTY_S  # s: a user caught writing past her declared
                                    # size loses all her unpublished files, and her
                                    # creates are refused so long (doubled at each repeat)
    max_pins_per_user: int = 262144  # KV read leases of all connections of one uid
    max_pinned_bytes_per_user: int = 16 << 30  # bytes of KV chunks they keep from eviction
                                    # (charged to their writers: a reader of a shared
                                    # namespace pinned it full for as long as she liked)
    max_chunks_per_user: int = 1 << 20  # KV chunks one uid has put, in any namespace (~2 KB each)
    max_kv_lent_per_user: int = 1 << 30  # bytes of KV copies a reading node lends one uid
    max_kv_lent: int = 4 << 30      # ... of copies lent and puts held, all uids together
    max_kv_claims_per_user: int = 16384  # KV keys one uid claims to compute at once
    max_kv_views: int = 4096        # namespaces' presence tables (`kv_view`; 2 fds each)
    max_kv_views_per_user: int = 512  # ... those one uid's views made
    max_remote_reads: int = 64      # chunk-service connections a reading node hands readers
    max_remote_reads_per_user: int = 16  # ... to one uid (fs/remote_reads.py)
    idle_timeout: int = 3600        # s: a connection holding nothing is closed when idle so long
    frame_timeout: int = 10         # s: a started request must arrive whole, a reply be taken
    max_chunk_conns: int = 256      # chunk service connections (fs/chunk_service.py) of all
                                    # peers' own (readers' scoped ones apart: 75% of this)
    reserved_chunk_conns: int = 64  # ... each peer has room for past that (a node's own:
                                    # ~48, idle 16, far I/O 8 helpers and its callers'
                                    # threads, KV 4 + 4 + 16 waits)
    max_chunk_conns_per_peer: int = 128  # ... of one address (its own; its readers' scoped
                                    # ones to as many apart)
    max_chunk_handshakes_per_peer: int = 8  # of one address not yet past the key proof
    max_chunk_handshakes: int = 64  # of all peers not yet past it (room kept for nodes)
    max_chunk_accept_burst: int = 1024  # chunk service connections one address opens at
                                    # once (a node's reconnect: ~100) ...
    max_chunk_accepts_per_s: int = 1024  # ... and a second after that (fs/accept_rate.py)
    fd_reserve: int = 256           # descriptors kept back for the daemon's own work (FUSE,
                                    # the store, members): an eighth of its limit, this many
                                    # at least (fs/descriptors.py)

    @classmethod
    def options(cls) -> tuple[str, ...]:
        """The mount options that set these (all but the reserve)."""
        return tuple(f.name for f in fields(cls) if f.name != "fd_reserve")

    @classmethod
    def from_options(cls, own: dict[str, str]) -> Limits:
        """Limits from mount options; ValueError names the option that is not a count."""
        given = {}
        for name in cls.options():
            if own.get(name):
                value = int(own[name])
                if value <= 0:
                    raise ValueError(name)
                given[name] = value
        return cls(**given)


@dataclass
class NodeHeld:
    """Bytes of a reading node's memory held for its KV users, all together: copies
    lent (`fs/kv_follow.py`) and chunks being put (`fs/kv_forward.py`), one count
    bounded by `max_kv_lent` (each user bounded alone, N tenants held N times that)."""

    most: int
    held: int = 0

    def room(self, n: int) -> bool:
        """Whether `n` bytes more stay within the bound."""
        return self.held + n <= self.most


def raise_fd_limit() -> int:
    """Lift the soft descriptor limit to the hard one (daemons hold many); the limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


def fd_limit() -> int:
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def open_fds() -> int:
    """Descriptors this process holds (asked only by status), as of the last second:
    counting them lists /proc, milliseconds with thousands open, and any user may ask
    status as often as it likes."""
    now = time.monotonic()
    if now - _counted[0] >= 1.0:
        try:
            n = len(os.listdir("/proc/self/fd"))
        except OSError:
            n = -1
        _counted[:] = [now, n]
    return int(_counted[1])


_counted: list[float] = [-1.0, -1]  # (when, how many) open_fds last counted
