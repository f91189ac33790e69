"""Chunk checksums a restore computed while it verified a node's copies, reused by its load.

A restore from the node-local tier hashes every copy on the node whole before it loads
(``tier.restore_local``: a copy that fails is replaced by another before anything is loaded).
That pass (:func:`hash_file`, ``posix.digest_file`` with the spans of the chunks the file's
index lists) computes each chunk's xxh3-64 besides the file's xxh3-128, and the load of the
same file in this process compares each chunk's recorded checksum with these instead of hashing
the chunk again: one pass over the bytes fewer (on a RAM disk each pass costs about as much as
reading the file). Tried and dropped: keeping the verify's mapping for the load to copy from
(review: its pages stay resident in the process, a tensor sent from it can outlive it, and a
truncation becomes SIGBUS in the verify).

What the load still does: it reads the index itself and compares every chunk's recorded
checksum with a digest of the chunk's bytes; a digest recorded here counts only for exactly
that byte range of the file that was hashed (the descriptor hashed and the one the load opens
have the same device, inode, size, modification and change time): a copy replaced (every
safeckpt write renames a new file in, and a tool that restores the old modification time
still changes the change time) or rewritten is hashed again. Not detected: a write that changes
neither time (another program writing through a memory mapping on tmpfs; on kernels before
6.13 a write within the same clock tick as the file's previous change) between the verify and
the load, the exposure a load has between its own check and copy (docs/limitations.md), over
the longer window of the restore's plan and fetch. The registry is per process; a restore
releases what it recorded when its load returns (:func:`release`). Size: one entry per chunk of
the files this rank verified.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from ..format.shardfile import MappedFile
from ..storage.digest import FileDigest
from ..storage.posix import digest_fd, open_beneath

# st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns: the change time, which no program can set
# back (every write, truncation, rename, utime updates it), so a copy replaced by a new file that
# got the same inode number and the old modification time back (cp -p, rsync -t) is no match.
Identity = tuple[int, int, int, int, int]


class Hashed(NamedTuple):
    ident: Identity | None  # None: the file changed while it was hashed (nothing is reused)
    digests: dict[tuple[int, int], str]  # (start, end) -> xxh3-64


_HASHED: dict[str, Hashed] = {}
_LOCK = threading.Lock()


def identity(st: os.stat_result) -> Identity:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def hash_file(path: str, spans_of: Callable[[int], Sequence[tuple[int, int]]]
              ) -> tuple[FileDigest, Hashed]:
    """``digest_file(path, spans)`` with ``spans = spans_of(fd)`` (read from the descriptor
    hashed: the chunks its index lists) and what :func:`remember` keeps of it: the spans'
    digests with the identity of the file hashed (``fstat`` of that descriptor, the same
    before and after; else nothing is kept)."""
    fd = open_beneath(path)
    try:
        before = identity(os.fstat(fd))
        spans = spans_of(fd)
        got = digest_fd(fd, spans)
        after = identity(os.fstat(fd))
    finally:
        os.close(fd)
    digests = {sp: h for sp, h in zip(spans, got.spans, strict=True) if h is not None}
    return got, Hashed(after if after == before else None, digests)


def remember(path: str, hashed: Hashed) -> None:
    """Keep ``hashed`` (a verified copy's) for this process's load of ``path``."""
    if hashed.ident is None or not hashed.digests:
        return
    with _LOCK:
        _HASHED[os.path.normpath(path)] = hashed


def release(prefix: str) -> None:
    """Forget every file recorded under the directory ``prefix``."""
    base = os.path.normpath(prefix) + os.sep
    with _LOCK:
        for key in [k for k in _HASHED if k.startswith(base)]:
            del _HASHED[key]


def open_file(path: str, size: int) -> MappedFile:
    """The reader's file for ``path``: with the digests recorded for it when it is still the
    file that was hashed, else a plain :class:`MappedFile`."""
    with _LOCK:
        got = _HASHED.get(os.path.normpath(path))
    return MappedFile(path, size) if got is None else PrehashedFile(path, size, got)


class PrehashedFile(MappedFile):
    """A :class:`MappedFile` whose chunk hashes come from the digests recorded for it (where
    one was recorded for exactly that byte range) when the file opened is the one hashed."""

    def __init__(self, path: str, size: int, hashed: Hashed) -> None:
        super().__init__(path, size)
        try:
            same = identity(os.fstat(self.fd)) == hashed.ident
        except OSError:
            same = False
        self._digests = hashed.digests if same else {}

    def hash_runs(self, spans: Sequence[tuple[int, int]]) -> list[str]:
        got: list[Any] = [self._digests.get((s, e)) for s, e in spans]
        return got if all(g is not None for g in got) else super().hash_runs(spans)

    def hash_range_local(self, start: int, end: int, window: int) -> str:
        got = self._digests.get((start, end))
        return got if got is not None else super().hash_range_local(start, end, window)
