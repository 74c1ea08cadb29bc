"""`mxfs ckpt ls | verify | rm | prune`: checkpoints as an operator sees them."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

from mxfs.errors import MxfsError
from mxfs.text import shown
from mxfs.units import format_size


def _root(path: str) -> str:
    if not os.path.isdir(path):
        raise MxfsError(f"{path} is not a folder", "give the folder that holds checkpoints")
    return path


def _when(ns: int) -> str:
    return datetime.datetime.fromtimestamp(ns / 1e9).strftime("%Y-%m-%d %H:%M:%S")


def cmd_ls(args: argparse.Namespace) -> int:
    from mxfs.ckpt import catalog

    root = _root(args.folder)
    entries, damaged = catalog.listing(root)
    partial = catalog.partials(root)
    if args.json:
        print(json.dumps({"checkpoints": [e.as_dict() for e in entries],
                          "incomplete": partial, "damaged": damaged}, indent=2))
        return 0
    if not entries:
        print(f"no checkpoints in {shown(root)}")
    for e in entries:
        mark = "  <- latest" if e.latest else ""
        comp = f", {e.compress}" if e.compress else ""
        print(f"{shown(e.name):30} {_when(e.created_ns)}  {format_size(e.nbytes):>10}  "
              f"{e.tensors} tensors{comp}{mark}")
    if partial:
        print(f"({len(partial)} incomplete save(s) left by dead writers; "
              f"mxfs ckpt prune {shown(root)} removes them)")
    for path in damaged:
        print(f"({shown(path)} is damaged: mxfs ckpt verify says how; mxfs ckpt rm "
              "removes it)")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from mxfs.ckpt import verify
    from mxfs.ckpt.catalog import CheckpointError

    bad = 0
    results = []
    for path in args.path:
        try:
            damage = verify(path)
        except CheckpointError as e:  # (its manifest: each path is looked at all the same)
            bad += 1
            results.append({"path": path, "ok": False, "error": str(e)})
            print(f"mxfs: {shown(str(e))}", file=sys.stderr)  # (as the CLI says one)
            continue
        bad += bool(damage)
        results.append({"path": path, "ok": not damage,
                        "damage": [{"file": d.file, "begin": d.begin, "end": d.end,
                                    "tensors": d.tensors, "member": d.member} for d in damage]})
        if not args.json:
            for d in damage:
                print(f"DAMAGED {shown(d.describe())}")
            if not damage:
                print(f"ok {shown(path)}")
    if args.json:
        print(json.dumps(results, indent=2))
    return 1 if bad else 0


def cmd_rm(args: argparse.Namespace) -> int:
    from mxfs.ckpt import remove

    for path in args.path:
        remove(path)
        if not args.json:
            print(f"removed {shown(path)}")
    if args.json:
        print(json.dumps({"removed": args.path}))
    return 0


def cmd_prune(args: argparse.Namespace) -> int:
    from mxfs.ckpt import prune

    # A user prunes her own; root each owner's (`prune`: counted per owner either way).
    euid = os.geteuid()
    removed = prune(_root(args.folder), args.keep, owner=None if euid == 0 else euid)
    if args.json:
        print(json.dumps({"removed": removed}))
    else:
        print("\n".join(f"removed {shown(p)}" for p in removed) or "nothing to remove")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`mxfs ckpt ...` and its verbs."""
    s = sub.add_parser("ckpt", help="list, verify, remove and prune checkpoints")
    verbs = s.add_subparsers(dest="verb", required=True, parser_class=type(s))
    v = verbs.add_parser("ls", help="complete checkpoints in a folder, oldest first")
    v.add_argument("folder")
    v.set_defaults(func=cmd_ls)
    v = verbs.add_parser("verify", help="check every byte of checkpoints against checksums")
    v.add_argument("path", nargs="+")
    v.set_defaults(func=cmd_verify)
    v = verbs.add_parser("rm", help="remove checkpoints (latest moves to the newest left)")
    v.add_argument("path", nargs="+")
    v.set_defaults(func=cmd_rm)
    v = verbs.add_parser("prune", help="keep the newest N checkpoints of each owner (yours, "
                         "unless root), drop dead partial saves")
    v.add_argument("folder")
    v.add_argument("--keep", type=int, required=True, metavar="N")
    v.set_defaults(func=cmd_prune)
    json_everywhere(s, verbs)


def json_everywhere(command: argparse.ArgumentParser, verbs: argparse._SubParsersAction
                    ) -> None:
    """`--json` on a command and each of its verbs (where a script would read it)."""
    command.add_argument("--json", action="store_true")
    for p in verbs.choices.values():  # (not a default of its own: `CMD --json VERB` holds)
        p.add_argument("--json", action="store_true", default=argparse.SUPPRESS)
