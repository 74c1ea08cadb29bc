"""Making a pool (`mxfs mkfs`): superblocks on every member, then its metadata store."""

from __future__ import annotations

import os

from mxfs.errors import MxfsError
from mxfs.meta import MetaStore, Unusable, location
from mxfs.pool import Pool, format_members
from mxfs.pool.lock import make_pool_lock, refuse_in_use
from mxfs.vol.volume import tighten


def format_pool(members: list[str], stripe_unit: int, label: str = "",
                force: bool = False, meta: str = "") -> Pool:
    """mkfs: superblocks on every member, then an empty metadata store on member 0, or in
    the database `meta` names (a URL; the superblocks record it without a password)."""
    if meta and not location.is_server(meta):
        raise MxfsError(f"--meta {meta} is not a server's URL",
                        "give postgresql://HOST/DATABASE, or leave --meta out")
    if meta:
        refuse_other_pool(meta, force)
    if force:
        refuse_in_use(members)

    def store() -> None:  # inside mkfs's undo: a failure leaves every member as it was
        pool = Pool.open(members[0])
        os.chmod(pool.meta_dir, 0o700)  # before the store exists: nobody reaches it meanwhile
        try:
            make_pool_lock(pool)  # (its block taken now: a full member still mounts)
            MetaStore.format(meta or pool.meta_dir, pool.uuid, stripe_unit).close()
        except (Unusable, OSError) as e:
            where = location.public(meta) if meta else members[0]
            raise MxfsError(f"the metadata store on {where} cannot be made ({e})",
                            "check that it is writable (a server: reachable, and yours) and "
                            "has free space") from None
        tighten(pool)

    sb = format_members(members, stripe_unit, label, force, then=store,
                        meta=location.public(meta) if meta else "")
    pool = Pool.open(members[0])
    assert pool.uuid == sb.pool_uuid
    return pool


def refuse_other_pool(meta: str, force: bool) -> None:
    """A database that holds a pool's metadata is not wiped without --force."""
    try:
        old = MetaStore.open(meta, readonly=True)
    except Unusable as e:
        if "cannot be reached" in str(e):
            raise MxfsError(str(e), "start the server, or check the URL and credentials "
                            "(~/.pgpass, PGPASSFILE)") from None
        return
    try:
        uuid = old.setting("pool_uuid")
    finally:
        old.close()
    if uuid and not force:
        raise MxfsError(f"{location.public(meta)} holds the metadata of pool {uuid}",
                        "name another database, or --force to replace that pool's metadata")
