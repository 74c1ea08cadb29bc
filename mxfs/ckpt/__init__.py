"""Checkpoints: async snapshots written through the direct path, verified on load.

`save(state, path)` stages and returns a `Snapshot`; `load(path)` reads it back,
every byte checked; `verify(path)` lists damage; `catalog` lists, prunes and
removes checkpoints; `dcp` is a torch.distributed.checkpoint storage backend.

The catalog is imported at once; the rest (which needs torch, a second to import) when
first named, so `mxfs ckpt ls | rm | prune` answer without loading torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from mxfs.ckpt.catalog import CheckpointError, list_checkpoints, prune, remove

if TYPE_CHECKING:
    from mxfs.ckpt.reader import CheckpointCorrupt, Damage, load, verify
    from mxfs.ckpt.snapshot import Checkpointer, Snapshot, save

_LAZY = {"CheckpointCorrupt": "reader", "Damage": "reader", "load": "reader",
         "verify": "reader", "Checkpointer": "snapshot", "Snapshot": "snapshot",
         "save": "snapshot"}

__all__ = ["CheckpointCorrupt", "CheckpointError", "Checkpointer", "Damage", "Snapshot",
           "list_checkpoints", "load", "prune", "remove", "save", "verify"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'mxfs.ckpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"mxfs.ckpt.{module}"), name)
    globals()[name] = value
    return value
