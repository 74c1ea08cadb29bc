"""vLLM integration: `vllm serve MODEL --load-format mxfs` loads weights through mxfs.

Registered through vLLM's `vllm.general_plugins` entry point (pyproject.toml).
vLLM is imported only inside `register`, so mxfs never needs it; where vLLM is
absent, `register` does nothing.  `tests/test_load.py` checks it against vLLM 0.33
where vLLM is installed (skipped otherwise: it is not in the test extras).
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("mxfs.load.vllm")
LOAD_FORMAT = "mxfs"


def register() -> None:
    try:
        from vllm.model_executor.model_loader import register_model_loader
        from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    except ImportError:
        return

    from mxfs.load.model import load_model

    @register_model_loader(LOAD_FORMAT)
    class MxfsModelLoader(BaseModelLoader):  # type: ignore[misc, valid-type]
        """Weights from a model folder on an mxfs mount, mapped stripe by stripe.

        vLLM's own weight loaders narrow each tensor to this rank's slice; mapped
        tensors page in only the bytes that slice touches.
        """

        def download_model(self, model_config: Any) -> None:
            pass  # the model is a local folder on the pool

        def load_weights(self, model: Any, model_config: Any) -> None:
            path = model_config.model
            log.info("loading %s through mxfs", path)
            model.load_weights(load_model(path))
