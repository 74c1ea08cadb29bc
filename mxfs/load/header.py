"""The safetensors header: parsed and checked before a single tensor byte is read.

A file is an 8-byte little-endian header length N, N bytes of JSON, then the data.
The JSON maps tensor names to {"dtype", "shape", "data_offsets": [begin, end]}
(relative to the data start), plus an optional "__metadata__" of strings.
Every check here turns a corrupt file into one `HeaderError` naming the file and
the tensor, so no later step can read out of bounds.  Pure Python, no torch.
"""

from __future__ import annotations

import json
import math
import reprlib
import struct
from dataclasses import dataclass

from mxfs.errors import MxfsError

# Bytes per element for each dtype safetensors knows (F4 packs two values per byte).
DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32, "C64": 64,
    "I64": 64, "U64": 64, "F64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}
MAX_HEADER = 100 << 20  # safetensors' own limit
# Shapes a tensor library can hold: dims and element counts fit int64, at most 64 dims.
MAX_DIM = (1 << 63) - 1
MAX_NDIM = 64
_brief = reprlib.Repr()  # error messages show bounded, shallow values (no huge reprs)
_brief.maxlevel, _brief.maxlist, _brief.maxdict, _brief.maxstring = 2, 6, 4, 40
_show = _brief.repr


class HeaderError(MxfsError):
    """A safetensors file whose header cannot be trusted."""


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute file offsets
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Header:
    path: str
    data_start: int
    file_size: int
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str] | None

    def ordered(self) -> list[TensorInfo]:
        """Tensors in file order: reading them in this order is sequential."""
        return sorted(self.tensors.values(), key=lambda t: t.begin)


def header_length(path: str, prefix: bytes, file_size: int) -> int:
    """The JSON length from the first 8 bytes, checked against the file size."""
    if len(prefix) < 8 or file_size < 8:
        raise HeaderError(f"{path}: too short to be a safetensors file ({file_size} bytes)",
                          "check that the file was copied completely")
    n: int = struct.unpack("<Q", prefix[:8])[0]
    if n > MAX_HEADER:
        raise HeaderError(f"{path}: header length {n} is over the {MAX_HEADER} byte limit",
                          "the file is corrupt or not safetensors")
    if 8 + n > file_size:
        raise HeaderError(f"{path}: header length {n} runs past the end of the file "
                          f"({file_size} bytes)", "the file is truncated or corrupt")
    return n


def parse_header(path: str, raw: bytes, file_size: int) -> Header:
    """Parse and check the JSON header `raw` (the N bytes after the length)."""
    data_start = 8 + len(raw)
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise HeaderError(f"{path}: header is not valid JSON ({e})",
                          "the file is corrupt or not safetensors") from None
    if not isinstance(doc, dict):
        raise HeaderError(f"{path}: header is not a JSON object",
                          "the file is corrupt or not safetensors")
    metadata = doc.pop("__metadata__", None)
    if metadata is not None and not (isinstance(metadata, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise HeaderError(f"{path}: __metadata__ must map strings to strings",
                          "the file is corrupt")
    data_size = file_size - data_start
    tensors: dict[str, TensorInfo] = {}
    for name, entry in doc.items():
        tensors[name] = _tensor(path, name, entry, data_start, data_size)
    spans = sorted((t.begin, t.end, t.name) for t in tensors.values() if t.nbytes)
    for (_, end_a, a), (begin_b, _, b) in zip(spans, spans[1:], strict=False):
        if begin_b < end_a:
            raise HeaderError(f"{path}: tensors {a!r} and {b!r} overlap",
                              "the file is corrupt")
    return Header(path, data_start, file_size, tensors, metadata)


def _tensor(path: str, name: str, entry: object, data_start: int, data_size: int
            ) -> TensorInfo:
    where = f"{path}: tensor {name!r}"
    if not isinstance(entry, dict):
        raise HeaderError(f"{where} is not described by a JSON object", "the file is corrupt")
    dtype = entry.get("dtype")
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise HeaderError(f"{where} has unknown dtype {_show(dtype)}",
                          f"known dtypes: {', '.join(sorted(DTYPE_BITS))}")
    shape = entry.get("shape")
    if not (isinstance(shape, list) and len(shape) <= MAX_NDIM and all(
            _is_int(d) and 0 <= d <= MAX_DIM for d in shape)
            and math.prod(d for d in shape if d) <= MAX_DIM):
        raise HeaderError(f"{where} has a bad shape {_show(shape)}", "the file is corrupt")
    offsets = entry.get("data_offsets")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_int, offsets))):
        raise HeaderError(f"{where} has bad data_offsets {_show(offsets)}",
                          "the file is corrupt")
    begin, end = offsets
    if not 0 <= begin <= end <= data_size:
        raise HeaderError(f"{where} has data_offsets {_show(offsets)} outside the data "
                          f"({data_size} bytes)", "the file is truncated or corrupt")
    bits = math.prod(shape) * DTYPE_BITS[dtype]
    if bits % 8 or bits // 8 != end - begin:
        need = f"{bits // 8} bytes" if bits % 8 == 0 else f"{bits} bits"
        raise HeaderError(f"{where}: shape {shape} of {dtype} needs {need} but its range "
                          f"holds {end - begin}", "the file is corrupt")
    return TensorInfo(name, dtype, tuple(shape), data_start + begin, data_start + end)


def _is_int(v: object) -> bool:
    """A JSON integer (JSON true/false are bools, which Python counts as ints)."""
    return isinstance(v, int) and not isinstance(v, bool)
