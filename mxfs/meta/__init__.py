"""The metadata store (SQLite, WAL): stdlib only, behind one interface."""

from mxfs.meta.store import NAME_MAX, ROOT_INO, Entry, Inode, LayoutPicker, MetaStore

__all__ = ["NAME_MAX", "ROOT_INO", "Entry", "Inode", "LayoutPicker", "MetaStore"]
