"""safetensors files to torch tensors, read through the direct path.

On the CPU, a file's whole data section is read (all members in parallel) into
one buffer that the returned tensors are views of: the tensors own that buffer
together, and it is freed when the last of them is.  A tensor whose offset does
not suit its dtype's alignment is copied out instead.  Before any tensor is
returned, the file is checked not to have changed while it was read.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from mxfs.client.direct import DirectFile, Reader, aligned_like, open_reader
from mxfs.errors import MxfsError
from mxfs.io.memory import meminfo
from mxfs.load.gds import GdsReader, Unavailable, open_gds
from mxfs.load.header import Header, HeaderError, TensorInfo, header_length, parse_header
from mxfs.load.options import MODES, FileLoad, LoadReport
from mxfs.load.staging import STAGING, read_to_device, writable_view

log = logging.getLogger("mxfs.load")
# Mappings one mapped load may make; the kernel's default limit is 65530 a process.
MAX_MAPPINGS = 16384

# safetensors dtype names -> torch dtypes (None where this torch lacks one).
ST_DTYPES = {name: getattr(torch, attr, None) for name, attr in {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16",
    "F16": "float16", "BF16": "bfloat16", "I32": "int32", "U32": "uint32", "F32": "float32",
    "C64": "complex64", "I64": "int64", "U64": "uint64", "F64": "float64",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
    "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz"}.items()}


def torch_dtype(info: TensorInfo, path: str) -> torch.dtype:
    dt: torch.dtype | None = ST_DTYPES.get(info.dtype)
    if dt is None:
        raise HeaderError(f"{path}: tensor {info.name!r} has dtype {info.dtype}, which this "
                          f"torch ({torch.__version__}) cannot hold", "use a newer torch")
    return dt


def read_header(reader: Reader) -> Header:
    prefix = bytearray(min(8, reader.size))
    reader.read_into(0, memoryview(prefix))
    n = header_length(reader.path, bytes(prefix), reader.size)
    raw = bytearray(n)
    reader.read_into(8, memoryview(raw))
    return parse_header(reader.path, bytes(raw), reader.size)


def check_device(device: str | torch.device) -> torch.device:
    if str(device).startswith("npu"):
        try:
            import torch_npu  # noqa: F401 - registers the "npu" device type and torch.npu
        except ImportError:
            raise MxfsError(f"device {device} asked for, but torch_npu is not installed",
                            "pip install -e .[npu] on the Ascend machine") from None
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise MxfsError(f"device {device!r} is not a device torch knows",
                        "load to 'cpu', 'cuda:N' or 'npu:N'") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise MxfsError(f"device {dev} asked for, but this torch sees no CUDA device",
                        "load to device='cpu', or run where a GPU is visible")
    if dev.type not in ("cpu", "cuda", "npu"):
        raise MxfsError(f"device {dev} is not supported by mxfs.load",
                        "load to 'cpu', 'cuda:N' or 'npu:N'")
    return dev


def _tensor(buf: torch.Tensor, base: int, info: TensorInfo, path: str) -> torch.Tensor:
    dtype = torch_dtype(info, path)
    if info.nbytes == 0:
        return torch.empty(info.shape, dtype=dtype, device=buf.device)
    raw = buf[info.begin - base:info.end - base]
    itemsize = torch.empty((), dtype=dtype).element_size()
    if (raw.data_ptr() % itemsize) != 0:
        raw = raw.clone()  # misaligned for its dtype: copy out
    return raw.view(dtype).reshape(info.shape)


def load_file(path: str, device: str | torch.device = "cpu", mode: str = "auto",
              pool: Any = None, staging: int = STAGING, *, odirect: str | None = None,
              gds: str | None = None, report: LoadReport | None = None
              ) -> dict[str, torch.Tensor]:
    """Load every tensor of a safetensors file; equal to safetensors.torch.load_file.

    mode "map" reads the file into the page cache (every member at once; a file
    larger than half the memory available is left to page in on first touch),
    maps it (its stripes side by side) and returns tensors over the mapping, as
    safetensors does with one file: nothing is copied and cached pages cost no
    memory of their own.  Its risk: the tensors show whatever is written to the file
    later, and once the file is truncated, removed or replaced, or a chmod takes a
    right to read it away, its pages are cut (at once, or after a grace) and the next
    touch raises SIGBUS, which kills the process.  mode "read" reads
    every byte now, every member at once, into one buffer the tensors share.
    mode "stream" moves the bytes through a few host buffers of `staging` bytes in
    all, reads overlapped with copies to the device (pinned memory and a side
    stream on CUDA), into one device buffer the tensors share: host memory stays
    bounded and the model is never held twice.  mode "gds" reads the chunk files
    by DMA straight into that device buffer (GPUDirect Storage through kvikio;
    `mxfs.load.gds`).  "auto" maps CPU loads only where nobody but the caller (or
    root) can change or end the file (`Reader.map_risk`: hers or root's, written by
    no one else or sealed, in a folder no one else may write) and it needs few
    enough mappings, else reads them; it uses GDS for CUDA loads where it runs
    (logging why where it does not), and streams other loads to a device.
    With `pool` (`mxfs.pool.offline.OfflinePool`), `path` is inside that unmounted pool.
    `odirect` and `gds` are the policies of `mxfs.load.options` (default: from the
    environment); `report`, when given, gets what this load did.
    """
    dev = check_device(device)
    if mode not in MODES:
        raise MxfsError(f"mode {mode!r} is not known",
                        "use mode='auto', 'read', 'map', 'stream' or 'gds'")
    start = time.perf_counter()
    with open_reader(path, pool=pool, odirect=odirect) as reader:
        header = read_header(reader)
        nbytes = reader.size - header.data_start
        gds_reader = _open_gds(reader, dev, mode, gds)
        why_not = gds_reader if isinstance(gds_reader, str) else None
        if mode == "auto":
            mode = ("gds" if isinstance(gds_reader, GdsReader) else "stream"
                    if dev.type != "cpu" else _cpu_mode(reader))
        if isinstance(gds_reader, GdsReader):
            try:
                buf = gds_reader.read_to_device(header.data_start, nbytes)
            finally:
                gds_reader.close()
            base = header.data_start
        elif mode == "stream":
            buf = read_to_device(reader, header.data_start, nbytes, dev, staging)
            base = header.data_start
        elif mode == "map" and nbytes:
            if isinstance(reader, DirectFile) and fits_in_memory(reader.size):
                reader.cache()  # all members read together, into large folios
            buf = torch.frombuffer(reader.map(), dtype=torch.uint8)
            base = 0
        else:  # lined up with the file, so uncached stripes move with O_DIRECT
            mem = aligned_like(nbytes, header.data_start)
            buf = (torch.frombuffer(mem, dtype=torch.uint8) if nbytes
                       else torch.empty(0, dtype=torch.uint8))
            base = header.data_start
            if nbytes:
                reader.read_into(header.data_start, mem)
        reader.check_unchanged()
    out = {t.name: _tensor(buf, base, t, path) for t in header.ordered()}
    secs = time.perf_counter() - start
    log.info("loaded %s (%s): %d tensors, %.2f GB in %.2f s (%.2f GB/s)", path, mode,
             len(out), nbytes / 1e9, secs, nbytes / 1e9 / max(secs, 1e-9))
    if report is not None:
        report.files.append(FileLoad(path, nbytes, mode, why_not))
    if dev.type != "cpu" and mode not in ("stream", "gds"):
        out = {k: v.to(dev) for k, v in out.items()}
    return out  # in file order, as safetensors returns them


def _cpu_mode(reader: Reader) -> str:
    """"map" where it is safe, else "read": a mapping shows whatever is written to the
    file after, and faults (SIGBUS: the process dies) once its chunk files are cut, so
    it is the default only for a file that only the caller (or root) can change or
    end (`Reader.map_risk`), and that needs few enough mappings."""
    if reader.mappings() > MAX_MAPPINGS:
        return "read"
    risk = reader.map_risk()
    if risk is not None:
        log.info("%s is read, not mapped: %s", reader.path, risk)
        return "read"
    return "map"


def fits_in_memory(nbytes: int) -> bool:
    """Would `nbytes` more of page cache take at most half the memory available now?
    (A mapped load reads ahead only then: past it, its first pages would be evicted
    before they are touched.)"""
    available, _ = meminfo()
    return nbytes <= available // 2


def _open_gds(reader: Reader, dev: torch.device, mode: str, policy: str | None
              ) -> GdsReader | str | None:
    """GDS for mode "gds" (or a clear error), tried for "auto" loads to CUDA: the
    reader, why GDS cannot serve, or None where it was not asked for."""
    if mode == "gds" or (mode == "auto" and dev.type == "cuda"):
        try:
            return open_gds(reader, dev, required=mode == "gds", policy=policy)
        except Unavailable as e:
            raise MxfsError(f"GPUDirect Storage cannot load {reader.path}: {e}",
                            "load with mode='stream' (pinned buffers), or fix what it "
                            "names") from None
    return None


class SafeOpen:
    """Like safetensors.safe_open: read tensors one by one, or slices of them."""

    def __init__(self, path: str, framework: str = "pt", device: str | torch.device = "cpu",
                 pool: Any = None) -> None:
        if framework not in ("pt", "torch"):
            raise MxfsError(f"framework {framework!r} is not supported", "use framework='pt'")
        self.device = check_device(device)
        self.reader = open_reader(path, pool=pool)
        try:
            self.header = read_header(self.reader)
        except BaseException:
            self.reader.close()
            raise

    def __enter__(self) -> SafeOpen:
        return self

    def __exit__(self, *exc: object) -> None:
        self.reader.close()

    def keys(self) -> list[str]:
        return sorted(self.header.tensors)

    def metadata(self) -> dict[str, str] | None:
        return self.header.metadata

    def _info(self, name: str) -> TensorInfo:
        try:
            return self.header.tensors[name]
        except KeyError:
            raise KeyError(f"{self.reader.path} has no tensor {name!r}") from None

    def get_tensor(self, name: str) -> torch.Tensor:
        info = self._info(name)
        t = torch.empty(info.shape, dtype=torch_dtype(info, self.reader.path))
        if info.nbytes:
            self.reader.read_into(info.begin, writable_view(t))
        self.reader.check_unchanged()
        return t.to(self.device) if self.device.type != "cpu" else t

    def get_slice(self, name: str) -> TensorSlice:
        return TensorSlice(self, self._info(name))


class TensorSlice:
    """Rows of a tensor read on demand: only the bytes of the asked rows move."""

    def __init__(self, owner: SafeOpen, info: TensorInfo) -> None:
        self.owner = owner
        self.info = info

    def get_shape(self) -> list[int]:
        return list(self.info.shape)

    def get_dtype(self) -> str:
        return self.info.dtype

    def __getitem__(self, index: Any) -> torch.Tensor:
        info = self.info
        dtype = torch_dtype(info, self.owner.reader.path)
        first = index[0] if isinstance(index, tuple) else index
        rest = index[1:] if isinstance(index, tuple) else ()
        if not info.shape or not isinstance(first, slice) or first.step not in (None, 1):
            return self.owner.get_tensor(info.name)[index]
        start, stop, _ = first.indices(info.shape[0])
        stop = max(stop, start)
        row = info.nbytes // info.shape[0] if info.shape[0] else 0
        t = torch.empty((stop - start, *info.shape[1:]), dtype=dtype)
        if t.numel():
            self.owner.reader.read_into(info.begin + start * row, writable_view(t))
        self.owner.reader.check_unchanged()
        t = t[(slice(None), *rest)] if rest else t
        return t.to(self.owner.device) if self.owner.device.type != "cpu" else t


def safe_open(path: str, framework: str = "pt", device: str | torch.device = "cpu",
              pool: Any = None) -> SafeOpen:
    return SafeOpen(path, framework, device, pool)


def touch_pages(tensors: dict[str, torch.Tensor]) -> int:
    """Read one byte of every page of every CPU tensor.

    safetensors returns lazily mapped tensors; benchmarks call this on every arm so
    that each is timed until its bytes are really in memory.
    """
    total = 0
    for t in tensors.values():
        if t.numel() and t.device.type == "cpu":
            total += int(t.reshape(-1).view(torch.uint8)[::4096].sum())
    return total
