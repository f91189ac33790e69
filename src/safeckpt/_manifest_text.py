"""The manifest's canonical JSON, assembled from pieces cached per save plan.

A training loop saves the same layout again and again, and between two saves of it only each
chunk's xxh3-64 (and the few top-level fields) change. Serializing the whole manifest with
``json.dumps`` cost 17 ms of a 4,000-tensor save (a fifth of it); here every chunk's JSON up to
its checksum, and every tensor record's JSON up to its chunk list, is rendered once per plan
and reused, so a save only joins strings.

The result is byte for byte what :func:`safeckpt._manifest.encode_manifest` makes of the same
manifest as a dict (the same key order, separators and escaping: every piece is rendered by
``json.dumps`` with the canonical settings), so readers cannot tell the difference; the tests
check that every written manifest is the canonical encoding of what it parses to.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from ._manifest import seal_manifest


def dumps(value: Any) -> str:
    """``value`` as canonical manifest JSON (the settings of ``_manifest._canonical``)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=True, allow_nan=True)


class ManifestPieces:
    """The JSON pieces of one save plan, on every rank (each renders its own chunks) and on the
    coordinator (the ``tensors`` object as fixed text with a gap for each chunk's checksum).
    Each cache is one tuple, read once and replaced whole, so two saves of the same plan in
    two threads (an async save in the background, a plain ``save`` in the loop) never pair one
    save's key with the other's pieces."""

    def __init__(self) -> None:
        # ((file name, header), [[key, sort order, chunk JSON up to its checksum], ...] in
        # record order, index of each record's chunk in the file's chunk order)
        self._chunks: tuple[Any, list[list[Any]], list[int]] = (None, [], [])
        # (table, every rank's chunk heads, text between checksums, where each checksum comes
        # from as an index into all ranks' checksums joined)
        self._template: tuple[Any, list[Any], list[str], list[int]] = (None, [], [], [])

    def chunk_report(self, records: Sequence[Mapping[str, Any]], fname: str, written: Any) -> dict[str, Any]:
        """This rank's chunks for the coordinator: ``heads`` (per record of ``records``, the
        plan's: [tensor key, sort order, chunk JSON up to the checksum]; the same list object
        while the file layout stays) and ``digests`` (each record's checksum). ``written`` is
        the WrittenFile of ``fname``."""
        stamp = (fname, written.header)
        cached, heads, where = self._chunks
        if stamp != cached:
            index = {name: i for i, name in enumerate(written.names)}
            where = [index[rec["name"]] for rec in records]
            heads = []
            for rec, i in zip(records, where, strict=True):
                ch = {k: v for k, v in rec.items() if k not in ("key", "name")}
                ch["file"], (ch["start"], ch["end"]) = fname, written.spans[i]
                head = dumps(ch)[:-1] + ',"xxh3_64":"'
                heads.append([rec["key"], (rec.get("rank", 0), rec["offsets"]), head])
            self._chunks = (stamp, heads, where)
        digests = written.digests
        return {"heads": heads, "digests": [digests[i] for i in where]}

    def tensors_json(self, table: Mapping[str, Mapping[str, Any]], reports: Sequence[Mapping[str, Any]]) -> str:
        """The manifest's ``tensors`` object: ``table`` (key -> record without chunks, in
        manifest order) with every rank's chunks from ``reports`` (their chunk_report), each
        tensor's sorted by (rank, offsets). The text around the checksums is built once per
        plan; a save fills in its checksums and joins (4,000 chunks: ~6 -> ~1 ms)."""
        heads = [r["heads"] for r in reports]
        cached_table, cached_heads, texts, sources = self._template
        if table is not cached_table or not _same_lists(heads, cached_heads):
            texts, sources = _template(table, heads)
            self._template = (table, heads, texts, sources)
        digests = [d for r in reports for d in r["digests"]]
        parts: list[str | None] = [None] * (2 * len(sources) + 1)
        parts[0::2] = texts
        parts[1::2] = [digests[i] for i in sources]
        return "".join(parts)  # type: ignore[arg-type]


def _same_lists(a: Sequence[Any], b: Sequence[Any]) -> bool:
    return len(a) == len(b) and all(x is y or x == y for x, y in zip(a, b))


def _template(table: Mapping[str, Mapping[str, Any]], heads: Sequence[Sequence[list[Any]]]) -> tuple[list[str], list[int]]:
    """(texts, sources): the ``tensors`` JSON is texts[0] + checksum[sources[0]] + texts[1] + ...
    where the checksums are every rank's, rank after rank, in each rank's record order."""
    chunks: dict[str, list[tuple[Any, int, str]]] = {k: [] for k in table}
    n = 0
    for rank_heads in heads:
        for key, order, head in rank_heads:
            chunks[key].append((order, n, head))
            n += 1
    texts: list[str] = []
    sources: list[int] = []
    text = "{"
    for i, (k, rec) in enumerate(table.items()):
        text += ("," if i else "") + f"{dumps(k)}:{dumps(dict(rec))[:-1]},\"chunks\":["
        found = chunks[k]
        found.sort(key=lambda c: c[0])
        for j, (_, source, head) in enumerate(found):
            texts.append(text + ("," if j else "") + head)
            sources.append(source)
            text = '"}'
        text += "]}"
    texts.append(text + "}")
    return texts, sources


def encode(head: Mapping[str, Any], objects: Mapping[str, Any], tensors_json: str) -> bytes:
    """The bytes of ``manifest.json``: ``head`` (every top-level field but objects and tensors,
    in order, at least one) followed by ``objects`` and ``tensors``, sealed with the manifest
    checksum. The objects are rendered every time: they hold the state's plain values, and a
    cache compared by ``==`` would take ``1`` for ``True`` or ``1.0``."""
    body = dumps(dict(head))
    return seal_manifest(f'{body[:-1]},"objects":{dumps(objects)},"tensors":{tensors_json}}}')
