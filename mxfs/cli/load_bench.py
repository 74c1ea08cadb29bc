"""`mxfs load-bench`: mxfs.load against safetensors on the user's own files, side by side.

Both arms touch every page of every tensor (safetensors hands back lazily mapped
tensors); caches are dropped before each load when root; medians of repeats.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from typing import Any

from mxfs.cli.measure import drop_caches
from mxfs.errors import MxfsError, UsageError
from mxfs.units import format_size


def run_load_bench(files: list[str], device: str, repeat: int, as_json: bool) -> int:
    if repeat < 1:  # (checked first: no median of no rounds, after the imports' seconds)
        raise UsageError(f"--repeat {repeat}: no rounds to take a median of",
                         "give 1 or more (default 3)")
    try:
        import safetensors.torch as st

        from mxfs.load import load_file
        from mxfs.load.tensors import touch_pages
    except ImportError as e:
        raise MxfsError(f"load-bench needs torch and safetensors ({e.name} is missing)",
                        "pip install torch==2.13.0 safetensors") from None
    files = [f for f in files if f.endswith(".safetensors")]
    if not files:
        raise MxfsError("no .safetensors files given", "name model files or their folder")
    nbytes = sum(os.path.getsize(f) for f in files)
    times: dict[str, list[float]] = {"mxfs.load": [], "safetensors": []}
    cold = False
    for _ in range(repeat):
        for name, fn in (("mxfs.load", load_file), ("safetensors", st.load_file)):
            cold = drop_caches()
            start = time.perf_counter()
            for f in files:
                touch_pages(fn(f, device=device))
            times[name].append(time.perf_counter() - start)
    med = {k: statistics.median(v) for k, v in times.items()}
    result: dict[str, Any] = {"files": len(files), "bytes": nbytes, "device": device, "cold": cold,
              "GBps": {k: nbytes / v / 1e9 for k, v in med.items()},
              "speedup": med["safetensors"] / med["mxfs.load"]}
    if as_json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{len(files)} files, {format_size(nbytes)}, device {device}, "
          f"{'cold' if cold else 'warm'} cache, median of {repeat}:")
    for k, v in result["GBps"].items():
        print(f"  {k:12s} {v:6.2f} GB/s")
    print(f"  mxfs.load is {result['speedup']:.2f}x safetensors")
    return 0
