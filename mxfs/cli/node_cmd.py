"""`mxfs node add` / `mxfs node remove`: nodes that read a pool held by another node.

A reading node needs the pool's metadata server, the pool key copied from the writer
node (`mxfs.key` beside member 0's superblock), and a name; and, where the pool gives
it members (`mxfs mkfs --member NODE:PATH`), a folder for each (`--member`), which
it makes members of the pool and serves (the writer writes them through it).
`node add` checks all three against the store (the key by its name, `key_id`, which
the writer publishes when it serves chunks) and writes the node config that
`mxfs mount CONFIG MOUNTPOINT` takes (`pool/node_config.py`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from mxfs.errors import MxfsError

if TYPE_CHECKING:
    from mxfs.meta import MetaStore

# (The store, the pool and the volume are imported by the commands that use them: every
# `mxfs` command builds this module's parsers, and most never open a store.)


def member_spec(stat: Mapping[str, Any], what: str) -> str:
    """The member path a tool opens the pool of a mount by (its `stat` reply); a reading
    node's mount has none: `what` runs on the writer node."""
    first = stat["members"][0]
    if first.get("node"):
        raise MxfsError(f"{what} works on the pool's members, and node {stat.get('node')} "
                        "holds none", f"run it on node {first['node']}, which holds them")
    return str(first["path"])


def _open_store(url: str, readonly: bool = True) -> MetaStore:
    """The pool's store on its server.  Never a local path: a folder is a pool's own
    SQLite store (a mounted pool's live one, perhaps), which nodes do not share."""
    from mxfs.meta import MetaStore, Unusable, location

    if not location.is_server(url):
        raise MxfsError(f"{url} is not a metadata server's URL",
                        "give the pool's postgresql:// URL (mxfs status on the writer node)")
    fix = "check the URL and that this node may connect to it"
    try:
        return MetaStore.open(url, readonly=readonly)
    except OSError as e:
        raise MxfsError(f"the metadata server {location.public(url)} cannot be reached ({e})",
                        fix) from None
    except Unusable as e:  # (the server refused, or holds no mxfs store: it says which)
        raise MxfsError(" ".join(str(e).split()), fix) from None


def cmd_node_add(args: argparse.Namespace) -> int:
    from mxfs.meta import lease, location
    from mxfs.pool.key import install_key, key_id, read_key
    from mxfs.pool.node_config import NODE_NAME, NodeConfig, write_node_config
    from mxfs.pool.superblock import check_label
    from mxfs.vol.volume import KEY_ID_KEY, MEMBERS_KEY

    if not NODE_NAME.fullmatch(args.name):
        raise MxfsError(f"node name {args.name!r} is not one",
                        "use letters, digits, '.', '_' and '-' (at most 63)")
    check_label(args.label or "")
    key = read_key(args.key)
    with contextlib.closing(_open_store(args.meta)) as store:
        pool = store.setting("pool_uuid")
        if pool is None:
            raise MxfsError(f"{location.public(args.meta)} holds no mxfs pool",
                            "give the URL the pool was made with (mxfs mkfs --meta)")
        published = store.setting(KEY_ID_KEY)
        if published is None:
            raise MxfsError(f"pool {pool}'s writer node has never served chunks",
                            "mount it there with -o chunk_port=N,chunk_addr=IP first")
        if published != key_id(key, pool):
            raise MxfsError(f"the key {args.key} is not pool {pool}'s",
                            "copy mxfs.key from member 0 of the pool's writer node")
        members = store.setting(MEMBERS_KEY)
        if members is None:
            raise MxfsError(f"pool {pool} has no members named in its store",
                            "mount it once on its writer node")
        for n in lease.nodes(store):
            if n["name"] == args.name and (n["role"] == "writer" or n["state"] == "alive"):
                raise MxfsError(f"node name {args.name} is in use ({n['role']} on "
                                f"{n['host']}, {n['state']})", "pick another --name")
    paths = _own_members(json.loads(members), args.name, args.member or [], pool)
    config = os.path.abspath(args.config)
    os.makedirs(os.path.dirname(config), mode=0o755, exist_ok=True)
    stem = os.path.splitext(config)[0]
    key_file = stem + ".key"
    if os.path.realpath(args.key) != os.path.realpath(key_file):
        install_key(key, key_file)
    state = os.path.abspath(args.state or stem + ".state")
    os.makedirs(state, mode=0o700, exist_ok=True)
    write_node_config(NodeConfig(config, pool, args.name, args.meta, key_file, state,
                                 args.label or "", paths))
    print(f"node {args.name} joined pool {pool}: mount it with mxfs mount {config} "
          "MOUNTPOINT")
    return 0


def _own_members(known: Mapping[str, Any], name: str, given: list[str], pool: str
                 ) -> list[str]:
    """The member folders this node holds (made members of the pool if they are not
    yet), as many as the pool gives it (`mxfs mkfs --member NAME:PATH`)."""
    from mxfs.pool.pool import format_node_members
    from mxfs.pool.superblock import Superblock

    indices = [i for i, owner in enumerate(known.get("owners") or []) if owner == name]
    if len(given) != len(indices):
        where = ", ".join(map(str, indices))
        raise MxfsError(f"pool {pool} gives node {name} {len(indices)} members"
                        + (f" ({where})" if indices else "") + f", and {len(given)} were "
                        "given", f"name {'each with --member PATH' if indices else 'none'}"
                        " (mxfs mkfs --member NODE:PATH names a node's members)")
    if not indices:
        return []
    model = Superblock.from_bytes(str(known["superblock"]).encode())
    paths = [os.path.realpath(p) for p in given]
    for p in paths:
        if not os.path.isdir(p):
            raise MxfsError(f"member {p} is not an existing folder",
                            "create it or mount the member device there")
    format_node_members(paths, indices, model)
    return paths


def cmd_node_remove(args: argparse.Namespace) -> int:
    from mxfs.meta import lease

    with contextlib.closing(_open_store(args.meta, readonly=False)) as store:
        for n in lease.nodes(store):
            if n["name"] != args.name or n["role"] != "reader":
                continue
            if n["state"] == "alive":
                raise MxfsError(f"node {args.name} is alive (pid {n['pid']} on {n['host']})",
                                f"unmount it there first (mxfs umount {n['mountpoint']})")
            store.drop_setting(lease.node_key(args.name))
            print(f"node {args.name} removed from pool {store.setting('pool_uuid')}")
            return 0
    raise MxfsError(f"no reading node {args.name} in that pool",
                    "see the nodes with mxfs status on a node of the pool")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("node", help="join a node that reads the pool, or take one out")
    nodes = p.add_subparsers(dest="node_cmd", required=True)
    s = nodes.add_parser("add", help="join this host as a reading node (no members)")
    s.add_argument("--meta", required=True, help="the pool's metadata server URL")
    s.add_argument("--key", required=True,
                   help="the pool key, copied from member 0 of the writer node (0600)")
    s.add_argument("--name", required=True, help="this node's name in the pool")
    s.add_argument("--config", required=True, help="where to write the node config (TOML)")
    s.add_argument("--state", help="this node's lock folder (default: beside the config)")
    s.add_argument("--label", help="a label for the mount (default: none)")
    s.add_argument("--member", action="append", metavar="PATH",
                   help="a folder of this node's that holds a member the pool gives it "
                        "(mxfs mkfs --member NODE:PATH), in index order; repeat for each")
    s.set_defaults(func=cmd_node_add)
    s = nodes.add_parser("remove", help="forget a dead reading node")
    s.add_argument("--meta", required=True, help="the pool's metadata server URL")
    s.add_argument("name")
    s.set_defaults(func=cmd_node_remove)
