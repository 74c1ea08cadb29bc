#!/usr/bin/env bash
# Install what mxfs needs on a fresh Debian/Ubuntu machine: FUSE 3 and its headers
# (pyfuse3 builds against them), PostgreSQL's server (the shared metadata engine), a
# virtualenv, the CPU build of torch, and mxfs itself.
set -euo pipefail
venv=${1:-.venv}

need=()
command -v fusermount3 >/dev/null || need+=(fuse3)
pkg-config --exists fuse3 2>/dev/null || need+=(libfuse3-dev)
command -v pkg-config >/dev/null || need+=(pkg-config)
command -v getfattr >/dev/null || need+=(attr)
command -v rsync >/dev/null || need+=(rsync)
command -v mkfs.ext4 >/dev/null || need+=(e2fsprogs)
command -v git >/dev/null || need+=(git)
command -v mkfs.xfs >/dev/null || need+=(xfsprogs)  # the benches' members rig (tools/rig.py)
# PostgreSQL's server binaries: the shared metadata engine; its tests run a cluster of their own
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || need+=(postgresql)
[ -f /usr/include/liburing.h ] || need+=(liburing-dev)  # the native I/O engine builds on it
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "install.sh: missing ${need[*]}; run as root or: sudo apt-get install ${need[*]}" >&2
    exit 1
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi

[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
# The CPU wheel: a plain "torch" requirement would pull several GB of CUDA build.
"$venv/bin/python" -c "import torch" 2>/dev/null || "$venv/bin/python" -m pip install -q torch==2.13.0
"$venv/bin/python" -m pip install -q -e ".[test,bench]"
echo "install.sh: ready ($("$venv/bin/python" -c 'import pyfuse3, torch; print("pyfuse3", pyfuse3.__version__, "torch", torch.__version__)'))"
