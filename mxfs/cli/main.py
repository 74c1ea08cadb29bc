"""The `mxfs` command: mkfs, mount, umount, status, stripes, warm, put, load-bench, ckpt, kv,
fsck, scrub, meta, df, top, bench, demo.

Every user error is one line on stderr and a non-zero exit code; a traceback
only appears with --debug (or MXFS_DEBUG=1).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import io
import json
import logging
import os
import stat
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any, NoReturn

from mxfs import __version__
from mxfs.errors import MxfsError, UsageError
from mxfs.proto.constants import LAYOUT_XATTR
from mxfs.text import shown
from mxfs.units import count_arg, finite_arg, format_size, parse_size


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message}", f"see {self.prog} --help")


def _emit(args: argparse.Namespace, data: dict[str, Any], text: str) -> None:
    print(json.dumps(data, indent=2) if getattr(args, "json", False) else text)


# ---- mkfs ------------------------------------------------------------------

def cmd_mkfs(args: argparse.Namespace) -> int:
    from mxfs.vol.format import format_pool

    unit = parse_size(args.stripe_unit)
    pool = format_pool(args.member, unit, label=args.label, force=args.force, meta=args.meta)
    data = {"pool_uuid": pool.uuid, "label": pool.label, "stripe_unit": pool.stripe_unit,
            "members": [m.path for m in pool.members]}
    _emit(args, data, f"made pool {pool.uuid} ({len(pool.members)} members, stripe unit "
          f"{format_size(unit)}); mount it with: mxfs mount {pool.members[0].path} MOUNTPOINT")
    return 0


# ---- mount / umount --------------------------------------------------------

def _options(raw: list[str] | None) -> list[str]:
    return [o for group in raw or [] for o in group.split(",") if o]


def _from_config(args: argparse.Namespace) -> list[str]:
    """Fill the mount point and options from a pool config file where it names them."""
    from mxfs.pool import read_pool_config

    options = _options(args.o)
    if os.path.isfile(args.pool):
        conf = read_pool_config(args.pool)
        options = [str(o) for o in conf.get("options", [])] + options
        args.mountpoint = args.mountpoint or conf.get("mountpoint")
    if not args.mountpoint:
        raise UsageError("no mount point given",
                         "name one, or set mountpoint = \"...\" in the pool config")
    return options


def cmd_mount(args: argparse.Namespace) -> int:
    options = _from_config(args)
    if args.foreground:
        return _mount_foreground(args, options)
    from mxfs.fs.options import check_options
    from mxfs.pool import Pool
    from mxfs.vol.mounts import check_apart, check_mountpoint, runtime_dir, spawn_daemon

    # Check what we can here, so the common mistakes need no daemon log.
    check_options(options)
    check_mountpoint(args.mountpoint, nonempty="nonempty" in options)
    pool = Pool.open(args.pool, degraded="degraded" in options)
    check_apart(args.mountpoint, [pool.members[m].path for m in pool.local_members()])
    # (a reading node's has its name: nodes of one pool may share a host, as in tests)
    log_path = os.path.join(runtime_dir(), f"{pool.uuid}-{pool.node}.log" if pool.node
                            else f"{pool.uuid}.log")
    # Absolute: the daemon runs from a neutral folder, not the caller's.
    argv = ["mount", "-f", os.path.abspath(args.pool), os.path.abspath(args.mountpoint)]
    if options:
        argv += ["-o", ",".join(options)]
    pid, warnings = spawn_daemon(argv, log_path)
    for w in warnings:
        print(f"mxfs: warning: {w}", file=sys.stderr)
    print(f"mounted pool {pool.uuid} on {os.path.abspath(args.mountpoint)} "
          f"(daemon pid {pid}, log {log_path})")
    return 0


class JsonLogFormatter(logging.Formatter):
    """One JSON object a line (-o log_json): for log collectors."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"), "level": record.levelname,
               "logger": record.name, "message": record.getMessage(), "pid": record.process}
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out)


def _mount_foreground(args: argparse.Namespace, options: list[str]) -> int:
    from mxfs.fs import daemon
    from mxfs.vol.mounts import WAITING

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLogFormatter() if "log_json" in options else logging.Formatter(
        "%(asctime)s %(name)s %(levelname)s %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    fd = args.ready_fd
    told = False

    def ready(err: MxfsError | None, warnings: list[str]) -> None:
        nonlocal told
        for w in warnings:
            logging.getLogger("mxfs.daemon").warning("%s", w)
        if told or fd is None:
            return
        told = True
        msg = ("\t".join(["ok", *warnings]) + "\n" if err is None
               else f"error\t{err.problem}\t{err.fix or ''}\n")
        try:
            os.write(fd, msg.encode())
            os.close(fd)
        except OSError:
            pass

    def waiting() -> None:  # (mount-time work goes on: `mxfs mount` waits longer)
        if not told and fd is not None:
            with contextlib.suppress(OSError):
                os.write(fd, WAITING)

    daemon.run(args.pool, args.mountpoint, options, ready, waiting)
    return 0


def cmd_umount(args: argparse.Namespace) -> int:
    from mxfs.client import ControlClient
    from mxfs.client.control import Untrusted
    from mxfs.proto.constants import FSTYPE
    from mxfs.proto.mountinfo import mount_table
    from mxfs.vol.mounts import unmount, wait_pid_gone

    mp = os.path.abspath(args.mountpoint)
    kind = mount_table().get(mp)
    if kind is None:
        raise MxfsError(f"{args.mountpoint} is not mounted", "nothing to do")
    if kind != FSTYPE:
        raise MxfsError(f"{args.mountpoint} is a {kind} mount, not mxfs", "use umount")
    got: dict[str, Any] = {}

    def ask() -> None:  # (finding the socket touches the mount: a hung daemon's hangs)
        try:
            with ControlClient(mp, timeout=5) as c:
                got["pid"] = c.server.get("pid")
        except Untrusted:
            got["theirs"] = True  # another user's own daemon: neither asked nor waited for
        except OSError:
            pass  # the daemon is gone: detach the dead mount
    asker = threading.Thread(target=ask, name="mxfs-umount", daemon=True)
    asker.start()
    asker.join(args.timeout)
    hung = asker.is_alive()
    pid, theirs = got.get("pid"), bool(got.get("theirs"))
    unmount(mp, lazy=args.lazy or (pid is None and not theirs))
    if pid and not wait_pid_gone(int(pid), 120):
        raise MxfsError(f"daemon {pid} is still writing back after 120 s",
                        "wait, then check mxfs status")
    print(f"unmounted {mp}" + (
        "" if pid else " (its daemon is another user's, not waited for)" if theirs else
        f" (detached: its daemon did not answer in {args.timeout:g} s, stopped or hung; "
        "stop it with kill)" if hung else " (its daemon had died)"))
    return 0


UMOUNT_ASK_S = 10.0  # a daemon that has not answered `mxfs umount` by then is hung


# ---- status ----------------------------------------------------------------

STATUS_WAIT_S = 15.0  # a daemon that has not answered `mxfs status` by then is reported


def _status_of_mount(mp: str, wait: float = STATUS_WAIT_S) -> dict[str, Any]:
    return _status_of_mounts([mp], wait)[0]


def _status_of_mounts(mps: list[str], wait: float) -> list[dict[str, Any]]:
    """Each daemon's status, all asked at once, each from a thread of its own: finding a
    socket touches the mount, and a hung daemon's mount would hang its asker (the
    thread is left); asked one after another, each hung daemon would add `wait`."""
    from mxfs.client import ControlClient

    def ask(mp: str, got: dict[str, Any]) -> None:
        try:
            with ControlClient(mp, timeout=10) as c:
                got.update(c.stat())
        except OSError as e:
            got.update(error=f"daemon not answering ({e.strerror or e})")

    asks = []
    for mp in mps:
        got: dict[str, Any] = {}
        t = threading.Thread(target=ask, args=(mp, got), name="mxfs-status", daemon=True)
        t.start()
        asks.append((mp, t, got))
    deadline = time.monotonic() + wait
    found = []
    for mp, t, got in asks:
        t.join(max(0.0, deadline - time.monotonic()))
        if t.is_alive() or "error" in got:
            got = {"mountpoint": mp, "error": got.get("error") or "daemon not answering (its "
                   f"mount did not answer in {wait:g} s: stopped or hung)"}
        found.append(got)
    return found


def _status_of_pool(spec: str) -> dict[str, Any]:
    from mxfs.pool import Pool
    from mxfs.pool.lock import read_lock_info

    pool = Pool.open(spec)
    holder = read_lock_info(pool) or {}
    if holder.get("mountpoint"):
        return _status_of_mount(holder["mountpoint"])
    return {"pool_uuid": pool.uuid, "label": pool.label, "stripe_unit": pool.stripe_unit,
            "mountpoint": None, "pid": None, "members": pool.usage()}


def _format_status(s: dict[str, Any]) -> str:
    if "error" in s:
        return f"{s['mountpoint']}: {s['error']}"
    where = f"mounted on {s['mountpoint']} (daemon pid {s['pid']})" if s.get("mountpoint") \
        else "not mounted"
    lines = [f"pool {s['pool_uuid']} {s.get('label') or ''}".rstrip() + f": {where}",
             f"  stripe unit {format_size(s['stripe_unit'])}"
             + (f", {s['inodes']} inodes, {s['open_files']} open" if "inodes" in s else "")
             + (f", {s['orphans_queued']} removed being freed" if s.get("orphans_queued")
                else "")
             + (f", {s['closing']} descriptors still closing (a member not answering?)"
                if s.get("closing") else "")]
    if "io_engine" in s:
        lines.append(f"  I/O engine: {s['io_engine']} ({s['native_engine']})")
        if s.get("io_taken_back"):
            lines.append(f"  I/O requests taken back after a stall: {s['io_taken_back']} "
                         "(the kernel lost them; see docs/operations.md)")
    wake = s.get("wake_latency")
    if wake:
        lines.append(f"  wake latency limit {wake['us']} us while busy: "
                     + (f"cannot be set ({wake['broken']})" if wake["broken"] else
                        f"{'held now' if wake['held'] else 'not held now'}, "
                        f"taken {wake['holds']} times"))
    held = s.get("lease")
    if held:
        lines.append(f"  lease: {held['state']}, epoch {held['epoch']}, "
                     f"{max(0.0, held['expires_in']):.0f} of {held['ttl']:.0f} s left"
                     + (f" (renewals failing: {held['error']})" if held["error"] else ""))
    lim = s.get("limits")
    if lim:
        busiest = lim["busiest_user"]
        lines.append(f"  control: {lim['connections']} of {lim['max_conns']} connections, "
                     f"{lim['users']} users"
                     + (f" (busiest uid {busiest[0]}: {busiest[1]} of "
                        f"{lim['max_conns_per_user']})" if busiest else "")
                     + f"; {lim['fds_open']} of {lim['fds_max']} descriptors"
                     + (f" ({lim['fds_held']} of {lim['fds_budget']} held for users, "
                        f"{lim['fds_share']} a user)" if "fds_held" in lim else ""))
        for uid, held in (lim.get("by_user") or {}).items():
            lines.append(f"    uid {uid}: " + ", ".join(
                f"{n} {what.replace('_', ' ')}" for what, n in held.items() if n))
    if s.get("quotas"):
        from mxfs.cli.quota_cmd import quota_lines

        lines.append("  quotas (mxfs quota):")
        lines += quota_lines(s["quotas"], indent="    ")
    feed = s.get("feed")
    if feed and feed["role"] == "publishes":
        lines.append(f"  change feed: {feed['published']} groups of changes published "
                     "for the reading nodes")
    elif feed:
        lines.append("  change feed: " + (f"read to row {feed['seq']}, "
                     f"{feed['invalidations']} kernel invalidations"
                     + (f", {feed['pending']} waiting" if feed.get("pending") else "")
                     if feed["live"] else
                     f"NOT READ ({feed['error']}): the kernel asks again every second"))
    remote = s.get("remote_reads")
    if remote:
        lines.append(f"  direct reads of other nodes: {remote['grants']} files open, "
                     f"{remote['connections']} connections to their owners"
                     + (f"; {remote['refused']} opens read through the mount (limits "
                        "max_remote_reads, max_remote_reads_per_user)" if remote["refused"]
                        else ""))
    fwd = s.get("kv_forward")
    if fwd and (fwd["puts"] or fwd["claims"] or fwd["pins"] or fwd["requests"]
                or fwd["writing"]):
        lines.append(f"  KV sent on to the writer: {fwd['puts']} chunks put "
                     f"({format_size(fwd['put_bytes'])}), {fwd['claims']} claims and waits "
                     f"({fwd['waiting']} waiting now), {fwd['pins']} pins and unpins, "
                     f"{fwd['requests']} other requests; "
                     f"{format_size(fwd['writing'])} being written here; "
                     f"{fwd['sending']} requests being sent, {fwd['queued']} queued")
    views = s.get("kv_views")
    if views:
        lines.append(f"  KV lookups: {views['tables']} namespaces' keys ({views['keys']}) "
                     "held here, kept by the change feed" if views["live"] else
                     "  KV lookups ask the metadata store: the change feed cannot be read")
    for n in s.get("nodes") or []:
        here = " (this node)" if n["name"] == s.get("node") else ""
        lines.append(f"  node {n['name']}{here}: {n['role']}, {n['state']}, epoch {n['epoch']}, "
                     f"{n['members']} members, chunks at {n['addr'] or '(none)'}; "
                     f"{n['host']} pid {n['pid']} on {n['mountpoint']}")
    for m in s["members"]:
        if m.get("failed"):
            lines.append(f"  member {m['index']}: {m['path']}  FAILED: {m['failed']}")
            continue
        if m.get("node"):
            lines.append(f"  member {m['index']}: node {m['node']}'s")
            continue
        lines.append(f"  member {m['index']}: {m['path']}  {format_size(m['used'])} used of "
                     f"{format_size(m['size'])}, {format_size(m['free'])} free")
    from mxfs.pool.pool import pool_totals

    total = pool_totals(s["members"])  # members sharing a disk count once
    lines.append(f"  capacity {format_size(total['size'])}, {format_size(total['free'])} free")
    if s.get("degraded"):
        lines.append(f"  DEGRADED: {s['lost_files']} files have stripes on a failed member "
                     "and are lost (RAID0 keeps no copy):")
        lines += [f"    {shown(name)}" for name in s["lost_examples"]]
        if s["lost_files"] > len(s["lost_examples"]):
            lines.append(f"    ... and {s['lost_files'] - len(s['lost_examples'])} more "
                         "(mxfs status --json)")
    return "\n".join(lines)


def cmd_status(args: argparse.Namespace) -> int:
    from mxfs.client.control import trusted_uid
    from mxfs.proto.constants import FSTYPE
    from mxfs.proto.mountinfo import fuse_mounts, mount_table

    others: dict[str, int | None] = {}
    if args.target:
        target = os.path.abspath(args.target)
        kind = mount_table().get(target)
        found = [_status_of_mount(target, args.timeout) if kind == FSTYPE
                 else _status_of_pool(args.target)]
    else:
        # Other users' mounts are not asked, nor counted in the exit code: any user may
        # mount a fuse.mxfs of her own (fusermount3), which root may not even enter.
        mounts = fuse_mounts(FSTYPE)
        others = {mp: uid for mp, uid in mounts.items() if uid is not None
                  and not trusted_uid(uid)}
        found = _status_of_mounts([mp for mp in mounts if mp not in others], args.timeout)
    if args.json:
        print(json.dumps(found if not args.target else found[0], indent=2))
    else:
        print("\n".join(_format_status(s) for s in found) if found else
              "no mxfs pool is mounted" + (" by root or you" if others else ""))
        for mp, uid in others.items():
            print(f"{shown(mp)}: uid {uid}'s mount, not asked (name it to ask it)")
    return status_code(found)


def status_code(found: list[dict[str, Any]]) -> int:
    """What `mxfs status` exits with, for scripts and monitors: 2 when a daemon does not
    answer, 1 when a pool is degraded (a member failed), else 0."""
    if any("error" in s for s in found):
        return 2
    return 1 if any(s.get("degraded") for s in found) else 0


# ---- layouts ---------------------------------------------------------------

def _xattr_error(path: str, e: OSError) -> MxfsError:
    if e.errno in (errno.ENODATA, errno.ENOTSUP):
        return MxfsError(f"{path} is not on an mxfs mount", "give a path inside one")
    if e.errno == errno.ENOENT:
        return MxfsError(f"{path} does not exist", "check the path")
    if e.errno == errno.EBUSY:
        return MxfsError(f"{path} already holds data",
                         "set the layout on its directory or on a new empty file")
    if e.errno == errno.EINVAL:
        return MxfsError(f"layout refused for {path}",
                         "the unit must be a multiple of 4 KiB up to 1 GiB, the width at "
                         "most the members")
    if e.errno == errno.EPERM:
        return MxfsError(f"not allowed to change the layout of {path}", "ask its owner or root")
    return MxfsError(f"{path}: {e.strerror}", "check the path")


def _on_mxfs(path: str) -> None:
    """Refuse a path outside every mxfs mount before touching its xattrs (another
    filesystem would take user.mxfs.layout as a plain xattr and keep it)."""
    from mxfs.client.control import mount_root

    if not os.path.lexists(path):  # (mount_root asks the mount above a missing path)
        raise MxfsError(f"{path} does not exist", "check the path")
    try:
        root = mount_root(path)
    except OSError as e:
        raise _xattr_error(path, e) from None
    if root is None:
        raise MxfsError(f"{path} is not on an mxfs mount", "give a path inside one")


def cmd_getstripe(args: argparse.Namespace) -> int:
    _on_mxfs(args.path)
    try:
        raw = os.getxattr(args.path, LAYOUT_XATTR).decode()
    except OSError as e:
        raise _xattr_error(args.path, e) from None
    fields = {k: int(v) for k, v in (p.split("=") for p in raw.split())}
    text = "\n".join(f"{k}: {v}" for k, v in fields.items())
    _emit(args, {"path": args.path, **fields}, f"{args.path}\n{text}")
    return 0


def cmd_setstripe(args: argparse.Namespace) -> int:
    parts = []
    if args.unit is not None:
        unit = parse_size(args.unit)
        if unit < 1:
            raise UsageError(f"--unit {args.unit} is not a size", "give one like 1MiB")
        parts.append(f"stripe_unit={unit}")
    if args.across_nodes and args.width is not None:
        raise UsageError("--across-nodes and --width both name the width",
                         "give one of them")
    _on_mxfs(args.path)
    if args.across_nodes:  # every member of the pool, whichever node holds it
        from mxfs.client.control import mount_root

        args.width = len(_status_of_mount(str(mount_root(args.path))).get("members") or [1])
    if args.width is not None:
        if args.width < 1:
            raise UsageError(f"--width {args.width} is not positive", "give 1 or more")
        parts.append(f"stripe_width={args.width}")
    if not parts:
        raise UsageError("nothing to set", "give --unit SIZE, --width N or --across-nodes")
    try:
        os.setxattr(args.path, LAYOUT_XATTR, " ".join(parts).encode())
    except OSError as e:
        raise _xattr_error(args.path, e) from None
    return cmd_getstripe(args)


# ---- demo ------------------------------------------------------------------

def cmd_demo(args: argparse.Namespace) -> int:
    from mxfs.cli.demo import run_demo

    return run_demo(size=parse_size(args.size), scratch=args.dir, keep=args.keep,
                    as_json=args.json)


# ---- models ------------------------------------------------------------------

def _regular_files(paths: list[str]) -> list[tuple[str, int]]:
    """The regular files `paths` name, folders walked (sorted), each with the file
    system it must be on: a walked folder's own (a link out of it, to /proc/kmsg say,
    which procfs calls a regular file and which reads forever, is skipped with FIFOs,
    devices, dangling links and names gone meanwhile, and named as skipped).  A path
    given that is none, on a dead mount, or that cannot be read: one line."""
    found: list[tuple[str, int]] = []
    skipped: list[str] = []

    def fail(e: OSError) -> NoReturn:
        where = e.filename or "?"
        if e.errno == errno.ENOENT:
            raise MxfsError(f"{where} does not exist", "check the path") from None
        if e.errno == errno.ENOTCONN:
            raise MxfsError(f"{where} is on a mount whose daemon died",
                            "run mxfs umount on it, then mount the pool again") from None
        raise MxfsError(f"{where} cannot be read ({e.strerror})",
                        "check the path and its permissions") from None

    def skip(e: OSError) -> None:  # (inside a walk: a tenant's, perhaps; the rest goes on)
        if e.errno == errno.ENOTCONN:
            fail(e)
        skipped.append(e.filename or "?")

    def regular(path: str, dev: int) -> bool:
        try:
            st = os.stat(path)
        except OSError as e:
            skip(e)
            return False
        if stat.S_ISREG(st.st_mode) and st.st_dev == dev:
            return True
        skipped.append(path)
        return False

    for p in paths:
        try:
            st = os.stat(p)
        except OSError as e:
            fail(e)
        if stat.S_ISDIR(st.st_mode):
            for d, _, names in os.walk(p, onerror=skip):
                found += sorted((f, st.st_dev) for f in (os.path.join(d, n) for n in names)
                                if regular(f, st.st_dev))
        elif stat.S_ISREG(st.st_mode):
            found.append((p, st.st_dev))
        else:
            raise MxfsError(f"{p} is not a regular file", "name files or folders of them")
    if skipped:
        print(f"mxfs: skipped {len(skipped)} paths that are not regular files of the "
              f"folder's file system, or could not be read (such as "
              f"{shown(skipped[0])})", file=sys.stderr)
    return found


def _open_regular(path: str, dev: int) -> int | None:
    """`path` opened to read if it is still a regular file on the file system `dev`,
    else None (closed by `read_fd`).  Looked at through an O_PATH descriptor first,
    which opens nothing: a name swapped meanwhile for a link to /proc/kmsg or a device
    is never opened to read (a device's open alone may act: a watchdog's arms it)."""
    try:
        where = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ELOOP):
            return None  # (gone meanwhile, or a link that leads nowhere)
        raise MxfsError(f"{path} cannot be read ({e.strerror})",
                        "check the path and its permissions") from None
    try:
        st = os.fstat(where)
        if not stat.S_ISREG(st.st_mode) or st.st_dev != dev:
            return None
        fd = os.open(f"/proc/self/fd/{where}", os.O_RDONLY | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as e:
        raise MxfsError(f"{path} cannot be read ({e.strerror})",
                        "check the path and its permissions") from None
    finally:
        os.close(where)
    return fd


def cmd_warm(args: argparse.Namespace) -> int:
    """Read files through the mount so the kernel's cache holds them for FUSE readers."""
    import time

    from mxfs.cli.measure import read_fd

    files = _regular_files(args.path)
    buf = bytearray(8 << 20)
    total, start = 0, time.perf_counter()
    for f, dev in files:
        fd = _open_regular(f, dev)  # (judged again as opened: it may be swapped meanwhile)
        if fd is not None:
            total += read_fd(fd, buf)[2]
    secs = time.perf_counter() - start
    _emit(args, {"files": len(files), "bytes": total, "seconds": secs},
          f"warmed {len(files)} files, {format_size(total)} in {secs:.1f} s "
          f"({total / max(secs, 1e-9) / 1e9:.2f} GB/s)")
    return 0


def cmd_load_bench(args: argparse.Namespace) -> int:
    from mxfs.cli.load_bench import run_load_bench

    files = [path for path, _ in _regular_files(args.path)]
    return run_load_bench(files, args.device, args.repeat, args.json)


def cmd_put(args: argparse.Namespace) -> int:
    """Copy files into an unmounted pool (no FUSE needed), sealed with their checksums."""
    import time

    from mxfs.admin.offline_put import put_files

    start = time.perf_counter()
    done = put_files(args.pool, args.files, args.to)
    secs = time.perf_counter() - start
    total = sum(p.size for p in done)
    _emit(args, {"files": [{"source": p.source, "path": p.path, "bytes": p.size}
                           for p in done], "bytes": total, "seconds": secs},
          "\n".join(f"{shown(p.source)} -> {shown(p.path)} ({format_size(p.size)})"
                    for p in done) +
          f"\nput {len(done)} files, {format_size(total)} in {secs:.1f} s "
          f"({total / max(secs, 1e-9) / 1e9:.2f} GB/s)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="mxfs", description="mxfs: a striped storage tier for AI computing centres")
    p.add_argument("--version", action="version", version=f"mxfs {__version__}")
    p.add_argument("--debug", action="store_true", help="show a traceback on any error")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    s = sub.add_parser("mkfs", help="make a pool from empty member folders")
    s.add_argument("--member", action="append", required=True, metavar="PATH",
                   help="a member folder (repeat for each member); NODE:PATH names one "
                        "that node NODE holds (it joins with mxfs node add --member PATH)")
    s.add_argument("--stripe-unit", default="1MiB", help="stripe unit, a multiple of 4 KiB")
    s.add_argument("--label", default="", help="a name for the pool")
    s.add_argument("--force", action="store_true", help="wipe members of an old pool")
    s.add_argument("--meta", default="", metavar="URL",
                   help="keep the metadata in this PostgreSQL database "
                        "(postgresql://HOST/DB; credentials from ~/.pgpass or PGPASSFILE) "
                        "instead of SQLite on member 0")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_mkfs)

    s = sub.add_parser("mount", help="mount a pool (POOL: a member path or a pool config)")
    s.add_argument("pool")
    s.add_argument("mountpoint", nargs="?", help="default: the pool config's mountpoint")
    s.add_argument("-f", "--foreground", action="store_true", help="stay in the foreground")
    s.add_argument("-o", action="append", metavar="OPT[,OPT...]",
                   help="mount options: allow_other, noatime, nonempty, io_threads=N, ...")
    s.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)
    s.set_defaults(func=cmd_mount)

    s = sub.add_parser("umount", help="unmount and wait for the daemon to write back")
    s.add_argument("mountpoint")
    s.add_argument("--lazy", action="store_true", help="detach now even if files are open")
    s.add_argument("--timeout", type=finite_arg(3600), default=UMOUNT_ASK_S,
                   metavar="SECONDS", help="how long to wait for the daemon to answer "
                   "before detaching its mount as hung (default %(default)s)")
    s.set_defaults(func=cmd_umount)

    s = sub.add_parser("status", help="members, capacity, usage and daemon of pools")
    s.add_argument("target", nargs="?", help="a mount point or pool (default: every mount)")
    s.add_argument("--json", action="store_true")
    s.add_argument("--timeout", type=finite_arg(3600), default=STATUS_WAIT_S,
                   metavar="SECONDS",
                   help="how long to wait for each daemon's answer (default %(default)s)")
    s.set_defaults(func=cmd_status)

    s = sub.add_parser("getstripe", help="show a file's or directory's stripe layout")
    s.add_argument("path")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_getstripe)

    s = sub.add_parser("setstripe", help="set a directory's default layout (or an empty file's)")
    s.add_argument("path")
    s.add_argument("--unit", help="stripe unit, e.g. 4MiB")
    s.add_argument("--width", type=int, help="number of members to stripe over")
    s.add_argument("--across-nodes", action="store_true",
                   help="stripe over every member of the pool, whichever node holds it "
                        "(new files default to the writer node's own members)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_setstripe)

    s = sub.add_parser("warm", help="read models through the mount into the kernel cache")
    s.add_argument("path", nargs="+", help="files or folders")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_warm)

    s = sub.add_parser("put", help="copy files into an unmounted pool (as root, no FUSE)")
    s.add_argument("pool", help="a member path or a pool config")
    s.add_argument("files", nargs="+", help="local files to copy")
    s.add_argument("--to", default="/", help="folder in the pool (default: its root)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_put)

    s = sub.add_parser("load-bench", help="time mxfs.load against safetensors on real files")
    s.add_argument("path", nargs="+", help="safetensors files or folders of them")
    s.add_argument("--device", default="cpu")
    s.add_argument("--repeat", type=count_arg(1, 1000), default=3)
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_load_bench)

    from mxfs.cli import check_cmd, ckpt_cmd, kv_cmd, meta_cmd, node_cmd, observe_cmd, quota_cmd

    ckpt_cmd.add_parser(sub)
    kv_cmd.add_parser(sub)
    check_cmd.add_parsers(sub)
    meta_cmd.add_parser(sub)
    quota_cmd.add_parser(sub)
    node_cmd.add_parser(sub)
    observe_cmd.add_parsers(sub)
    observe_cmd.add_bench_parser(sub)

    s = sub.add_parser("demo", help="make a demo pool, mount it; load a model, checkpoint, "
                       "reuse KV, write and read files, each against its baseline")
    s.add_argument("--size", default="2GiB", help="bytes of files to write and read each "
                   "way (the jobs use a quarter, at most 256 MiB)")
    s.add_argument("--dir", help="where a scratch folder is made (default /var/tmp); "
                   "one that other users can change is refused")
    s.add_argument("--keep", action="store_true", help="leave the pool mounted and in place")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_demo)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    for out in (sys.stdout, sys.stderr):  # (a name shown escaped, on any terminal's encoding)
        if isinstance(out, io.TextIOWrapper):
            out.reconfigure(errors="backslashreplace")
    debug = "--debug" in argv or os.environ.get("MXFS_DEBUG", "").lower() in ("1", "true", "yes")
    if debug:
        os.environ["MXFS_DEBUG"] = "1"  # daemons started from here show them too
    try:
        args = build_parser().parse_args(argv)
        return int(args.func(args) or 0)
    except MxfsError as e:
        if debug:
            raise
        print(f"mxfs: {shown(str(e))}", file=sys.stderr)  # (it may name users' files)
        return e.exit_code
    except KeyboardInterrupt:
        print("mxfs: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # (its reader stopped reading: `mxfs kv ls | head`)
        with contextlib.suppress(OSError):  # (no flush of what is left at exit either)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as e:
        if debug:
            raise
        # A file the user named is missing, not allowed, or on a full member.
        name = e.filename
        where = f": {shown(name if isinstance(name, str | bytes) else str(name))}" if name \
            else ""
        print(f"mxfs: {shown(str(e.strerror or e))}{where}", file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001 - the last line of defence for users
        if debug:
            raise
        print(f"mxfs: internal error: {type(e).__name__}: {shown(str(e))} "
              "(run with --debug for a traceback, and please report it)", file=sys.stderr)
        return 70
