"""`mxfs quota MOUNT`: show or set how many bytes and inodes each user may own.

Everyone sees their own line; root sees every user's and sets limits (`vol/quota.py`
enforces them in the daemon and keeps them in the metadata store).
"""

from __future__ import annotations

import argparse
import json
import pwd
from typing import Any

from mxfs.errors import MxfsError, UsageError
from mxfs.proto.messages import QUOTA, QuotaReport, QuotaRequest
from mxfs.units import MAX_SIZE, format_size, size_arg

# The largest uid or gid: 2^32 - 1 is (uid_t)-1, "no id" to chown and setuid.
ID_MAX = 2**32 - 2


def numeric_id(text: str, kind: str) -> int | None:
    """`text` as a uid or gid (`kind`: "uid", "gid") if it is a number, else None (a
    name); a number no kernel gives out is refused here, not stored for nobody."""
    if not (text.isascii() and text.isdecimal()):
        return None
    if len(text.lstrip("0")) > len(str(ID_MAX)) or int(text) > ID_MAX:
        raise UsageError(f"{kind} {text[:24]}{'...' if len(text) > 24 else ''} is out of range",
                         f"give a {kind} from 0 to {ID_MAX}, or a name")
    return int(text)


def _uid(user: str) -> int:
    n = numeric_id(user, "uid")
    if n is not None:
        return n
    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError:
        raise UsageError(f"no user named {user!r}", "give a user name or a numeric uid") from None


def _count(text: str) -> int:
    digits = text.strip()
    if not (digits.isascii() and digits.isdecimal()):
        raise UsageError(f"bad inode count {text[:24]!r}",
                         "give a whole number (0 lifts the limit)")
    if len(digits.lstrip("0")) > len(str(MAX_SIZE)) or int(digits) > MAX_SIZE:
        raise UsageError(f"inode count {digits[:24]}{'...' if len(digits) > 24 else ''} is "
                         "too big", f"give at most {MAX_SIZE} (0 lifts the limit)")
    return int(digits)


def quota_lines(report: QuotaReport, indent: str = "") -> list[str]:
    """One line per user: what it owns against its limits (for `quota` and `status`)."""
    def limit(n: int, fmt: Any) -> str:
        return f" of {fmt(n)}" if n else " (no limit)"
    lines = []
    for row in report["users"]:
        writing = (f" (+{format_size(row['reserved'])} being written)"
                   if row["reserved"] else "") + (
            f" (+{format_size(row['held'])} kept for readers)" if row.get("held") else "")
        source = "" if row["own"] or row["uid"] == 0 or not (
            row["bytes_limit"] or row["inodes_limit"]) else "  [default]"
        lines.append(f"{indent}uid {row['uid']}: {format_size(row['bytes'])}"
                     f"{limit(row['bytes_limit'], format_size)}{writing}, "
                     f"{row['inodes']} inodes{limit(row['inodes_limit'], str)}{source}")
    default = report["default"]
    if default["bytes_limit"] or default["inodes_limit"]:
        lines.append(f"{indent}default for every other user: "
                     + (format_size(default["bytes_limit"]) if default["bytes_limit"]
                        else "no byte limit") + ", "
                     + (f"{default['inodes_limit']} inodes" if default["inodes_limit"]
                        else "no inode limit"))
    return lines


def cmd_quota(args: argparse.Namespace) -> int:
    from mxfs.client.control import ControlClient, mount_root

    root = mount_root(args.mount)
    if root is None:
        raise MxfsError(f"{args.mount} is not on an mxfs mount", "give a mount point (mxfs status)")
    fields: QuotaRequest = {}
    if args.user is not None:
        fields["uid"] = _uid(args.user)
    setting = args.bytes is not None or args.inodes is not None or args.clear
    if args.clear and (args.bytes is not None or args.inodes is not None):
        raise UsageError("--clear removes both limits", "give --clear alone, or the limits")
    if setting:
        if args.user is None and not args.default:
            raise UsageError("setting a quota needs --user or --default",
                             "name whose quota it is")
        fields.update({"set": True, "default": bool(args.default), "clear": bool(args.clear)})
        if args.bytes is not None:
            fields["bytes"] = args.bytes
        if args.inodes is not None:
            fields["inodes"] = _count(args.inodes)
    elif args.default:
        raise UsageError("--default only goes with --bytes, --inodes or --clear",
                         "every user's line shows the limits that hold for it")
    with ControlClient(root, timeout=60) as c:
        report = c.request(QUOTA(fields))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print("\n".join(quota_lines(report)) or "no user owns anything on this pool yet")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("quota", help="show or set how many bytes and inodes users may own")
    s.add_argument("mount")
    who = s.add_mutually_exclusive_group()
    who.add_argument("--user", help="user name or uid (root: show or set this user's)")
    who.add_argument("--default", action="store_true",
                     help="set the limits of every user without limits of their own")
    s.add_argument("--bytes", type=size_arg(), help="most bytes of file sizes, KV chunks included "
                   "(like 500GiB; 0 lifts the limit)")
    s.add_argument("--inodes", help="most files, folders and KV chunks (0 lifts the limit)")
    s.add_argument("--clear", action="store_true", help="remove the user's own limits")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_quota)
