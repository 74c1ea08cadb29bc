"""How many FUSE requests reach the daemon at once: its tasks, and the kernel's slots.

Two first-come queues stand in front of the daemon's per-user turns (`fs/fair.py`):
- pyfuse3 reads requests with a pool of tasks, each held until its request is
  answered.  With 64, one user's 150 blocked reads took them all and another
  user's lookups waited in the kernel's single queue behind the rest of hers.
  `fuse_tasks` (a mount option, `fs/limits.py`) is how many read at once; a task
  that waits for its user's turn costs a coroutine and a buffer (touched only as
  far as its request reaches: a page for a read, a write's bytes for a write, and
  pyfuse3 copies those once more: about 2 MiB a task parked on a 1 MiB write, so
  1 GiB at most with the default 512).  A user with more requests waiting inside
  than that still fills them: the bar is raised, not removed.
- The kernel sends readahead (every buffered read of pages not cached) in the
  background, at most `max_background` requests at a time (12 by default), the
  rest queued in order of asking: one user's streams held them all and another's
  read waited behind every request queued before it.  Root raises the limit in
  the FUSE control filesystem, to half the tasks, so the requests reach the
  daemon, where they wait their users' turns instead.
"""

from __future__ import annotations

import logging
import os
import subprocess

from mxfs.vol.mounts import mount_device

log = logging.getLogger("mxfs.fs")

CONTROL_FS = "/sys/fs/fuse/connections"
MOUNT = "/bin/mount"


def background_slots(tasks: int) -> tuple[int, int]:
    """The kernel's (max_background, congestion_threshold) for `tasks` reading tasks:
    half of them for the background, the rest left for lookups, opens, direct reads
    and writes; readahead is cut short past three quarters of the slots."""
    slots = max(12, tasks // 2)
    return slots, max(9, slots * 3 // 4)


def raise_background(mountpoint: str, tasks: int) -> bool:
    """Blocking: set the mount's background slots (`background_slots`) in the FUSE
    control filesystem, mounting it where nothing has (systemd does, at boot); False
    where that cannot be done (not root, no such filesystem: the kernel's 12 stay)."""
    dev = mount_device(mountpoint)
    if dev is None:
        return False
    major, minor = (int(n) for n in dev.split(":"))
    conn = os.path.join(CONTROL_FS, str(major << 20 | minor))  # (the kernel's dev_t)
    if not os.path.isdir(conn) and os.path.isdir(CONTROL_FS) and os.geteuid() == 0:
        try:  # (the system's own mount, not one found on a PATH a user may write to)
            subprocess.run([MOUNT, "-t", "fusectl", "fusectl", CONTROL_FS], env={},
                           capture_output=True, check=False, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            pass  # (the writes below say what could not be done)
    slots, congestion = background_slots(tasks)
    try:
        # (the slots first: raised, so the threshold never stands above them)
        with open(os.path.join(conn, "max_background"), "w") as f:
            f.write(str(slots))
        with open(os.path.join(conn, "congestion_threshold"), "w") as f:
            f.write(str(congestion))
    except OSError as e:
        log.info("could not raise the FUSE background slots of %s to %d (%s): the "
                 "kernel's 12 stay", mountpoint, slots, os.strerror(e.errno or 0))
        return False
    return True
