"""mxfs: a striped storage tier for AI computing centres.

Layers (each a subpackage; arrows are imports, never upwards):
cli -> fs, client, pool, meta; fs -> meta, pool, io, proto; client -> io, proto;
pool -> io; meta, io, proto -> stdlib.  See docs/architecture.md.
"""

__version__ = "0.1.0"
