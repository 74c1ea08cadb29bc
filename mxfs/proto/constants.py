"""Names and limits the daemon and its clients both rely on, defined once."""

# The extended attributes the mount answers: a file's or folder's stripe layout
# (`mxfs getstripe/setstripe`), and where the control socket of the mount is.
LAYOUT_XATTR = "user.mxfs.layout"
CONTROL_XATTR = "user.mxfs.control"
# The type the kernel's mount table gives an mxfs mount (FUSE, subtype mxfs).
FSTYPE = "fuse.mxfs"

# The longest KV key the index stores; clients hash longer ones (SHA-256).
MAX_KEY = 1024
