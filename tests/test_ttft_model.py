"""The TTFT model: loading KV beats recomputing above the break-even bandwidth."""

from __future__ import annotations

from pathlib import Path

import pytest
import ttft_model as tm


@pytest.mark.parametrize("name", list(tm.MODELS))
def test_break_even_is_where_load_and_recompute_meet(name: str) -> None:
    m = tm.MODELS[name]
    for n in (1024, 32768, 131072):
        bw = tm.break_even_gbps(m, n, tm.H200_FLOPS, 0.4)
        assert tm.load_s(m, n, bw, 0.0) == pytest.approx(tm.recompute_s(m, n, tm.H200_FLOPS, 0.4))
        assert tm.load_s(m, n, bw * 2, 0.0) < tm.recompute_s(m, n, tm.H200_FLOPS, 0.4)
    # attention grows as n^2, KV as n: longer prefixes need less bandwidth to win
    assert tm.break_even_gbps(m, 131072, tm.H200_FLOPS, 0.4) < \
        tm.break_even_gbps(m, 1024, tm.H200_FLOPS, 0.4)


def test_kv_bytes_follow_the_config() -> None:
    m = tm.MODELS["qwen2.5-32b"]
    assert m.kv_bytes_per_token() == 2 * m.layers * m.kv_heads * m.head_dim * m.dtype_bytes


def test_cli_writes_a_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "ttft.png"
    assert tm.main(["--pool-gbps", "1.5", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert "break_even_gbps" in capsys.readouterr().out
