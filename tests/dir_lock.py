"""A directory's lock held in the kernel for as long as a test wants, by a real process
of a real user, with no help from the daemon.

The process lists the directory with getdents64 into a buffer registered with
userfaultfd: the kernel holds the directory's inode lock (shared) while it copies the
names out, the copy faults on the buffer's missing page, and the fault waits until
the page is given (here: until the test lets go).  A FUSE invalidation of a name in
that directory (`pyfuse3.invalidate_entry` takes the lock exclusively) waits as long,
as it would behind a user's lookup or mkdir the daemon answers slowly.  userfaultfd
for kernel faults needs privilege, so the process makes it as root, then becomes the
user before it opens the directory.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from users import User

HOLD = r"""
import ctypes, mmap, os, select, struct, sys, threading
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
SYS_USERFAULTFD, SYS_GETDENTS64 = 323, 217  # x86_64
UFFDIO_API, UFFDIO_REGISTER, UFFDIO_ZEROPAGE = 0xC018AA3F, 0xC020AA00, 0xC020AA04
uffd = libc.syscall(SYS_USERFAULTFD, os.O_CLOEXEC)
if uffd < 0:
    sys.exit("userfaultfd: " + os.strerror(ctypes.get_errno()))
import fcntl
fcntl.ioctl(uffd, UFFDIO_API, bytearray(struct.pack("QQQ", 0xAA, 0, 0)))
page = mmap.PAGESIZE
addr = libc.mmap(None, page, mmap.PROT_READ | mmap.PROT_WRITE,
                 mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
fcntl.ioctl(uffd, UFFDIO_REGISTER, bytearray(struct.pack("QQQQ", addr, page, 1, 0)))
uid, gid, groups = int(sys.argv[2]), int(sys.argv[3]), [int(g) for g in sys.argv[4:]]
os.setgroups(groups); os.setresgid(gid, gid, gid); os.setresuid(uid, uid, uid)
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
done = []
listing = threading.Thread(target=lambda: done.append(
    libc.syscall(SYS_GETDENTS64, fd, ctypes.c_void_p(addr), page)), daemon=True)
listing.start()
select.select([uffd], [], [])  # the copy faulted: the lock is held from here on
os.read(uffd, 32)
print("held", flush=True)
sys.stdin.read()  # until the test lets go
fcntl.ioctl(uffd, UFFDIO_ZEROPAGE, bytearray(struct.pack("QQQq", addr, page, 0, 0)))
listing.join(60)
print("done" if done else "stuck", flush=True)
"""


@contextlib.contextmanager
def held_dir_lock(path: Path, user: User) -> Iterator[subprocess.Popen[str]]:
    """`path`'s inode lock held by a process of `user` until the block ends."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(path), str(user.uid), str(user.gid),
         *map(str, user.groups)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    assert holder.stdin is not None and holder.stdout is not None
    try:
        line = holder.stdout.readline()
        assert line == "held\n", (line, holder.stderr.read() if holder.stderr else "")
        yield holder
    finally:
        holder.stdin.close()  # (the page is given: the listing ends, the lock with it)
        try:
            holder.wait(60)
        except subprocess.TimeoutExpired:
            holder.kill()
            holder.wait()
