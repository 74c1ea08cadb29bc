"""What the pool's sole writer keeps of the rows besides its inodes: names, which
files are sealed, and how many inodes there are (`MetaStore.sole_writer`).

A daemon holding the lease is the only writer, so these answers stay true between
its own changes, and each spares a read (a round trip to a server) or a scan:
(directory, name) to inode or to "no such entry", with directories made while caching
"complete" (every name of theirs is cached, so a name missing there is absent); a
file's seal; the inode count statfs asks for.  A change notes what it read or wrote
here; if it fails, those answers are dropped (they may have come from the change, or
been stale), and a lost group drops everything.  The rows still check what the cache
says (`MetaStore` writes entries with `expect`), so a stale answer is never acted on.
"""

from __future__ import annotations

import errno
from collections import OrderedDict

# Names, parents and seals cached, at most each: past it the least recently used one
# goes for each one learnt (each table was cleared whole there, 18 ms of the daemon's
# one thread for 200,000 names, which 200,000 lookups of absent names brought back).
LIMIT = 200_000

Name = tuple[int, bytes]  # (directory inode, name)


class SoleCache:
    def __init__(self) -> None:
        self.on = False  # (`MetaStore.sole_writer`)
        # (Each least recently used first.)
        self.names: OrderedDict[Name, int | None] = OrderedDict()
        self.complete: set[int] = set()  # directories whose every name is in `names`
        self.sealed: OrderedDict[int, bool] = OrderedDict()
        self.inodes: int | None = None  # the inode rows, counted once, then kept count
        self.parents: OrderedDict[int, int] = OrderedDict()  # directory: its parent (a
        #                   rename's ancestry walk reads memory, not a row a level)
        self.hit = False  # the change running took an answer from the cache
        self._names_used: list[Name] = []  # by the change running
        self._seals_used: list[int] = []
        self._parents_used: list[int] = []  # set by the change running
        self._parents_read: list[int] = []  # ... and read from here by it

    def forget(self) -> None:
        """Drop every answer (a lost group, the lease going)."""
        self.names.clear()
        self.complete.clear()
        self.sealed.clear()
        self.parents.clear()
        self.inodes = None

    def begin(self) -> None:
        """A change starts: nothing of it noted yet."""
        self._names_used.clear()
        self._seals_used.clear()
        self._parents_used.clear()
        self._parents_read.clear()
        self.hit = False

    def undo(self, births: int) -> None:
        """The change running failed: drop what it read or wrote, and count the
        `births` inodes it made as not made."""
        for key in self._names_used:
            self.names.pop(key, None)
            self.complete.discard(key[0])
        for ino in self._seals_used:
            self.sealed.pop(ino, None)
        for ino in self._parents_used:  # (it may have moved some: read again; the rest
            self.parents.pop(ino, None)  # stand: all of them dropped made each failed
        self._names_used.clear()          # rename into a deep tree read every level)
        self._seals_used.clear()
        self._parents_used.clear()
        if self.inodes is not None:
            self.inodes -= births

    # ---- names --------------------------------------------------------------------

    def name(self, key: Name, in_change: bool) -> tuple[bool, int | None]:
        """(whether the cache knows `key`, what it names)."""
        if key in self.names:
            self.names.move_to_end(key)  # (the most recently used: the last to go)
        elif key[0] not in self.complete:
            return False, None
        if in_change:
            self._names_used.append(key)
            self.hit = True
        return True, self.names.get(key)

    def set_name(self, key: Name, ino: int | None, in_change: bool) -> None:
        """What `key` names now (read, or written by the change running)."""
        if not self.on:
            return
        names = self.names
        names[key] = ino
        names.move_to_end(key)
        if len(names) > LIMIT:  # (a name alone: the inode count stays, whose recount
            gone, _ = names.popitem(last=False)  # scans every row)
            self.complete.discard(gone[0])  # (its directory may have names not cached now)
        if in_change:
            self._names_used.append(key)

    def made_dir(self, ino: int, parent: int) -> None:
        """A directory was made in `parent`: it has no name the cache lacks."""
        if self.on:
            self.complete.add(ino)
            self.set_parent(ino, parent)

    def parent(self, ino: int, in_change: bool) -> int | None:
        """A directory's parent, if the cache knows it."""
        parent = self.parents.get(ino)
        if parent is not None:
            self.parents.move_to_end(ino)
            if in_change:
                self.hit = True
                self._parents_read.append(ino)
        return parent

    def drop_read(self, errno_: int) -> None:
        """The change that failed (`errno_`) is run again on fresh reads: the parents
        it read here go too if a stale chain may have been what failed it (EINVAL: a
        loop); a failure of a name (EEXIST, ENOTEMPTY, ...) keeps them, or each such
        rename into a deep tree read every level again."""
        if errno_ == errno.EINVAL:
            for ino in self._parents_read:
                self.parents.pop(ino, None)

    def learn_parent(self, ino: int, parent: int) -> None:
        """A directory's parent read from its row: kept whether or not the change
        reading it stands (it changed nothing)."""
        if self.on:
            self._keep_parent(ino, parent)

    def set_parent(self, ino: int, parent: int | None) -> None:
        """A directory's parent now (None: it is gone), as the change running sets it
        (dropped if the change fails)."""
        if not self.on:
            return
        self._parents_used.append(ino)
        if parent is None:  # (and no longer "complete": a user's mkdir and rmdir in a
            self.parents.pop(ino, None)  # loop kept every one, 0.5-1 GB an hour)
            self.complete.discard(ino)
            return
        self._keep_parent(ino, parent)

    def _keep_parent(self, ino: int, parent: int) -> None:
        parents = self.parents
        parents[ino] = parent
        parents.move_to_end(ino)
        if len(parents) > LIMIT:
            parents.popitem(last=False)

    # ---- seals and the inode count -------------------------------------------------

    def set_sealed(self, ino: int, sealed: bool, in_change: bool) -> None:
        if self.on:
            self.sealed[ino] = sealed
            self.sealed.move_to_end(ino)
            if len(self.sealed) > LIMIT:
                self.sealed.popitem(last=False)
            if in_change:
                self._seals_used.append(ino)

    def counted(self, n: int) -> None:
        if self.on:
            self.inodes = n

    def born(self) -> None:
        if self.inodes is not None:
            self.inodes += 1

    def dropped(self, inos: list[int]) -> None:
        for ino in inos:
            self.sealed.pop(ino, None)
            self.complete.discard(ino)
        if self.inodes is not None:
            self.inodes -= len(set(inos))
