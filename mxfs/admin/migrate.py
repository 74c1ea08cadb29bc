"""`mxfs meta migrate`: move an unmounted pool's metadata to another engine, and back.

The pool is held (the daemon's lock) from the start, the rows are copied through the
engine primitives into a fresh store at the destination in one transaction, the copy
is compared row by row with the source, and only then does every member's superblock
name the new place.  Until that last step the pool is served from where it was; the
old store is left as it was (a member's store is renamed aside), for the operator to drop.
"""

from __future__ import annotations

import dataclasses

from mxfs.errors import MxfsError
from mxfs.meta import MetaStore, Unusable, location
from mxfs.meta.check import problems
from mxfs.meta.dump import copy_rows
from mxfs.meta.schema import TABLES
from mxfs.pool import Pool
from mxfs.pool.lock import pool_lock
from mxfs.pool.superblock import read_superblock, write_superblock
from mxfs.vol.format import refuse_other_pool

MEMBER = "member"  # --to member: the embedded store on the metadata member


def migrate(spec: str, to: str, force: bool = False) -> tuple[str, int]:
    """Copy the pool's store to `to` (a URL, or MEMBER) and switch the pool to it;
    (where it lives now, rows copied)."""
    pool = Pool.open(spec)
    pool.require_members("mxfs meta migrate")
    with pool_lock(pool, "mxfs meta migrate"):
        return _migrate_held(pool, to, force)


def _migrate_held(pool: Pool, to: str, force: bool) -> tuple[str, int]:
    dest = pool.meta_dir if to == MEMBER else to
    if to != MEMBER and not location.is_server(to):
        raise MxfsError(f"--to {to} is neither a server's URL nor 'member'",
                        "give postgresql://HOST/DATABASE, or member")
    if dest == pool.meta_location or (to != MEMBER and pool.meta_url == location.public(to)):
        raise MxfsError(f"the metadata already lives at {location.public(dest)}",
                        "name another place")
    if to != MEMBER:
        refuse_other_pool(to, force)
    try:
        src = MetaStore.open(pool.meta_location, readonly=True)
    except Unusable as e:
        raise MxfsError(str(e), "repair it first (mxfs fsck, mxfs meta restore)") from None
    try:
        if src.setting("pool_uuid") != pool.uuid:
            raise MxfsError(f"the store at {location.public(pool.meta_location)} is not "
                            f"pool {pool.uuid}'s", "restore the right metadata store")
        found = problems(src)
        if found:
            raise MxfsError(f"the metadata has {len(found)} problems ({found[0].text})",
                            "run mxfs fsck --repair first")
        if to == MEMBER:
            location.set_aside(pool.meta_dir)
        try:
            dst = MetaStore(location.create(dest))
        except (Unusable, OSError) as e:
            raise MxfsError(f"the metadata store at {location.public(dest)} cannot be made "
                            f"({e})", "check that it is reachable, yours, and has room") \
                from None
        try:
            rows = copy_rows(src.engine, dst.engine)
            dst.durable()
            _compare(src, dst)
        finally:
            dst.close()
    finally:
        src.close()
    public = "" if to == MEMBER else location.public(to)
    for m in pool.members:
        sb = read_superblock(m.path)
        write_superblock(m.path, dataclasses.replace(sb, meta=public))
    if to != MEMBER:
        location.set_aside(pool.meta_dir)
    return location.public(dest), rows


def _compare(src: MetaStore, dst: MetaStore) -> None:
    """Every row of the copy equals the source's; sequences go on past the source's."""
    for t in TABLES.values():
        if t.transient:  # (not copied: `dump.copy_rows`)
            continue
        a = sorted(map(repr, (tuple(bytes(v) if isinstance(v, memoryview) else v for v in r)
                              for r in src.engine.scan(t.name, t.names))))
        b = sorted(map(repr, dst.engine.scan(t.name, t.names)))
        if a != b:
            raise MxfsError(f"the copy of table {t.name} differs from the source "
                            f"({len(a)} rows, {len(b)} copied)", "nothing was switched; "
                            "run the migration again")
    have, want = dst.engine.sequences(), src.engine.sequences()
    for name, value in want.items():
        if have.get(name, 0) < value:
            raise MxfsError(f"the copy's sequence {name} is behind the source's",
                            "nothing was switched; run the migration again")


