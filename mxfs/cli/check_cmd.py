"""`mxfs fsck` and `mxfs scrub`: check a pool's metadata, and its sealed data."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING

from mxfs.cli.node_cmd import member_spec
from mxfs.errors import MxfsError
from mxfs.units import size_arg

if TYPE_CHECKING:  # (imported when run: the command starts without the daemon's code)
    from mxfs.admin.fsck import Finding
    from mxfs.vol.volume import Volume

# What fsck finds and leaves for a person even with --repair (it has no repair for it).
_NO_REPAIR = {"entry outside a directory"}


def repairable(f: Finding) -> bool:
    """Would `fsck --repair` repair `f`?  Only then is --repair the fix to suggest."""
    return not f.repaired and not f.fatal and f.kind not in _NO_REPAIR


def _open_pool_offline(spec: str, repair: bool) -> Volume:
    """The pool, held (lock taken before the store is opened) so no mount starts meanwhile."""
    from mxfs.vol.volume import Volume

    try:
        return Volume.open(spec, hold="mxfs fsck --repair" if repair else "mxfs fsck")
    except MxfsError as e:
        if e.fix and "umount" in e.fix:
            raise MxfsError(e.problem, f"{e.fix}; mxfs scrub checks data while mounted") \
                from None
        raise


def cmd_fsck(args: argparse.Namespace) -> int:
    from mxfs.admin.fsck import fsck
    from mxfs.meta import lease

    vol = _open_pool_offline(args.pool, args.repair)
    try:
        findings = fsck(vol, args.repair)
        nodes = lease.nodes(vol.store) if vol.pool.meta_url else []
    finally:
        vol.store.close()
        vol.unlock()
    left = [f for f in findings if not f.repaired]
    code = 0 if not findings else (1 if not left else 4)
    if args.json:
        print(json.dumps({"findings": [vars(f) for f in findings], "nodes": nodes,
                          "exit": code}, indent=2))
    else:
        for n in nodes:  # (a pool across nodes: who else holds a lease on it)
            print(f"node {n['name']}: {n['role']}, {n['state']}, epoch {n['epoch']}, "
                  f"{n['host']} pid {n['pid']} on {n['mountpoint']}")
        for f in findings:
            print(f.line())
        print("clean" if not findings else
              f"{len(findings) - len(left)} repaired, {len(left)} left"
              + (" (run again with --repair)" if not args.repair
                 and any(repairable(f) for f in left) else ""))
    return code


def cmd_scrub(args: argparse.Namespace) -> int:
    from mxfs.admin.scrub import scrub
    from mxfs.client.control import ControlClient, mount_root
    from mxfs.meta import MetaStore, Unusable, location
    from mxfs.pool import Pool
    from mxfs.vol.volume import reach_owners

    if os.geteuid() != 0:
        raise MxfsError("scrub reads the members' chunk files directly", "run it as root")
    root = mount_root(args.target) if os.path.isdir(args.target) else None
    degraded = False
    if root is not None:
        with ControlClient(root) as c:
            stat = c.stat()
        spec = stat.get("config") or member_spec(stat, "mxfs scrub")
        # (a mount that serves with a member failed: its pool is opened as it was, the
        # failed member's stripes reported missing, not refused as missing at the start)
        degraded = bool(stat.get("degraded")) or any(m.get("failed") for m in stat["members"])
    else:
        spec = args.target
    try:
        pool = Pool.open(spec, degraded=degraded)
    except MxfsError as e:
        if root is None and e.fix and "-o degraded" in e.fix:  # (scrub takes no -o)
            raise MxfsError(e.problem, "attach it, or mount the pool with -o degraded and "
                            "scrub the mount") from None
        raise
    try:
        store = MetaStore.open(pool.meta_location, readonly=True)
    except (Unusable, OSError) as e:  # (as fsck says it: Volume.open)
        raise MxfsError(f"metadata store in {location.public(pool.meta_location)} cannot "
                        f"be opened ({e})", "restore it from a backup (mxfs meta restore)"
                        ) from None
    show = not args.json and sys.stderr.isatty()
    try:
        if pool.meta_url:  # (a pool across nodes: the others' stripes through them)
            reach_owners(pool, store)
        if not pool.local_members():
            holder = next((m.node for m in pool.members if m.node), "")
            raise MxfsError(f"mxfs scrub works on the pool's members, and node {pool.node} "
                            "holds none", f"run it on node {holder}, which holds them"
                            if holder else "run it on the writer node (mxfs status)")
        if show:
            from rich.progress import Progress

            with Progress(transient=True) as bar:
                task = bar.add_task("scrub", total=None)
                checked, bad, unchecked = scrub(
                    pool, store, args.rate or 0,
                    lambda done, total: bar.update(task, completed=done, total=total))
        else:
            checked, bad, unchecked = scrub(pool, store, args.rate or 0)
    finally:
        store.close()
    if args.json:
        print(json.dumps({"checked": checked, "damaged": [vars(b) for b in bad],
                          "unchecked": [vars(u) for u in unchecked]}, indent=2))
    else:
        for line in [b.line() for b in bad] + [u.line() for u in unchecked]:
            print(line)
        files = len({b.path for b in bad})
        failed = [str(m.index) for m in pool.members if m.failed]
        print(f"checked {checked} sealed files; "
              + (f"{files} damaged" if bad else "all blocks match their checksums")
              + (f" (member {', '.join(failed)} failed: its stripes are missing)"
                 if bad and failed else "")
              + (f"; {len(unchecked)} not checked (each line above says why: a node "
                 "that could not be reached, scrub again once it serves; or a damaged "
                 "seal)" if unchecked else ""))
    return 1 if bad or unchecked else 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("fsck", help="check an unmounted pool's metadata and chunk files")
    s.add_argument("pool", help="a member path or pool config")
    s.add_argument("--repair", action="store_true", help="fix what can be fixed")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_fsck)
    s = sub.add_parser("scrub", help="read every sealed file and check its checksums")
    s.add_argument("target", help="a mount point, or a member path of an unmounted pool")
    s.add_argument("--rate", type=size_arg(), help="read at most this many bytes a second, "
                   "e.g. 200MiB (0: no limit)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_scrub)
