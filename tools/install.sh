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
command -v setfacl >/dev/null || need+=(acl)  # tests: folders above a mount point with ACLs
command -v rsync >/dev/null || need+=(rsync)
command -v mkfs.ext4 >/dev/null || need+=(e2fsprogs)
command -v git >/dev/null || need+=(git)
command -v mkfs.xfs >/dev/null || need+=(xfsprogs)
command -v ip >/dev/null || need+=(iproute2)  # tests of several nodes: network namespaces  # the benches' members rig (tools/rig.py)
# PostgreSQL's server binaries: the shared metadata engine; its tests run a cluster of their own
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || need+=(postgresql)
[ -f /usr/include/liburing.h ] || need+=(liburing-dev)  # the native I/O engine builds on it
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "install.sh: missing ${need[*]}; run as root or: sudo apt-get install ${need[*]}" >&2
    exit 1
  fi
  # A fresh machine often runs its own apt at boot: wait for it (5 minutes at most).
  for try in $(seq 60); do
    apt-get update -qq 2>/dev/null && break
    [ "$try" -eq 60 ] && { echo "install.sh: apt-get update keeps failing (apt busy for 5 min, or offline); see: apt-get update" >&2; exit 1; }
    [ "$try" -eq 1 ] && echo "install.sh: apt is busy (another install?); waiting up to 5 minutes" >&2
    sleep 5
  done
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o DPkg::Lock::Timeout=300 \
    "${need[@]}" >/dev/null
fi

[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
# The CPU wheel: a plain "torch" requirement would pull several GB of CUDA build.
# (--no-compile: a package's modules are compiled when first imported, and a run imports
# a fraction of them; compiling all of torch's is half a minute of CPU.)
"$venv/bin/python" -c "import torch" 2>/dev/null || \
  "$venv/bin/python" -m pip install -q --no-compile torch==2.13.0
"$venv/bin/python" -m pip install -q --no-compile -e ".[test,bench]"
bash tools/checkout_path.sh "$venv"
echo "install.sh: ready ($("$venv/bin/python" -c 'import pyfuse3, torch; print("pyfuse3", pyfuse3.__version__, "torch", torch.__version__)'))"
