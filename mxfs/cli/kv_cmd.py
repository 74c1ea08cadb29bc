"""`mxfs kv stats | ls | evict | verify | create | set | rm`: the KV spill tier as an operator
sees it."""

from __future__ import annotations

import argparse
import errno
import json
import os
from typing import TYPE_CHECKING, Any

from mxfs.cli.ckpt_cmd import json_everywhere
from mxfs.cli.quota_cmd import numeric_id
from mxfs.errors import MxfsError
from mxfs.proto.messages import (
    KV_NS_CREATE,
    KV_NS_REMOVE,
    KV_NS_SET,
    KV_STATS,
    KVNsCreateRequest,
    KVNsSetRequest,
)
from mxfs.text import shown, shown_key
from mxfs.units import format_size, parse_size

if TYPE_CHECKING:
    from mxfs.client.control import ControlError
    from mxfs.kv import KVStore


def _store(mount: str, namespace: str) -> KVStore:
    from mxfs.client.control import ControlError
    from mxfs.kv import KVStore

    kv = KVStore(mount, namespace, shared=True)  # an operator looks at anyone's it may
    try:
        kv.client.request(KV_STATS({"namespace": namespace}))
    except ControlError as e:
        kv.close()
        raise MxfsError(f"{e.strerror}", f"list namespaces with: mxfs kv stats {mount}"
                        ) from None
    return kv


def _keys(kv: KVStore) -> list[tuple[bytes, int, int]]:
    out: list[tuple[bytes, int, int]] = []
    while True:  # (in key order, a page past the last: a cursor the daemon seeks to)
        page = kv.list_chunks(after=out[-1][0] if out else b"")
        out += page
        if len(page) < 1000:
            return out


def cmd_stats(args: argparse.Namespace) -> int:
    from mxfs.client import ControlClient
    from mxfs.client.control import mount_root

    root = mount_root(args.mount)
    if root is None:
        raise MxfsError(f"{args.mount} is not on an mxfs mount", "give a mount point")
    with ControlClient(root) as c:
        spaces = c.request(KV_STATS())["namespaces"]
    if args.json:
        print(json.dumps({"namespaces": spaces}, indent=2))
        return 0
    if not spaces:
        print("no KV namespaces")
    for s in spaces:
        cap = format_size(s["capacity"]) if s["capacity"] else "pool"
        print(f"{shown(s['namespace'])} (uid {s['uid']}, gid {s['gid']}, mode {s['mode']}): "
              f"{s['chunks']} chunks, {format_size(s['bytes'])} of {cap}; "
              f"{s['hits']} hits, {s['misses']} misses, {s['puts']} puts, "
              f"{s['evictions']} evictions, {s['pinned']} pinned")
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    kv = _store(args.mount, args.namespace)
    try:
        rows = _keys(kv)
    finally:
        kv.close()
    if args.json:
        print(json.dumps({"chunks": [{"key": shown_key(k), "bytes": n, "pins": p}
                                     for k, n, p in rows]}, indent=2))
    else:
        for k, n, p in rows:
            print(f"{format_size(n):>10}  {'pinned ' if p else ''}{shown_key(k)}")
    return 0


def cmd_evict(args: argparse.Namespace) -> int:
    kv = _store(args.mount, args.namespace)
    try:
        n = kv.evict(parse_size(args.keep))
    finally:
        kv.close()
    print(json.dumps({"evicted": n}) if args.json else f"evicted {n} chunks")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """Read every chunk and check its checksums; damaged ones are dropped as misses."""
    kv = _store(args.mount, args.namespace)
    try:
        keys = [k for k, _, _ in _keys(kv)]
        damaged: list[str] = []
        gone = 0  # (deleted or evicted since they were listed: no damage, told apart)
        for i in range(0, len(keys), 64):
            part = keys[i:i + 64]
            failed = kv.misses["checksum"]
            missed = [k for k, got in zip(part, kv.batch_get(part), strict=True)
                      if got is None]
            if missed and kv.misses["checksum"] == failed:  # (none failed its sums)
                gone += len(missed)
            else:  # (a batch of both is told damaged whole: never damage untold)
                damaged += [shown_key(k) for k in missed]
    finally:
        kv.close()
    checked = len(keys) - gone
    if args.json:
        print(json.dumps({"checked": checked, "gone": gone, "damaged": damaged}, indent=2))
    else:
        for key in damaged:
            print(f"DAMAGED {key} (dropped)")
        print(f"checked {checked} chunks, {len(damaged)} damaged" +
              (f" ({gone} gone meanwhile: deleted or evicted)" if gone else ""))
    return 1 if damaged else 0


def _control(mount: str) -> Any:
    from mxfs.client import ControlClient
    from mxfs.client.control import mount_root

    root = mount_root(mount)
    if root is None:
        raise MxfsError(f"{mount} is not on an mxfs mount", "give a mount point")
    return ControlClient(root)


def _id_of(text: str | None, kind: str) -> int | None:
    """A uid or gid from a name or a number (None: the caller's own)."""
    import grp
    import pwd

    if text is None:
        return None
    n = numeric_id(text, "uid" if kind == "user" else "gid")
    if n is not None:
        return n
    try:
        return pwd.getpwnam(text).pw_uid if kind == "user" else grp.getgrnam(text).gr_gid
    except KeyError:
        raise MxfsError(f"no {kind} named {text!r}", f"give an existing {kind} or a number"
                        ) from None


def _mode(text: str) -> int:
    try:
        mode = int(text, 8)
    except ValueError:
        mode = -1
    if not 0 <= mode <= 0o777:
        raise MxfsError(f"mode {text!r} is not octal permission bits", "write it like 0750")
    return mode


def _refused(e: ControlError, mount: str, fixes: dict[int, str | None]) -> MxfsError:
    """The daemon's refusal as one line: its own words, which name the namespace and the
    problem, and the fix for that problem (`fixes`, by errno); a namespace that is not
    there, or that the caller may not see, is looked up in the list."""
    fix = fixes.get(e.errno or 0, f"list namespaces with: mxfs kv stats {mount}")
    return MxfsError(e.strerror or str(e), fix)


def _shown_ns(s: Any) -> str:
    return (f"KV namespace {shown(s['namespace'])} (uid {s['uid']}, gid {s['gid']}, mode "
            f"{s['mode']}, capacity {format_size(s['capacity']) if s['capacity'] else 'pool'})")


def cmd_create(args: argparse.Namespace) -> int:
    """Make a namespace ahead of its users: root gives one to a service user, so the
    engine never races anyone for its name."""
    from mxfs.client.control import ControlError

    mode = _mode(args.mode)
    fields: KVNsCreateRequest = {"namespace": args.namespace, "mode": mode,
                                 "capacity": parse_size(args.capacity), "force": args.force}
    uid, gid = _id_of(args.owner, "user"), _id_of(args.group, "group")
    if uid is not None:
        fields["uid"] = uid
    if gid is not None:
        fields["gid"] = gid
    with _control(args.mount) as c:
        try:
            s = c.request(KV_NS_CREATE(fields))
        except ControlError as e:
            root = os.geteuid() == 0
            raise _refused(e, args.mount, {
                errno.EINVAL: "pick another name",
                errno.EEXIST: "pick another name" + (", or take it over with --force (its "
                                                     "chunks are dropped)" if root else ""),
                errno.EPERM: "run it as root, or make one for yourself (no --owner or "
                             "--force, a --group you are in)",
                errno.EACCES: None, errno.EDQUOT: None,  # (their words say what to do)
            }) from None
    print(json.dumps(s) if args.json else f"made {_shown_ns(s)}")
    return 0


def cmd_set(args: argparse.Namespace) -> int:
    """Give a namespace another group or mode (its owner, to a group of her own, or
    root): how a user is cut off a shared namespace, since the daemon cannot see her
    leave a group; the presence tables handed out end when anyone loses access."""
    from mxfs.client.control import ControlError

    fields: KVNsSetRequest = {"namespace": args.namespace}
    gid = _id_of(args.group, "group")
    if gid is not None:
        fields["gid"] = gid
    if args.mode is not None:
        fields["mode"] = _mode(args.mode)
    if len(fields) == 1:
        raise MxfsError("nothing to change", "give --group, --mode or both")
    with _control(args.mount) as c:
        try:
            s = c.request(KV_NS_SET(fields))
        except ControlError as e:
            raise _refused(e, args.mount, {
                errno.EPERM: "run it as the namespace's owner (giving it a group of hers) "
                             "or as root",
                errno.EINVAL: "see mxfs kv set --help"}) from None
    print(json.dumps(s) if args.json else f"set {_shown_ns(s)}")
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    from mxfs.client.control import ControlError

    with _control(args.mount) as c:
        try:
            n = c.request(KV_NS_REMOVE({"namespace": args.namespace}))["deleted"]
        except ControlError as e:
            raise _refused(e, args.mount, {
                errno.EPERM: "run it as the namespace's owner or as root"}) from None
    print(json.dumps({"deleted": n}) if args.json else
          f"removed KV namespace {args.namespace} and its {n} chunks")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("kv", help="KV-cache chunks: stats, list, evict, verify, create, set, rm")
    verbs = s.add_subparsers(dest="verb", required=True, parser_class=type(s))
    v = verbs.add_parser("stats", help="every namespace: chunks, bytes, hits, evictions")
    v.add_argument("mount")
    v.set_defaults(func=cmd_stats)
    for name, fn, text in (("ls", cmd_ls, "chunks of a namespace, least recently used first"),
                           ("evict", cmd_evict, "evict least recently used chunks"),
                           ("verify", cmd_verify, "check every chunk against its checksums")):
        v = verbs.add_parser(name, help=text)
        v.add_argument("mount")
        v.add_argument("namespace")
        v.set_defaults(func=fn)
        if name == "evict":
            v.add_argument("--keep", default="0", help="bytes to keep (default: none)")
    v = verbs.add_parser("create", help="make a namespace for a user or group ahead of use")
    v.add_argument("mount")
    v.add_argument("namespace")
    v.add_argument("--owner", help="user name or uid (default: you; others: root only)")
    v.add_argument("--group", help="group name or gid (default: your group)")
    v.add_argument("--mode", default="0700", help="octal, like a directory's (default 0700)")
    v.add_argument("--capacity", default="0", help="bytes, e.g. 200GiB (default: the pool)")
    v.add_argument("--force", action="store_true",
                   help="root: take the name over, dropping its chunks")
    v.set_defaults(func=cmd_create)
    v = verbs.add_parser("set", help="give a namespace another group or mode")
    v.add_argument("mount")
    v.add_argument("namespace")
    v.add_argument("--group", help="group name or gid")
    v.add_argument("--mode", help="octal, like a directory's")
    v.set_defaults(func=cmd_set)
    v = verbs.add_parser("rm", help="remove a namespace and every chunk in it")
    v.add_argument("mount")
    v.add_argument("namespace")
    v.set_defaults(func=cmd_rm)
    json_everywhere(s, verbs)
