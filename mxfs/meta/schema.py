"""The store's tables, described once for every engine.

Each engine turns these into its own DDL (`meta/sql.py` for the SQL engines); the
namespace rules address rows only by these table and column names.  Integers are
64-bit, names and keys are bytes, settings are text.  Inode numbers and readdir
cookies come from sequences (`Engine.next_id`), never from an engine's row ids, so
several writers can draw them at once and none is ever reused.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEMA_VERSION = 5

INT, TEXT, BLOB = "int", "text", "blob"


@dataclass(frozen=True)
class Column:
    name: str
    kind: str  # INT, TEXT or BLOB
    null: bool = False


@dataclass(frozen=True)
class Table:
    name: str
    columns: tuple[Column, ...]
    key: tuple[str, ...]
    indexes: tuple[tuple[str, ...], ...] = ()
    rekeyed: bool = False  # rows change their key (renames): engines may keep them apart
    transient: bool = False  # kept a while for the running nodes: not dumped or copied

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns)


def _cols(spec: str) -> tuple[Column, ...]:
    """'a:int b:blob? ...' -> columns (a trailing ? allows NULL)."""
    out = []
    for part in spec.split():
        name, kind = part.split(":")
        out.append(Column(name, kind.rstrip("?"), kind.endswith("?")))
    return tuple(out)


# The inode columns, in the order `Inode` takes them.
INODE_COLUMNS = ("ino", "mode", "uid", "gid", "nlink", "size", "atime_ns", "mtime_ns",
                 "ctime_ns", "rdev", "target", "stripe_unit", "stripe_width", "first_member",
                 "generation")

TABLES: dict[str, Table] = {t.name: t for t in (
    Table("settings", _cols("key:text value:text"), ("key",)),
    Table("inodes", _cols("ino:int mode:int uid:int gid:int nlink:int size:int atime_ns:int "
                          "mtime_ns:int ctime_ns:int rdev:int target:blob? stripe_unit:int? "
                          "stripe_width:int? first_member:int? generation:int"), ("ino",)),
    # `id` is the readdir cookie: entries keep it through renames, so a listing in
    # progress stays correct while entries change.
    Table("dentries", _cols("id:int parent:int name:blob ino:int"), ("parent", "name"),
          indexes=(("ino",), ("parent", "id")), rekeyed=True),
    Table("xattrs", _cols("ino:int name:blob value:blob"), ("ino", "name")),
    Table("orphans", _cols("ino:int"), ("ino",)),
    Table("dirty_data", _cols("ino:int"), ("ino",)),
    Table("sealed", _cols("ino:int sum_unit:int sums:blob"), ("ino",)),
    Table("kv_ns", _cols("ns:text uid:int gid:int mode:int capacity:int"), ("ns",)),
    Table("kv", _cols("ns:text key:blob ino:int size:int atime:int"), ("ns", "key"),
          indexes=(("ino",),)),
    # The change feed (`meta/change_feed.py`): what each committed group of a node
    # changed, for the other nodes to drop from their caches; kept some minutes.
    Table("changes", _cols("seq:int node:text epoch:int at:int body:blob"), ("seq",),
          transient=True),
)}

# Sequences every engine provides: inode numbers, directory entry ids (cookies), and
# the change feed's numbers.
SEQUENCES = ("ino", "dentry", "change")
