"""Mount options checked one by one, so a wrong one is named with its fix.

FUSE itself says only "fuse_session_new() failed" for an option it does not know,
and a bad number once listed every option instead of the one that was wrong.
"""

from __future__ import annotations

import difflib

from mxfs.errors import MxfsError
from mxfs.fs.limits import Limits
from mxfs.fs.node_files import HOLDS_AT_ONCE

# mxfs's options that take a whole number: (the least it may be, the most).
NUMBERS: dict[str, tuple[int, int]] = {
    "io_threads": (1, 1024), "readahead": (0, 1 << 20), "write_behind": (0, 1 << 16),
    "meta_backup": (0, 1 << 31), "metrics_port": (1, 65535),
    "wake_latency_us": (0, (1 << 31) - 1), "lease_s": (2, 3600),
    "chunk_port": (0, 65535), "stray_s": (600, 1 << 31),
    "holds_full_s": (1, 3600), "holds_at_once": (1, HOLDS_AT_ONCE),
    "connect_s": (1, 600), "unacked_s": (1, 600), "renew_s": (1, 3600),
    "gc_freeze_s": (1, 86400),
    **{name: (1, 1 << 40) for name in Limits.options()},
}
FLAGS = ("nonempty", "noatime", "writeback_cache", "degraded", "log_json", "metrics_by_user")
TEXTS = ("metrics_addr", "chunk_addr", "node")
# What FUSE and the kernel take (libfuse 3's mount options and the generic ones).
FUSE = ("allow_other", "allow_root", "default_permissions", "ro", "rw", "nosuid", "suid",
        "nodev", "dev", "noexec", "exec", "atime", "relatime", "norelatime", "strictatime",
        "lazytime", "nolazytime", "sync", "async", "dirsync", "auto_unmount", "fsname",
        "subtype", "max_read", "blksize", "debug")


def check_options(options: list[str]) -> None:
    """MxfsError naming the first option that is unknown or has a bad value."""
    known = (*NUMBERS, *FLAGS, *TEXTS, *FUSE)
    given = {opt.partition("=")[0] for opt in options}
    if "allow_other" in given and given & {"suid", "dev"}:
        # Any user could place a set-uid program or a device node and use it.
        raise MxfsError(f"mount option {sorted(given & {'suid', 'dev'})[0]} with allow_other "
                        "lets any user make a set-uid program or a device node work",
                        "leave suid and dev out of a mount other users may write to")
    for opt in options:
        if not opt:
            continue
        key, eq, value = opt.partition("=")
        if key not in known:
            near = difflib.get_close_matches(key, known, n=1)
            raise MxfsError(f"unknown mount option {key!r}",
                            (f"did you mean {near[0]}? " if near else "") +
                            "see the mount options in README.md")
        if key in NUMBERS:
            low, high = NUMBERS[key]
            digits = value.strip()  # (ASCII: int("²") raised a traceback, not this line)
            if not (digits.isascii() and digits.isdecimal()) or not low <= int(digits) <= high:
                raise MxfsError(f"mount option {opt!r}: {key} takes a whole number from "
                                f"{low} to {high}", f"write it like {key}={max(low, 1)}")
        elif key in TEXTS and not value:
            raise MxfsError(f"mount option {opt!r} needs a value", f"write it like {key}=...")
        elif key == "writeback_cache" and value not in ("", "0", "1", "yes", "no"):
            raise MxfsError(f"mount option {opt!r}: writeback_cache is on or off",
                            "write writeback_cache or writeback_cache=0")
        elif key in FLAGS and eq and key != "writeback_cache":
            raise MxfsError(f"mount option {opt!r} takes no value", f"write just {key}")
