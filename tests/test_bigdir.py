"""A directory of 100k entries lists completely and in pages, through the mount."""

from __future__ import annotations

import os

from conftest import Mounted

N = 100_000


def test_hundred_thousand_entries(mounted: Mounted) -> None:
    d = mounted.path / "big"
    d.mkdir()
    names = [f"entry-{i:06d}" for i in range(N)]
    for n in names:
        os.mknod(d / n)
    listed = os.listdir(d)
    assert len(listed) == N and set(listed) == set(names)
    assert os.stat(d / names[N // 2]).st_size == 0
    # remove every other entry while a listing is under way
    seen = []
    with os.scandir(d) as it:
        for i, e in enumerate(it):
            seen.append(e.name)
            if i == 1000:
                for n in names[::2]:
                    os.unlink(d / n)
    assert len(seen) == len(set(seen))
    assert set(names[1::2]) <= set(seen)
    assert sorted(os.listdir(d)) == names[1::2]
