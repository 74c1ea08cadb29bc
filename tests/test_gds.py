"""GPUDirect Storage: the read plan is exact; without GDS the reason is clear and loads go on.

The kvikio reads themselves need a GPU (tools/gpu_check.sh runs them); here the plan
they follow is executed with pread, and the choice between GDS and pinned staging is
checked on a machine without CUDA.
"""

from __future__ import annotations

import logging
import os
import random

import pytest

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")

from conftest import Mounted  # noqa: E402

from mxfs.client.direct import DirectFile, open_reader  # noqa: E402
from mxfs.errors import MxfsError  # noqa: E402
from mxfs.load import load_file  # noqa: E402
from mxfs.load.gds import GdsReader, Unavailable, open_gds, plan  # noqa: E402

CUDA = torch.device("cuda:0")


def test_the_gds_plan_places_every_byte_of_any_range(mounted: Mounted) -> None:
    path = mounted.path / "f.bin"
    with open(path, "wb") as f:  # a hole in the middle: one member may hold nothing there
        f.write(random.Random(1).randbytes(300_000))
        f.seek(700_000)
        f.write(random.Random(2).randbytes(123_457))
    data = path.read_bytes()
    rng = random.Random(5)
    with open_reader(str(path)) as r:
        assert isinstance(r, DirectFile)
        for _ in range(30):
            off = rng.randrange(len(data))
            n = rng.randrange(len(data) - off + 1)
            out = bytearray(b"\xee" * n)
            lengths = {m: os.fstat(fd).st_size for m, fd in r.fds.items()}
            for s in plan(r.layout, off, n, lengths):
                got = os.pread(r.fds[s.member], s.have, s.offset) if s.have else b""
                assert len(got) == s.have  # never a read past a chunk file's end
                out[s.at:s.at + s.n] = got + bytes(s.n - s.have)
            assert bytes(out) == data[off:off + n], (off, n)


def test_gds_is_declined_with_a_reason(mounted: Mounted, monkeypatch: pytest.MonkeyPatch,
                                       tmp_path) -> None:  # noqa: ANN001
    st.save_file({"w": torch.ones(4)}, str(mounted.path / "m.safetensors"))
    st.save_file({"w": torch.ones(4)}, str(tmp_path / "m.safetensors"))
    with open_reader(str(mounted.path / "m.safetensors")) as r:
        with pytest.raises(Unavailable, match="CUDA devices"):
            GdsReader(r, torch.device("cpu"))
        monkeypatch.setenv("MXFS_GDS", "off")
        with pytest.raises(Unavailable, match="gds=off"):
            GdsReader(r, CUDA)
        monkeypatch.delenv("MXFS_GDS")
        with pytest.raises(Unavailable, match="gds=off"):
            GdsReader(r, CUDA, "off")  # the option, as a loader config gives it
        try:
            import kvikio  # noqa: F401
        except ImportError:
            with pytest.raises(Unavailable, match="kvikio is not installed"):
                GdsReader(r, CUDA)
    with open_reader(str(tmp_path / "m.safetensors")) as plain, \
            pytest.raises(Unavailable, match="not on an mxfs pool"):
        GdsReader(plain, CUDA)


def test_a_declined_gds_is_logged_once_and_the_load_goes_on(
        mounted: Mounted, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from mxfs.load import gds

    monkeypatch.setattr(gds, "_said", set())
    caplog.set_level(logging.INFO, logger="mxfs.load")
    st.save_file({"w": torch.ones(4)}, str(mounted.path / "n.safetensors"))
    with open_reader(str(mounted.path / "n.safetensors")) as r:
        why = open_gds(r, torch.device("cpu"), required=False)
        assert isinstance(why, str) and "CUDA devices" in why  # the reason, for reports
        assert open_gds(r, torch.device("cpu"), required=False) == why
        with pytest.raises(Unavailable):
            open_gds(r, torch.device("cpu"), required=True)
    said = [m for m in caplog.messages if "GPUDirect Storage not used" in m]
    assert len(said) == 1 and "CUDA devices" in said[0]


def test_mode_gds_where_it_cannot_run_is_one_clear_error(mounted: Mounted) -> None:
    st.save_file({"w": torch.ones(4)}, str(mounted.path / "m.safetensors"))
    with pytest.raises(MxfsError, match="GPUDirect Storage"):
        load_file(str(mounted.path / "m.safetensors"), mode="gds")
