"""The metadata store: the namespace rules (`store.py`) over engine primitives
(`engine.py`), served by an engine that `location.py` picks (SQLite, or PostgreSQL
for a `postgresql://` location)."""

from mxfs.meta.engine import Unusable
from mxfs.meta.inode import ROOT_INO, Entry, Inode, LayoutPicker
from mxfs.meta.names import NAME_MAX
from mxfs.meta.store import MetaStore

__all__ = ["NAME_MAX", "ROOT_INO", "Entry", "Inode", "LayoutPicker", "MetaStore", "Unusable"]
