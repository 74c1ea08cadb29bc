"""A state dict's structure as JSON: tensors by name, plain values stored safely.

Training state is nested dicts and lists (an optimizer's `state` has integer
keys, `param_groups` tuples and floats).  `flatten` turns it into a JSON tree
plus the tensors in order; `unflatten` rebuilds it.  Only data types are
accepted, so loading never runs code (no pickle anywhere): an object of any
other type is refused at save time, naming where it sits.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Callable
from typing import Any

import torch

from mxfs.errors import MxfsError

Tree = dict[str, Any]


class UnsupportedValue(MxfsError):
    """A value in the state dict that cannot be stored without pickle."""


def _float(x: float) -> Tree | float:
    return x if math.isfinite(x) else {"t": "float", "v": repr(x)}


def _key(k: Any, where: str) -> Any:
    if k is None or isinstance(k, str | int | float | bool):
        return [type(k).__name__, k if not isinstance(k, float) else _float(k)]
    raise UnsupportedValue(f"state dict key {k!r} at {where} is a {type(k).__name__}",
                           "use str, int, float or bool keys")


def _unkey(k: list[Any]) -> Any:
    kind, v = k
    if kind == "float" and isinstance(v, dict):
        return float(v["v"])
    make: dict[str, Callable[[Any], Any]] = {"NoneType": lambda x: None, "str": str, "int": int,
                                             "float": float, "bool": bool}
    return make[kind](v)


def flatten(state: Any) -> tuple[Tree, list[tuple[str, torch.Tensor]]]:
    """(JSON tree, [(name, tensor)]) for `state`; a tensor seen twice is stored once."""
    tensors: list[tuple[str, torch.Tensor]] = []
    seen: dict[tuple[Any, ...], str] = {}
    names: set[str] = set()

    def name_for(path: str) -> str:
        name, n = path or "tensor", 1
        while name in names:
            n += 1
            name = f"{path}#{n}"
        names.add(name)
        return name

    def walk(v: Any, path: str) -> Any:
        if isinstance(v, torch.Tensor):
            if v.is_sparse or v.layout != torch.strided:
                raise UnsupportedValue(f"tensor at {path or '<root>'} has layout {v.layout}",
                                       "convert it to a dense tensor (to_dense()) first")
            ident = (v.device, v.data_ptr(), v.dtype, tuple(v.shape), v.stride(),
                     v.storage_offset()) if v.numel() else None
            if ident is not None and ident in seen:
                return {"t": "tensor", "name": seen[ident]}  # tied: stored once
            name = name_for(path)
            if ident is not None:
                seen[ident] = name
            tensors.append((name, v))
            return {"t": "tensor", "name": name}
        if v is None or isinstance(v, bool | int | str):
            return v
        if isinstance(v, float):
            return _float(v)
        if isinstance(v, dict):
            return {"t": "dict", "items": [
                [_key(k, path), walk(x, f"{path}.{k}" if path else str(k))]
                for k, x in v.items()]}
        if isinstance(v, torch.Size):
            return {"t": "size", "v": list(v)}
        if isinstance(v, list | tuple):
            items = [walk(x, f"{path}.{i}" if path else str(i)) for i, x in enumerate(v)]
            return {"t": "tuple" if isinstance(v, tuple) else "list", "v": items}
        if isinstance(v, bytes):
            return {"t": "bytes", "v": base64.b64encode(v).decode()}
        if isinstance(v, torch.dtype):
            return {"t": "dtype", "v": str(v).removeprefix("torch.")}
        if isinstance(v, torch.device):
            return {"t": "device", "v": str(v)}
        raise UnsupportedValue(f"value at {path or '<root>'} is a {type(v).__module__}."
                               f"{type(v).__qualname__}, which mxfs stores only as pickle",
                               "store tensors, numbers, strings, bytes, lists and dicts")

    return walk(state, ""), tensors


def unflatten(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Rebuild the state from `flatten`'s tree and the loaded tensors."""
    if not isinstance(tree, dict):
        if isinstance(tree, list):
            raise ValueError("bare list in a checkpoint tree")
        return tree
    kind = tree.get("t")
    if kind == "tensor":
        return tensors[tree["name"]]
    if kind == "dict":
        return {_unkey(k): unflatten(v, tensors) for k, v in tree["items"]}
    if kind in ("list", "tuple"):
        items = [unflatten(x, tensors) for x in tree["v"]]
        return items if kind == "list" else tuple(items)
    if kind == "size":
        return torch.Size(tree["v"])
    if kind == "float":
        return float(tree["v"])
    if kind == "bytes":
        return base64.b64decode(tree["v"])
    if kind == "dtype":
        dt = getattr(torch, tree["v"], None)
        if not isinstance(dt, torch.dtype):
            raise ValueError(f"unknown dtype {tree['v']!r}")
        return dt
    if kind == "device":
        return torch.device(tree["v"])
    raise ValueError(f"unknown node {kind!r} in a checkpoint tree")
