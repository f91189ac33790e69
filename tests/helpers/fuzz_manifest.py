"""Manifest mutants: edits of the parsed JSON (values, keys, header, tensors, chunks (format 2),
placement and layout fields (format 3, from :mod:`tests.helpers.fuzz_index`), files, object trees) and
of its text (duplicate keys, syntax, nesting, size, reformatting).

A parsed-JSON generator returns ``(description, new manifest, invalid[, extra ops])``; a text
generator returns ``(description, ops, changed)``. ``invalid`` is for forged edits (see
:mod:`tests.helpers.fuzz_mutants`).
"""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import xxhash

from tests.helpers.fuzz_bases import MANIFEST
from tests.helpers.fuzz_index import g_layout3, g_placement
from tests.helpers.fuzz_json import (
    Path,
    canon,
    dumps,
    fmt_path,
    get,
    is_leaf,
    pick_node,
    put,
    value_edits,
    walk,
)

if TYPE_CHECKING:
    from tests.helpers.fuzz_mutants import BaseView


# Fields whose change breaks an invariant of the format (for forged edits).
_INVARIANT_FIELDS = {"format", "format_version", "world_size", "size", "start", "end", "offsets",
                     "sizes", "file", "shape", "dtype", "kind", "@tensor",
                     # format 3: placement of chunks, where a file's data and index are
                     "pieces", "sharding", "boxes", "meshes", "mesh", "dims", "ranks", "data", "index"}


def _invalid_leaf(path: Path) -> bool | None:
    if path and path[0] in ("metadata", "metrics", "step", "created_at", "created_unix",
                            "safeckpt_version", "torch_version"):
        return False
    if path and path[0] in ("extra", "rank_trees"):
        return None  # loads do not read extra files (verify does); a listed rank may hold no tree
    if len(path) >= 3 and path[0] == "tensors" and path[2] == "placement":
        return None  # informational (the reader places chunks by sharding/boxes)
    names = {p for p in path if isinstance(p, str)}
    if "@tensor" in names and path[0] != "objects":
        names.discard("@tensor")  # an extra key named like a tag outside any tree
    return True if names & _INVARIANT_FIELDS else None




def g_value(rng: random.Random, v: BaseView) -> tuple[str, Any, bool | None] | None:
    man = copy.deepcopy(v.manifest)
    path = pick_node(rng, man, is_leaf)
    if path is None:
        return None
    old = get(man, path)
    label, new = rng.choice(value_edits(old))
    if canon(new) == canon(old):
        return None
    put(man, path, new)
    return f"{fmt_path(path)}: {old!r:.60} -> {label} {new!r:.60}", man, _invalid_leaf(path)


def g_delete_key(rng: random.Random, v: BaseView) -> tuple[str, Any, bool | None] | None:
    man = copy.deepcopy(v.manifest)
    path = pick_node(rng, man, lambda p, x: isinstance(x, dict) and bool(x))
    if path is None:
        return None
    node = get(man, path)
    key = rng.choice(list(node))
    del node[key]
    return f"delete {fmt_path((*path, key))}", man, None


_ADD_KEYS = ["x", "@tensor", "@tuple", "@dict", "@float", "rank_trees", "chunks", "scope", "rank",
             "kind", "step", "files", "xxh3_64", "placement", "pieces", "sharding", "boxes", "meshes",
             "index", "data", "extra", "alias_of"]


def g_add_key(rng: random.Random, v: BaseView) -> tuple[str, Any, bool | None] | None:
    man = copy.deepcopy(v.manifest)
    path = pick_node(rng, man, lambda p, x: isinstance(x, dict))
    if path is None:
        return None
    node = get(man, path)
    key = rng.choice(_ADD_KEYS)
    value = rng.choice([1, "x", None, [], {}, {"@tensor": rng.choice(list(man["tensors"]))}, [[0, 1]]])
    existed = key in node
    node[key] = value
    verb = "replace" if existed else "add"
    in_tree = len(path) >= 3 and path[0] == "objects" and path[2] in ("tree", "rank_trees")
    return f"{verb} {fmt_path((*path, key))} = {value!r}", man, True if key.startswith("@") and in_tree else None


def g_object(rng: random.Random, v: BaseView) -> tuple[str, Any, bool | None] | None:
    """Objects and their trees: kinds, tags, dangling refs, per-rank trees."""
    man = copy.deepcopy(v.manifest)
    objects = man["objects"]
    name = rng.choice(list(objects))
    obj = objects[name]
    keys = list(man["tensors"])
    kind = rng.choice(["kind", "drop", "add", "tree-type", "node", "node", "node", "node", "rank_trees",
                       "drop-field"])
    if kind == "drop-field":
        fld = rng.choice([f for f in obj if f != "tree"] + ["tree", "tree"])
        del obj[fld]
        return f"objects[{name!r}]: delete its {fld!r}", man, True if fld in ("tree", "kind") else None
    if kind == "kind":
        new = rng.choice(["module", "stateful", "tensor", "tree", "bogus", 5, None])
        obj["kind"] = new
        return f"objects[{name!r}].kind -> {new!r}", man, None if new in ("module", "stateful", "tensor", "tree") else True
    if kind == "drop":
        refs = any(isinstance(x, dict) and "@tensor" in x for _, x in walk(obj))
        del objects[name]
        return f"remove object {name!r}" + (" (its tensors stay described)" if refs else ""), man, refs or None
    if kind == "add":
        objects["extra"] = {"kind": "tree", "tree": rng.choice([1, {"@tensor": rng.choice(keys)}, {"@tensor": "nope"}])}
        return f"add object 'extra' = {objects['extra']!r}", man, None
    if kind == "tree-type":
        new = rng.choice([None, [], "x", 5, {}])
        obj["tree"] = new
        return f"objects[{name!r}].tree -> {new!r}", man, None
    if kind == "rank_trees":
        obj["rank_trees"] = rng.choice([{"0": 5}, {"1": obj["tree"]}, [], {"0": {"@tensor": "nope"}}])
        return f"objects[{name!r}].rank_trees = {obj['rank_trees']!r:.60}", man, None
    nodes = [p for p, x in walk(obj["tree"]) if isinstance(x, (dict, list))]
    path = rng.choice(nodes)
    tree_path = ("objects", name, "tree", *path)
    node = get(man, tree_path) if path else obj["tree"]
    ref = node.get("@tensor") if isinstance(node, dict) else None
    same = [k for k in keys if ref is not None and k != ref and _same_layout(man, k, ref)]
    choices: list[tuple[str, Any, bool | None]] = [
        ("dangling @tensor", {"@tensor": "no/such/tensor"}, True),
        ("@tensor int", {"@tensor": 5}, True),
        ("@tensor list", {"@tensor": ["a"]}, True),
        ("@tuple int", {"@tuple": 5}, True),
        ("@tuple string", {"@tuple": "ab"}, True),
        ("@tuple null", {"@tuple": None}, True),
        ("@dict one-element item", {"@dict": [[1]]}, True),
        ("@dict flat", {"@dict": [1, 2]}, True),
        ("@dict list key", {"@dict": [[[1], 2]]}, True),
        ("@dict object key", {"@dict": [[{"a": 1}, 2]]}, True),
        ("@dict string", {"@dict": "x"}, True),
        ("@dict triple", {"@dict": [[1, 2, 3]]}, True),
        ("@dict null key", {"@dict": [[None, 1]]}, None),
        ("@dict float key", {"@dict": [[1.5, 1]]}, None),
        ("@float word", {"@float": "abc"}, True),
        ("@float empty", {"@float": ""}, True),
        ("@float int", {"@float": 5}, True),
        ("@float null", {"@float": None}, True),
        ("@float 1e999", {"@float": "1e999"}, None),
        ("two tags", {"@tensor": rng.choice(keys), "@tuple": []}, True),
        ("tag plus key", {"@tensor": rng.choice(keys), "x": 1}, True),
        ("unknown tag", {"@set": [1]}, True),
        ("null", None, None),
        ("string", "x", None),
        ("empty list", [], None),
        ("empty object", {}, None),
    ]
    if same:
        other = rng.choice(same)
        choices.append((f"@tensor -> other tensor {other!r} of the same dtype/shape", {"@tensor": other}, True))
    label, new, invalid = rng.choice(choices)
    if path:
        put(man, tree_path, new)
    else:
        obj["tree"] = new
    return f"{fmt_path(tree_path)}: {label}", man, invalid


def _same_layout(man: dict[str, Any], a: str, b: Any) -> bool:
    ra, rb = man["tensors"].get(a), man["tensors"].get(b) if isinstance(b, str) else None
    return bool(ra and rb and ra["dtype"] == rb["dtype"] and ra["shape"] == rb["shape"])


_ELSIZE = {"F64": 8, "I64": 8, "U64": 8, "C64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2,
           "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def g_tensor(rng: random.Random, v: BaseView) -> tuple[str, Any, bool | None] | None:
    """Tensor records: dtype, shape, scope, dims, removal, renaming."""
    man = copy.deepcopy(v.manifest)
    key = rng.choice(list(man["tensors"]))
    rec = man["tensors"][key]
    kind = rng.choice(["dtype", "dtype", "shape", "shape", "scope", "drop", "rename", "extra-dim", "add",
                       "alias", "alias"])
    where = f"tensors[{key!r}]"
    if kind == "alias":
        return _alias(rng, man, key, where)
    if kind == "dtype":
        size = _ELSIZE.get(rec["dtype"])
        same = [c for c, s in _ELSIZE.items() if s == size and c != rec["dtype"]]
        new = rng.choice(same + ["F64", "BOOL", "X9", 4, None, "f32", ""])
        rec["dtype"] = new
        return f"{where}.dtype -> {new!r}", man, False if new in same and rec.get("scope") != "per_rank" else True
    if kind == "shape":
        shape = list(rec["shape"])
        options: list[tuple[str, Any, bool | None]] = [
            ("append 1", [*shape, 1], True), ("drop dim", shape[:-1], True),
            ("double first", [shape[0] * 2, *shape[1:]] if shape else [2], True),
            ("negative", [-1, *shape[1:]], True), ("huge", [2**40, 2**40]), ("2**63", [2**63]),
            ("bool", [True] * len(shape) or [True]), ("float", [float(s) for s in shape] or [1.0]),
            ("string", "8,4"), ("null", None), ("zeros", [0] * max(1, len(shape))),
            ("65 dims", [1] * 65),
        ]
        if len(shape) >= 2 and shape[0] != shape[1]:
            options.append(("transpose, chunks too", [shape[1], shape[0], *shape[2:]], False))
        label, new, *inv = rng.choice(options)
        if new == shape:
            return None  # e.g. dropping a dim of a 0-d tensor: no edit
        rec["shape"] = new
        if label.startswith("transpose"):
            if "chunks" not in rec:
                return f"{where}.shape {shape} -> transposed {new!r:.60}", man, True  # format 3: rows placed
            for c in rec["chunks"]:
                c["sizes"] = [c["sizes"][1], c["sizes"][0], *c["sizes"][2:]]
                c["offsets"] = [c["offsets"][1], c["offsets"][0], *c["offsets"][2:]]
        return f"{where}.shape {shape} -> {label} {new!r:.60}", man, inv[0] if inv else True
    if kind == "scope":
        new = rng.choice(["replicated", "per_rank", "sharded", "bogus", None, 1])
        old = rec.get("scope")
        rec["scope"] = new
        return f"{where}.scope {old!r} -> {new!r}", man, None if new in ("replicated", "sharded") else True
    if kind == "drop":
        del man["tensors"][key]
        return f"remove {where} (still referenced by a tree)", man, True
    if kind == "rename":
        man["tensors"][key + "x"] = man["tensors"].pop(key)
        return f"rename {where} -> {key + 'x'!r} (tree still refers to the old name)", man, True
    if kind == "extra-dim" and "chunks" not in rec:
        return _extra_dim3(v, man, key, where)
    if kind == "extra-dim":
        rec["shape"] = [*rec["shape"], 1]
        for c in rec["chunks"]:
            c["offsets"] = [*c["offsets"], 0]
            c["sizes"] = [*c["sizes"], 1]
        return f"{where}: extra trailing dim of size 1 in shape and chunks (consistent)", man, False
    man["tensors"]["unused"] = copy.deepcopy(rec)
    return f"add an unreferenced copy of {where} as 'unused'", man, True


def _extra_dim3(v: BaseView, man: dict[str, Any], key: str, where: str) -> tuple[Any, ...] | None:
    """Format 3: a trailing dim of size 1 in the shape and in every index entry of the tensor
    (files rebuilt, their records re-signed): consistent."""
    from tests.helpers.fuzz_index import _idx_dumps, rewrite

    rec = man["tensors"][key]
    if "alias_of" in rec:
        return None
    rec["shape"] = [*rec["shape"], 1]
    if "boxes" in rec:
        for b in rec["boxes"]:
            b[1], b[2] = [*b[1], 0], [*b[2], 1]
    ops = []
    for name, idx in sorted(v.indexes.items()):
        obj = copy.deepcopy(idx["obj"])
        hits = [c for c in obj["chunks"] if c[0] == key]
        if not hits:
            continue
        for c in hits:
            c[1], c[2] = [*c[1], 0], [*c[2], 1]
        op = rewrite(v, man, name, _idx_dumps(obj))
        if op is None:
            return None
        ops.append(op)
    return f"{where}: extra trailing dim of size 1 in shape and index entries (consistent)", man, False, tuple(ops)


def _alias(rng: random.Random, man: dict[str, Any], key: str, where: str) -> tuple[str, Any, bool | None]:
    """Tied-weight records (``alias_of``): consistent, of another layout, self, missing, cycles."""
    tensors = man["tensors"]
    rec = tensors[key]
    plain = [k for k, r in tensors.items() if k != key and "alias_of" not in r]
    same = [k for k in plain if _same_layout(man, key, k)]
    other_layout = [k for k in plain if k not in same]
    how = rng.choice(["same-layout", "other-layout", "self", "missing", "cycle", "keep-chunks",
                      "to-alias"])
    target = {"same-layout": rng.choice(same) if same else None, "keep-chunks": rng.choice(same) if same else None,
              "other-layout": rng.choice(other_layout) if other_layout else None, "self": key,
              "missing": "no/such", "cycle": rng.choice(plain) if plain else None,
              "to-alias": next((k for k, r in tensors.items() if "alias_of" in r and k != key), None)}[how]
    if target is None:
        how, target = "missing", "no/such"
    chunks = rec.get("chunks", []) if how == "keep-chunks" else []
    placed = {"chunks": chunks} if "chunks" in rec else {}  # format 3 aliases carry no placement
    if how == "keep-chunks" and "chunks" not in rec:
        placed = {f: rec[f] for f in ("pieces", "sharding", "boxes") if f in rec}
    tensors[key] = {**{f: rec.get(f) for f in ("dtype", "shape", "scope")}, "alias_of": target, **placed}
    if how == "cycle":
        t = tensors[target]
        tensors[target] = {**{f: t.get(f) for f in ("dtype", "shape", "scope")}, "alias_of": key,
                           **({"chunks": []} if "chunks" in t else {})}
    return f"{where} made an alias ({how}) of {target!r}", man, False if how == "same-layout" else True


def g_chunks(rng: random.Random, v: BaseView) -> tuple[str, Any, bool | None] | None:
    """Chunk lists and boxes: removal, duplication, swaps, splits with overlaps and gaps, fields."""
    if v.fmt != 2:
        return None  # format 3 lists no chunks in the manifest: see fuzz_index (placement, index)
    man = copy.deepcopy(v.manifest)
    key = rng.choice([k for k, r in man["tensors"].items() if r["chunks"]])
    rec = man["tensors"][key]
    chunks = rec["chunks"]
    where = f"tensors[{key!r}].chunks"
    kind = rng.choice(["remove", "duplicate", "reorder", "swap-lists", "point-at-other", "split",
                       "split", "split", "extra-dim", "drop-dim", "field", "field", "field", "shift",
                       "file"])
    i = rng.randrange(len(chunks))
    if kind == "remove":
        del chunks[i]
        return f"{where}: remove chunk {i}", man, True
    if kind == "duplicate":
        chunks.append(copy.deepcopy(chunks[i]))
        empty = 0 in rec["shape"]  # boxes of no element overlap in nothing
        return f"{where}: duplicate chunk {i} (overlapping boxes)", man, None if empty else True
    if kind == "reorder" and len(chunks) > 1:
        chunks.reverse()
        return f"{where}: reverse chunk order", man, False
    if kind == "swap-lists":
        others = [k for k in man["tensors"] if k != key and man["tensors"][k]["chunks"]]
        other = rng.choice(others)
        same = _same_layout(man, key, other)
        rec["chunks"], man["tensors"][other]["chunks"] = man["tensors"][other]["chunks"], chunks
        return f"{where}: swap chunk lists with {other!r}", man, False if same else True
    if kind == "point-at-other":
        nbytes = chunks[i]["end"] - chunks[i]["start"]
        pool = [c for k, r in man["tensors"].items() for c in r["chunks"]
                if k != key and c["end"] - c["start"] == nbytes and c is not chunks[i]]
        if pool:
            src = rng.choice(pool)
            for f in ("file", "start", "end", "xxh3_64"):
                chunks[i][f] = src[f]
            return f"{where}[{i}]: point at another tensor's bytes (same size, checksum copied)", man, False
    if kind == "split":
        return _split(rng, v, man, key, where)
    if kind == "extra-dim":
        chunks[i]["offsets"] = [*chunks[i]["offsets"], 0]
        chunks[i]["sizes"] = [*chunks[i]["sizes"], 1]
        return f"{where}[{i}]: extra dim in the box only", man, True
    if kind == "drop-dim" and chunks[i]["sizes"]:
        chunks[i]["offsets"] = chunks[i]["offsets"][:-1]
        chunks[i]["sizes"] = chunks[i]["sizes"][:-1]
        return f"{where}[{i}]: drop the last dim of the box", man, True
    if kind == "shift":
        d = rng.choice([1, -1, 4, -4, 8, 1 << 20])
        chunks[i]["start"] += d
        chunks[i]["end"] += d
        return f"{where}[{i}]: byte range shifted by {d}", man, None  # the chunk checksum decides
    if kind == "file":
        new = rng.choice([n for n in man["files"] if n != chunks[i]["file"]] + [
            "rank-00009.safetensors", "../rank-00000.safetensors", "/etc/hostname", "", 5, None,
            MANIFEST, "sub/rank-00000.safetensors"])
        old = chunks[i]["file"]
        chunks[i]["file"] = new
        return f"{where}[{i}].file {old!r} -> {new!r}", man, True
    fields = [("start",), ("end",), ("xxh3_64",), ("rank",)] + [
        (f, j) for f in ("offsets", "sizes") for j in range(len(chunks[i]["sizes"]))]
    fpath = rng.choice(fields)
    node_path = ("tensors", key, "chunks", i, *fpath)
    if fpath == ("rank",) and "rank" not in chunks[i]:
        chunks[i]["rank"] = rng.choice([0, 1, -1, "0"])
        return f"{where}[{i}]: add rank {chunks[i]['rank']!r}", man, None
    old = get(man, node_path)
    label, new = rng.choice(value_edits(old))
    put(man, node_path, new)
    invalid = None if fpath == ("rank",) else True
    if fpath == ("xxh3_64",) and new is None:
        invalid = None  # an unchecked chunk
    return f"{fmt_path(node_path)}: {old!r:.40} -> {label} {new!r:.40}", man, invalid


def _split(rng: random.Random, v: BaseView, man: dict[str, Any], key: str, where: str
           ) -> tuple[str, Any, bool | None] | None:
    """Cut a whole-tensor chunk into two row chunks: exact, overlapping, with a gap, or both."""
    rec = man["tensors"][key]
    if len(rec["chunks"]) != 1 or len(rec["shape"]) < 1 or rec["shape"][0] < 3:
        cands = [k for k, r in man["tensors"].items() if len(r["chunks"]) == 1 and r["shape"] and r["shape"][0] >= 3]
        if not cands:
            return None
        key = rng.choice(cands)
        rec = man["tensors"][key]
        where = f"tensors[{key!r}].chunks"
    (c,) = rec["chunks"]
    if c["offsets"][0] != 0 or c["sizes"] != rec["shape"]:
        return None
    data = v.files[c["file"]]
    rows = rec["shape"][0]
    row_bytes = (c["end"] - c["start"]) // rows
    k = rng.randrange(1, rows - 1)

    def piece(r0: int, r1: int) -> dict[str, Any]:
        start, end = c["start"] + r0 * row_bytes, c["start"] + r1 * row_bytes
        return {**c, "offsets": [r0, *c["offsets"][1:]], "sizes": [r1 - r0, *c["sizes"][1:]],
                "start": start, "end": end, "xxh3_64": xxhash.xxh3_64_hexdigest(data[start:end])}

    how = rng.choice(["exact", "overlap", "gap", "overlap+gap"])
    second = {"exact": (k, rows), "overlap": (k - 1, rows), "gap": (k + 1, rows),
              "overlap+gap": (k - 1, rows - 1)}[how]
    rec["chunks"] = [piece(0, k), piece(*second)]
    return (f"{where}: split rows [0,{k}) + [{second[0]},{second[1]}) of {rows} ({how}, checksums "
            "recomputed)", man, how != "exact")


def g_files(rng: random.Random, v: BaseView) -> tuple[str, Any, bool | None, tuple[Any, ...]] | None:
    """File records; renames are mirrored on disk so only the manifest decides what is read."""
    man = copy.deepcopy(v.manifest)
    name = rng.choice(list(man["files"]))
    rec = man["files"][name]
    kind = rng.choice(["size", "hash", "rank", "rename", "unsafe", "unsafe", "drop", "add-missing", "add-present"])
    where = f"files[{name!r}]"
    if kind in ("size", "hash", "rank"):
        fld = {"size": "size", "hash": "xxh3_128", "rank": "rank"}[kind]
        old = rec.get(fld)
        label, new = rng.choice(value_edits(old))
        rec[fld] = new
        return f"{where}.{fld}: {old!r:.40} -> {label} {new!r:.40}", man, True if fld == "size" else None, ()
    if kind == "drop":
        del man["files"][name]
        return f"remove {where} (chunks still point at it)", man, True, ()
    if kind == "add-missing":
        man["files"]["rank-00007.safetensors"] = dict(rec)
        return "add a record for a missing file rank-00007.safetensors (no chunk in it)", man, None, ()
    if kind == "add-present":
        man["files"]["rank-00007.safetensors"] = dict(rec)
        return ("add a record for an extra copy rank-00007.safetensors (present)", man, None,
                (("copy", name, "rank-00007.safetensors"),))
    new, disk, invalid = rng.choice([
        ("rank-00042.safetensors", ("rename", name, "rank-00042.safetensors"), False),
        (".hidden.safetensors", ("rename", name, ".hidden.safetensors"), None),
        ("../outside.safetensors", ("copy", name, "@root/outside.safetensors"), True),
        ("@ABS@", ("copy", name, "@outside/abs.safetensors"), True),
        ("sub/rank-00000.safetensors", ("copy", name, "sub/rank-00000.safetensors"), True),
        (MANIFEST, None, True),
        ("", None, True),
        ("a" * 300, None, True),
        ("rank-00000.safetensors\x00x", None, True),
        ("..", None, True),
    ]) if kind == "unsafe" else ("rank-00042.safetensors", ("rename", name, "rank-00042.safetensors"), False)
    ops: tuple[Any, ...] = (disk,) if disk else ()
    man["files"][new] = man["files"].pop(name)
    for r in man["tensors"].values():
        for c in r.get("chunks", []):  # format 3: the manifest names a file only in 'files'
            if c["file"] == name:
                c["file"] = new
    return f"rename file {name!r} -> {new!r} in the manifest" + (f" and on disk ({disk[0]})" if disk else ""), man, invalid, ops


def g_header(rng: random.Random, v: BaseView) -> tuple[str, Any, bool | None] | None:
    """Top-level fields and the manifest's own type."""
    man = copy.deepcopy(v.manifest)
    field_, new = rng.choice([
        ("format", "torch"), ("format", None), ("format_version", 1), ("format_version", 3),
        ("format_version", 2), ("format_version", 4),
        ("format_version", 0), ("format_version", "2"), ("format_version", 2.0), ("format_version", True),
        ("world_size", 0), ("world_size", 2), ("world_size", 3), ("world_size", -1), ("world_size", "abc"),
        ("world_size", 2**40), ("world_size", 1.0), ("world_size", True), ("world_size", None),
        ("step", -1), ("step", "7"), ("step", 2**70), ("step", 1.5), ("metadata", []), ("metrics", "x"),
        ("metrics", {"loss": {"@float": "nan"}}), ("files", []), ("tensors", None), ("objects", [1]),
        ("@top", None), ("@top", []), ("@top", 5), ("@top", "safeckpt"),
    ])
    if field_ == "@top":
        return f"whole manifest -> {new!r}", new, True
    old = man.get(field_)
    man[field_] = new
    inv = False if field_ in ("step", "metadata", "metrics") and not isinstance(new, str) else True
    if field_ == "metrics" and new != "x":
        inv = None
    return f"{field_}: {old!r:.40} -> {new!r}", man, inv


MANIFEST_GENS: dict[str, tuple[float, Callable[..., Any]]] = {
    "value": (6, g_value),
    "delete_key": (2, g_delete_key),
    "add_key": (2, g_add_key),
    "header": (2, g_header),
    "tensor": (3, g_tensor),
    "chunks": (4, g_chunks),
    "files": (2, g_files),
    "tree": (4, g_object),
    "placement": (4, g_placement),  # format 3: pieces, sharding, meshes, boxes
    "layout3": (3, g_layout3),  # format 3: rank_trees, extra files, files' data/index records
}


# ------------------------------------------------------------------ raw manifest text
def g_dup_key(rng: random.Random, v: BaseView) -> tuple[str, tuple[Any, ...], bool] | None:
    """A JSON object with a repeated key (Python keeps the last one)."""
    man = v.manifest
    path: Path | None = () if rng.random() < 0.25 else pick_node(
        rng, man, lambda p, x: isinstance(x, dict) and bool(x))
    if path is None:
        return None
    node = get(man, path)
    key = rng.choice(list(node))
    label, new = rng.choice(value_edits(node[key]))
    last = rng.random() < 0.5
    marker = "\u0001DUP\u0001"
    tmp = copy.deepcopy(man)
    target = get(tmp, path)
    if last:  # after the original: the duplicate wins
        target[marker] = None
    else:
        items = list(target.items())
        target.clear()
        target[marker] = None
        target.update(items)
    dup = json.dumps(key) + ":" + json.dumps(new, allow_nan=True)
    text = dumps(tmp).decode().replace(json.dumps(marker) + ":null", dup, 1).encode()
    where = fmt_path((*path, key))
    return (f"duplicate key {where} = {label} {new!r:.40} ({'after: it wins' if last else 'before: original wins'})",
            (("write", MANIFEST, text),), changed_from(text, v))


def g_syntax(rng: random.Random, v: BaseView) -> tuple[str, tuple[Any, ...], bool] | None:
    """Invalid or odd JSON text."""
    raw = v.manifest_raw
    kind = rng.choice(["truncate", "truncate", "byte", "byte", "nonutf8", "bom", "trailing", "empty",
                       "whitespace", "null", "list", "object", "nan-token", "single-quotes", "comment"])
    if kind == "truncate":
        n = rng.randrange(0, len(raw))
        return f"manifest truncated to {n} of {len(raw)} bytes", (("truncate", MANIFEST, n),), True
    if kind == "byte":
        at = rng.randrange(len(raw))
        new = rng.choice(b'{}[]",:0123456789 \\ntfx\x00\xff')
        text = raw[:at] + bytes([new]) + raw[at + 1:]
        return f"manifest byte {at} {raw[at:at + 1]!r} -> {bytes([new])!r}", (("write", MANIFEST, text),), changed_from(text, v)
    if kind == "nonutf8":
        at = rng.randrange(len(raw))
        text = raw[:at] + b"\xc3\x28" + raw[at:]
        return f"invalid UTF-8 inserted at byte {at}", (("write", MANIFEST, text),), True
    if kind == "bom":
        return "UTF-8 BOM prefix", (("write", MANIFEST, b"\xef\xbb\xbf" + raw),), changed_from(b"\xef\xbb\xbf" + raw, v)
    if kind == "trailing":
        return "trailing garbage after the JSON", (("write", MANIFEST, raw + b" x"),), True
    if kind == "empty":
        return "empty manifest", (("write", MANIFEST, b""),), True
    if kind == "whitespace":
        return "manifest of whitespace only", (("write", MANIFEST, b" \n\t "),), True
    if kind in ("null", "list", "object"):
        text = {"null": b"null", "list": b"[]", "object": b"{}"}[kind]
        return f"manifest is {text.decode()}", (("write", MANIFEST, text),), True
    if kind == "nan-token":
        text = raw.replace(b'"world_size":', b'"world_size":NaN,"x":', 1)
        return "NaN token as world_size", (("write", MANIFEST, text),), True
    if kind == "single-quotes":
        return "single-quoted keys", (("write", MANIFEST, raw.replace(b'"format"', b"'format'", 1)),), True
    return "a // comment", (("write", MANIFEST, b"// safeckpt\n" + raw),), True


def changed_from(text: bytes, v: BaseView) -> bool:
    """Whether ``text`` parses to something other than the base's manifest."""
    try:
        return canon(json.loads(text)) != canon(v.manifest)
    except (ValueError, RecursionError):
        return True


def g_benign(rng: random.Random, v: BaseView) -> tuple[str, tuple[Any, ...], bool] | None:
    """Control: a different text of the same parsed manifest (should load)."""
    kind = rng.choice(["indent", "sort", "newline", "reorder", "spaces"])
    man = v.manifest
    if kind == "indent":
        text = json.dumps(man, indent=2, allow_nan=True).encode()
    elif kind == "sort":
        text = json.dumps(man, sort_keys=True, allow_nan=True).encode()
    elif kind == "newline":
        text = v.manifest_raw + b"\n"
    elif kind == "spaces":
        text = json.dumps(man, allow_nan=True).encode()
    else:
        keys = list(man)
        rng.shuffle(keys)
        text = dumps({k: man[k] for k in keys})
    return f"same manifest, {kind}", (("write", MANIFEST, text),), False


def g_nesting(rng: random.Random, v: BaseView) -> tuple[str, tuple[Any, ...], bool] | None:
    """Deeply nested arrays/objects/tags in a tree or the metadata."""
    depth = rng.choice([50, 199, 201, 400, 990, 1100, 5000, 100000])
    kind = rng.choice(["array", "object", "tuple", "dict"])
    opener, closer = {"array": ("[", "]"), "object": ('{"a":', "}"), "tuple": ('{"@tuple":[', "]}"),
                      "dict": ('{"@dict":[[1,', "]]}")}[kind]
    nested = opener * depth + "0" + closer * depth
    marker = "\u0001NEST\u0001"
    man = copy.deepcopy(v.manifest)
    where = rng.choice(["metadata", "tree"])
    if where == "metadata":
        man["metadata"] = {"x": marker}
    else:
        man["objects"]["tree"]["tree"]["nested"] = marker
    text = dumps(man).decode().replace(json.dumps(marker), nested, 1).encode()
    return f"{kind} nested {depth} deep in {where}", (("write", MANIFEST, text),), True


def g_huge(rng: random.Random, v: BaseView, huge: int) -> tuple[str, tuple[Any, ...], bool] | None:
    """A very large manifest, written by streaming (the fuzzer itself stays small)."""
    kind = rng.choice(["ws", "string", "array", "records", "sparse"])
    raw = v.manifest_raw
    if kind == "sparse":  # costs no disk: a hole of NULs after the JSON
        return "manifest extended to 1 GiB with a sparse hole", (("truncate", MANIFEST, 1 << 30),), True
    if kind == "ws":
        return (f"{huge >> 20} MiB of whitespace before the closing brace",
                (("splice", MANIFEST, raw[:-1], "ws", huge, b"}"),), False)
    marker = "\u0001HUGE\u0001"
    man = copy.deepcopy(v.manifest)
    man["metadata"] = {"x": marker}
    head, tail = dumps(man).split(json.dumps(marker).encode(), 1)
    n = {"string": huge // 3, "array": min(60 << 20, huge // 5), "records": min(40 << 20, huge // 7)}[kind]
    return (f"metadata holding a {n >> 20} MiB {kind}", (("splice", MANIFEST, head, kind, n, tail),), True)
