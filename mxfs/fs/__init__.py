"""The mount daemon: FUSE operations (`ops.py`), the control socket (`listener.py`,
`control.py` and its services `*_ops.py`) and the daemon's tasks (`daemon.py`).

Everything here runs on the daemon's trio thread or its workers; what offline tools
share with the daemon (opening a volume, mkfs, mounts, permissions, quotas, the KV
index) is the volume library, `mxfs.vol`.
"""
