"""`mxfs kv stats | ls | evict | verify`: the KV spill tier as an operator sees it."""

from __future__ import annotations

import argparse
import base64
import json
from typing import Any

from mxfs.cli.ckpt_cmd import json_everywhere
from mxfs.errors import MxfsError
from mxfs.units import format_size, parse_size


def _store(mount: str, namespace: str) -> Any:
    from mxfs.client.control import ControlError
    from mxfs.kv import KVStore

    kv = KVStore(mount, namespace)
    try:
        kv.client.call("kv_stats", namespace=namespace)
    except ControlError as e:
        kv.close()
        raise MxfsError(f"{e.strerror}", f"list namespaces with: mxfs kv stats {mount}"
                        ) from None
    return kv


def _show(key: bytes) -> str:
    try:
        text = key.decode()
        if text.isprintable():
            return text
    except UnicodeDecodeError:
        pass
    return "0x" + key.hex()


def _keys(kv: Any) -> list[tuple[bytes, int, int]]:
    out, skip = [], 0
    while True:
        page = kv._call("kv_list", skip=skip, limit=1000)["chunks"]
        out += [(base64.b64decode(k), size, pins) for k, size, pins in page]
        if len(page) < 1000:
            return out
        skip += len(page)


def cmd_stats(args: argparse.Namespace) -> int:
    from mxfs.client import ControlClient
    from mxfs.client.control import mount_root

    root = mount_root(args.mount)
    if root is None:
        raise MxfsError(f"{args.mount} is not on an mxfs mount", "give a mount point")
    with ControlClient(root) as c:
        spaces = c.call("kv_stats")["namespaces"]
    if args.json:
        print(json.dumps({"namespaces": spaces}, indent=2))
        return 0
    if not spaces:
        print("no KV namespaces")
    for s in spaces:
        cap = format_size(s["capacity"]) if s["capacity"] else "pool"
        print(f"{s['namespace']}: {s['chunks']} chunks, {format_size(s['bytes'])} of {cap}; "
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
        print(json.dumps({"chunks": [{"key": _show(k), "bytes": n, "pins": p}
                                     for k, n, p in rows]}, indent=2))
    else:
        for k, n, p in rows:
            print(f"{format_size(n):>10}  {'pinned ' if p else ''}{_show(k)}")
    return 0


def cmd_evict(args: argparse.Namespace) -> int:
    kv = _store(args.mount, args.namespace)
    try:
        n = kv._call("kv_evict", keep=parse_size(args.keep))["evicted"]
    finally:
        kv.close()
    print(json.dumps({"evicted": n}) if args.json else f"evicted {n} chunks")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """Read every chunk and check its checksums; damaged ones are dropped as misses."""
    kv = _store(args.mount, args.namespace)
    try:
        keys = [k for k, _, _ in _keys(kv)]
        damaged = []
        for i in range(0, len(keys), 64):
            part = keys[i:i + 64]
            for k, got in zip(part, kv.batch_get(part), strict=True):
                if got is None:
                    damaged.append(_show(k))
    finally:
        kv.close()
    if args.json:
        print(json.dumps({"checked": len(keys), "damaged": damaged}, indent=2))
    else:
        for k in damaged:
            print(f"DAMAGED {k} (dropped)")
        print(f"checked {len(keys)} chunks, {len(damaged)} damaged")
    return 1 if damaged else 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("kv", help="KV-cache chunks: stats, list, evict, verify")
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
    json_everywhere(s, verbs)
