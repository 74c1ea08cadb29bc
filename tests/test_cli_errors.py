"""Bad input to the command line: one line naming the problem and its fix, a non-zero
exit, never an internal error, and nothing half-made left behind; refused before any
work starts.  (The tests marked `unit` need no root and no mount.)"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Mounted, chunk_files, make_members, mkfs, mount_with, mxfs, one_line_error
from users import as_user

from mxfs.pool import Pool

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")


def refused(*args: str) -> str:
    """The one line a refused command printed, checked to be no internal error."""
    res = mxfs(*args, check=False)
    line = one_line_error(res)
    assert res.returncode != 70 and "internal error" not in line, line
    return line


# ---- numbers checked where they are parsed --------------------------------------------

@pytest.mark.unit
@pytest.mark.parametrize("args, flag", [
    (("top", "/nonexistent", "--interval", "-1"), "--interval"),
    (("top", "/nonexistent", "--interval", "nan"), "--interval"),
    (("top", "/nonexistent", "--interval", "inf"), "--interval"),
    (("top", "/nonexistent", "--interval", "1e99"), "--interval"),
    (("top", "/nonexistent", "--count", "-1"), "--count"),
    (("bench", "run", "--out", "OUT", "--repeat", "0"), "--repeat"),
    (("bench", "run", "--out", "OUT", "--size", "0"), "--size"),
    (("bench", "gates", "--out", "OUT", "--tolerance", "-1"), "--tolerance"),
    (("bench", "gates", "--out", "OUT", "--tolerance", "nan"), "--tolerance"),
    (("bench", "gates", "--out", "OUT", "--crash-every", "0"), "--crash-every"),
    (("bench", "gates", "--out", "OUT", "--g2-repeat", "0"), "--g2-repeat"),
    (("scrub", "/nonexistent", "--rate", "9" * 400), "--rate"),
    (("quota", "/nonexistent", "--user", "5", "--bytes", "99999999999999999999999"), "--bytes"),
])
def test_a_bad_number_is_refused_by_the_parser(tmp_path: Path, args: tuple[str, ...],
                                               flag: str) -> None:
    out = tmp_path / "out"
    line = refused(*[str(out) if a == "OUT" else a for a in args])
    assert flag in line and "--help" in line, line
    assert len(line) < 300, line  # (a 400-digit size is not echoed whole)
    assert not out.exists()  # nothing made for a run refused


@pytest.mark.unit
def test_load_bench_with_no_rounds_is_refused(tmp_path: Path) -> None:
    model = tmp_path / "m.safetensors"
    model.write_bytes(b"")
    line = refused("load-bench", str(model), "--repeat", "0")
    assert "--repeat" in line and "'0'" in line and "from 1 to 1000" in line, line


@pytest.mark.unit
@pytest.mark.parametrize("doc", ["{}", "[]", '{"median": {}}', '{"median": []}',
                                 '{"median": {"striped_read": 0}}', "NaN"])
def test_compare_refuses_what_bench_run_did_not_write(tmp_path: Path, doc: str) -> None:
    good = {k: 1.0 for k in ("member0_write", "member0_read", "striped_write", "striped_read",
                             "mount_write", "mount_read", "load_mxfs", "load_safetensors",
                             "ckpt_mxfs", "ckpt_torch_save", "kv_get_mxfs", "kv_get_files")}
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "results.json").write_text(json.dumps({"median": good}))
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "results.json").write_text(doc)
    assert "| striped_read |" in mxfs("bench", "compare", str(tmp_path / "a"),
                                      str(tmp_path / "a")).stdout
    for a, b in (("a", "b"), ("b", "a")):
        line = refused("bench", "compare", str(tmp_path / a), str(tmp_path / b))
        assert "not a bench results file" in line or "is not JSON" in line, line
        assert str(tmp_path / "b" / "results.json") in line


@pytest.mark.unit
def test_gates_check_the_baseline_before_running_a_gate(tmp_path: Path) -> None:
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "results.json").write_text("{}")
    out = tmp_path / "out"
    line = refused("bench", "gates", str(tmp_path), "--out", str(out), "--baseline",
                   str(tmp_path / "base"), "--skip", "g3,g4")
    assert "not a bench results file" in line and "--baseline" in line, line
    assert not out.exists()


@needs_root
def test_bench_run_checks_its_out_folder_first(tmp_path: Path) -> None:
    """A --out that is a file is refused before the pool is even looked at (it was
    found after minutes of measuring)."""
    taken = tmp_path / "taken"
    taken.write_text("a file\n")
    line = refused("bench", "run", "--out", str(taken), str(tmp_path))
    assert f"--out {taken} exists and is not a folder" in line, line
    line = refused("bench", "run", "--out", str(taken / "below"), str(tmp_path))
    assert f"{taken} is not a folder" in line, line
    assert taken.read_text() == "a file\n"


# ---- nodes -----------------------------------------------------------------------------

@pytest.mark.unit
def test_node_commands_take_only_a_reachable_server(tmp_path: Path) -> None:
    for where in ("foo://x", str(tmp_path)):  # never a local SQLite store (a live one?)
        line = refused("node", "remove", "--meta", where, "n1")
        assert f"{where} is not a metadata server's URL" in line, line
    key = tmp_path / "pool.key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o600)
    config = tmp_path / "node" / "n2.toml"
    for verb in (["add", "--key", str(key), "--name", "n2", "--config", str(config)],
                 ["remove", "n2"]):
        line = refused("node", verb[0], "--meta", "postgresql://127.0.0.1:1/db", *verb[1:])
        assert "cannot be reached" in line and "check the URL" in line, line
    assert not config.parent.exists()


# ---- fsck and scrub --------------------------------------------------------------------

@needs_root
def test_scrub_of_a_damaged_store_says_what_fsck_says(tmp_path: Path) -> None:
    members = make_members(tmp_path)
    mkfs(members)
    os.truncate(Path(members[0]) / "meta" / "mxfs.db", 1000)
    for cmd in ("scrub", "fsck"):
        line = refused(cmd, members[0])
        assert "cannot be opened" in line and "mxfs meta restore" in line, line


@needs_root
def test_fsck_suggests_repair_only_where_it_repairs(tmp_path: Path) -> None:
    members = make_members(tmp_path)
    mkfs(members)
    small = tmp_path / "small.bin"
    small.write_bytes(b"s" * 1000)
    mxfs("put", members[0], str(small))
    for f in chunk_files(members):
        os.unlink(f)  # its data lost: nothing fsck can repair
    res = mxfs("fsck", members[0], check=False)
    assert res.returncode == 4, res.stdout + res.stderr
    assert "NOT REPAIRABLE: missing data" in res.stdout
    assert res.stdout.splitlines()[-1] == "0 repaired, 1 left", res.stdout
    Path(Pool.open(members[0]).chunk_path(1, 888888)).write_bytes(b"x")  # a stray: repairable
    res = mxfs("fsck", members[0], check=False)
    assert res.stdout.splitlines()[-1] == "0 repaired, 2 left (run again with --repair)", \
        res.stdout


@pytest.mark.daemon_log(r"mounted read-only and degraded")
def test_scrub_of_a_degraded_mount_names_what_the_failed_member_held(tmp_path: Path) -> None:
    members = make_members(tmp_path / "pool")
    mkfs(members)
    wide = tmp_path / "wide.bin"
    wide.write_bytes(os.urandom(600_000))  # 64 KiB stripes over all four members
    mxfs("put", members[0], str(wide))
    os.rename(members[1], tmp_path / "away")
    with mount_with(members, "degraded", check=False) as m:
        res = mxfs("scrub", str(m.path), check=False)
        assert res.returncode == 1, res.stderr
        assert "-o degraded" not in res.stderr and res.stderr == "", res.stderr
        assert "DAMAGED /wide.bin:" in res.stdout and "on member 1: missing" in res.stdout
        assert "member 1 failed" in res.stdout.splitlines()[-1], res.stdout
    line = refused("scrub", members[0])  # unmounted: it says how to scrub it anyway
    assert "member 1" in line and "mount the pool with -o degraded and scrub" in line, line


# ---- mounted pools -------------------------------------------------------------------

def test_top_ends_quietly_when_its_reader_goes(mounted: Mounted) -> None:
    """`mxfs top MNT | head -2`: the reader leaving ends the stream, with no error."""
    p = subprocess.Popen([sys.executable, "-m", "mxfs", "top", str(mounted.path),
                          "--interval", "0.05"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stderr is not None
        assert p.stdout.readline().startswith("over ")
        p.stdout.close()
        assert p.wait(timeout=60) == 0
        assert p.stderr.read() == ""
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_ids_and_sizes_are_checked_before_they_are_sent(mounted: Mounted) -> None:
    m = str(mounted.path)
    for args in (("quota", m, "--user", "99999999999", "--bytes", "1G"),
                 ("quota", m, "--user", "4294967295", "--bytes", "1G"),
                 ("kv", "create", m, "ns2", "--owner", "99999999999"),
                 ("kv", "create", m, "ns2", "--group", "4294967295")):
        line = refused(*args)
        assert "out of range" in line and "from 0 to 4294967294" in line, line
    assert json.loads(mxfs("kv", "stats", "--json", m).stdout)["namespaces"] == []
    line = refused("quota", m, "--user", "1234", "--inodes", "99999999999999999999999")
    assert "too big" in line and "9223372036854775807" in line, line
    # Sizes are exact: 2^53 + 1 bytes is not rounded to 2^53 as a float
    report = json.loads(mxfs("quota", m, "--user", "1234", "--bytes", "9007199254740993",
                             "--json").stdout)
    assert [u["bytes_limit"] for u in report["users"] if u["uid"] == 1234] == \
        [9007199254740993]


def test_kv_refusals_say_the_real_problem(mounted: Mounted) -> None:
    m = str(mounted.path)
    line = refused("kv", "create", m, "../x")
    assert "a new name is 1-128" in line and "pick another name" in line, line
    assert "root" not in line
    line = refused("kv", "set", m, "nosuch", "--mode", "0700")
    assert line == f"mxfs: no KV namespace 'nosuch': list namespaces with: mxfs kv stats {m}"
    line = refused("kv", "rm", m, "nosuch")
    assert line == f"mxfs: no KV namespace 'nosuch': list namespaces with: mxfs kv stats {m}"
    mxfs("kv", "create", m, "ns1")
    line = refused("kv", "create", m, "ns1")
    assert line.count("ns1") == 1 and "exists" in line and "--force" in line, line


@contextlib.contextmanager
def _full_tmpfs(where: Path) -> Iterator[Path]:
    """A small tmpfs at `where`, filled up; unmounted after."""
    where.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)],
                         capture_output=True, text=True)
    if res.returncode:
        pytest.skip(f"cannot mount a tmpfs: {res.stderr.strip()}")
    try:
        fd = os.open(where / "fill", os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            with contextlib.suppress(OSError):
                while os.write(fd, b"f" * 4096):
                    pass
        finally:
            os.close(fd)
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def test_meta_dump_names_the_users_file_and_the_fix(mounted: Mounted, tmp_path: Path) -> None:
    m = str(mounted.path)
    missing = tmp_path / "missing" / "d.sql"
    line = refused("meta", "dump", str(missing), m)
    assert f"the dump {missing} cannot be written" in line and "make " in line, line
    assert ".d.sql." not in line  # (never the temporary file's name)
    line = refused("meta", "dump", str(tmp_path), m)
    assert "Is a directory" in line and "name a file" in line, line
    with _full_tmpfs(tmp_path / "full") as full:
        line = refused("meta", "dump", str(full / "d.json"), m)
        assert f"the dump {full / 'd.json'} cannot be written (No space left on device)" \
            in line and "free space" in line, line
        assert os.listdir(full) == ["fill"]  # no temporary file left
    done = json.loads(mxfs("meta", "dump", "--json", str(tmp_path / "d.json.zst"), m).stdout)
    assert done["rows"] > 0 and (tmp_path / "d.json.zst").stat().st_size > 0
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".d.json.zst.")]


# As root first (every module the command needs loaded while the interpreter's library,
# perhaps root's alone, can still be read), then as nobody.
WARM = r"""
import contextlib, io, sys
from mxfs.cli.main import main
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    main(sys.argv[1:])
"""


def test_meta_ls_as_a_user_says_it_is_roots(mounted: Mounted) -> None:
    cmd = as_user(None, "sys.exit(main(sys.argv[1:]))", "meta", "ls", str(mounted.path))
    cmd[2] = WARM + cmd[2]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    line = one_line_error(res)
    assert line == ("mxfs: mxfs meta ls reads the pool's metadata store, which only root "
                    "may read: run it as root"), line


# ---- the demo ------------------------------------------------------------------------

@pytest.mark.unit
def test_demo_leaves_no_dir_it_made(tmp_path: Path) -> None:
    where = tmp_path / "new" / "deeper"
    line = refused("demo", "--dir", str(where), "--size", "1000TiB")
    assert "the demo needs" in line, line
    assert os.listdir(tmp_path) == []  # (neither folder it made for --dir is left)



# ---- what a command loads ------------------------------------------------------------

@pytest.mark.unit
def test_commands_that_open_no_pool_load_no_store_pool_or_torch() -> None:
    """Every `mxfs` command builds the whole parser: a module it names that loads the
    pool, the metadata store or torch at import made `mxfs umount` and `mxfs status`
    (run by scripts and tests some thousands of times) pay for them each time."""
    probe = ("import sys\nfrom mxfs.cli.main import build_parser\n"
             "build_parser().parse_args(['umount', '/nowhere'])\n"
             "print(' '.join(sorted(m for m in ('mxfs.pool', 'mxfs.meta', 'mxfs.vol', "
             "'mxfs.io', 'torch', 'mxfs.fs') if m in sys.modules)))")
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == [], res.stdout
