"""Members, superblocks, stripe math and chunk files (imports only mxfs.io)."""

from mxfs.pool.chunks import ChunkFiles
from mxfs.pool.pool import Member, Pool, format_members, read_pool_config
from mxfs.pool.superblock import Superblock, SuperblockError, read_superblock

__all__ = ["ChunkFiles", "Member", "Pool",
           "Superblock", "SuperblockError", "format_members", "read_pool_config", "read_superblock"]
