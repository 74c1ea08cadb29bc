"""Scratch folders for `mxfs demo` and the benchmarks in tools/, made safely as root.

`--dir` names where scratch goes, never the scratch itself: a folder of that name
may already hold others' files (all of it was removed after), or be another user's,
who could swap what root makes in it for links to root's files (root then wrote
through them).  So the scratch is always a fresh `mkdtemp` folder (0700, the caller's)
in a `--dir` that no other user can change on the way down from `/`.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Iterator

from mxfs.errors import MxfsError


def safe_parent(where: str) -> str:
    """`where` made if missing, as a real path; MxfsError if another user could rename
    or replace anything on the way to it (each folder from `/` is root's or the
    caller's, and others may not write it unless it is sticky, as /tmp is)."""
    os.makedirs(where, exist_ok=True)  # (only what is missing: nothing there is touched)
    real = os.path.realpath(where)
    path = "/"
    for part in ["", *real.strip("/").split("/")]:
        path = os.path.join(path, part)
        st = os.stat(path)
        loose = st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX
        if st.st_uid not in (0, os.geteuid()) or loose:
            raise MxfsError(f"--dir {where}: {path} may be changed by another user (owner "
                            f"uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o})",
                            "give a folder of root's or your own that others cannot "
                            "write, such as /var/tmp (a scratch folder is made in it)")
    return real


def scratch_dir(prefix: str, where: str = "/var/tmp") -> str:
    """A fresh private folder (mkdtemp) in `where`, checked by `safe_parent`."""
    return tempfile.mkdtemp(prefix=prefix, dir=safe_parent(where))


@contextlib.contextmanager
def parent_for(where: str) -> Iterator[str]:
    """`safe_parent(where)` for a run that cleans up after itself: the folders it had to
    make for a `--dir` that did not exist are removed again afterwards, the deepest first,
    each only if empty (a run that keeps its scratch keeps them; nothing else there is
    touched), so a mistyped --dir is not left behind."""
    made, path = [], os.path.abspath(where)
    while not os.path.lexists(path):
        made.append(path)
        path = os.path.dirname(path)
    try:
        yield safe_parent(where)
    finally:
        for folder in made:  # (deepest first)
            with contextlib.suppress(OSError):
                os.rmdir(folder)
