"""`mxfs meta backup | ls | dump | restore | migrate`: copies of the metadata store, and
moving it between engines."""

from __future__ import annotations

import argparse
import datetime
import errno
import json
import os
from typing import TYPE_CHECKING

from mxfs.cli.node_cmd import member_spec
from mxfs.errors import MxfsError
from mxfs.proto.messages import META_BACKUP, META_SYNC

if TYPE_CHECKING:
    from mxfs.pool import Pool


def _pool_of(target: str, what: str) -> Pool:
    """The pool a mount point or member path names, for `what` ("mxfs meta ls"): root's
    alone, as its metadata store is (the daemon would refuse another user's sync with
    words about syncing, which the user never asked for)."""
    from mxfs.client.control import ControlClient, mount_root
    from mxfs.pool import Pool

    if os.geteuid() != 0:
        raise MxfsError(f"{what} reads the pool's metadata store, which only root may read",
                        "run it as root")
    root = mount_root(target) if os.path.isdir(target) else None
    if root is not None:
        with ControlClient(root, timeout=600) as c:
            target = member_spec(c.stat(), what)
            # What the daemon holds in memory (sizes of files being written, the open
            # group of changes) goes into the store first: the dump is what users saw.
            c.request(META_SYNC())
    return Pool.open(target)


def cmd_backup(args: argparse.Namespace) -> int:
    from mxfs.client.control import ControlClient, mount_root

    root = mount_root(args.mount) if os.path.isdir(args.mount) else None
    if root is None:
        raise MxfsError(f"{args.mount} is not an mxfs mount",
                        "give the mount point (an unmounted pool needs no online copy)")
    with ControlClient(root, timeout=600) as c:
        path = c.request(META_BACKUP())["path"]
    print(json.dumps({"backup": path}) if args.json else f"metadata backed up to {path}")
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    from mxfs.meta import backup

    pool = _pool_of(args.pool, "mxfs meta ls")
    found = [(c, backup.problem(c.path, pool.uuid))
             for d in pool.backup_dirs() for c in backup.copies(d)]
    found.sort(key=lambda x: -x[0].taken_ns)
    if args.json:
        print(json.dumps([{"path": c.path, "taken_ns": c.taken_ns, "problem": p}
                          for c, p in found], indent=2))
        return 0
    if not found:
        print("no backups")
    for c, p in found:
        when = datetime.datetime.fromtimestamp(c.taken_ns / 1e9).strftime("%Y-%m-%d %H:%M:%S")
        print(f"{when}  {c.path}  {p or 'good'}")
    return 0


def cmd_dump(args: argparse.Namespace) -> int:
    from mxfs.meta import MetaStore, Unusable
    from mxfs.meta.dump import dump

    _check_dump_path(args.file)
    pool = _pool_of(args.pool, "mxfs meta dump")
    try:
        store = MetaStore.open(pool.meta_location, readonly=True)
    except Unusable as e:
        raise MxfsError(str(e), "restore it from a backup (mxfs meta restore)") from None
    try:
        rows = dump(store, args.file)
    except ValueError as e:
        raise MxfsError(str(e), "name the dump FILE.sql, FILE.json, or either with .zst") from None
    except OSError as e:
        if e.filename != args.file:
            raise  # (the store's, not the dump file's)
        raise _unwritable(args.file, e) from None
    finally:
        store.close()
    print(json.dumps({"file": args.file, "rows": rows}) if args.json
          else f"dumped {rows} rows to {args.file}")
    return 0


def _check_dump_path(path: str) -> None:
    """Refuse a dump file that cannot be written before the daemon is asked to sync and
    the store is read: its folder missing, or the name a folder."""
    folder = os.path.dirname(path) or "."
    if not os.path.isdir(folder):
        raise _unwritable(path, OSError(errno.ENOENT, os.strerror(errno.ENOENT)))
    if os.path.isdir(path):
        raise _unwritable(path, OSError(errno.EISDIR, os.strerror(errno.EISDIR)))


def _unwritable(path: str, e: OSError) -> MxfsError:
    """Why the dump file `path` cannot be written, and the fix for that cause."""
    fixes = {errno.ENOENT: f"make {os.path.dirname(path) or '.'} first, or name a file in "
                           "a folder that exists",
             errno.EISDIR: "name a file, like DIR/meta.json.zst",
             errno.ENOSPC: "free space there, or dump elsewhere (.json.zst is smallest)",
             errno.EDQUOT: "free space there, or dump elsewhere (.json.zst is smallest)",
             errno.EFBIG: "dump elsewhere, or compressed (.json.zst)",
             errno.EACCES: "name a file in a folder you may write",
             errno.EPERM: "name a file in a folder you may write",
             errno.EROFS: "name a file on a file system mounted read-write"}
    return MxfsError(f"the dump {path} cannot be written ({e.strerror or e})",
                     fixes.get(e.errno or 0, "name another file"))


def cmd_restore(args: argparse.Namespace) -> int:
    """Hold the pool before reading anything: a mount started meanwhile would run on a
    store about to be swapped away, and lose what it wrote."""
    from mxfs.pool import Pool
    from mxfs.pool.lock import pool_lock

    pool = Pool.open(args.pool)
    pool.require_members("mxfs meta restore")
    with pool_lock(pool, "mxfs meta restore"):
        kept = _restore_held(pool, args.file, args.pool)
    print(json.dumps({"restored": args.file, "previous": kept}) if args.json
          else f"restored the metadata store from {args.file}; the previous one is {kept}")
    return 0


def _restore_held(pool: Pool, file: str, spec: str) -> str:
    """Load `file`, check it is this pool's, put it in place and recover; the kept store."""
    from mxfs.meta import Unusable
    from mxfs.meta.dump import restore
    from mxfs.vol.volume import Volume

    if os.path.isdir(file):
        raise MxfsError(f"{file} is a folder, not a dump (is it a member? the order is "
                        "mxfs meta restore FILE POOL)", "give a dump made by mxfs meta dump")
    if not os.path.isfile(file):
        raise MxfsError(f"{file} does not exist", "give a dump made by mxfs meta dump")
    try:
        kept = restore(file, pool.meta_location, pool.uuid, pool.meta_dir)
    except (ValueError, OSError, Unusable) as e:
        raise MxfsError(f"{file} cannot be read as a metadata dump of this pool ({e})",
                        "give this pool's dump, made by mxfs meta dump") from None
    except Exception as e:  # noqa: BLE001 - zstd errors on foreign input
        raise MxfsError(f"{file} is not a metadata dump ({type(e).__name__}: {e})",
                        "give a dump made by mxfs meta dump") from None
    vol = Volume.open(spec)  # the caller holds the lock
    vol.restored_from = file
    vol.checked = True  # (a store built here from the dump: closed clean, not left to check)
    vol.recover()  # drops chunk files the restored store does not know
    vol.close()
    return kept


def cmd_migrate(args: argparse.Namespace) -> int:
    from mxfs.admin.migrate import migrate

    where, rows = migrate(args.pool, args.to, force=args.force)
    print(json.dumps({"meta": where, "rows": rows}) if args.json
          else f"copied {rows} rows to {where}, checked them, and switched the pool to it")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    from mxfs.cli.ckpt_cmd import json_everywhere

    s = sub.add_parser("meta", help="back up, dump and restore the metadata store")
    verbs = s.add_subparsers(dest="verb", required=True, parser_class=type(s))
    v = verbs.add_parser("backup", help="copy the store of a mounted pool to the next member now")
    v.add_argument("mount")
    v.set_defaults(func=cmd_backup)
    v = verbs.add_parser("ls", help="the backups of a pool, newest first")
    v.add_argument("pool", help="a mount point or member path")
    v.set_defaults(func=cmd_ls)
    v = verbs.add_parser("dump", help="write the store as SQL or JSON (.zst to compress)")
    v.add_argument("file")
    v.add_argument("pool", help="a mount point or member path")
    v.set_defaults(func=cmd_dump)
    v = verbs.add_parser("migrate", help="move an unmounted pool's metadata to another "
                         "engine (a PostgreSQL URL, or member: SQLite on member 0)")
    v.add_argument("pool", help="a member path or pool config")
    v.add_argument("--to", required=True, metavar="URL|member")
    v.add_argument("--force", action="store_true",
                   help="replace another pool's metadata in that database")
    v.set_defaults(func=cmd_migrate)
    v = verbs.add_parser("restore", help="replace an unmounted pool's store with a dump")
    v.add_argument("file")
    v.add_argument("pool", help="a member path or pool config")
    v.set_defaults(func=cmd_restore)
    json_everywhere(s, verbs)
