"""Node copies a restore verified, kept mapped with their chunk checksums for its load.

A restore from the node-local tier hashes every copy on the node whole before it loads
(``tier.restore_local``: a copy that fails is replaced by another before anything is loaded).
That pass (:func:`hash_file`) maps the file and computes, besides the file's xxh3-128, the
xxh3-64 of each chunk its index lists; the load of the same file in this process then
compares each chunk's recorded checksum with these instead of hashing it again, and copies the
chunks out of the pages already mapped instead of reading the file again. On a RAM disk each
pass over a file costs about a plain read of it: hash + copy through one mapping measured 1.1x
a plain read of 22 MiB here, hash + check + read 3x.

What the load still does: it reads the index itself and compares every chunk's recorded
checksum with a digest of its bytes; only a digest computed here, of this file, by this
process, replaces a second hash. The digests and the mapping are used only while the file is
the one hashed (same device, inode, size and modification time): a file replaced or rewritten
since is opened, hashed and read again as before. The registry is per process; a restore
releases what it recorded when its load returns (:func:`release`). Size: one entry per chunk
of the files this rank verified, and a mapping of each (the page cache's pages, no copy).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from ..format.shardfile import MappedFile
from ..storage.digest import FileDigest, StreamDigest
from ..storage.posix import HASH_BLOCK, digest_file, open_beneath

Identity = tuple[int, int, int, int]  # st_dev, st_ino, st_size, st_mtime_ns


class Hashed(NamedTuple):
    ident: Identity
    digests: dict[tuple[int, int], str]  # (start, end) -> xxh3-64
    mapping: mmap.mmap | None  # the file's pages, read-only (None: not mapped)


_HASHED: dict[str, Hashed] = {}
_LOCK = threading.Lock()


def identity(st: os.stat_result) -> Identity:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def hash_file(path: str, spans: Sequence[tuple[int, int]]) -> tuple[FileDigest, Hashed]:
    """The file's digest (``posix.digest_file``'s, with ``spans``' xxh3-64) computed through a
    read-only mapping of it, and that mapping with its identity for :func:`remember`; read as
    ``digest_file`` reads where the file cannot be mapped (mapping None)."""
    fd = open_beneath(path)
    try:
        st = os.fstat(fd)
        mapping = mmap.mmap(fd, st.st_size, access=mmap.ACCESS_READ) if st.st_size else None
    except (OSError, ValueError):
        mapping = None
    finally:
        os.close(fd)
    if mapping is None:
        got = digest_file(path, spans)
        return got, Hashed(identity(os.stat(path, follow_symlinks=False)), {}, None)
    d = StreamDigest(spans)
    with memoryview(mapping) as view:
        for off in range(0, len(view), HASH_BLOCK):
            d.update(view[off:off + HASH_BLOCK])
    got = d.result()
    return got, Hashed(identity(st), {sp: h for sp, h in zip(spans, got.spans, strict=True) if h is not None}, mapping)


def remember(path: str, hashed: Hashed) -> None:
    """Keep ``hashed`` (verified) for this process's load of ``path``."""
    with _LOCK:
        old = _HASHED.pop(os.path.normpath(path), None)
        _HASHED[os.path.normpath(path)] = hashed
    if old is not None:
        _close(old)


def discard(hashed: Hashed) -> None:
    """Drop what :func:`hash_file` made and nobody keeps (a copy that failed)."""
    _close(hashed)


def release(prefix: str) -> None:
    """Forget every file recorded under the directory ``prefix`` (their mappings closed)."""
    base = os.path.normpath(prefix) + os.sep
    with _LOCK:
        gone = [_HASHED.pop(k) for k in [k for k in _HASHED if k.startswith(base)]]
    for h in gone:
        _close(h)


def _close(h: Hashed) -> None:
    if h.mapping is not None:
        with contextlib.suppress(BufferError):  # a reader still holds a view: the GC closes it
            h.mapping.close()


def pages(path: str, size: int) -> torch.Tensor | None:
    """The verified file ``path`` of ``size`` bytes as a read-only uint8 tensor over its
    mapping (a restore sends it to a peer from there: no second read), or None when none is
    kept. Valid until :func:`release`; the receiver checks the bytes as always."""
    with _LOCK:
        got = _HASHED.get(os.path.normpath(path))
    if got is None or got.mapping is None or got.ident[2] != size:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # not writable: it is only sent
        return torch.frombuffer(got.mapping, dtype=torch.uint8)


def open_file(path: str, size: int) -> MappedFile:
    """The reader's file for ``path``: with what was recorded for it when it is still the file
    that was hashed, else a plain :class:`MappedFile`."""
    with _LOCK:
        got = _HASHED.get(os.path.normpath(path))
    return MappedFile(path, size) if got is None else PrehashedFile(path, size, got)


class PrehashedFile(MappedFile):
    """A :class:`MappedFile` whose chunk hashes come from the digests recorded for it (where
    one was recorded for exactly that byte range) and whose reads are copies out of the
    mapping the digests were computed through, when the file opened is the one hashed."""

    def __init__(self, path: str, size: int, hashed: Hashed) -> None:
        super().__init__(path, size)
        try:
            same = identity(os.fstat(self.fd)) == hashed.ident
        except OSError:
            same = False
        self._digests = hashed.digests if same else {}
        self._pages: memoryview | None = None
        if same and hashed.mapping is not None:
            with contextlib.suppress(ValueError):  # closed meanwhile: read the file
                self._pages = memoryview(hashed.mapping)
            if self._pages is not None and len(self._pages) != size:
                self._pages.release()
                self._pages = None

    def hash_runs(self, spans: Sequence[tuple[int, int]]) -> list[str]:
        got: list[Any] = [self._digests.get((s, e)) for s, e in spans]
        return got if all(g is not None for g in got) else super().hash_runs(spans)

    def hash_range_local(self, start: int, end: int, window: int) -> str:
        got = self._digests.get((start, end))
        return got if got is not None else super().hash_range_local(start, end, window)

    def preadv(self, bufs: list[Any], at: int) -> int:
        pages = self._pages
        if pages is None:
            return super().preadv(bufs, at)
        done = 0
        for b in bufs:
            mv = memoryview(b).cast("B")
            n = max(0, min(len(mv), self.size - at - done))
            mv[:n] = pages[at + done:at + done + n]
            done += n
            if n < len(mv):
                break
        return done

    def close(self) -> None:
        if self._pages is not None:
            self._pages.release()
            self._pages = None
        super().close()
