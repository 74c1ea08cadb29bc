"""Model loading through the direct path: safetensors to tensors (torch lives here).

CPU today; CUDA through pinned double buffers and GPUDirect Storage, Ascend NPUs,
sharded checkpoints and tensor-parallel slices are the next steps of issue 3.
"""

from mxfs.load.header import HeaderError
from mxfs.load.tensors import load_file, safe_open

__all__ = ["HeaderError", "load_file", "safe_open"]
