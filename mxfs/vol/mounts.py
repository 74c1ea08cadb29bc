"""Mount points: checks before mounting, the kernel's mount table, background
daemons and unmounting.  Pure process and file work, no FUSE calls."""

from __future__ import annotations

import errno
import fcntl
import os
import select
import stat
import subprocess
import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import BinaryIO

from mxfs.errors import MxfsError
from mxfs.proc import NEUTRAL_CWD, python_module, running
from mxfs.proto.constants import FSTYPE
from mxfs.proto.mountinfo import mount_table, unescape

READY_TIMEOUT = 120.0  # a daemon silent this long is killed ...
WAITING = b"wait\n"  # ... and each of these on its pipe gives it that long again
# The daemon's log (on tmpfs: RAM) is rotated past this many bytes (`rotate_log`).
LOG_CAP = 64 << 20


def check_mountpoint(path: str, nonempty: bool = False) -> str:
    """The absolute mount point, or one line saying why it cannot be used."""
    real = os.path.abspath(path)
    try:
        os.stat(real)
    except FileNotFoundError:
        raise MxfsError(f"mount point {path} does not exist", f"create it: mkdir -p {path}") \
            from None
    except OSError as e:
        if e.errno == errno.ENOTCONN and mount_table().get(real) == FSTYPE:
            # An mxfs daemon died here (its pool lock is free, or we fail later):
            # detach the dead mount so a restart just works.
            unmount(real, lazy=True)
            return check_mountpoint(path, nonempty)
        if e.errno == errno.ENOTCONN:
            raise MxfsError(f"mount point {path} holds a dead mount (its daemon died)",
                            f"detach it: umount -l {path}") from None
        raise MxfsError(f"mount point {path} cannot be read ({e.strerror})",
                        "check the path") from None
    if not os.path.isdir(real):
        raise MxfsError(f"mount point {path} is not a directory", "give an empty folder")
    if real in mount_table() or os.path.ismount(real):
        raise MxfsError(f"mount point {path} is busy: something is already mounted there",
                        f"unmount it first (mxfs umount {path})")
    if not nonempty and os.listdir(real):
        raise MxfsError(f"mount point {path} is not empty",
                        "use an empty folder, or pass -o nonempty to hide its contents")
    return real


def check_apart(mountpoint: str, folders: Iterable[str]) -> None:
    """Refuse a mount point that is, holds or lies in one of the pool's own `folders`
    (its members on this node): mounted over them (-o nonempty), the daemon's own
    opens of its chunk files went through its mount and hung it, and a mount inside
    one stored what was written there as zeros."""
    point = os.path.realpath(mountpoint)
    for folder in folders:
        real = os.path.realpath(folder)
        if point == real or real.startswith(point.rstrip("/") + "/") or \
                point.startswith(real.rstrip("/") + "/"):
            how = "is" if point == real else "holds" if len(point) < len(real) else "is in"
            raise MxfsError(f"mount point {mountpoint} {how} the pool's member folder "
                            f"{folder}", "mount the pool on a folder outside its members")


def spawn_daemon(argv: list[str], log_path: str) -> tuple[int, list[str]]:
    """Start `mxfs mount -f` in its own session and wait until it says it is mounted:
    (its pid, warnings for the user).  A daemon whose mount-time work goes on says
    WAITING now and then (`fs/startup.py`): each gives it READY_TIMEOUT again, since
    that work grows with what tenants stored, and a start killed past a fixed
    deadline began again from scratch, for ever.

    The log is root's alone (0600; it names files and callers); its folder stays
    reachable, since every user connects to the control sockets there.
    """
    ensure_runtime_dir(os.path.dirname(log_path))
    r, w = os.pipe()
    with open_private_log(log_path) as logf:
        logged = logf.seek(0, os.SEEK_END)  # where this start's lines begin
        proc = subprocess.Popen(
            python_module("mxfs", *argv, "--ready-fd", str(w)), cwd=NEUTRAL_CWD,
            pass_fds=(w,), stdin=subprocess.DEVNULL, stdout=logf, stderr=logf,
            start_new_session=True)
    os.close(w)
    answer = b""
    closed = False  # the daemon's end of the pipe went: it is exiting (or said its word)
    deadline = time.monotonic() + READY_TIMEOUT
    with os.fdopen(r, "rb", buffering=0) as pipe:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([pipe], [], [], 0.5)
            if ready:
                chunk = pipe.read(4096)
                if not chunk:
                    closed = True
                    break
                answer += chunk
                while answer.startswith(WAITING):
                    answer = answer[len(WAITING):]
                    deadline = time.monotonic() + READY_TIMEOUT
            elif proc.poll() is not None:
                closed = True
                break
    text = answer.decode(errors="replace").strip()
    if text == "ok" or text.startswith("ok\t"):
        return proc.pid, text.split("\t")[1:]
    if not closed and not text:  # silent, and still running, for READY_TIMEOUT
        proc.kill()
        raise MxfsError(f"the daemon did not report within {READY_TIMEOUT:.0f} s",
                        f"see {log_path}")
    if text.startswith("error\t"):
        _, problem, fix = (text.split("\t") + [""])[:3]
        raise MxfsError(problem, fix or None)
    try:  # a pipe closed at exit can be seen before the exit itself
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise MxfsError("the daemon closed its report pipe without a word and did not exit",
                        f"see {log_path}") from None
    said = last_line(log_path, logged)
    raise MxfsError(f"the daemon exited with code {proc.returncode}"
                    + (f" ({said})" if said else ""), f"see {log_path}")


def last_line(path: str, start: int) -> str:
    """The last line written to `path` after offset `start` (what a dying daemon said:
    the exception of a traceback), or ""."""
    try:
        with open(path, "rb") as f:
            f.seek(start)
            lines = f.read(1 << 16).decode(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1].strip()[:300] if lines else ""


def runtime_dir() -> str:
    """Where sockets and logs of running daemons live: $MXFS_RUNTIME_DIR when set (a
    container's, or a test session's own), else /run/mxfs for root."""
    if os.environ.get("MXFS_RUNTIME_DIR"):
        return os.environ["MXFS_RUNTIME_DIR"]
    if os.geteuid() == 0:
        return "/run/mxfs"
    base = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/mxfs-{os.getuid()}"
    return os.path.join(base, "mxfs") if "XDG_RUNTIME_DIR" in os.environ else base


def ensure_runtime_dir(path: str) -> None:
    """Make (or check) the folder of the daemon's log and control socket: it must be a
    real folder of this user's that nobody else can write, or another user who made
    it first (a fixed name under /tmp) could redirect the log or plant the socket.
    One made here is 0755 whatever the umask (the unit's is 0077): every user connects
    to the sockets in it."""
    made = not os.path.lexists(path)
    os.makedirs(path, mode=0o755, exist_ok=True)
    st = os.lstat(path)
    problem = ("is a symbolic link" if stat.S_ISLNK(st.st_mode) else
               "is not a folder" if not stat.S_ISDIR(st.st_mode) else
               f"belongs to uid {st.st_uid}" if st.st_uid != os.geteuid() else
               "can be written by others" if st.st_mode & 0o022 else None)
    if problem is not None:
        raise MxfsError(f"the daemon's runtime folder {path} {problem}",
                        "remove it, or set XDG_RUNTIME_DIR to a folder of your own")
    if made and stat.S_IMODE(st.st_mode) != 0o755:
        os.chmod(path, 0o755)


def open_private_log(path: str) -> BinaryIO:
    """`path` opened to append, 0600 (one made looser by an older version is tightened
    before anything more is written to it)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC |
                     os.O_NOFOLLOW, 0o600)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise MxfsError(f"the daemon's log {path} is a symbolic link",
                        "remove it (someone may have planted it)") from None
    try:
        if stat.S_IMODE(os.fstat(fd).st_mode) & 0o077:
            os.fchmod(fd, 0o600)
        return os.fdopen(fd, "ab")
    except BaseException:
        os.close(fd)
        raise


def wait_pid_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not running(pid):
            return True
        time.sleep(0.02)
    return False


def unmount(path: str, lazy: bool = False) -> None:
    """Ask the kernel to unmount `path` (umount as root, fusermount3 otherwise)."""
    if os.geteuid() == 0:
        cmd = ["umount", *(["-l"] if lazy else []), path]
    else:
        cmd = ["fusermount3", "-u", *(["-z"] if lazy else []), path]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        err = (res.stderr or res.stdout).strip()
        if "busy" in err.lower():
            raise MxfsError(f"mount point {path} is busy: files are open there",
                            f"close them (see: fuser -vm {path}), or pass --lazy")
        raise MxfsError(f"unmounting {path} failed: {err}", "check the mount point")


def mount_device(path: str) -> str | None:
    """'major:minor' of the filesystem mounted at `path` (without touching it)."""
    found = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if unescape(fields[4]) == path:
                found = fields[2]  # the last one is the top of a stack of mounts
    return found


def set_readahead(path: str, kib: int) -> bool:
    """Raise the kernel's readahead for a FUSE mount, so reads arrive in 1 MiB requests.

    FUSE mounts start at 128 KiB; only root may change it.
    """
    dev = mount_device(path)
    if dev is None:
        return False
    try:
        with open(f"/sys/class/bdi/{dev}/read_ahead_kb", "w") as f:
            f.write(str(kib))
    except OSError:
        return False
    return True


def rotate_log(fd: int, path: str, cap: int = LOG_CAP,
               quiet: Callable[[], AbstractContextManager[object]] = nullcontext) -> bool:
    """If the log that `fd` writes (at `path`, a regular file) holds more than `cap`
    bytes: copy them to `path`.1 (an older one replaced) and cut the log to nothing.
    `fd` is opened O_APPEND (`open_private_log`), so what is written next lands at its
    start; where it is not, its offset is moved there.  `quiet` is held while the last
    bytes are copied and the file cut (the daemon's logging handlers' locks: no line
    written between the copy and the cut is lost).  True if it was rotated.

    Blocking: the daemon runs it in a worker thread (`fs/daemon.py` `_cap_log`).
    """
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size <= cap:
        return False
    try:
        src = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False  # (moved or removed by its operator: not ours to rotate)
    try:
        here = os.fstat(src)
        if (here.st_dev, here.st_ino) != (st.st_dev, st.st_ino):
            return False  # (`path` names another file now)
        new = path + ".1.new"
        try:
            os.unlink(new)  # (left by a rotation that died midway)
        except FileNotFoundError:
            pass
        dst = os.open(new, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW |
                      os.O_CLOEXEC, 0o600)
        try:
            done = _copy_from(src, dst, 0)  # (the bulk, while lines are still written)
            with quiet():
                _copy_from(src, dst, done)
                os.ftruncate(fd, 0)
                if not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_APPEND:
                    os.lseek(fd, 0, os.SEEK_SET)
        finally:
            os.close(dst)
        os.replace(new, path + ".1")
    finally:
        os.close(src)
    return True


def _copy_from(src: int, dst: int, offset: int) -> int:
    """Copy `src` from `offset` to its end onto `dst`'s end; the offset reached."""
    while chunk := os.pread(src, 1 << 20, offset):
        view = memoryview(chunk)
        while view:
            view = view[os.write(dst, view):]
        offset += len(chunk)
    return offset
