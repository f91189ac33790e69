"""A data file's checksums from one sequential pass: the whole file's and each chunk's.

A deep verify checks both a file's xxh3-128 (in the manifest) and every chunk's xxh3-64 (in
the file's index, format 3, or the manifest, format 2). Hashing them in two passes reads every
byte twice, which on an object store is a second download. :class:`StreamDigest` takes the
file's bytes once, in order, in blocks of any size, and hashes each block into the file's
digest and into the digest of every span (chunk) it overlaps. A span that lies inside one
block is hashed in one call, without a hasher object.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import xxhash

EMPTY_64 = xxhash.xxh3_64_hexdigest(b"")


class FileDigest(NamedTuple):
    """What :meth:`Storage.hash` found: ``size`` bytes read, their ``xxh3_128``, and the xxh3-64
    of each requested span in the order given (None where the file ended before the span did)."""

    size: int
    xxh3_128: str
    spans: list[str | None]


class StreamDigest:
    """Hashes one file fed in order through :meth:`update` (see the module docstring).
    ``spans``: [start, end) byte ranges; any order, overlaps and empty ones allowed."""

    def __init__(self, spans: Sequence[tuple[int, int]] = ()) -> None:
        self._spans = [(int(s), int(e)) for s, e in spans]
        for s, e in self._spans:
            if s < 0 or e < s:
                raise ValueError(f"span {s}-{e} is not a byte range")
        self._order = sorted(range(len(self._spans)), key=lambda i: self._spans[i])
        self._next = 0  # self._order[:_next] are open or done
        self._open: list[tuple[int, int, Any]] = []  # (span index, end, hasher), started, not ended
        self._digests: list[str | None] = [None] * len(self._spans)
        self._whole = xxhash.xxh3_128()
        self.pos = 0  # bytes fed so far

    def update(self, data: Any) -> None:
        """Feed the next bytes of the file (bytes, bytearray or a memoryview of bytes)."""
        view = memoryview(data)
        lo, hi = self.pos, self.pos + len(view)
        self._whole.update(view)
        still = []
        for i, end, h in self._open:
            h.update(view[: min(end, hi) - lo])
            if end <= hi:
                self._digests[i] = h.hexdigest()
            else:
                still.append((i, end, h))
        spans, order = self._spans, self._order
        while self._next < len(order) and spans[order[self._next]][0] < hi:
            i = order[self._next]
            self._next += 1
            start, end = spans[i]
            if end <= hi:
                self._digests[i] = xxhash.xxh3_64_hexdigest(view[start - lo : end - lo])
            else:
                h = xxhash.xxh3_64()
                h.update(view[start - lo :])
                still.append((i, end, h))
        self._open = still
        self.pos = hi

    def result(self) -> FileDigest:
        """The digests of everything fed; spans past the end of the file have None."""
        for i in self._order[self._next :]:
            if self._spans[i] == (self.pos, self.pos):
                self._digests[i] = EMPTY_64
        return FileDigest(self.pos, self._whole.hexdigest(), list(self._digests))
