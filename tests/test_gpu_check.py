"""KVStore puts of tensors that live off the host keep their host copies until written
(tools/gpu_check.py's dry run joins them here)."""

from __future__ import annotations

import torch
from conftest import Mounted

from mxfs.kv import KVStore


class OffHost(torch.Tensor):
    """A host tensor that says it lives on a device, as a CUDA one does: KVStore copies
    it to the host with `to`, which hands back a fresh copy, as a device tensor's does."""

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", 0)

    def to(self, *args: object, **kwargs: object) -> torch.Tensor:  # type: ignore[override]
        return self.as_subclass(torch.Tensor).clone()


def test_kv_put_of_device_tensors_keeps_their_host_copies(mounted: Mounted) -> None:
    # The host copies were freed before the batch was written: wrong bytes, or a crash.
    src = [torch.full((1 << 20,), i, dtype=torch.uint8) for i in range(8)]
    with KVStore(str(mounted.path), "dev") as kv:
        keys = [f"k{i}" for i in range(8)]
        assert kv.batch_put(keys, [t.as_subclass(OffHost) for t in src]) == [True] * 8
        for key, want in zip(keys, src, strict=True):
            back = torch.empty_like(want)
            assert kv.get(key, out=back) is True and torch.equal(back, want)
