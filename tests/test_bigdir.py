"""A directory of 30,000 entries (60 pages of the daemon's listing) lists completely and
in pages, through the mount, while half of them are removed.  (It was 100,000: 43 s of a
2-CPU CI machine's 20 minutes, for no page the smaller one does not show.)"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from conftest import Mounted, make_members, mkfs

from mxfs.fs.ops import FIRST_PAGE, PAGE, PAGE_TARGETS, next_page
from mxfs.meta import ROOT_INO, Entry, Inode
from mxfs.vol.volume import Volume

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


@pytest.mark.unit
def test_a_page_of_long_symlinks_makes_the_next_page_smaller() -> None:
    """A readdir reads each page from the store in one go: 512 entries of 4 KiB symlink
    targets held the daemon's thread 3-4.6 ms.  Pages double while plain, and shrink
    where their targets would run past PAGE_TARGETS."""
    def entries(n: int, target: int) -> list[Entry]:
        mode = stat.S_IFLNK | 0o777 if target else stat.S_IFREG | 0o644
        return [Entry(i, b"e%d" % i, Inode(i + 2, mode, 0, 0, 1, target, 0, 0, 0, 0,
                                            b"t" * target if target else None))
                for i in range(n)]

    assert next_page(FIRST_PAGE, entries(FIRST_PAGE, 0)) == 2 * FIRST_PAGE
    assert next_page(PAGE, entries(PAGE, 0)) == PAGE
    assert next_page(FIRST_PAGE, entries(FIRST_PAGE, 100)) == 2 * FIRST_PAGE
    limit = PAGE
    for _ in range(3):
        limit = next_page(limit, entries(limit, 4096))
        assert limit * 4096 <= PAGE_TARGETS
    assert limit == PAGE_TARGETS // 4096
    assert next_page(2, entries(2, 4096)) == 4  # (growing again from a small page)
    assert next_page(64, entries(64, 4096)) == 64  # (at the bound, not past it)


def test_a_directory_of_long_symlinks_lists_whole_in_small_pages(mounted: Mounted) -> None:
    d = mounted.path / "links"
    d.mkdir()
    targets = {f"l{i:04d}": (f"{i:04d}/" * 800)[:4000] for i in range(600)}
    for name, target in targets.items():
        os.symlink(target, d / name)
    assert sorted(os.listdir(d)) == sorted(targets)
    with os.scandir(d) as it:
        assert {e.name: os.readlink(e.path) for e in it} == targets


@pytest.mark.unit
def test_a_page_is_cut_a_bite_past_its_symlink_targets_and_says_more(tmp_path: Path) -> None:
    """Plain entries let the pages grow to 512; the page after them, all 4 KiB symlinks,
    is cut a bite (LOAD_BITE inodes) past PAGE_TARGETS, says more follow, and the pages
    read on from its last entry list the directory whole, once."""
    from mxfs.meta.store import LOAD_BITE

    members = make_members(tmp_path, 2)
    mkfs(members)
    vol = Volume.open(members[0])
    store = vol.store
    try:
        for i in range(448):
            store.create(ROOT_INO, b"f%04d" % i, stat.S_IFREG | 0o644, 0, 0,
                         layout_for=vol.pick_layout)
        for i in range(300):
            store.create(ROOT_INO, b"s%04d" % i, stat.S_IFLNK | 0o777, 0, 0,
                         target=b"%04d" % i * 1000)
        store.commit()
        seen: list[bytes] = []
        after, limit, pages = 0, FIRST_PAGE, []
        while True:
            entries, more = store.readdir_page(ROOT_INO, after, limit, PAGE_TARGETS)
            targets = sum(e.inode.size for e in entries if e.inode.target is not None)
            pages.append((limit, len(entries), targets, more))
            assert targets <= PAGE_TARGETS + LOAD_BITE * 4000, pages
            seen += [e.name for e in entries]
            if not more:
                break
            after, limit = entries[-1].cookie, next_page(limit, entries)
        assert seen == sorted(seen) and len(seen) == len(set(seen)) == 748, pages
        assert pages[3][0] == PAGE and pages[3][1] < PAGE, pages  # (grown while plain; cut)
    finally:
        store.close()
