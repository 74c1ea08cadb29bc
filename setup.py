"""Build the native I/O engine (native/engine.c) when liburing is there.

Without liburing or a compiler, mxfs installs anyway and runs its Python
thread-pool engine (mxfs/io/engine.py says which engine runs).
"""

import os

from setuptools import Extension, setup

HAVE_URING = any(os.path.exists(os.path.join(d, "liburing.h"))
                 for d in ("/usr/include", "/usr/local/include"))

ext = [Extension("mxfs.io._engine", sources=["native/engine.c"], libraries=["uring"],
                 extra_compile_args=["-O2", "-Wall"], optional=True)] if HAVE_URING else []

setup(ext_modules=ext)
