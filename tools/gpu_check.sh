#!/usr/bin/env bash
# The loader's GPU check (issue 3): one prepared run, under 8 minutes, on a CUDA machine
# that cannot reach the internet.  tools/gpu_check.py says what it measures.
#
# Here, once: fetch the wheels the GPU machine lacks (Python 3.12) into .whl/ (ignored):
#   tools/gpu_check.sh --fetch
# There, from the repo root, with .whl/ carried along:
#   tools/gpu_check.sh            (SIZE=4GiB REPEAT=3 OUT=dir to change the defaults)
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(kvikio-cu13==26.10.* libkvikio-cu13==26.10.* rapids-logger==0.3.* zstandard)
if [ "${1:-}" = --fetch ]; then
  plat=()
  for p in manylinux_2_28_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
    plat+=(--platform "$p")
  done
  exec python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${plat[@]}" -d .whl "${WHEELS[@]}"
fi
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/mxfs-site .whl/*.whl
  export PYTHONPATH=/tmp/mxfs-site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
python3 -c "import kvikio, kvikio.defaults as d; print('kvikio', kvikio.__version__, \
'compat mode preferred:', d.is_compat_mode_preferred())" || echo "kvikio does not import"
timeout 450 python3 tools/gpu_check.py --size "${SIZE:-4GiB}" --repeat "${REPEAT:-3}" \
  --out "${OUT:-gpu-check-out}"
