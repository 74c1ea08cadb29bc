"""vLLM integration: `vllm serve MODEL --load-format mxfs` loads weights through mxfs.

Registered through vLLM's `vllm.general_plugins` entry point (pyproject.toml).
vLLM is imported only inside `register`, so mxfs never needs it; where vLLM is
absent, `register` does nothing.

Options come as vLLM users give every loader's: `--model-loader-extra-config
'{"mode": "read", "odirect": "always"}'` (keys and values in `mxfs.load.options`),
with the MXFS_* environment variables as the fallback.  Mode "auto" (the default:
"map" for files nobody but the loading user or root can change or end, else "read",
`load.tensors.load_file`) and "map"/"read" give vLLM CPU tensors its weight loaders
narrow to this rank's slice (mapped tensors page in only the bytes that slice
touches); "stream" and "gds" put whole tensors straight into the model's
device.  Each load logs one line in vLLM's own log, timed until every weight is in
place.  Errors are raised as vLLM's loaders raise them: ValueError for a bad config,
RuntimeError for weights that cannot be found or read.  `tests/test_vllm.py` runs it
in vLLM's CPU build.
"""

from __future__ import annotations

import time
from typing import Any

from mxfs.errors import MxfsError
from mxfs.load.model import load_model, shard_files
from mxfs.load.options import LoadOptions, LoadReport

LOAD_FORMAT = "mxfs"
CONFIG_FLAG = "--model-loader-extra-config"


def loader_options(extra: object) -> LoadOptions:
    """The options of one loader: the environment's, with vLLM's extra config on top."""
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        raise ValueError(f"{CONFIG_FLAG} must be a JSON object for load format "
                         f"{LOAD_FORMAT}, got {type(extra).__name__}")
    try:
        return LoadOptions.from_env().merged(extra, source=CONFIG_FLAG)
    except MxfsError as e:
        raise ValueError(str(e)) from None


def _model_device(model: Any) -> Any:
    for p in model.parameters():
        return p.device
    return "cpu"


def register() -> None:
    try:
        from vllm.logger import init_logger
        from vllm.model_executor.model_loader import register_model_loader
        from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    except ImportError:
        return

    # Under vllm.*, so the line goes where vLLM's own loaders' lines go.
    log = init_logger("vllm.model_executor.model_loader.mxfs")

    @register_model_loader(LOAD_FORMAT)
    class MxfsModelLoader(BaseModelLoader):
        """Weights from a model folder on an mxfs mount, through the direct path."""

        def __init__(self, load_config: Any) -> None:
            super().__init__(load_config)
            self.options = loader_options(load_config.model_loader_extra_config)

        def download_model(self, model_config: Any) -> None:
            """Nothing to download: the model is a folder on the pool; check it is one."""
            try:
                shard_files(model_config.model)
            except MxfsError as e:
                raise RuntimeError(f"Cannot find any safetensors model weights with "
                                   f"`{model_config.model}`: {e}") from None

        def load_weights(self, model: Any, model_config: Any) -> None:
            path = model_config.model
            opts = self.options
            device = _model_device(model) if opts.mode in ("stream", "gds") else "cpu"
            report = LoadReport()
            start = time.perf_counter()
            try:
                model.load_weights(load_model(path, device, options=opts, report=report))
            except (MxfsError, OSError) as e:
                raise RuntimeError(f"mxfs could not load the weights of `{path}`: "
                                   f"{e}") from None
            secs = time.perf_counter() - start
            log.info("Loading weights through mxfs took %.2f seconds: %s", secs,
                     report.summary(secs))
