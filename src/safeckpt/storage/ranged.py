"""A data object read by byte ranges (the object-store counterpart of _shardfile.MappedFile).

Requests are what costs on an object store: one sequential GET per tensor would make a load of
a few hundred tensors take longer than downloading the whole object. So reads are fetched in
*windows* of concurrent ranged GETs and the windows are kept (up to ``KEEP`` bytes per object)
for the reads that follow, in particular the copy after a chunk was verified:

- On the first read, the ranges this rank will most likely need (``likely``: for a verified
  load, from the manifest: replicated chunks, its own per-rank chunks, the shards its rank
  number wrote) are fetched together with the header, in one round of concurrent parts.
- Other reads fetch their range, extended to ``READAHEAD`` for small ones.
- ``rows`` (a partial chunk, when resharding without verification) fetches exactly its rows.
- A read larger than ``KEEP`` is fetched in parts and not kept.

The storage's ``fetch(path, starts, ends)`` does the GETs (concurrently on async filesystems,
each call bounded by the timeout); this module only decides what to fetch and keeps it.
"""

from __future__ import annotations

import bisect
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
import xxhash

from ..errors import CorruptCheckpoint
from ..format.shardfile import check_chunk, is_empty
from .digest import FileDigest, StreamDigest

READAHEAD = 4 << 20  # a small read fetches this much from its start
KEEP = 512 << 20  # fetched windows kept per object (verified chunks are read again by the copy)
MIN_PART = 32 << 20  # a window is fetched in parts of at least this size ...
MAX_PARTS = 8  # ... and at most this many at once
MERGE_GAP = 1 << 20  # likely ranges closer than this are fetched as one


def ignored_range(data: Any, lo: int, hi: int, size: int) -> bool:
    """Whether the answer to a GET of bytes [lo, hi) is the whole object of ``size`` bytes
    instead: the server ignored the Range header (plain HTTP servers such as Python's
    http.server do, answering 200 instead of 206)."""
    return len(data) == size != hi - lo


def check_part(data: Any, lo: int, hi: int, path: str, ckpt: str | None = None) -> None:
    """Raise unless ``data`` has the length of the range [lo, hi) it answers."""
    if len(data) != hi - lo:
        raise CorruptCheckpoint(
            f"{'short' if len(data) < hi - lo else 'long'} read from {path} bytes {lo}-{hi} (got "
            f"{len(data)} bytes): the object changed or was deleted while reading, or the server "
            "does not answer ranged GETs with the range asked for", path=ckpt,
        )


def split(start: int, end: int, min_part: int = MIN_PART, max_parts: int = MAX_PARTS) -> list[tuple[int, int]]:
    """[start, end) cut into at most ``max_parts`` nearly equal parts of at least ``min_part``."""
    n = end - start
    parts = max(1, min(max_parts, n // max(min_part, 1)))
    step = -(-n // parts)
    return [(s, min(s + step, end)) for s in range(start, end, step)] or [(start, end)]


def coalesce(ranges: Sequence[tuple[int, int]], gap: int = MERGE_GAP) -> list[tuple[int, int]]:
    """Sorted, merged ranges (neighbours closer than ``gap`` become one)."""
    out: list[list[int]] = []
    for lo, hi in sorted(r for r in ranges if r[1] > r[0]):
        if out and lo <= out[-1][1] + gap:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi) for lo, hi in out]


class RemoteFile:
    """Bytes of one object, fetched by ranges through ``store`` (see module docstring)."""

    def __init__(self, store: Any, path: str, expected_size: int, ckpt: str,
                 likely: Sequence[tuple[int, int]] = ()) -> None:
        self.store = store
        self.path = path
        self.ckpt = ckpt
        size = store.size(path)
        if size is None:
            raise CorruptCheckpoint(f"data file {path} is missing", path=ckpt)
        if size != expected_size:
            raise CorruptCheckpoint(
                f"data file {path} has {size} bytes, the manifest says {expected_size} "
                "(truncated or replaced)", path=ckpt,
            )
        self.size = size
        self._cuts = sorted({b for r in likely for b in r})  # chunk boundaries: where parts may end
        self._likely = coalesce(likely)
        # Fetched parts, as the store returned them (no copy), least recently used first.
        self._windows: OrderedDict[tuple[int, int], bytes] = OrderedDict()
        self._kept = 0
        self.fetched = 0  # bytes fetched from the store (for tests and statistics)

    # ------------------------------------------------------------------ fetching
    def _fetch(self, parts: Sequence[tuple[int, int]]) -> list[bytes]:
        """The bytes of each part, fetched concurrently."""
        try:
            got = self.store.fetch(self.path, [p[0] for p in parts], [p[1] for p in parts])
        except FileNotFoundError:
            raise CorruptCheckpoint(
                f"data file {self.path} vanished while reading (deleted by retention or an "
                "overwrite?)", path=self.ckpt,
            ) from None
        got = list(got)
        for i, ((lo, hi), data) in enumerate(zip(parts, got)):
            if ignored_range(data, lo, hi, self.size):  # the whole object: take the part asked for
                got[i] = data = data[lo:hi]
            check_part(data, lo, hi, self.path, self.ckpt)
        self.fetched += sum(hi - lo for lo, hi in parts)
        return got

    def _fetch_kept(self, parts: Sequence[tuple[int, int]]) -> None:
        for (lo, hi), data in zip(parts, self._fetch(parts)):
            if hi - lo > KEEP:
                continue
            while self._windows and self._kept + hi - lo > KEEP:
                (a, b), _ = self._windows.popitem(last=False)
                self._kept -= b - a
            self._windows[(lo, hi)] = data
            self._kept += hi - lo

    def _split(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """[lo, hi) in parts for one round of requests, cut at chunk boundaries where one is
        near, so that a chunk is served from one part (no copy to join it)."""
        out = []
        for a, b in split(lo, hi):
            if out and out[-1][1] > a:
                a = out[-1][1]
            if a >= b:
                continue
            i = bisect.bisect_left(self._cuts, b)  # the first boundary at or after b
            if b < hi and i < len(self._cuts) and self._cuts[i] < hi and self._cuts[i] - b < (b - a) // 2:
                b = self._cuts[i]
            out.append((a, b))
        if out and out[-1][1] < hi:
            out.append((out[-1][1], hi))
        return out

    def _cached(self, start: int, end: int) -> memoryview | None:
        """Bytes [start, end) from the fetched parts (joined if they span several), or None."""
        for (lo, hi), buf in self._windows.items():
            if lo <= start and end <= hi:
                self._windows.move_to_end((lo, hi))
                return memoryview(buf)[start - lo : end - lo]
        pieces, pos = [], start
        for (lo, hi), buf in sorted(self._windows.items()):
            if lo <= pos < hi:
                pieces.append(memoryview(buf)[pos - lo : min(hi, end) - lo])
                pos = min(hi, end)
        return memoryview(bytearray(b"".join(pieces))) if pos == end else None

    def _prefetch_likely(self) -> None:
        """Once, at the first read: fetch the ranges this rank will most likely read (less
        what is already here), in one round."""
        parts, total = [], 0
        for lo, hi in self._missing(self._likely):
            if total + hi - lo > KEEP:
                break
            parts += self._split(lo, hi)
            total += hi - lo
        self._likely = []
        if parts:
            self._fetch_kept(parts)

    def _missing(self, ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        """``ranges`` less the fetched windows."""
        out = []
        for lo, hi in ranges:
            pieces = [(lo, hi)]
            for a, b in self._windows:
                pieces = [p for x, y in pieces for p in ((x, min(y, a)), (max(x, b), y)) if p[1] > p[0]]
            out += pieces
        return out

    def _get(self, start: int, end: int) -> memoryview:
        if self._likely:
            self._prefetch_likely()
        hit = self._cached(start, end)
        if hit is not None:
            return hit
        hi = min(self.size, max(end, start + READAHEAD))
        if end - start > KEEP:
            return memoryview(b"".join(self._fetch(split(start, end))))
        self._fetch_kept(self._split(start, hi))
        hit = self._cached(start, end)
        assert hit is not None
        return hit

    # ------------------------------------------------------------------ reads
    def read(self, start: int, end: int) -> bytes:
        """A copy of bytes [start, end) (small reads such as the safetensors header)."""
        if end <= start:
            return b""
        if self._likely and self._likely[0][0] - end <= MERGE_GAP:
            lo, hi = self._likely[0]  # the header, read first: fetch it with the likely data
            self._likely[0] = (min(lo, start), max(hi, end))
            self._cuts = sorted({*self._cuts, start, end})
        return bytes(self._get(start, end))

    def tensor(self, start: int, end: int, dtype: torch.dtype, shape: Sequence[int], expect_hash: str | None) -> torch.Tensor:
        """The bytes [start, end) as a tensor (aliasing the fetched bytes: read it, do not
        write to it); verified if a hash is given."""
        if is_empty(shape, start, end):
            return torch.empty(tuple(shape), dtype=dtype)
        data = self._get(start, end)
        check_chunk(data, expect_hash, f"{self.path} bytes {start}-{end}", self.ckpt)
        return _as_tensor(data, dtype, tuple(shape))

    def rows(self, start: int, end: int, dtype: torch.dtype, shape: Sequence[int], r0: int, r1: int) -> torch.Tensor:
        """Rows [r0, r1) (along dim 0) of the chunk stored at [start, end) with ``shape``,
        fetching only their bytes (a chunk read in part is not verified, as for local files)."""
        numel = 1
        for s in shape:
            numel *= s
        itemsize = torch.empty((), dtype=dtype).element_size()
        if numel * itemsize != end - start or not shape or not 0 <= r0 < r1 <= shape[0]:
            raise CorruptCheckpoint(f"a chunk in {self.path} has a size that does not match its shape", path=self.ckpt)
        row = (end - start) // shape[0]
        lo, hi = start + r0 * row, start + r1 * row
        data = self._cached(lo, hi)
        if data is None:
            data = memoryview(b"".join(self._fetch(split(lo, hi))))
        return _as_tensor(data, dtype, (r1 - r0, *shape[1:]))

    def hash_range(self, start: int, end: int, window: int) -> str:
        """xxh3-64 of bytes [start, end). A range that fits the budget stays fetched, so the
        load that verified it does not fetch it a second time; a larger one is streamed."""
        if end - start <= KEEP:
            return xxhash.xxh3_64_hexdigest(self._get(start, end))
        h = xxhash.xxh3_64()
        for lo in range(start, end, window):
            for data in self._fetch(split(lo, min(lo + window, end))):
                h.update(data)
        return h.hexdigest()

    def close(self) -> None:
        self._windows.clear()
        self._kept = 0
        self._likely = []


def _as_tensor(data: memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor over ``data`` without a copy. Fetched bytes are immutable; the tensor is only
    a source to copy from, so torch's warning about a read-only buffer is silenced here."""
    if data.readonly:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            t = torch.frombuffer(data, dtype=torch.uint8)
    else:
        t = torch.frombuffer(data, dtype=torch.uint8)
    return t.view(dtype).reshape(shape)


def stream_hash(store: Any, path: str, size: int, progress: Any = None, window: int = 128 << 20,
                spans: Sequence[tuple[int, int]] = ()) -> FileDigest:
    """:meth:`Storage.hash` of an object: fetched ``window`` bytes at a time in concurrent
    parts, each part hashed in order into the object's digest and its spans' (one download).
    A server that ignores ranges answers each part with the whole object (``ignored_range``):
    that answer is hashed instead, once, rather than fetched again for every part."""
    d = StreamDigest(spans)
    for lo in range(0, size, window):
        hi = min(lo + window, size)
        parts = split(lo, hi)
        for (plo, phi), data in zip(parts, store.fetch(path, [p[0] for p in parts], [p[1] for p in parts])):
            if ignored_range(data, plo, phi, size):
                whole = StreamDigest(spans)
                whole.update(data)
                if progress is not None:
                    progress(size - lo)
                return whole.result()
            check_part(data, plo, phi, path)
            d.update(data)
        if progress is not None:
            progress(hi - lo)
    return d.result()
