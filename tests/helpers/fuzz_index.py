"""Format-3 mutants: the per-file index (its bytes and its JSON), chunk bytes located through it,
and the manifest fields that place chunks (pieces, sharding, meshes, boxes, rank_trees, extra).

A format-3 data file ends with the U8 safetensors tensor ``__safeckpt_index__`` (JSON
``{"trees": ..., "chunks": [[key, offsets, sizes, start, end, xxh3_64], ...]}``, start/end
relative to the data section); the manifest's record of the file holds ``data`` (where the data
section starts) and ``index`` ([start, end, xxh3_64]). :func:`rewrite` rebuilds a data file with
a new index (and optionally changed data bytes), and updates the manifest's record of it (size,
xxh3-128, data, index) so that a *forged* mutant is consistent everywhere but in the edit itself.

Generators return what :mod:`tests.helpers.fuzz_manifest`'s do (``(desc, manifest, invalid, ops,
verify_bad)``), or, for the unsigned file-only classes, ``(desc, ops)``.
"""

from __future__ import annotations

import copy
import json
import random
import struct
from typing import TYPE_CHECKING, Any

import xxhash

from tests.helpers.fuzz_json import dumps, fmt_path, get, is_leaf, put, value_edits, walk

if TYPE_CHECKING:
    from tests.helpers.fuzz_mutants import BaseView

INDEX = "__safeckpt_index__"


# ------------------------------------------------------------------ reading a base
def read_index(data: bytes, rec: dict[str, Any]) -> dict[str, Any] | None:
    """What a format-3 data file holds: its safetensors header, the index's raw bytes and JSON."""
    try:
        hl = struct.unpack("<Q", data[:8])[0]
        header = json.loads(data[8:8 + hl])
        start, end, _ = rec["index"]
        raw = data[start:end]
        return {"header": header, "hl": hl, "data": rec["data"], "start": start, "end": end, "raw": raw,
                "obj": json.loads(raw)}
    except (ValueError, KeyError, TypeError, struct.error):
        return None


def chunk_spans(v: BaseView) -> list[tuple[str, str, int, int, str]]:
    """(file, key, absolute start, end, xxh3_64) of every chunk with bytes, from the indexes
    (format 3) or the manifest's chunk records (format 2)."""
    out = []
    if v.fmt == 3:
        for name, idx in sorted(v.indexes.items()):
            for key, _o, _s, s, e, d in idx["obj"]["chunks"]:
                if e > s:
                    out.append((name, key, idx["data"] + s, idx["data"] + e, d))
    else:
        for key, rec in v.manifest["tensors"].items():
            for c in rec.get("chunks", []):
                if c["end"] > c["start"]:
                    out.append((c["file"], key, c["start"], c["end"], c["xxh3_64"]))
    return sorted(out)


# ------------------------------------------------------------------ rebuilding a data file
def rewrite(v: BaseView, man: dict[str, Any], name: str, raw: bytes | None = None,
            patches: list[tuple[int, bytes]] = ()) -> tuple[Any, ...] | None:
    """The op writing ``name`` with index ``raw`` (None: unchanged) and data ``patches``
    (absolute offset, bytes) applied; ``man``'s record of the file updated to match (None if the
    file is not laid out as the writer does: index last)."""
    data = bytearray(v.files[name])
    for at, b in patches:
        data[at:at + len(b)] = b
    rec = man["files"].get(name) if isinstance(man.get("files"), dict) else None
    if v.fmt == 3 and raw is not None:
        idx = v.indexes[name]
        if idx["end"] != len(data):
            return None
        rel = idx["start"] - idx["data"]
        if len(raw) != len(idx["raw"]):
            header = copy.deepcopy(idx["header"])
            header[INDEX] = {**header[INDEX], "shape": [len(raw)], "data_offsets": [rel, rel + len(raw)]}
            text = json.dumps(header, separators=(",", ":")).encode()
            text += b" " * (-len(text) % 8)
            body = bytes(data[idx["data"]:idx["start"]])
            data = bytearray(struct.pack("<Q", len(text)) + text + body)
            start = 8 + len(text)
        else:
            body = None
            start = idx["data"]
        data[start + rel:] = raw
        if isinstance(rec, dict):
            rec["data"] = start
            rec["index"] = [start + rel, start + rel + len(raw), xxhash.xxh3_64_hexdigest(raw)]
    if isinstance(rec, dict):
        rec["size"] = len(data)
        rec["xxh3_128"] = xxhash.xxh3_128_hexdigest(bytes(data))
    return ("write", name, bytes(data))


def _idx_dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=True, allow_nan=True).encode()


# ------------------------------------------------------------------ index edits
def _index_edit(rng: random.Random, v: BaseView, name: str) -> tuple[str, bytes, bool | None] | None:
    """A new index text for file ``name``: (desc, raw, invalid)."""
    idx = v.indexes[name]
    obj = copy.deepcopy(idx["obj"])
    chunks = obj["chunks"]
    rank = v.manifest["files"][name]["rank"]
    listed = rank in v.manifest.get("rank_trees", [])
    kind = rng.choice(["field", "field", "field", "drop", "dup", "reorder", "swap-bytes", "unknown-key",
                       "tree", "tree", "malformed", "malformed", "raw", "other-file", "shift", "sizes"])
    if kind == "field" and chunks:
        i = rng.randrange(len(chunks))
        paths = [p for p, x in walk(chunks[i]) if p and is_leaf(p, x)]
        path = rng.choice(paths)
        old = get(chunks[i], path)
        label, new = rng.choice(value_edits(old))
        put(chunks[i], path, new)
        what = {0: "key", 1: "offsets", 2: "sizes", 3: "start", 4: "end", 5: "xxh3_64"}[path[0]]
        return f"chunk {i} ({chunks[i][0]!r:.40}) {what}{fmt_path(path[1:])}: {old!r:.30} -> {label} {new!r:.30}", \
            _idx_dumps(obj), True
    if kind == "drop" and chunks:
        i = rng.randrange(len(chunks))
        key = chunks.pop(i)[0]
        return f"remove chunk {i} ({key!r:.40})", _idx_dumps(obj), True
    if kind == "dup" and chunks:
        i = rng.randrange(len(chunks))
        chunks.insert(rng.randrange(len(chunks) + 1), copy.deepcopy(chunks[i]))
        return f"duplicate chunk {i} ({chunks[i][0]!r:.40})", _idx_dumps(obj), True
    if kind == "reorder" and len(chunks) > 1:
        rng.shuffle(chunks)
        return "chunks listed in another order", _idx_dumps(obj), False
    if kind == "swap-bytes":
        by_size: dict[int, list[int]] = {}
        for i, c in enumerate(chunks):
            by_size.setdefault(c[4] - c[3], []).append(i)
        pairs = [ids for n, ids in by_size.items() if n and len(ids) > 1]
        if pairs:
            i, j = rng.sample(rng.choice(pairs), 2)
            for f in (3, 4, 5):
                chunks[i][f], chunks[j][f] = chunks[j][f], chunks[i][f]
            return (f"chunks {chunks[i][0]!r:.40} and {chunks[j][0]!r:.40} swap their bytes (same size, "
                    "checksums swapped too)", _idx_dumps(obj), False)
    if kind == "unknown-key" and chunks:
        c = copy.deepcopy(rng.choice(chunks))
        c[0] = rng.choice(["no/such", c[0] + "x", "", "tree/tied/1"])
        chunks.append(c)
        return f"extra chunk of key {c[0]!r}", _idx_dumps(obj), True
    if kind == "shift" and chunks:
        i = rng.randrange(len(chunks))
        d = rng.choice([1, -1, 4, 8, 1 << 20, -(1 << 20)])
        empty = chunks[i][3] == chunks[i][4]  # no bytes: where it "is" does not matter while inside the data
        chunks[i][3] += d
        chunks[i][4] += d
        return f"chunk {i} ({chunks[i][0]!r:.40}) byte range shifted by {d}", _idx_dumps(obj), None if empty else True
    if kind == "sizes" and chunks:  # a box and its bytes grown together (into the next chunk)
        i = rng.randrange(len(chunks))
        c = chunks[i]
        if c[2]:
            per = (c[4] - c[3]) // max(1, c[2][0])
            c[2][0] += 1
            c[4] += per
            return f"chunk {i} ({c[0]!r:.40}) one row longer, its end too", _idx_dumps(obj), True
    if kind == "tree":
        trees = obj["trees"]
        if listed and trees and rng.random() < 0.7:
            paths = [p for p, x in walk(trees) if p and is_leaf(p, x)]
            path = rng.choice(paths)
            old = get(trees, path)
            label, new = rng.choice(value_edits(old))
            put(trees, path, new)
            return f"trees{fmt_path(path)}: {old!r:.30} -> {label} {new!r:.30}", _idx_dumps(obj), None
        how = rng.choice(["unknown-object", "add", "dangling", "not-dict"])
        if how == "unknown-object":
            trees["nope"] = {"x": 1}
            return "a tree for an unknown object", _idx_dumps(obj), True
        if how == "add":
            objs = sorted(v.manifest["objects"])
            o = rng.choice(objs)
            trees[o] = copy.deepcopy(v.manifest["objects"][o]["tree"])
            return (f"a copy of object {o!r}'s tree" + ("" if listed else " (rank not in rank_trees)"),
                    _idx_dumps(obj), None if listed else True)
        if how == "dangling":
            trees[rng.choice(sorted(v.manifest["objects"]))] = {"@tensor": "no/such"}
            return "a tree referring to a missing tensor", _idx_dumps(obj), True
        obj["trees"] = rng.choice([[], None, "x", 5])
        return f"trees -> {obj['trees']!r}", _idx_dumps(obj), True
    if kind == "malformed":
        how = rng.choice(["list", "no-chunks", "five", "negative", "digest", "chunks-dict", "bigint",
                          "float", "string-ints"])
        if how == "list":
            return "index is a list", b"[]", True
        if how == "no-chunks":
            del obj["chunks"]
            return "index without chunks", _idx_dumps(obj), True
        if how == "chunks-dict":
            obj["chunks"] = {}
            return "chunks is an object", _idx_dumps(obj), True
        if not chunks:
            return None
        i = rng.randrange(len(chunks))
        if how == "five":
            chunks[i] = chunks[i][:5]
        elif how == "negative":
            chunks[i][3] = -1
        elif how == "digest":
            chunks[i][5] = chunks[i][5][:15]
        elif how == "bigint":
            text = _idx_dumps(obj).decode().replace(f",{chunks[i][3]},{chunks[i][4]},", f",{'9' * 5001},{chunks[i][4]},", 1)
            return f"chunk {i} start is a 5,001-digit integer", text.encode(), True
        elif how == "float":
            chunks[i][4] = float(chunks[i][4])
        else:
            chunks[i][3] = str(chunks[i][3])
        return f"chunk {i} malformed ({how})", _idx_dumps(obj), True
    if kind == "raw":
        raw = idx["raw"]
        how = rng.choice(["truncate", "nonutf8", "nan", "nest", "dupkey", "trailing", "empty"])
        if how == "truncate":
            return "index text truncated", raw[:rng.randrange(len(raw))], True
        if how == "nonutf8":
            at = rng.randrange(len(raw))
            return "invalid UTF-8 in the index", raw[:at] + b"\xc3\x28" + raw[at:], True
        if how == "nan":
            return "NaN as a chunk start", raw.replace(b'"chunks":[[', b'"chunks":[[NaN,', 1), True
        if how == "nest":
            depth = rng.choice([1000, 100000])
            return f"trees nested {depth} deep", b'{"trees":{"x":' + b"[" * depth + b"]" * depth + b"}," + \
                raw.split(b'"chunks":', 1)[1].join([b'"chunks":', b""]), True
        if how == "dupkey":
            return "a second, empty chunks key (it wins)", raw[:-1] + b',"chunks":[]}', True if chunks else None
        if how == "trailing":
            return "trailing garbage after the index", raw + b" x", True
        return "empty index", b"", True
    if kind == "other-file":
        others = [n for n in v.indexes if n != name]
        if others:
            other = rng.choice(others)
            return f"the index of {other}", v.indexes[other]["raw"], True
    return None


def g_index(rng: random.Random, v: BaseView) -> tuple[Any, ...] | None:
    """A data file's index edited and the file rebuilt (manifest record re-signed when forged)."""
    if v.fmt != 3 or not v.indexes:
        return None
    name = rng.choice(sorted(v.indexes))
    out = _index_edit(rng, v, name)
    if out is None:
        return None
    desc, raw, invalid = out
    if raw == v.indexes[name]["raw"]:
        return None
    man = copy.deepcopy(v.manifest)
    op = rewrite(v, man, name, raw)
    if op is None:
        return None
    return f"{name} index: {desc}", man, invalid, (op,)


def g_index_plain(rng: random.Random, v: BaseView) -> tuple[str, tuple[Any, ...]] | None:
    """The index edited in the file only (the manifest's checksum of it no longer matches)."""
    if v.fmt != 3 or not v.indexes:
        return None
    name = rng.choice(sorted(v.indexes))
    idx = v.indexes[name]
    if rng.random() < 0.4:
        at, bit = rng.randrange(idx["start"], idx["end"]), rng.randrange(8)
        return f"{name}: flip bit {bit} of byte {at} (its index)", (("xor", name, at, 1 << bit),)
    out = _index_edit(rng, v, name)
    if out is None or out[1] == idx["raw"]:
        return None
    if len(out[1]) == len(idx["raw"]):
        return f"{name} index (same length): {out[0]}", (("patch", name, idx["start"], out[1]),)
    op = rewrite(v, copy.deepcopy(v.manifest), name, out[1])
    return None if op is None else (f"{name} index (file rebuilt): {out[0]}", (op,))


# ------------------------------------------------------------------ chunk bytes
def g_chunk_bytes(rng: random.Random, v: BaseView) -> tuple[str, tuple[Any, ...]] | None:
    """A bit flipped inside one chunk's bytes, found through the index (format 2: the manifest)."""
    spans = chunk_spans(v)
    if not spans:
        return None
    name, key, s, e, _ = rng.choice(spans)
    at, bit = rng.randrange(s, e), rng.randrange(8)
    return f"{name}: flip bit {bit} of byte {at}, in the chunk of {key!r:.50}", (("xor", name, at, 1 << bit),)


def g_forged_data(rng: random.Random, v: BaseView) -> tuple[Any, ...] | None:
    """Chunk bytes changed and every checksum over them recomputed (chunk, index, file,
    manifest): a consistent other checkpoint; or with only the file's checksum redone."""
    spans = chunk_spans(v)
    if not spans:
        return None
    name, key, s, e, _ = rng.choice(spans)
    data = v.files[name]
    new = bytes(b ^ 0x5A for b in data[s:e]) if rng.random() < 0.5 else bytes(e - s)
    if new == data[s:e]:
        return None
    digest = xxhash.xxh3_64_hexdigest(new)
    consistent = rng.random() < 0.75
    man = copy.deepcopy(v.manifest)
    raw = None
    if consistent and v.fmt == 3:
        idx = v.indexes[name]
        obj = copy.deepcopy(idx["obj"])
        for c in obj["chunks"]:
            if idx["data"] + c[3] == s and idx["data"] + c[4] == e:
                c[5] = digest
        raw = _idx_dumps(obj)
        if len(raw) != len(idx["raw"]):
            return None
    elif consistent:
        for c in man["tensors"][key]["chunks"]:
            if c["file"] == name and c["start"] == s:
                c["xxh3_64"] = digest
    op = rewrite(v, man, name, raw, [(s, new)])
    if op is None:
        return None
    how = "chunk checksum recomputed" if consistent else "chunk checksum left as it was"
    return f"{name}: bytes {s}-{e} of {key!r:.50} changed, file checksum recomputed, {how}", man, \
        not consistent, (op,), not consistent


# ------------------------------------------------------------------ manifest: placement
def _sharded_boxes(v: BaseView, key: str) -> list[list[Any]]:
    """[rank, offsets, sizes] of every stored chunk of a tensor placed by the sharding rule."""
    from safeckpt.format.sharding import Mesh, overlapping

    rec = v.manifest["tensors"][key]
    sh = rec["sharding"]
    mesh = Mesh(v.manifest["meshes"][sh["mesh"]])
    return [[r, box[0], box[1]] for r, box in overlapping(key, rec["shape"], mesh, sh["dims"], None)]


def g_placement(rng: random.Random, v: BaseView) -> tuple[Any, ...] | None:
    """pieces, sharding, meshes and boxes: consistent rewrites and breaking edits."""
    if v.fmt != 3:
        return None
    man = copy.deepcopy(v.manifest)
    tensors = man["tensors"]
    pieces = [k for k, r in tensors.items() if "pieces" in r]
    sharded = [k for k, r in tensors.items() if "sharding" in r]
    what = rng.choice(["pieces"] * 4 + (["sharding", "sharding", "boxes", "boxes", "meshes", "meshes"] if sharded else []))
    world = man["world_size"]
    if what == "pieces":
        key = rng.choice(pieces)
        rec = tensors[key]
        ps = rec["pieces"]
        where = f"tensors[{key!r}].pieces"
        kind = rng.choice(["value", "value", "rank", "drop", "dup", "split", "reorder", "empty", "shape",
                           "replace", "per_rank"])
        i = rng.randrange(len(ps))
        if kind == "value":
            j = rng.randrange(3)
            old = ps[i][j]
            label, new = rng.choice(value_edits(old))
            ps[i][j] = new
            return f"{where}[{i}][{j}]: {old!r} -> {label} {new!r:.30}", man, True
        if kind == "rank":
            old = ps[i][0]
            ps[i][0] = rng.choice([r for r in range(world + 1) if r != old] or [old + 1])
            return f"{where}[{i}] moved from rank {old} to {ps[i][0]}", man, True
        if kind == "drop":
            del ps[i]
            return f"{where}: piece {i} removed", man, True
        if kind == "dup":
            ps.append(list(ps[i]))
            return f"{where}: piece {i} listed twice", man, True
        if kind == "split":
            r, start, n = ps[i]
            if n < 2:
                return None
            k = rng.randrange(1, n)
            ps[i:i + 1] = [[r, start, k], [rng.randrange(world), start + k, n - k]]
            return f"{where}[{i}] split at row {start + k} (the file holds one chunk)", man, True
        if kind == "reorder" and len(ps) > 1:
            ps.reverse()
            return f"{where}: listed in reverse order", man, False
        if kind == "empty":
            rec["pieces"] = []
            return f"{where}: empty", man, True
        if kind == "shape" and rec["shape"]:
            rec["shape"] = [rec["shape"][0] + 1, *rec["shape"][1:]]
            ps[-1][2] += 1
            return f"tensors[{key!r}]: one more row, in its shape and last piece", man, True
        if kind == "replace":
            rec["pieces"] = rng.choice([None, {}, [[0, 0]], [0, 0, 1], "x", [[0, -1, 2]]])
            return f"{where} -> {rec['pieces']!r}", man, True
        if kind == "per_rank":
            del rec["pieces"]
            rec["scope"] = "per_rank"
            # one rank: its file holds the whole tensor either way (consistent)
            return f"tensors[{key!r}]: replicated -> per_rank (pieces removed)", man, world > 1
        return None
    if what == "sharding":
        key = rng.choice(sharded)
        rec = tensors[key]
        sh = rec["sharding"]
        where = f"tensors[{key!r}].sharding"
        kind = rng.choice(["to-boxes", "to-boxes", "mesh", "dims", "dims", "drop", "both", "replace", "value"])
        if kind == "to-boxes":
            rec["boxes"] = _sharded_boxes(v, key)
            del rec["sharding"]
            return f"{where}: replaced by the boxes it gives ({len(rec['boxes'])})", man, False
        if kind == "mesh":
            old = sh["mesh"]
            sh["mesh"] = rng.choice([m for m in range(len(man["meshes"]) + 1) if m != old] + [-1, "0", None])
            return f"{where}.mesh {old} -> {sh['mesh']!r}", man, True
        if kind == "dims":
            i = rng.randrange(len(sh["dims"]))
            old = sh["dims"][i]
            new = rng.choice([["R"], ["S", 0], ["S", 1], ["S", 2], ["S", -1], ["P"], ["S"], "R", ["S", "0"], None])
            if new == old:
                return None
            sh["dims"][i] = new
            return f"{where}.dims[{i}] {old} -> {new!r}", man, True
        if kind == "drop":
            del rec["sharding"]
            return f"{where}: removed", man, True
        if kind == "both":
            rec["boxes"] = _sharded_boxes(v, key)
            return f"{where}: kept, and its boxes listed too", man, True
        if kind == "replace":
            rec["sharding"] = rng.choice([None, [], "x", {"mesh": 0}, {"dims": sh["dims"]}])
            return f"{where} -> {rec['sharding']!r}", man, True
        paths = [p for p, x in walk(sh) if p and is_leaf(p, x)]
        path = rng.choice(paths)
        old = get(sh, path)
        label, new = rng.choice(value_edits(old))
        put(sh, path, new)
        return f"{where}{fmt_path(path)}: {old!r} -> {label} {new!r:.30}", man, True
    if what == "boxes":
        key = rng.choice(sharded)
        rec = tensors[key]
        boxes = _sharded_boxes(v, key)
        rec["boxes"] = boxes
        del rec["sharding"]
        where = f"tensors[{key!r}] as boxes"
        kind = rng.choice(["value", "value", "value", "rank", "drop", "dup", "reorder", "overlap", "rank-swap"])
        i = rng.randrange(len(boxes))
        if kind == "value":
            paths = [p for p, x in walk(boxes[i]) if p and is_leaf(p, x)]
            path = rng.choice(paths)
            old = get(boxes[i], path)
            label, new = rng.choice(value_edits(old))
            put(boxes[i], path, new)
            return f"{where}[{i}]{fmt_path(path)}: {old!r} -> {label} {new!r:.30}", man, True
        if kind == "rank":
            old = boxes[i][0]
            boxes[i][0] = rng.choice([r for r in range(world + 1) if r != old])
            return f"{where}[{i}]: rank {old} -> {boxes[i][0]}", man, True
        if kind == "drop":
            del boxes[i]
            return f"{where}: box {i} removed", man, True
        if kind == "dup":
            boxes.append(copy.deepcopy(boxes[i]))
            return f"{where}: box {i} listed twice", man, True
        if kind == "reorder" and len(boxes) > 1:
            boxes.reverse()
            return f"{where}: listed in reverse order", man, False
        if kind == "rank-swap" and len(boxes) > 1:
            boxes[0][0], boxes[1][0] = boxes[1][0], boxes[0][0]
            return f"{where}: the ranks of boxes 0 and 1 swapped", man, True
        b = boxes[i]
        d = rng.randrange(len(b[1])) if b[1] else None
        if d is None or b[1][d] == 0:
            return None
        b[1][d] -= 1
        b[2][d] += 1
        return f"{where}[{i}]: starts one earlier along dim {d} (overlaps its neighbour)", man, True
    # meshes
    meshes = man["meshes"]
    m = rng.randrange(len(meshes))
    mesh = meshes[m]
    where = f"meshes[{m}]"
    kind = rng.choice(["value", "value", "equivalent", "permute", "shape", "drop", "add", "replace"])
    if kind == "equivalent":
        if "start" in mesh:
            n = 1
            for s in mesh["shape"]:
                n *= s
            meshes[m] = {"shape": mesh["shape"], "ranks": list(range(mesh["start"], mesh["start"] + n))}
            return f"{where}: start {mesh['start']} written as the list of its ranks", man, False
        if mesh["ranks"] == list(range(mesh["ranks"][0], mesh["ranks"][0] + len(mesh["ranks"]))):
            return None
        kind = "permute"
    if kind == "permute":
        n = 1
        for size in mesh["shape"]:
            n *= size
        ranks = mesh.get("ranks") or list(range(mesh["start"], mesh["start"] + n))
        meshes[m] = {"shape": mesh["shape"], "ranks": list(reversed(ranks))}
        if meshes[m]["ranks"] == ranks:
            return None
        return f"{where}: ranks {ranks} -> {meshes[m]['ranks']}", man, True
    if kind == "shape":
        new = rng.choice([list(reversed(mesh["shape"])), [*mesh["shape"], 1], [1, *mesh["shape"]], [world + 1], []])
        if new == mesh["shape"]:
            return None
        old = mesh["shape"]
        mesh["shape"] = new
        # a trailing/leading size-1 dim keeps the rank order: only the placements' count breaks
        return f"{where}.shape {old} -> {new}", man, True
    if kind == "drop":
        del meshes[m]
        return f"{where}: removed (tensors still refer to it)", man, True
    if kind == "add":
        meshes.append(rng.choice([{"shape": [1], "start": 0}, {"shape": [world], "start": 0}, {"shape": [2], "ranks": [0, 0]}]))
        ok = meshes[-1].get("ranks") != [0, 0] and (world >= meshes[-1]["shape"][0])
        return f"an unused mesh {meshes[-1]} appended", man, None if ok else True
    if kind == "replace":
        meshes[m] = rng.choice([None, [], "x", {"shape": [2]}, {"start": 0}])
        return f"{where} -> {meshes[m]!r}", man, True
    paths = [p for p, x in walk(mesh) if p and is_leaf(p, x)]
    path = rng.choice(paths)
    old = get(mesh, path)
    label, new = rng.choice(value_edits(old))
    put(mesh, path, new)
    return f"{where}{fmt_path(path)}: {old!r} -> {label} {new!r:.30}", man, True


def g_layout3(rng: random.Random, v: BaseView) -> tuple[Any, ...] | None:
    """rank_trees, extra files, and the files' data/index records."""
    if v.fmt != 3:
        return None
    man = copy.deepcopy(v.manifest)
    world = man["world_size"]
    what = rng.choice(["rank_trees", "rank_trees", "files", "files", "files"] + (["extra"] * 3 if "extra" in man else []))
    if what == "rank_trees":
        rt = man.get("rank_trees", [])
        kind = rng.choice(["drop", "add", "dup", "replace", "delete"])
        if kind == "drop" and rt:
            r = rt.pop(rng.randrange(len(rt)))
            return f"rank_trees: rank {r} removed (its index holds trees)", man, True
        if kind == "add":
            new = rng.choice([r for r in range(world + 1) if r not in rt] + [-1, "1", None])
            rt.append(new)
            man["rank_trees"] = rt
            # a listed rank whose index holds no tree: nothing differs from rank 0's (harmless)
            return f"rank_trees: {new!r} added", man, None if type(new) is int and 1 <= new < world else True
        if kind == "dup" and rt:
            rt.append(rt[0])
            return f"rank_trees: {rt[0]} listed twice", man, None
        if kind == "delete":
            if "rank_trees" not in man:
                return None
            del man["rank_trees"]
            return "rank_trees removed", man, True if rt else False
        man["rank_trees"] = rng.choice([None, {}, "1", [[1]], 1])
        return f"rank_trees -> {man['rank_trees']!r}", man, True
    if what == "files":
        name = rng.choice(sorted(man["files"]))
        rec = man["files"][name]
        where = f"files[{name!r}]"
        kind = rng.choice(["data", "data", "index", "index", "index", "swap-index", "swap-rank", "drop-field"])
        if kind == "data":
            old = rec["data"]
            label, new = rng.choice(value_edits(old) + [("+8", old + 8), ("-8", old - 8)])
            rec["data"] = new
            return f"{where}.data: {old} -> {label} {new!r:.30}", man, True
        if kind == "index":
            j = rng.randrange(3)
            old = rec["index"][j]
            label, new = rng.choice(value_edits(old))
            rec["index"][j] = new
            return f"{where}.index[{j}]: {old!r} -> {label} {new!r:.30}", man, True
        others = [n for n in man["files"] if n != name]
        if kind == "swap-index" and others:
            other = man["files"][others[0]]
            rec["index"], other["index"] = other["index"], rec["index"]
            return f"{where}.index swapped with {others[0]}'s", man, True
        if kind == "swap-rank" and others:
            other = man["files"][others[0]]
            rec["rank"], other["rank"] = other["rank"], rec["rank"]
            return f"{where}.rank swapped with {others[0]}'s", man, True
        fld = rng.choice(["data", "index", "rank", "size", "xxh3_128"])
        del rec[fld]
        return f"{where}: {fld} removed", man, True
    extra = man["extra"]
    name = rng.choice(sorted(extra))
    where = f"extra[{name!r}]"
    kind = rng.choice(["size", "hash", "missing", "data-file", "unsafe", "drop", "replace", "content"])
    if kind in ("size", "hash"):
        fld = {"size": "size", "hash": "xxh3_128"}[kind]
        old = extra[name][fld]
        label, new = rng.choice(value_edits(old))
        extra[name][fld] = new
        return f"{where}.{fld}: {old!r:.40} -> {label} {new!r:.40}", man, None, (), True
    if kind == "missing":
        extra["missing.json"] = dict(extra[name])
        return "extra: a record of a file that is not there", man, None, (), True
    if kind == "data-file":
        extra[sorted(man["files"])[0]] = dict(extra[name])
        return "extra: a record named like a data file", man, True
    if kind == "unsafe":
        new = rng.choice(["../outside.json", "/etc/hostname", "sub/x.json", "", "manifest.json", "a\x00b"])
        extra[new] = extra.pop(name)
        ops: tuple[Any, ...] = (("copy", name, "@root/outside.json"),) if new == "../outside.json" else ()
        return f"{where} renamed {new!r}", man, True, ops
    if kind == "drop":
        del extra[name]
        return f"{where}: record removed (the file stays, unlisted)", man, None
    if kind == "replace":
        man["extra"] = rng.choice([None, [], "x", {name: None}, {name: {"size": 1}}])
        return f"extra -> {man['extra']!r}", man, True
    data = dumps({"changed": True})
    return f"{name}: content replaced (the manifest keeps the old size and checksum)", v.manifest, None, \
        (("write", name, data),), True
