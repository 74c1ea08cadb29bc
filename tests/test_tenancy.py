"""Tenants of one pool: the direct path grants nothing the mount refuses; KV namespaces
have owners.

Real users (useradd), an allow_other mount, and each operation done both ways: through
the mount (the kernel checks, default_permissions) and through the control socket (the
daemon checks): the outcomes must be the same, allowed or the same errno.
"""

from __future__ import annotations

import errno
import grp
import json
import mmap
import os
from pathlib import Path

import pytest
from conftest import HAVE_FUSE, Mounted, mxfs, one_line_error
from users import TEAM, ensure_users, run_as

from mxfs.client import ControlClient
from mxfs.kv import KVStore
from mxfs.vol.kv_index import MAX_CHUNK

pytestmark = pytest.mark.skipif(not HAVE_FUSE, reason="needs root and /dev/fuse")

BOTH_WAYS = r"""
import mmap
from mxfs.client import ControlClient
from mxfs.client.writer import create_file
mount = sys.argv[1]
data = b"d" * 5000

def direct_write(path, replace=True):
    buf = mmap.mmap(-1, 8192)
    buf[:len(data)] = data
    with create_file(path, len(data)) as w:
        w.write_at(0, memoryview(buf), valid=len(data))
        w.commit(len(data), replace=replace)

def mount_write(path):
    with open(path, "wb") as f:
        f.write(data)

def mount_replace(path):
    tmp = os.path.join(os.path.dirname(path), ".tmp-" + str(os.getpid()))
    mount_write(tmp)
    try:
        os.rename(tmp, path)
    except OSError:
        os.unlink(tmp)
        raise

def direct_read(path):
    with ControlClient(mount) as c:
        c.call("open_read", path=c.pool_path(path))

def mount_read(path):
    open(path, "rb").close()

def gid_of(path):
    return os.stat(path).st_gid

out = {}
for case in json.loads(sys.argv[2]):
    name, kind, path = case
    p = os.path.join(mount, path)
    if kind == "create":
        me = str(os.getuid())
        out[name] = [attempt(mount_write, p + ".m" + me), attempt(direct_write, p + ".d" + me)]
        if out[name] == ["ok", "ok"]:
            out[name + " gid"] = [gid_of(p + ".m" + me), gid_of(p + ".d" + me)]
    elif kind == "replace":
        out[name] = [attempt(mount_replace, p), attempt(direct_write, p)]
    elif kind == "read":
        out[name] = [attempt(mount_read, p), attempt(direct_read, p)]
    elif kind == "overwrite":
        out[name] = [attempt(open, p, "r+b"), "n/a"]
print(json.dumps(out))
"""

NUL_NAME = r"""
from mxfs.client import ControlClient
with ControlClient(sys.argv[1]) as c:
    out = {"nul": attempt(c.call, "create", path="/sticky/a\0b", size=1),
           "surrogate": attempt(c.call, "create", path="/sticky/a\udc80", size=1),
           "dotdot": attempt(c.call, "create", path="/sticky/..", size=1)}
print(json.dumps(out))
"""


def aligned(data: bytes) -> mmap.mmap:
    buf = mmap.mmap(-1, max(4096, -(-len(data) // 4096) * 4096))
    buf[:len(data)] = data
    return buf


def sealed_file(path: Path, uid: int) -> None:
    from mxfs.client.writer import create_file

    with create_file(str(path), 4) as w:
        w.write_at(0, memoryview(aligned(b"seal")), valid=4)
        w.commit(4)
    os.chown(path, uid, uid)


def test_the_direct_path_and_the_mount_agree_on_every_rule(mounted: Mounted) -> None:
    users = ensure_users()
    alice, bob = users["alice"], users["bob"]
    team = grp.getgrnam(TEAM).gr_gid
    root = mounted.path
    os.chmod(root, 0o755)
    for d, mode, owner, group in (("rootdir", 0o755, 0, 0), ("sticky", 0o1777, 0, 0),
                                  ("private", 0o700, bob.uid, bob.gid),
                                  ("team", 0o2775, 0, team),
                                  ("alicedir", 0o755, alice.uid, alice.gid)):
        (root / d).mkdir()
        os.chmod(root / d, mode)
        os.chown(root / d, owner, group)
    for f, owner, mode in (("sticky/bobs", bob, 0o666), ("sticky/alices", alice, 0o644),
                           ("private/f", bob, 0o644), ("secret", bob, 0o600)):
        (root / f).write_bytes(b"x")
        os.chown(root / f, owner.uid, owner.gid)
        os.chmod(root / f, mode)
    sealed_file(root / "alicedir" / "sealed", alice.uid)
    os.chmod(root / "team", 0o2775)  # chown drops set-group-ID

    cases = [["root's folder", "create", "rootdir/x"],
             ["sticky, new name", "create", "sticky/new"],
             ["sticky, another's file", "replace", "sticky/bobs"],
             ["sticky, own file", "replace", "sticky/alices"],
             ["another's 0700 folder", "create", "private/g"],
             ["another's file in a 0700 folder", "read", "private/f"],
             ["another's 0600 file", "read", "secret"],
             ["set-group-ID folder", "create", "team/t"],
             ["name over 255 bytes", "create", "sticky/" + "n" * 256],
             ["sealed file, written in place", "overwrite", "alicedir/sealed"],
             ["sealed file, replaced whole", "replace", "alicedir/sealed"]]
    import json

    as_alice = run_as(alice, BOTH_WAYS, str(root), json.dumps(cases))
    assert (root / "sticky" / "bobs").read_bytes() == b"x"  # alice replaced nothing of his
    as_bob = run_as(bob, BOTH_WAYS, str(root), json.dumps(cases[:8]))
    for who, out in (("alice", as_alice), ("bob", as_bob)):
        for name, (via_mount, via_direct) in out.items():
            if via_direct != "n/a":
                assert via_mount == via_direct, (who, name, out)
    assert as_alice["root's folder"][0] == errno.EACCES
    assert as_alice["sticky, new name"] == ["ok", "ok"]
    assert as_alice["sticky, another's file"][0] == errno.EPERM
    assert as_alice["sticky, own file"] == ["ok", "ok"]
    assert as_alice["another's 0700 folder"][0] == errno.EACCES
    assert as_alice["another's 0600 file"][0] == errno.EACCES
    assert as_alice["set-group-ID folder"][0] == errno.EACCES  # not in the group
    assert as_bob["set-group-ID folder gid"] == [team, team]
    assert as_bob["another's 0600 file"] == ["ok", "ok"]
    assert as_alice["name over 255 bytes"][0] == errno.ENAMETOOLONG
    assert as_alice["sealed file, written in place"][0] == errno.EPERM
    assert as_alice["sealed file, replaced whole"] == ["ok", "ok"]
    # Names the kernel never passes are refused by the direct path, and leave nothing.
    assert run_as(alice, NUL_NAME, str(root)) == {"nul": errno.EINVAL,
                                                  "surrogate": errno.EINVAL,
                                                  "dotdot": errno.EINVAL}
    assert sorted(os.listdir(root / "sticky")) == sorted(
        ["bobs", "alices"] + [f"new.{how}{u.uid}" for u in (alice, bob) for how in "md"])


KV_AS_USER = r"""
from mxfs.client import ControlClient
from mxfs.kv import KVStore
mount = sys.argv[1]
out = {}
def use(ns, **kw):
    kv = KVStore(mount, ns, **kw)
    try:
        return {"get": attempt(lambda: kv.get("k") is not None),
                "exists": attempt(kv.exists, "k"),
                "put": attempt(kv.put, "mine-" + str(os.getuid()), b"v" * 100),
                "stats": attempt(lambda: kv.usage()["chunks"])}
    finally:
        kv.close()
for ns, kw in json.loads(sys.argv[2]):
    out[ns + (" shared" if kw.get("shared") else "")] = use(ns, **kw)
print(json.dumps(out))
"""


XATTRS_OF_OTHERS = r"""
p = sys.argv[1]
print(json.dumps({name: attempt(os.setxattr, p, name, b"v" * 1000)
                  for name in ("system.a", "system.posix_acl_access", "user.a",
                               "trusted.a", "security.a")}
                 | {"remove": attempt(os.removexattr, p, "system.a")}))
"""


def test_nobody_sets_system_attributes_on_anothers_file(mounted: Mounted) -> None:
    """The kernel leaves system.* attributes to the filesystem to judge: kept, anyone
    could set them on a file she cannot even read (charged to its owner's quota).  None
    but the ACL names mean anything here, so none is kept; the other namespaces are
    judged by the kernel."""
    alice = ensure_users()["alice"]
    secret = mounted.path / "secret"
    secret.write_bytes(b"root's")
    secret.chmod(0o600)
    got = run_as(alice, XATTRS_OF_OTHERS, str(secret))
    assert got == {"system.a": errno.EOPNOTSUPP, "system.posix_acl_access": errno.EOPNOTSUPP,
                   "user.a": errno.EACCES, "trusted.a": errno.EPERM,
                   "security.a": errno.EPERM, "remove": errno.EOPNOTSUPP}
    with pytest.raises(OSError) as err:  # (nor root: nothing would read it)
        os.setxattr(secret, "system.a", b"v")
    assert err.value.errno == errno.EOPNOTSUPP
    assert os.listxattr(secret) == []


def test_trusted_attributes_are_listed_to_root_alone(mounted: Mounted) -> None:
    """The kernel refuses others a trusted.* attribute's value but lists them whatever
    names a FUSE filesystem gives: their names are root's to know of, as on a disk."""
    alice = ensure_users()["alice"]
    shown = mounted.path / "shown"
    shown.write_bytes(b"root's")
    shown.chmod(0o644)
    os.setxattr(shown, "trusted.origin", b"root's note")
    os.setxattr(shown, "user.origin", b"anyone's")
    got = run_as(alice, "print(json.dumps(sorted(os.listxattr(sys.argv[1]))))", str(shown))
    assert got == ["user.origin"]
    assert sorted(os.listxattr(shown)) == ["trusted.origin", "user.origin"]


def test_kv_namespaces_have_owners_and_nobody_plants_chunks(mounted: Mounted) -> None:
    import json

    users = ensure_users()
    alice, bob = users["alice"], users["bob"]
    team = grp.getgrnam(TEAM).gr_gid
    m = str(mounted.path)
    os.chmod(mounted.path, 0o755)
    # Alice makes her own namespace on first use (private), and squats a name root's
    # engine will use, making it open to all.
    setup = r"""
from mxfs.client import ControlClient
from mxfs.kv import KVStore
for ns, mode in (("alice-own", None), ("engine", 0o777)):
    with KVStore(sys.argv[1], ns, mode=mode) as kv:
        kv.put("k", b"planted by alice")
print("{}")
"""
    run_as(alice, setup, m)
    # Root gives bob's team a namespace ahead of use; bob's engine owns "svc".
    mxfs("kv", "create", m, "team-ns", "--owner", "mxfs-alice", "--group", TEAM,
         "--mode", "0750")
    mxfs("kv", "create", m, "svc", "--owner", "mxfs-bob", "--capacity", "1MiB")
    with KVStore(m, "team-ns", shared=True) as kv:
        kv.put("k", b"team data")

    asks = [["alice-own", {}], ["alice-own", {"shared": True}], ["team-ns", {}],
            ["team-ns", {"shared": True}], ["svc", {}]]
    as_bob = run_as(bob, KV_AS_USER, m, json.dumps(asks))
    # Another's private namespace: nothing, shared or not; to bob it is not there (a
    # lookup misses, stats ENOENT) and its name is taken.
    assert as_bob["alice-own"] == {"get": False, "exists": False, "put": errno.EACCES,
                                   "stats": errno.ENOENT}
    assert as_bob["alice-own shared"]["get"] is False
    # A namespace given to a group: its members read when they ask to share, never write.
    assert as_bob["team-ns"]["get"] == errno.EACCES  # did not ask to share
    assert as_bob["team-ns shared"] == {"get": "ok", "exists": "ok", "put": errno.EACCES,
                                        "stats": 1}
    # What root gave bob is bob's, without racing anyone for the name.
    assert as_bob["svc"] == {"get": False, "exists": False, "put": "ok", "stats": 1}
    # Root's engine does not read what alice planted under the name it picked...
    with pytest.raises(OSError) as e, KVStore(m, "engine") as kv:
        kv.get("k")
    assert e.value.errno == errno.EACCES and "belongs to uid" in str(e.value)
    # ...and root takes the name over (her chunks go), then uses it as its own.
    mxfs("kv", "create", m, "engine", "--force")
    with KVStore(m, "engine") as kv:
        assert kv.get("k") is None
        kv.put("k", b"root's")
    stats = {s["namespace"]: s for s in json.loads(
        mxfs("kv", "stats", "--json", m).stdout)["namespaces"]}
    assert stats["engine"]["uid"] == 0 and stats["svc"]["uid"] == bob.uid
    assert stats["team-ns"]["gid"] == team and stats["team-ns"]["mode"] == "750"
    # Only root makes namespaces for others; a user may remove only her own.
    other = r"""
from mxfs.client import ControlClient
with ControlClient(sys.argv[1]) as c:
    print(json.dumps({"for-root": attempt(c.call, "kv_ns_create", namespace="x", uid=0),
                      "takeover": attempt(c.call, "kv_ns_create", namespace="svc",
                                          force=True),
                      "rm-others": attempt(c.call, "kv_ns_remove", namespace="svc"),
                      "rm-own": attempt(c.call, "kv_ns_remove", namespace="alice-own")}))
"""
    assert run_as(alice, other, m) == {"for-root": errno.EPERM, "takeover": errno.EPERM,
                                       "rm-others": errno.ENOENT,  # (not hers to see)
                                       "rm-own": "ok"}


def test_a_huge_declared_size_is_refused_before_anything_is_evicted(
        mounted: Mounted) -> None:
    from mxfs.client import ControlClient, ControlError

    with KVStore(str(mounted.path), "others") as kv:
        for i in range(20):
            kv.put(f"k{i}", b"x" * 10_000)
    with KVStore(str(mounted.path), "capped", capacity=1 << 20) as kv, \
            ControlClient(str(mounted.path)) as c:
        for size, code in ((1 << 62, errno.EFBIG), (2 << 20, errno.EFBIG)):
            with pytest.raises(ControlError) as e:
                c.call("kv_create", namespace="capped", key="aw==", size=size)
            assert e.value.errno == code
        kv.set_capacity(0)
        for size in (1 << 62, MAX_CHUNK + 1):  # no KV chunk: refused at any capacity
            with pytest.raises(ControlError) as e:
                c.call("kv_create", namespace="capped", key="aw==", size=size)
            assert e.value.errno == errno.EFBIG and "over" in e.value.strerror
    with KVStore(str(mounted.path), "others") as kv:
        assert kv.usage()["chunks"] == 20 and kv.usage()["evictions"] == 0


def test_a_chunk_larger_than_the_pool_could_hold_evicts_nothing(loop_pool: Mounted) -> None:
    from mxfs.client import ControlClient, ControlError

    m = str(loop_pool.path)
    with KVStore(m, "others") as kv:
        for i in range(20):
            kv.put(f"k{i}", b"x" * (1 << 20))
    free = sum(os.statvfs(p).f_bavail * os.statvfs(p).f_frsize for p in loop_pool.members)
    size = min(MAX_CHUNK, free + (40 << 20))  # more than free space and all KV together
    assert size > free + (20 << 20)
    with ControlClient(m) as c:
        with pytest.raises(ControlError) as e:
            c.call("kv_create", namespace="newcomer", key="aw==", size=size)
        assert e.value.errno == errno.ENOSPC
    with KVStore(m, "others") as kv:
        assert kv.usage()["chunks"] == 20 and kv.usage()["evictions"] == 0


def test_pool_wide_eviction_takes_from_the_namespace_over_its_share(
        loop_pool: Mounted) -> None:
    m = str(loop_pool.path)
    chunk = b"c" * (1 << 20)
    with KVStore(m, "big") as big, KVStore(m, "small") as small:
        for i in range(8):
            small.put(f"s{i}", chunk)
        stored = 0
        for i in range(400):  # until the pool is short: eviction must begin
            try:
                big.put(f"b{i}", chunk)
                stored += 1
            except OSError as e:
                assert e.errno == errno.ENOSPC
            if big.usage()["evictions"]:
                break
        assert big.usage()["evictions"] > 0
        assert small.usage()["chunks"] == 8 and small.usage()["evictions"] == 0
        assert all(small.get(f"s{i}") is not None for i in range(8))


def test_pool_wide_eviction_shares_the_pool_by_owner_not_by_namespace(
        loop_pool: Mounted) -> None:
    """Owners share the pool, then their namespaces share each owner's part: alice's
    chunks spread over 16 namespaces (twice bob's bytes) are what an eviction takes,
    not bob's one namespace (by namespace, his held half the pool to each of hers a
    sixteenth: every eviction fell on him)."""
    from mxfs.client import ControlClient

    m = str(loop_pool.path)
    users = ensure_users()
    alice, bob = users["alice"], users["bob"]
    names = [f"alice-{i}" for i in range(16)]
    with ControlClient(m) as c:  # (root makes them for their owners, and puts for them)
        c.call("kv_ns_create", namespace="bob", uid=bob.uid, gid=bob.gid, mode=0o700)
        for name in names:
            c.call("kv_ns_create", namespace=name, uid=alice.uid, gid=alice.gid, mode=0o700)
    chunk = b"c" * (1 << 20)
    stores = {n: KVStore(m, n, shared=True) for n in ["bob", *names]}
    try:
        for i in range(400):  # until the pool is short: eviction must begin
            for name in ("bob", names[(2 * i) % 16], names[(2 * i + 1) % 16]):
                try:
                    stores[name].put(f"k{i}", chunk)
                except OSError as e:
                    assert e.errno == errno.ENOSPC
            if any(s.usage()["evictions"] for s in stores.values()):
                break
        assert sum(stores[n].usage()["evictions"] for n in names) > 0
        assert stores["bob"].usage()["evictions"] == 0
        assert stores["bob"].usage()["chunks"] == i + 1
    finally:
        for s in stores.values():
            s.close()


def test_a_damaged_chunk_is_a_miss_to_a_reader_who_may_not_delete_it(
        mounted: Mounted) -> None:
    """A client drops a chunk that fails its checksum; a reader who may only read the
    namespace is refused the drop, and that refusal failed her whole get (a writer
    with bad checksums broke every read-only sharer's gets): now it is her miss."""
    from conftest import chunk_files

    m = str(mounted.path)
    os.chmod(mounted.path, 0o755)
    with KVStore(m, "ro", mode=0o755) as kv:
        kv.put("k", b"k" * 5000)
        kv.put("good", b"g" * 5000)
    for path in chunk_files(mounted.members):
        with open(path, "r+b") as f:
            if os.path.getsize(path) == 5000 and f.read(1) == b"k":
                f.seek(0)
                f.write(b"X")
    got = run_as(ensure_users()["alice"], """
from mxfs.client import ControlClient
from mxfs.kv import KVStore
kv = KVStore(sys.argv[1], "ro", shared=True)
print(json.dumps([None if v is None else bytes(v).decode()[:1]
                  for v in kv.batch_get(["k", "good"])]))
""", m)
    assert got == [None, "g"]


PROBE_NAMESPACES = r"""
import base64
from mxfs.client import ControlClient
k = [base64.b64encode(b"k" * 16).decode()]
asks = {"kv_get": {"keys": k}, "kv_exists": {"keys": k}, "kv_view": {},
        "kv_pin": {"keys": k}, "kv_unpin": {"keys": k}, "kv_wait": {"keys": k, "ms": 0},
        "kv_list": {}, "kv_delete": {"keys": k}, "kv_evict": {"keep": 0},
        "kv_stats": {}, "kv_commit": {"ino": 1, "size": 0}, "kv_ns_remove": {},
        # (these make a namespace that is not there: the name is taken, says no more)
        "kv_put": {"keys": k, "data": ["dg=="]}, "kv_create": {"key": k[0], "size": 1},
        "kv_claim": {"keys": k}, "kv_config": {"capacity": 1}, "kv_ns_create": {}}
out = {}
with ControlClient(sys.argv[1]) as c:
    for ns in sys.argv[2:]:
        for op, fields in asks.items():
            for shared in ((False,) if op.startswith("kv_ns_") else (False, True)):
                extra = {"shared": True} if shared else {}
                try:
                    c.call(op, namespace=ns, **fields, **extra)
                    got = "ok"
                except OSError as e:
                    got = [errno.errorcode[e.errno], e.strerror.replace(repr(ns), "NS")]
                out[f"{op}{' shared' if shared else ''} {ns}"] = got
print(json.dumps(out))
"""


def test_a_namespace_one_may_not_see_answers_as_a_missing_one(mounted: Mounted) -> None:
    """A user whom a namespace's mode grants nothing is told of it exactly what she is
    told of a name nobody uses, errno and message: before, EACCES named its owner,
    group and mode where a missing one was ENOENT, so any tenant could list which names
    others use.  Making one of its name says only that the name is taken.  Those the
    namespace lets in (a member of its group, its owner, root) are told why they are
    refused."""
    users = ensure_users()
    alice, bob = users["alice"], users["bob"]
    m = str(mounted.path)
    os.chmod(mounted.path, 0o755)
    run_as(alice, """
from mxfs.client import ControlClient
from mxfs.kv import KVStore
with KVStore(sys.argv[1], "alice-secret") as kv:
    kv.put("k" * 16, b"hers")
print("{}")
""", m)
    mxfs("kv", "create", m, "team-only", "--owner", "mxfs-alice", "--group", TEAM,
         "--mode", "0750")
    got = run_as(bob, PROBE_NAMESPACES, m, "alice-secret", "team-only", "never-made")
    makes = ("kv_put", "kv_create", "kv_claim", "kv_config", "kv_ns_create")
    for ask, answer in got.items():
        op, ns = ask.split()[0], ask.split()[-1]
        if ns != "alice-secret":
            continue
        missing = got[ask.replace("alice-secret", "never-made")]
        if op in makes:  # (made where nobody used the name)
            assert missing == "ok" or missing[0] == "EEXIST", (ask, missing)
            assert answer == ["EEXIST" if op == "kv_ns_create" else "EACCES",
                              "KV namespace name NS is taken: pick another name"], ask
        else:
            assert answer == missing == ["ENOENT", "no KV namespace NS"], (ask, answer)
    # A member of the namespace's group is told why (she may read it, not write).
    assert got["kv_put shared team-only"][0] == "EACCES" and \
        "does not grant write" in got["kv_put shared team-only"][1]
    assert got["kv_get team-only"][0] == "EACCES" and \
        "shared=True" in got["kv_get team-only"][1]
    assert got["kv_get shared team-only"] == "ok"
    # The admin CLI says the daemon's word in one line (to bob the same of both: above).
    assert one_line_error(mxfs("kv", "ls", m, "no-such", check=False)) == \
        f"mxfs: no KV namespace 'no-such': list namespaces with: mxfs kv stats {m}"
    assert mxfs("kv", "ls", m, "alice-secret").stdout.strip().endswith("k" * 16)
    # Its owner and root are told whose it is.
    as_alice = run_as(alice, """
from mxfs.client import ControlClient
with ControlClient(sys.argv[1]) as c:
    try:
        c.call("kv_ns_create", namespace="alice-secret")
    except OSError as e:
        print(json.dumps([e.errno, e.strerror]))
""", m)
    assert as_alice == [errno.EEXIST, f"KV namespace 'alice-secret' exists (uid {alice.uid})"]
    with pytest.raises(OSError) as e, KVStore(m, "alice-secret") as kv:
        kv.get("k" * 16)
    assert e.value.errno == errno.EACCES and f"belongs to uid {alice.uid}" in str(e.value)


def test_a_users_kv_stats_counts_no_claims_in_namespaces_she_may_not_read(
        mounted: Mounted) -> None:
    """Root's two claims in a 0700 namespace: root's kv_stats counts them; bob's counts
    none (it showed, live, what prefills another had under way in a namespace that
    answers him ENOENT) and names no other node's claimants."""
    m = str(mounted.path)
    os.chmod(mounted.path, 0o755)
    mxfs("kv", "create", m, "roots", "--mode", "0700")
    with KVStore(m, "roots") as kv:
        assert kv.claim([b"a" * 16, b"b" * 16]) == ["yours", "yours"]
        with ControlClient(m) as c:
            assert c.call("kv_stats")["claims"] == 2
        got = run_as(ensure_users()["bob"], """
from mxfs.client import ControlClient
with ControlClient(sys.argv[1]) as c:
    stats = c.call("kv_stats")
print(json.dumps([stats["claims"], stats["node_claimants"], len(stats["namespaces"])]))
""", m)
    assert got == [0, 0, 0]


VIEW_HELD = r"""
from mxfs.client import ControlClient
from mxfs.kv.key_view import KeyView
with ControlClient(sys.argv[1]) as c:
    reply, fds = c.call_with_fds("kv_view", namespace=sys.argv[2], shared=True)
    view = KeyView(fds[0], reply["size"])
    print(json.dumps(view.present([b"before"])), flush=True)
    sys.stdin.readline()  # (the namespace changes meanwhile)
    print(json.dumps([view.live(), view.present([b"after"]),
                      attempt(c.call, "kv_view", namespace=sys.argv[2], shared=True)]))
"""


def test_a_namespace_that_lets_a_reader_in_no_more_ends_the_tables_handed_out(
        mounted: Mounted) -> None:
    """A presence table is a right to read a namespace's keys: once the namespace's
    owner or root changes its group or mode (`mxfs kv set`), the table its readers
    hold says MOVED and is never written again, so a reader cut off sees no key put
    after; those still let in ask again and are judged anew.  Before, there was no
    way to change who may read a namespace but to drop it, and a reader who had the
    table read every key put into it for as long as it was kept."""
    import subprocess

    from users import as_user

    bob = ensure_users()["bob"]
    m = str(mounted.path)
    os.chmod(mounted.path, 0o755)
    mxfs("kv", "create", m, "team-view", "--owner", "mxfs-alice", "--group", TEAM,
         "--mode", "0750")
    with KVStore(m, "team-view", shared=True) as kv:
        kv.put(b"before", b"v")
        with subprocess.Popen(as_user(bob, VIEW_HELD, m, "team-view"), text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE) as reader:
            assert reader.stdout is not None and reader.stdin is not None
            assert json.loads(reader.stdout.readline()) == [True]  # (bob, of the team)
            said = mxfs("kv", "set", m, "team-view", "--mode", "0700").stdout
            assert said.startswith("set KV namespace team-view") and "mode 700" in said
            kv.put(b"after", b"v")
            out, _ = reader.communicate("\n", timeout=60)
        assert json.loads(out) == [False, None, errno.ENOENT]
        assert kv.exists(b"after")  # (root's own table: made anew)
        stats = kv.usage()
        assert stats["mode"] == "700" and stats["chunks"] == 2


def test_a_namespace_made_with_an_explicit_mode_lets_others_read_not_write(
        mounted: Mounted) -> None:
    import json

    m = str(mounted.path)
    os.chmod(mounted.path, 0o755)
    with KVStore(m, "open", mode=0o755) as kv:
        kv.put("k", b"v")
    out = run_as(None, KV_AS_USER, m, json.dumps([["open", {"shared": True}]]))
    assert out["open shared"] == {"get": "ok", "exists": "ok", "put": errno.EACCES,
                                  "stats": 1}


FILL_SHARED = r"""
from mxfs.client import ControlClient
from mxfs.kv import KVStore
m, n = sys.argv[1], int(sys.argv[2])
with KVStore(m, "alice-team", shared=True) as kv:
    put = kv.batch_put([f"e{i}" for i in range(n)], [b""] * n)
    past = attempt(kv.put, "past", b"")
    usage = kv.usage()
with KVStore(m, "bob-own") as kv:
    own = attempt(kv.put, "k", b"v")
print(json.dumps([sum(put), past, own, usage["chunks"]]))
"""

PUT_OWN = r"""
from mxfs.client import ControlClient
from mxfs.kv import KVStore
with KVStore(sys.argv[1], "alice-own") as kv:
    print(json.dumps(attempt(kv.put, "k", b"v")))
"""


def _kv_chunks_by_user(m: Mounted) -> dict[str, int]:
    import json

    by_user = json.loads(mxfs("status", "--json", str(m.path)).stdout)["limits"]["by_user"]
    return {uid: held["kv_chunks"] for uid, held in by_user.items() if held["kv_chunks"]}


def test_a_writers_chunks_in_a_shared_namespace_count_against_her_not_its_owner(
        tmp_path: Path) -> None:
    """Bob fills alice's group namespace with empty chunks up to max_chunks_per_user:
    they are his chunks to count, so he is the one refused more, anywhere, and alice
    still puts into her own namespaces (counted against her, the namespace's owner,
    his chunks refused her every put: EDQUOT); the counts rebuild the same at mount."""
    from conftest import make_members, mkfs, mounted_pool

    users = ensure_users()
    alice, bob = users["alice"], users["bob"]
    limit = 20
    members = make_members(tmp_path)
    mkfs(members)
    with mounted_pool(members, f"max_chunks_per_user={limit}") as m:
        os.chmod(m.path, 0o755)
        mxfs("kv", "create", str(m.path), "alice-team", "--owner", "mxfs-alice",
             "--group", TEAM, "--mode", "0770")
        stored, past, own, held = run_as(bob, FILL_SHARED, str(m.path), str(limit))
        assert stored == held == limit and past == errno.EDQUOT
        assert run_as(alice, PUT_OWN, str(m.path)) == "ok"
        assert own == errno.EDQUOT  # his limit, wherever he puts
        assert _kv_chunks_by_user(m) == {str(bob.uid): limit, str(alice.uid): 1}
    with mounted_pool(members, f"max_chunks_per_user={limit}") as m:  # (the index loaded)
        assert _kv_chunks_by_user(m) == {str(bob.uid): limit, str(alice.uid): 1}
        assert run_as(bob, FILL_SHARED, str(m.path), "1")[1:3] == [errno.EDQUOT] * 2


EMPTY_CHUNKS = r"""
from mxfs.client import ControlClient
from mxfs.kv import KVStore
m, n = sys.argv[1], int(sys.argv[2])
with KVStore(m, "alice-team", shared=True) as kv:
    put = kv.batch_put([f"e{i}" for i in range(n)], [b""] * n)
    print(json.dumps([sum(put), kv.usage()["chunks"]]))
"""

EVICT_ALL = r"""
from mxfs.client import ControlClient
from mxfs.kv import KVStore
with KVStore(sys.argv[1], "alice-team") as kv:
    print(json.dumps([kv.evict(0), kv.usage()["chunks"]]))
"""


def test_empty_chunks_count_a_page_so_capacity_and_eviction_reach_them(
        mounted: Mounted) -> None:
    """Empty chunks a group member puts into alice's namespace are bounded by its
    capacity and evicted by her `evict` (counted at their size, they added nothing to
    its bytes: any number fit, and no eviction, which stops below its target, took
    one)."""
    users = ensure_users()
    m = str(mounted.path)
    os.chmod(mounted.path, 0o755)
    page = 4096  # (what a chunk counts for at least: kv_index.CHUNK_FLOOR)
    capacity = 16 * page
    mxfs("kv", "create", m, "alice-team", "--owner", "mxfs-alice", "--group", TEAM,
         "--mode", "0770", "--capacity", str(capacity))
    stored, held = run_as(users["bob"], EMPTY_CHUNKS, m, "100")
    assert stored == 100 and 0 < held <= capacity // page
    evicted, left = run_as(users["alice"], EVICT_ALL, m)
    assert evicted == held and left == 0
