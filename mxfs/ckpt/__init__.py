"""Checkpoints: async snapshots written through the direct path, verified on load.

`save(state, path)` stages and returns a `Snapshot`; `load(path)` reads it back,
every byte checked; `verify(path)` lists damage; `catalog` lists, prunes and
removes checkpoints; `dcp` is a torch.distributed.checkpoint storage backend.
"""

from mxfs.ckpt.catalog import CheckpointError, list_checkpoints, prune, remove
from mxfs.ckpt.reader import CheckpointCorrupt, Damage, load, verify
from mxfs.ckpt.snapshot import Checkpointer, Snapshot, save

__all__ = ["CheckpointCorrupt", "CheckpointError", "Checkpointer", "Damage", "Snapshot",
           "list_checkpoints", "load", "prune", "remove", "save", "verify"]
