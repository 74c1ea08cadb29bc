#!/usr/bin/env bash
# The GPU check (issue 12): model loads, checkpoints from CUDA tensors, KV gets into CUDA
# buffers and the environment found, in one prepared run of under 8 minutes on a CUDA
# machine that cannot reach the internet.  tools/gpu_check.py says what it measures.
#
# Here, once: put what the GPU image lacks (Python 3.12, x86-64) into .whl/ (ignored):
#   tools/gpu_check.sh --fetch        (PY312=/path/to/python3.12 to build the two
#                                      extensions, when python3.12 is not on the PATH)
#   .whl/*.whl       kvikio for CUDA 13, zstandard, trio and its needs, the peer loaders
#                    fastsafetensors and InstantTensor, and pyfuse3 built here for cp312
#                    (it ships no wheels)
#   .whl/lib/        libfuse3.so.3 (pyfuse3 needs it; the image has no libfuse3)
#   .whl/native/     mxfs's io_uring engine built for cp312, liburing linked in
# There, from the repo root, with .whl/ carried along:
#   tools/gpu_check.sh            (SIZE=4GiB REPEAT=3 BUDGET=420 OUT=dir to change them;
#                                  PARTS=loads to rerun one part with the whole budget)
# Whatever is missing there (FUSE, io_uring, GDS) is recorded and its unmounted or
# buffered path runs instead; OUT/gpu_check.json and OUT/gpu_check.md hold everything.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(kvikio-cu13==26.10.* libkvikio-cu13==26.10.* rapids-logger==0.3.* zstandard
        fastsafetensors==0.5.0 instanttensor==0.2.2
        trio==0.35.* outcome==1.3.* sniffio==1.3.*)
if [ "${1:-}" = --fetch ]; then
  plat=()
  for p in manylinux_2_28_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
    plat+=(--platform "$p")
  done
  mkdir -p .whl/lib .whl/native
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${plat[@]}" -d .whl "${WHEELS[@]}"
  PY312=${PY312:-$(command -v python3.12 || true)}
  if [ -z "$PY312" ] || ! "$PY312" -c 'import sys; assert sys.version_info[:2] == (3, 12)'; then
    echo "gpu_check: no Python 3.12 here (set PY312=...): pyfuse3 and the io_uring engine" \
         "are not built, so the GPU machine will record FUSE and io_uring as missing" >&2
    exit 0
  fi
  # pyfuse3 against this machine's libfuse3 (shipped beside it); liburing linked in
  # statically, so the engine needs nothing the image lacks.
  "$PY312" -m pip wheel -q --no-deps --no-binary=pyfuse3 -w .whl pyfuse3==3.5.0
  cp -L "$(ldconfig -p | awk '/libfuse3\.so\.3 /{print $NF; exit}')" .whl/lib/libfuse3.so.3
  inc=$("$PY312" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
  gcc -shared -fPIC -O2 -Wall -I"$inc" native/engine.c -Wl,-Bstatic -luring -Wl,-Bdynamic \
    -o .whl/native/_engine.cpython-312-x86_64-linux-gnu.so
  du -sh .whl
  exit 0
fi
if compgen -G ".whl/*.whl" >/dev/null; then
  # A folder of our own (mktemp -d: 0700, a fresh name): a fixed /tmp path could be made
  # first by another user, whose sitecustomize.py would then run in this (root's) Python.
  site=$(mktemp -d "${TMPDIR:-/tmp}/mxfs-site.XXXXXXXX")
  trap 'rm -rf -- "$site"' EXIT
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" .whl/*.whl || echo "gpu_check: some wheels did not install"
  export PYTHONPATH="$site"
fi
[ -d .whl/lib ] && export LD_LIBRARY_PATH="$PWD/.whl/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
engine=.whl/native/_engine.cpython-312-x86_64-linux-gnu.so
[ -f "$engine" ] && [ ! -e "mxfs/io/${engine##*/}" ] && cp "$engine" mxfs/io/
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
timeout 470 python3 tools/gpu_check.py --size "${SIZE:-4GiB}" --repeat "${REPEAT:-3}" \
  --budget "${BUDGET:-420}" --parts "${PARTS:-loads,checkpoint,kv}" --out "${OUT:-gpu-check-out}"
