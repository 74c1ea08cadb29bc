"""Model loading through the direct path: safetensors to tensors (torch lives here).

CPU today (CUDA by copying from CPU tensors); pinned double buffers, GPUDirect
Storage and Ascend NPUs are the next steps of issue 3.
"""

from mxfs.load.header import HeaderError
from mxfs.load.model import load_model
from mxfs.load.tensors import load_file, safe_open

__all__ = ["HeaderError", "load_file", "load_model", "safe_open"]
