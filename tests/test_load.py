"""mxfs.load against safetensors: same tensors on every dtype, corrupt files refused."""

from __future__ import annotations

import errno
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")

from conftest import Mounted, mxfs, one_line_error  # noqa: E402

from mxfs.cli.measure import drop_caches  # noqa: E402
from mxfs.client import ControlClient  # noqa: E402
from mxfs.client.direct import DirectFile, FileChanged, PlainFile, open_reader  # noqa: E402
from mxfs.errors import MxfsError  # noqa: E402
from mxfs.load import HeaderError, load_file, load_model, safe_open  # noqa: E402
from mxfs.load.options import LoadOptions, LoadReport  # noqa: E402
from mxfs.load.staging import read_to_device  # noqa: E402
from mxfs.proc import running  # noqa: E402

DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.uint16, torch.float16,
          torch.bfloat16, torch.int32, torch.uint32, torch.float32, torch.int64, torch.uint64,
          torch.float64, torch.complex64, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.float8_e8m0fnu]


def every_dtype() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    out = {}
    for i, dt in enumerate(DTYPES):
        raw = torch.randint(0, 256, (3 * (i + 1), 5 + i), dtype=torch.uint8, generator=g)
        size = torch.empty((), dtype=dt).element_size()
        out[f"t{i}.{str(dt).split('.')[1]}"] = raw.view(-1)[: raw.numel() // size * size] \
            .view(dt).reshape(-1) if dt != torch.bool else raw.bool()
    out["scalar"] = torch.tensor(3.5)
    out["empty"] = torch.empty(0, 4)
    out["big.weight"] = torch.randn(700, 1000, generator=g).to(torch.bfloat16)  # spans stripes
    return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        # compare bytes: NaN payloads and float8 have no reliable ==
        as_bytes = [t.reshape(-1).view(torch.uint8) for t in (a[k], b[k])]
        assert torch.equal(*as_bytes), k


def test_every_dtype_equals_safetensors_through_the_direct_path(mounted: Mounted) -> None:
    path = str(mounted.path / "model.safetensors")
    st.save_file(every_dtype(), path, metadata={"format": "pt"})
    reader = open_reader(path)
    assert isinstance(reader, DirectFile)  # not through FUSE
    reader.close()
    same(load_file(path, mode="read"), st.load_file(path))
    mapped = load_file(path)  # auto: mapped on the CPU
    same(mapped, st.load_file(path))
    mapped["big.weight"][0, 0] = 1  # copy-on-write: the file stays as it was
    same(load_file(path), st.load_file(path))
    with safe_open(path) as f:
        assert f.metadata() == {"format": "pt"}
        assert f.keys() == sorted(every_dtype())
        w = f.get_tensor("big.weight")
        assert torch.equal(w, st.load_file(path)["big.weight"])
        rows = f.get_slice("big.weight")[100:250]
        assert torch.equal(rows, w[100:250])
        assert f.get_slice("big.weight").get_shape() == [700, 1000]
        assert torch.equal(f.get_slice("big.weight")[5:9, 2:4], w[5:9, 2:4])


def test_plain_files_load_too(plain: Path) -> None:
    path = str(plain / "m.safetensors")
    st.save_file(every_dtype(), path)
    assert isinstance(open_reader(path), PlainFile)
    same(load_file(path, mode="read"), st.load_file(path))
    same(load_file(path, mode="map"), st.load_file(path))


def test_mapping_a_file_with_holes_reads_zeros(mounted: Mounted) -> None:
    """Stripes never written and a tail past the chunk files map as zeros, no SIGBUS."""
    path = mounted.path / "sparse.safetensors"
    st.save_file({"w": torch.ones(16)}, str(path))
    size = os.path.getsize(path)
    os.truncate(path, size + 5 * 64 * 1024 + 123)  # grows past several stripes
    reader = open_reader(str(path))
    mm = reader.map()
    data = bytes(mm[:reader.size])
    assert data[:size] == path.read_bytes()[:size]
    assert data[size:] == bytes(reader.size - size)
    mm.close()
    reader.close()


def test_a_mapped_load_reads_every_member_into_the_cache_first(mounted: Mounted) -> None:
    """All members at once, before the first touch, so its pages come as large folios
    (WILLNEED would leave all but the first few MiB of each member to page faults)."""
    path = mounted.path / "cold.safetensors"
    st.save_file({"w": torch.arange(16 << 20, dtype=torch.float32)}, str(path))  # 64 MiB
    drop_caches()
    ino = os.stat(path).st_ino
    sizes = [os.stat(Path(m, "chunks", f"{ino % 256:02x}", str(ino))).st_size
             for m in mounted.members]
    assert min(sizes) >= 16 << 20
    # Counted as read from the drives, not as found in the cache afterwards: this VM's
    # host takes clean pages back every few seconds, mapped or not (a plain ext4 file
    # pread into the cache lost 41-950 of its 16384 pages within 1.3 s in 16 of 64
    # tries), so residency read after the load is not the load's doing.
    before = _storage_reads()
    tensors = load_file(str(path), mode="map")
    assert _storage_reads() - before >= sum(sizes)  # all of it, before the first touch
    assert torch.equal(tensors["w"], torch.arange(16 << 20, dtype=torch.float32))


def _storage_reads() -> int:
    """Bytes this process (all its threads) has had read from storage."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))


def write_raw(path: Path, header: object, data: bytes = b"", length: int | None = None) -> str:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(raw) if length is None else length
    path.write_bytes(struct.pack("<Q", n) + raw + data)
    return str(path)


@pytest.mark.parametrize("case,header,data,length,expect", [
    ("too long", {}, b"", 10_000, "runs past the end"),
    ("not json", b"{nope", b"", None, "not valid JSON"),
    ("overlap", {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                 "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}},
     bytes(12), None, "overlap"),
    ("past end", {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}},
     bytes(8), None, "outside the data"),
    ("unknown dtype", {"a": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}},
     bytes(16), None, "unknown dtype"),
    ("shape vs bytes", {"a": {"dtype": "F32", "shape": [3, 3], "data_offsets": [0, 16]}},
     bytes(16), None, "needs 36 bytes"),
    ("short file", b"", b"", 0, None),
])
def test_corrupt_headers_are_one_clear_error(mounted: Mounted, case: str, header: object,
                                             data: bytes, length: int | None,
                                             expect: str | None) -> None:
    path = write_raw(mounted.path / "bad.safetensors", header, data, length)
    if case == "short file":
        Path(path).write_bytes(b"\x01\x02")
        expect = "too short"
    with pytest.raises(HeaderError) as e:
        load_file(path)
    assert path in str(e.value) and expect in str(e.value)
    if case in ("overlap", "past end", "unknown dtype", "shape vs bytes"):
        assert "'a'" in str(e.value) or "'b'" in str(e.value)


def test_a_file_written_while_it_loads_is_detected(mounted: Mounted) -> None:
    path = str(mounted.path / "m.safetensors")
    st.save_file({"w": torch.randn(256, 1024)}, path)
    reader = open_reader(path)
    buf = bytearray(reader.size)
    reader.read_into(0, memoryview(buf))
    reader.check_unchanged()
    with open(path, "r+b") as f:
        f.seek(100)
        f.write(b"changed")
    with pytest.raises(FileChanged):
        reader.check_unchanged()
    reader.close()
    reader = open_reader(path)
    (mounted.path / "other").write_bytes(b"x")
    os.replace(mounted.path / "other", path)
    with pytest.raises(FileChanged):
        reader.check_unchanged()
    reader.close()


def test_writes_through_a_writer_opened_before_the_reader_are_detected(mounted: Mounted
                                                                        ) -> None:
    """A writer that opened and wrote before a reader opened, and writes on after,
    changes the generation the reader was told: each reader in turn sees it."""
    path = str(mounted.path / "m.bin")
    Path(path).write_bytes(b"A" * (1 << 20))
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, b"A", 0)
        os.fsync(fd)
        for byte in (b"B", b"C"):
            reader = open_reader(path)
            assert isinstance(reader, DirectFile)
            reader.check_unchanged()
            os.pwrite(fd, byte * (512 << 10), 512 << 10)
            os.fsync(fd)
            with pytest.raises(FileChanged):
                reader.check_unchanged()
            reader.close()
    finally:
        os.close(fd)


LAYOUT_AS_NOBODY = r"""
import os, sys
from mxfs.client import ControlClient
os.setgroups([]); os.setgid(65534); os.setuid(65534)
with ControlClient(sys.argv[1]) as c:
    print(c.layout(sys.argv[2])["generation"])
"""


def test_a_layout_of_a_file_one_may_not_read_costs_its_writer_nothing(mounted: Mounted
                                                                       ) -> None:
    """Only a caller who may read a file is told its generation: one who may not (who
    walked to it, and looped LAYOUT) made each of its writer's next writes a commit on
    the daemon's thread, and its generation changed for every reader."""
    path = mounted.path / "private.bin"
    path.write_bytes(b"A" * (1 << 20))
    path.chmod(0o600)

    def generation(as_nobody: bool = False) -> int:
        if not as_nobody:
            with ControlClient(str(mounted.path)) as c:
                return int(c.layout(str(path))["generation"])
        res = subprocess.run([sys.executable, "-c", LAYOUT_AS_NOBODY, str(mounted.path),
                              str(path)], capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        return int(res.stdout)

    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, b"A", 0)
        os.fsync(fd)
        told = generation()
        os.pwrite(fd, b"B", 0)  # (root was told: this write changes it)
        os.fsync(fd)
        now = generation(as_nobody=True)
        assert now != told
        os.pwrite(fd, b"C", 0)  # (nobody's ask told nothing: this one changes nothing)
        os.fsync(fd)
        assert generation() == now
    finally:
        os.close(fd)


CALLER = r"""
import json, os, sys
from mxfs.load import load_file  # imports first: Python may live under /root
import torch
os.setgroups([]); os.setgid(65534); os.setuid(65534)
out = {}
for p in sys.argv[1:]:
    try:
        load_file(p); out[p] = "ok"
    except PermissionError as e:
        out[p] = "EACCES"
    try:
        open(p, "rb").close(); out["mount:" + p] = "ok"
    except PermissionError:
        out["mount:" + p] = "EACCES"
print(json.dumps(out))
"""


def test_direct_reads_refuse_what_the_mount_refuses(mounted: Mounted) -> None:
    os.chmod(mounted.path, 0o755)
    tensors = {"w": torch.arange(10.0)}
    for name, mode in (("open.safetensors", 0o644), ("closed.safetensors", 0o600)):
        st.save_file(tensors, str(mounted.path / name))
        os.chmod(mounted.path / name, mode)
    (mounted.path / "hidden").mkdir(mode=0o700)
    st.save_file(tensors, str(mounted.path / "hidden" / "m.safetensors"))
    paths = [str(mounted.path / "open.safetensors"), str(mounted.path / "closed.safetensors"),
             str(mounted.path / "hidden" / "m.safetensors")]
    res = subprocess.run([sys.executable, "-c", CALLER, *paths], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out[paths[0]] == out["mount:" + paths[0]] == "ok"
    for p in paths[1:]:
        assert out[p] == out["mount:" + p] == "EACCES", p


def test_a_dead_daemon_is_a_clear_error(mounted: Mounted) -> None:
    import signal

    from conftest import eventually

    from mxfs.errors import MxfsError

    path = str(mounted.path / "m.safetensors")
    st.save_file({"w": torch.zeros(4)}, path)
    pid = mounted.daemon_pid()
    os.kill(pid, signal.SIGKILL)
    assert eventually(lambda: not running(pid))
    with pytest.raises(MxfsError) as e:
        load_file(path)
    assert "daemon" in str(e.value) and "mxfs mount" in str(e.value)


def write_sharded(folder: Path) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    full = {f"layers.{i}.{kind}": torch.randn(96, 40, generator=g).to(torch.bfloat16)
            for i in range(4) for kind in ("qkv", "out")}
    full["embed"] = torch.randn(50, 64, generator=g)
    full["norm"] = torch.ones(64)
    names = sorted(full)
    shards = [names[:5], names[5:]]
    weight_map = {}
    for i, part in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        st.save_file({n: full[n] for n in part}, str(folder / fname))
        weight_map.update({n: fname for n in part})
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return full


def test_load_model_sharded_and_tensor_parallel(mounted: Mounted) -> None:
    from mxfs.load import load_model

    folder = mounted.path / "model"
    folder.mkdir()
    full = write_sharded(folder)
    got = dict(load_model(str(folder), progress=True))
    same(got, full)

    def rule(name: str, shape: tuple[int, ...]) -> int | None:
        if name.endswith("qkv"):
            return 0  # column-parallel: rows split
        if name.endswith("out"):
            return 1  # row-parallel: columns split
        return None

    for size in (2, 3):
        parts = [dict(load_model(str(folder / "model.safetensors.index.json"),
                                 tp_rank=r, tp_size=size, shard_dim=rule)) for r in range(size)]
        for name, t in full.items():
            dim = rule(name, tuple(t.shape))
            if dim is None:
                assert all(torch.equal(p[name], t) for p in parts)
            else:
                expect = torch.chunk(t, size, dim=dim)
                for p, e in zip(parts, expect, strict=False):
                    assert torch.equal(p[name], e), (name, size)


def test_cli_warm_and_load_bench(mounted: Mounted) -> None:
    from conftest import mxfs

    folder = mounted.path / "m"
    folder.mkdir()
    write_sharded(folder)
    out = json.loads(mxfs("warm", "--json", str(folder)).stdout)
    assert out["files"] == 3 and out["bytes"] > 0
    out = json.loads(mxfs("load-bench", "--json", "--repeat", "1", str(folder)).stdout)
    assert out["files"] == 2 and out["GBps"]["mxfs.load"] > 0
    res = mxfs("load-bench", str(mounted.path / "nothing"), check=False)
    assert res.returncode != 0 and "does not exist" in res.stderr


def test_index_naming_a_missing_tensor_is_one_clear_error(plain: Path) -> None:
    from mxfs.errors import MxfsError
    from mxfs.load import load_model

    write_sharded(plain)
    index = plain / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"]["ghost.weight"] = "model-00001-of-00002.safetensors"
    index.write_text(json.dumps(doc))
    with pytest.raises(MxfsError) as e:
        dict(load_model(str(plain)))
    assert "ghost.weight" in str(e.value) and "index" in str(e.value)
    with pytest.raises(MxfsError) as e:
        dict(load_model(str(plain / "nothing-here")))
    assert "no safetensors model" in str(e.value)


@pytest.mark.parametrize("fname", ["../elsewhere.safetensors", "/tmp/x.safetensors",
                                   "sub/x.safetensors", ".."])
def test_an_index_naming_a_path_is_one_clear_error(plain: Path, fname: str) -> None:
    """An index's files are plain names beside it: one naming a path is refused,
    naming the entry, before any file is opened."""
    write_sharded(plain)
    index = plain / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"]["evil.weight"] = fname
    index.write_text(json.dumps(doc))
    with pytest.raises(MxfsError) as e:
        dict(load_model(str(plain)))
    assert "evil.weight" in str(e.value) and fname in str(e.value)


def test_a_model_file_that_is_not_a_regular_file_is_refused(plain: Path,
                                                             tmp_path: Path) -> None:
    """A folder's .safetensors entry that is a link to a FIFO elsewhere is refused as
    not a regular file (with no writer on the FIFO its open never returned before;
    one is held open here so the old path errs instead of hanging)."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (plain / "a.safetensors").symlink_to(fifo)
    held = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
    try:
        with pytest.raises(OSError) as e:
            dict(load_model(str(plain)))
        assert e.value.errno == errno.EINVAL and "not a regular file" in str(e.value)
    finally:
        os.close(held)


def test_an_unmounted_pool_is_read_directly_and_kept_unmounted(mounted: Mounted) -> None:
    from mxfs.load import load_model
    from mxfs.pool.offline import OfflinePool

    tensors = {"a": torch.randn(300, 700), "b": torch.arange(10_000, dtype=torch.int64)}
    (mounted.path / "m").mkdir()
    st.save_file(tensors, str(mounted.path / "m" / "model.safetensors"))
    sharded = mounted.path / "sharded"
    sharded.mkdir()
    st.save_file({"a": tensors["a"]}, str(sharded / "model-00001-of-00002.safetensors"))
    st.save_file({"b": tensors["b"]}, str(sharded / "model-00002-of-00002.safetensors"))
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(MxfsError, match="is mounted"):
        OfflinePool(mounted.members[0])
    mounted.umount()
    with OfflinePool(mounted.members[0]) as pool:
        assert pool.listdir("/m") == ["model.safetensors"]
        got = load_file("/m/model.safetensors", mode="read", pool=pool)
        assert all(torch.equal(got[k], v) for k, v in tensors.items())
        with safe_open("/m/model.safetensors", pool=pool) as f:
            assert torch.equal(f.get_slice("a")[10:20], tensors["a"][10:20])
        with pytest.raises(FileNotFoundError):
            load_file("/m/missing.safetensors", pool=pool)
        whole = dict(load_model("/sharded", pool=pool))
        assert all(torch.equal(whole[k], v) for k, v in tensors.items())
        rank1 = dict(load_model("/sharded/model.safetensors.index.json", pool=pool,
                                tp_rank=1, tp_size=2, shard_dim=lambda n, s: 0))
        assert torch.equal(rank1["a"], tensors["a"].chunk(2)[1])
        assert torch.equal(rank1["b"], tensors["b"].chunk(2)[1])
        with pytest.raises(MxfsError, match="holds no safetensors model"):
            dict(load_model("/nothing", pool=pool))
        line = one_line_error(mxfs("mount", mounted.members[0], str(mounted.path),
                                   check=False))
        assert "already mounted" in line or "is mounted" in line


def test_load_model_takes_options_and_reports_what_each_file_did(mounted: Mounted) -> None:
    g = torch.Generator().manual_seed(4)
    folder = mounted.path / "two"
    folder.mkdir()
    parts = [{"a": torch.randn(100, 7, generator=g)}, {"b": torch.randn(33, generator=g)}]
    for i, part in enumerate(parts):
        st.save_file(part, str(folder / f"m{i}.safetensors"))
    for opts, path in ((LoadOptions(mode="read", odirect="always"), "read"),
                       (LoadOptions(mode="stream", staging=8192), "stream"),
                       (LoadOptions(), "map")):
        report = LoadReport()
        got = dict(load_model(str(folder), options=opts, report=report))
        assert torch.equal(got["a"], parts[0]["a"]) and torch.equal(got["b"], parts[1]["b"])
        assert report.path_taken() == path and len(report.files) == 2
        assert report.nbytes == (100 * 7 + 33) * 4
    report = LoadReport()
    dict(load_model(str(folder), options=LoadOptions(mode="read"), report=report,
                    tp_rank=1, tp_size=2, shard_dim=lambda n, s: 0))
    assert report.path_taken() == "slices" and report.nbytes == (50 * 7 + 16) * 4


@pytest.mark.parametrize("staging", [8192, 64 << 10, 1 << 30])  # many pieces .. one piece
def test_stream_mode_equals_safetensors_through_bounded_staging(mounted: Mounted,
                                                                staging: int) -> None:
    g = torch.Generator().manual_seed(3)
    tensors = {"odd": torch.randn(1001, 37, generator=g), "bf": torch.randn(333, generator=g)
               .bfloat16(), "i8": torch.randint(-9, 9, (77_777,), generator=g, dtype=torch.int8),
               "empty": torch.empty(0, 5)}
    path = str(mounted.path / "s.safetensors")
    st.save_file(tensors, path)
    got = load_file(path, device="cpu", mode="stream", staging=staging)
    want = st.load_file(path)
    assert list(got) == list(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize(("buffers", "reads"), [(1, 1), (2, 1), (3, 2), (8, 4), (4, 9)])
def test_staging_with_reads_in_flight_moves_every_byte_once(mounted: Mounted, buffers: int,
                                                            reads: int) -> None:
    """Any number of buffers and reads in flight (more reads than buffers allow are
    fewer): a range that starts and ends off the page boundary comes back whole."""
    path = mounted.path / "staged.bin"
    data = os.urandom(3 * 1024 * 1024 + 12345)
    path.write_bytes(data)
    with open_reader(str(path)) as r:
        got = read_to_device(r, 4097, len(data) - 4097 - 99, torch.device("cpu"),
                             staging=192 << 10, buffers=buffers, reads=reads)
    assert bytes(got.numpy()) == data[4097:len(data) - 99]


def test_devices_this_machine_lacks_are_one_clear_error(tmp_path: Path) -> None:
    path = str(tmp_path / "x.safetensors")
    st.save_file({"a": torch.ones(3)}, path)
    for dev, words in (("npu:0", "torch_npu"), ("xpu:0", "not supported"),
                       *([("cuda:0", "no CUDA")] if not torch.cuda.is_available() else [])):
        with pytest.raises(MxfsError, match=words):
            load_file(path, device=dev)
