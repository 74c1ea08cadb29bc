"""The volume library: a pool's members and metadata store opened together, and what
works on it with no FUSE and no trio (the daemon in `fs/` and the offline tools in
`admin/` and `cli/` share it).

    volume.py     Volume: open, lock, recover, open-file counts, hidden files, reclaim
    format.py     mkfs: superblocks, then the store
    mounts.py     mount points, the mount table, starting and stopping the daemon
    access.py     the kernel's permission rules, applied to callers
    quota.py      per-user limits on bytes and inodes
    kv_index.py   the KV chunk index: namespaces, LRU, capacity, eviction
    spares.py     hidden inodes made ahead for KV puts
"""
