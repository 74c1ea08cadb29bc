"""The operator's tools beside the daemon: fsck, scrub, put and metadata migration.

They open a pool through `fs.volume` (an unmounted one under the pool lock; scrub also
reads a mounted pool's sealed files) and never run inside the daemon.
"""
