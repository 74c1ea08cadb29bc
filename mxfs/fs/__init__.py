"""The FUSE daemon and its control server.

Import submodules directly: `volume` and `mounts` need no FUSE, `ops`,
`control` and `daemon` import pyfuse3 and trio.
"""
