"""Stripe math and batched parallel pread/pwrite on open descriptors (stdlib only).

The FUSE daemon and the direct clients both move bytes through here, so a
request that spans several members is served by all of them at once.
"""

from mxfs.io.batch import ReadOp, WriteOp, read_batch, write_batch
from mxfs.io.layout import DEFAULT_STRIPE_UNIT, PAGE, Layout, Piece

__all__ = ["DEFAULT_STRIPE_UNIT", "PAGE", "Layout", "Piece", "ReadOp", "WriteOp", "read_batch",
           "write_batch"]
