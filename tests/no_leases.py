"""Run a command (argv[1:]) whose process tree the kernel refuses every lease
(F_SETLEASE fails EINVAL), as on a file system without leases or under
`fs.leases-enable=0`.  That sysctl is global: flipped, it would fail the tests other
workers run beside; a seccomp filter holds for this process and its children alone."""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct
import sys

# (audit arch, fcntl's syscall number)
_ARCH = {"x86_64": (0xC000003E, 72), "aarch64": (0xC00000B7, 25)}
_F_SETLEASE = 1024
_LD_ABS, _JEQ, _RET = 0x20, 0x15, 0x06
_RET_ERRNO, _RET_ALLOW = 0x00050000, 0x7FFF0000
_PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 38, 22, 2


class _Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def refuse_leases() -> None:
    """From now on F_SETLEASE fails EINVAL in this process and what it runs."""
    arch, fcntl_nr = _ARCH[platform.machine()]

    def op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
        return struct.pack("HBBI", code, jt, jf, k)
    code = b"".join([
        op(_LD_ABS, 4), op(_JEQ, arch, 0, 5),  # (another arch's calls: allowed)
        op(_LD_ABS, 0), op(_JEQ, fcntl_nr, 0, 3),
        op(_LD_ABS, 24), op(_JEQ, _F_SETLEASE, 0, 1),  # (args[1], its low word)
        op(_RET, _RET_ERRNO | errno.EINVAL),
        op(_RET, _RET_ALLOW)])
    buf = ctypes.create_string_buffer(code, len(code))
    prog = _Prog(len(code) // 8, ctypes.addressof(buf))
    libc = ctypes.CDLL(None, use_errno=True)
    ul = ctypes.c_ulong
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, ul(1), ul(0), ul(0), ul(0)) or \
            libc.prctl(_PR_SET_SECCOMP, ul(_SECCOMP_MODE_FILTER), ctypes.byref(prog),
                       ul(0), ul(0)):
        raise OSError(ctypes.get_errno(), "seccomp filter refused")


if __name__ == "__main__":
    refuse_leases()
    os.execvp(sys.argv[1], sys.argv[1:])
