"""The index a data file carries (format 3): which chunk is where, and its checksum.

Format 3 keeps per-chunk records out of the manifest (they grow with tensors x ranks). Each
rank's data file ends with one more safetensors tensor, ``__safeckpt_index__`` (U8), holding
JSON::

    {"trees": {object name: tree, ...},            this rank's trees that differ from rank 0's
     "header": xxh3_64,                            the file's safetensors tensor entries
     "chunks": [[key, offsets, sizes, start, end, xxh3_64], ...]}   in file order

``header`` (written since the named files; optional, absent in older checkpoints) is the
xxh3-64 of :func:`header_digest`'s canonical form of every tensor entry of the file's own
safetensors header (name, data_offsets, shape; not ``__metadata__``, not the index's own
entry): the names and byte ranges other safetensors readers go by, which the chunk records do
not hold. ``format.v3`` hands it on with the file's chunks and a reader checks it against the
header it reads anyway when it opens the file (``format.shardfile.header_problems``, on every
rank for the files it reads, and in ``verify``): a renamed tensor or two swapped
``data_offsets`` make the file corrupt for safeckpt too, at no extra read.

``start``/``end`` are relative to the start of the safetensors data section (its
``data_offsets``), so the index can be built before the header, whose length depends on the
index's own size. Checksums have a fixed width, so the index is rendered with placeholders,
its size fixed, the data written and hashed, and the index filled in last. The manifest's
record of the file holds the index's byte range and xxh3-64, so a reader that needs one file
reads and checks only that file's index (O(chunks in the file)), never the others'.

Sizes: an index is ~60 bytes + the key per chunk; a rank's index grows with the tensors it
writes, not with the world size.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import xxhash

from ..errors import CorruptCheckpoint

INDEX_NAME = "__safeckpt_index__"
MAX_INDEX = 256 << 20  # bytes of one file's index a reader accepts
_SLOT = "0" * 16


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=True, allow_nan=True)


HEADER_ENTRY_BYTES = len(',"header":""') + 16  # what the header digest adds to an index


def header_digest(entries: Sequence[tuple[str, int, int, Sequence[int]]]) -> str:
    """xxh3-64 of a safetensors header's tensor entries (name, start, end relative to the data
    section, shape), in a canonical order: by byte range, then name."""
    rows = sorted(([n, int(s), int(e), [int(v) for v in shape]] for n, s, e, shape in entries),
                  key=lambda r: (r[1], r[2], r[0]))
    return xxhash.xxh3_64_hexdigest(_dumps(rows).encode())


class IndexTail:
    """A rendered index with a gap for each chunk's checksum: ``size`` is fixed up front."""

    def __init__(self, texts: list[str]) -> None:
        self._texts = texts  # len = chunks + 1; a checksum goes between each pair
        self.size = sum(len(t) for t in texts) + 16 * (len(texts) - 1)

    def render(self, digests: Sequence[str]) -> bytes:
        parts: list[str] = [""] * (2 * len(self._texts) - 1)
        parts[0::2] = self._texts
        parts[1::2] = digests
        data = "".join(parts).encode()
        assert len(data) == self.size, "index size changed while rendering"
        return data


class IndexBuilder:
    """Builds the index of one data file from the save plan: ``records`` maps a chunk's name in
    the file to its (key, offsets, sizes). The chunk text is cached per file layout (a training
    loop writes the same layout every save); the trees are rendered every save."""

    def __init__(self, records: Mapping[str, tuple[str, list[int], list[int]]]) -> None:
        self.records = records
        self._cache: tuple[Any, tuple[list[str], str]] = (None, ([], ""))

    def __call__(self, names: Sequence[str], rel_spans: Sequence[tuple[int, int]], trees: Mapping[str, Any]) -> IndexTail:
        stamp = (tuple(names), tuple(rel_spans))
        cached, (heads, digest) = self._cache
        if cached != stamp:
            heads = []
            for name, (s, e) in zip(names, rel_spans, strict=True):
                key, offsets, sizes = self.records[name]
                heads.append(f"[{_dumps(key)},{_dumps(offsets)},{_dumps(sizes)},{s},{e},\"")
            digest = header_digest([(name, s, e, self.records[name][2])
                                    for name, (s, e) in zip(names, rel_spans, strict=True)])
            self._cache = (stamp, (heads, digest))
        texts = [f'{{"trees":{_dumps(dict(trees))},"header":"{digest}","chunks":[']
        for i, head in enumerate(heads):
            texts[-1] += ("," if i else "") + head
            texts.append('"]')
        texts[-1] += "]}"
        return IndexTail(texts)


def parse_index(raw: bytes, where: str, ckpt: str, expect_digest: str) -> dict[str, Any]:
    """Check ``raw`` against the manifest's checksum and parse it: ``{"trees": {...},
    "chunks": [[key, offsets, sizes, start, end, xxh3_64], ...]}`` (shapes checked here; the
    caller checks the chunks against the manifest)."""

    def bad(msg: str) -> CorruptCheckpoint:
        return CorruptCheckpoint(f"{where}: {msg}", path=ckpt)

    if xxhash.xxh3_64_hexdigest(raw) != expect_digest:
        raise bad("checksum mismatch in the file's index (corrupt data)")
    try:
        idx = json.loads(raw)
        if isinstance(idx, str):  # a named file's index: a JSON string in its header's metadata
            idx = json.loads(idx)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise bad(f"unreadable index ({type(exc).__name__})") from None
    if not isinstance(idx, dict) or not isinstance(idx.get("trees"), dict) or not isinstance(idx.get("chunks"), list):
        raise bad("the index is not {trees, chunks}")
    if "header" in idx and not (isinstance(idx["header"], str) and len(idx["header"]) == 16):
        raise bad(f"malformed header checksum {str(idx['header'])[:40]!r}")
    for c in idx["chunks"]:
        if not (isinstance(c, list) and len(c) == 6 and isinstance(c[0], str) and isinstance(c[1], list)
                and isinstance(c[2], list) and type(c[3]) is int and type(c[4]) is int
                and isinstance(c[5], str) and len(c[5]) == 16 and 0 <= c[3] <= c[4]
                and all(type(v) is int and v >= 0 for v in (*c[1], *c[2]))):
            raise bad(f"malformed index entry {str(c)[:120]}")
    return idx
