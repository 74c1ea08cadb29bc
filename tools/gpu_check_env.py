"""What the GPU check finds on the machine: the sandbox, FUSE, io_uring, O_DIRECT, CUDA, cuFile.

Each probe answers with what it saw or why it could not look; none raises, so one
missing piece never stops the check.  `host` needs no torch (the parent runs it);
`gpu` imports torch and kvikio (run in a child, so a kvikio that crashes or hangs
costs only that part).
"""

from __future__ import annotations

import ctypes
import errno
import glob
import json
import mmap
import os
import platform
import shutil
import subprocess
import sys
from importlib.metadata import version
from typing import Any

IO_URING_SETUP = 425  # the syscall's number on x86-64 and arm64 alike
GVISOR_BOOT = "#1 SMP Sun Jan 10 15:06:54 PST 2016"  # the /proc/version gVisor fakes


def _errno(e: OSError | int) -> str:
    code = e if isinstance(e, int) else (e.errno or 0)
    return f"{errno.errorcode.get(code, code)} ({os.strerror(code)})"


def _run(argv: list[str], timeout: float = 10) -> str | None:
    """A command's stdout, or None when it is missing, fails or hangs."""
    if shutil.which(argv[0]) is None:
        return None
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return res.stdout if res.returncode == 0 else None


def sandbox() -> dict[str, Any]:
    """gVisor, a Firecracker VM, or neither, with the hints that said so."""
    try:
        with open("/proc/version") as f:
            version = f.read().strip()
    except OSError:
        version = ""
    release = platform.release()
    dmesg = _run(["dmesg"]) or ""
    hints = []
    if GVISOR_BOOT in version:
        hints.append("/proc/version is gVisor's fixed one")
    if "gvisor" in dmesg.lower():
        hints.append("dmesg speaks of gVisor")
    if shutil.which("runsc"):
        hints.append("runsc is on the PATH")
    runtime = "gVisor" if hints else "unknown"
    if not hints and "-fc-" in release:
        runtime, hints = "Firecracker VM", [f"kernel {release}"]
    elif not hints:
        hints.append(f"kernel {release}: no sign of gVisor")
    return {"runtime": runtime, "hints": hints, "kernel": release, "proc_version": version}


def fuse() -> dict[str, Any]:
    """/dev/fuse and pyfuse3; the parent adds whether a mount succeeded."""
    out: dict[str, Any] = {"dev_fuse": os.path.exists("/dev/fuse")}
    if out["dev_fuse"]:
        try:
            os.close(os.open("/dev/fuse", os.O_RDWR))
            out["dev_fuse_opens"] = True
        except OSError as e:
            out["dev_fuse_opens"] = _errno(e)
    try:
        import pyfuse3  # noqa: F401 - only whether it imports

        out["pyfuse3"] = version("pyfuse3")
    except Exception as e:  # noqa: BLE001 - ImportError, or its libfuse3 missing (OSError)
        out["pyfuse3"] = None
        out["pyfuse3_why"] = f"does not import: {e}"
    return out


def io_uring() -> dict[str, Any]:
    """The kernel's answer to io_uring_setup, and which engine mxfs/io runs."""
    out: dict[str, Any] = {}
    try:
        with open("/proc/sys/kernel/io_uring_disabled") as f:
            out["io_uring_disabled"] = int(f.read())
    except (OSError, ValueError):
        pass
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    params = ctypes.create_string_buffer(120)  # struct io_uring_params
    fd = libc.syscall(ctypes.c_long(IO_URING_SETUP), ctypes.c_uint(4), params)
    if fd >= 0:
        os.close(fd)
        out["kernel"] = "io_uring_setup works"
    else:
        out["kernel"] = f"io_uring_setup refused: {_errno(ctypes.get_errno())}"
    from mxfs.io.batch import ENGINE, native_engine

    out["mxfs_engine"] = ENGINE
    out["native_engine"] = native_engine()[1]
    return out


def fs_type(path: str) -> str:
    """The filesystem holding `path` (from mountinfo: the longest mount point above it)."""
    real, best, kind = os.path.realpath(path), "", "unknown"
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                point = left.split()[4].replace("\\040", " ")
                if (real == point or real.startswith(point.rstrip("/") + "/")) and \
                        len(point) >= len(best):
                    best, kind = point, f"{right.split()[0]} on {point} ({right.split()[1]})"
    except (OSError, IndexError):
        pass
    return kind


def o_direct(folder: str) -> dict[str, Any]:
    """Whether a 4 KiB O_DIRECT write and read round-trip in `folder` (the pool's disk)."""
    out: dict[str, Any] = {"filesystem": fs_type(folder)}
    path = os.path.join(folder, ".gpu-check-odirect")
    buf, back = mmap.mmap(-1, 4096), mmap.mmap(-1, 4096)
    buf.write(os.urandom(4096))
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
        try:
            os.pwrite(fd, buf, 0)
            os.preadv(fd, [back], 0)
        finally:
            os.close(fd)
        out["works"] = bytes(buf) == bytes(back)
    except OSError as e:
        out["works"] = False
        out["why"] = _errno(e)
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
    return out


def host(pool_dir: str) -> dict[str, Any]:
    """Everything that needs no torch, each probe on its own."""
    out: dict[str, Any] = {"python": platform.python_version(), "cpus": os.cpu_count()}
    for name, probe in (("sandbox", sandbox), ("fuse", fuse), ("io_uring", io_uring),
                        ("o_direct", lambda: o_direct(pool_dir))):
        try:
            out[name] = probe()
        except Exception as e:  # noqa: BLE001 - a probe that breaks is itself a finding
            out[name] = {"error": f"{type(e).__name__}: {e}"}
    return out


# ---- the GPU side (a child process) --------------------------------------------------


def _cuda_versions() -> dict[str, Any]:
    """The CUDA runtime loaded (torch loaded it) and the driver's CUDA version."""
    out: dict[str, Any] = {}
    for key, names, fn in (("cuda_runtime", ["libcudart.so.13", "libcudart.so.12",
                                             "libcudart.so"], "cudaRuntimeGetVersion"),
                           ("cuda_driver", ["libcuda.so.1"], "cuDriverGetVersion")):
        for name in names:
            try:
                lib = ctypes.CDLL(name)
            except OSError:
                continue
            v = ctypes.c_int()
            if getattr(lib, fn)(ctypes.byref(v)) == 0:
                out[key] = f"{v.value // 1000}.{v.value % 1000 // 10}"
                break
        else:
            out[key] = f"unknown ({names[0]} not loadable)"
    smi = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], 20)
    if smi:
        out["driver"] = smi.strip().splitlines()[0]
    return out


def cufile(folder: str, dev: Any) -> dict[str, Any]:
    """kvikio and cuFile: versions, real GDS or compatibility mode, and one real read."""
    out: dict[str, Any] = {"nvidia_fs_driver": os.path.exists("/proc/driver/nvidia-fs")}
    libs = sorted({p for d in sys.path for p in glob.glob(
        os.path.join(d, "nvidia", "*", "lib", "libcufile.so*"))})
    out["libcufile"] = libs or "not found beside the Python packages"
    try:
        import kvikio
        import kvikio.defaults as defaults
    except Exception as e:  # noqa: BLE001 - ImportError, or its CUDA libraries failing
        out["kvikio"] = f"does not import: {e}"
        return out
    out["kvikio"] = kvikio.__version__
    for name in ("compat_mode", "is_compat_mode_preferred"):
        fn = getattr(defaults, name, None)
        if callable(fn):
            try:
                out[name] = str(fn())
            except Exception as e:  # noqa: BLE001
                out[name] = f"error: {e}"
    driver = getattr(kvikio, "cufile_driver", None)
    try:
        out["gds_available"] = bool(driver.get("is_gds_available")) if driver else "unknown"
    except Exception as e:  # noqa: BLE001 - older kvikio, or cuFile not loadable
        out["gds_available"] = f"unknown ({e})"
    from mxfs.load.gds import _without_gds

    why = _without_gds(kvikio)
    out["path"] = "GDS (DMA from the disk into GPU memory)" if why is None else \
        f"compatibility mode: {why}"
    if dev.type == "cuda":
        out["read"] = _cufile_read(kvikio, folder, dev)
    return out


def _cufile_read(kvikio: Any, folder: str, dev: Any) -> str:
    """One 4 MiB CuFile pread into GPU memory, checked: "ok" or why not."""
    import torch

    path = os.path.join(folder, ".gpu-check-cufile")
    data = os.urandom(4 << 20)
    try:
        with open(path, "wb") as f:
            f.write(data)
        dst = torch.empty(len(data), dtype=torch.uint8, device=dev)
        f = kvikio.CuFile(path, "r")
        try:
            n = f.pread(dst).get()
        finally:
            f.close()
        same = n == len(data) and bytes(dst.cpu().numpy()) == data
        return "ok, bytes equal" if same else f"read {n} bytes, not equal"
    except Exception as e:  # noqa: BLE001 - whatever cuFile or kvikio raise
        return f"failed: {type(e).__name__}: {e}"
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass


def gpu(folder: str, device: str) -> dict[str, Any]:
    """torch, CUDA and the device; cuFile through kvikio."""
    import torch

    out: dict[str, Any] = {"torch": torch.__version__, "torch_cuda": torch.version.cuda,
                           "device": device}
    dev = torch.device(device)
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        out.update(gpu_name=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1),
                   capability=f"{p.major}.{p.minor}")
        torch.empty(1, device=dev)  # the runtime is loaded once a context exists
        out.update(_cuda_versions())
    else:
        out["gpu_name"] = "none (a dry run on the CPU)"
    try:
        import safetensors

        out["safetensors"] = safetensors.__version__
    except ImportError:
        out["safetensors"] = "not installed"
    out["cufile"] = cufile(folder, dev)
    return out


if __name__ == "__main__":  # a quick look: python tools/gpu_check_env.py [FOLDER]
    print(json.dumps(host(sys.argv[1] if len(sys.argv) > 1 else "."), indent=1))
