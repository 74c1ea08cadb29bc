"""A directory of 30,000 entries (60 pages of the daemon's listing) lists completely and
in pages, through the mount, while half of them are removed.  (It was 100,000: 43 s of a
2-CPU CI machine's 20 minutes, for no page the smaller one does not show.)"""

from __future__ import annotations

import os

from conftest import Mounted

N = 30_000


def test_thirty_thousand_entries(mounted: Mounted) -> None:
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
