"""Mutants of a real checkpoint: seeded, described in words, applied as plain file operations.

A :class:`Mutant` is data (picklable, reproducible from ``(seed, id)``): a class name for the
tables, a one-line description, and ``ops``, file operations on a copy of the base root
(:func:`apply`). Manifest edits are computed here on the parsed JSON and written as bytes.

Two families of manifest edits:

- plain: the edit is written as is, so the manifest's own checksum no longer matches; any
  successful load of a manifest whose parsed JSON differs from the original is SILENT.
- ``forged.*``: the same edits with the manifest checksum recomputed (a buggy writer, another
  tool), so the checks behind the checksum are exercised too. ``invalid`` says whether the
  edit breaks an invariant of the format (a load that succeeds is then SILENT); ``False`` means
  a consistent alternative checkpoint (loading it is fine), ``None`` that it depends.
"""

from __future__ import annotations

import copy
import json
import math
import os
import random
import shutil
import socket
import stat
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import xxhash

from tests.fuzz_bases import STEP_A, STEP_B

MANIFEST = "manifest.json"
Path = tuple[Any, ...]


@dataclass(frozen=True)
class Mutant:
    id: int
    base: str
    cls: str
    desc: str
    ops: tuple[tuple[Any, ...], ...]
    changed: bool = False  # the parsed manifest differs from the original
    forged: bool = False  # the manifest checksum was recomputed after the edit
    invalid: bool | None = None  # (forged) the edit breaks a format invariant


@dataclass
class BaseView:
    """What the generator knows of a base: the newer checkpoint's manifest and data files."""

    name: str
    root: str
    manifest_raw: bytes
    manifest: dict[str, Any]
    files: dict[str, bytes]
    older_files: dict[str, bytes]
    forge_ok: bool = field(default=False)

    @classmethod
    def load(cls, name: str, root: str) -> BaseView:
        ckpt = os.path.join(root, STEP_B)
        raw = _read(os.path.join(ckpt, MANIFEST))
        man = json.loads(raw)
        files = {n: _read(os.path.join(ckpt, n)) for n in man["files"]}
        older = {n: _read(os.path.join(root, STEP_A, n)) for n in os.listdir(os.path.join(root, STEP_A))
                 if n != MANIFEST}
        view = cls(name, root, raw, man, files, older)
        view.forge_ok = forge(man) is not None and json.loads(forge(man) or b"{}") == man
        return view


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


# ------------------------------------------------------------------ JSON helpers
def canon(obj: Any) -> str:
    """Canonical text of parsed JSON: equal iff the parsed values are equal (key order aside)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=True)


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), allow_nan=True).encode()


def forge(obj: Any) -> bytes | None:
    """``obj`` encoded with a valid manifest checksum, or None when that cannot be done."""
    try:
        from safeckpt import _manifest
    except Exception:  # noqa: BLE001 - src mid-edit: no forging this run
        return None
    name = getattr(_manifest, "CHECKSUM_FIELD", None)
    digest = getattr(_manifest, "manifest_digest", None)
    if not isinstance(obj, dict) or not name or digest is None:
        return None
    body = {k: v for k, v in obj.items() if k != name}
    try:
        body[name] = digest(body)
        return dumps(body)
    except (RecursionError, ValueError, TypeError):
        return None


def fmt_path(path: Path) -> str:
    out = ""
    for p in path:
        if isinstance(p, int):
            out += f"[{p}]"
        elif out and p.replace("_", "").isalnum():
            out += f".{p}"
        else:
            out += f"[{p!r}]" if out else p
    return out or "<root>"


def walk(obj: Any, path: Path = ()) -> Iterator[tuple[Path, Any]]:
    """Every node (path, value), parents before children."""
    yield path, obj
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from walk(v, (*path, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from walk(v, (*path, i))


def get(obj: Any, path: Path) -> Any:
    for p in path:
        obj = obj[p]
    return obj


def put(obj: Any, path: Path, value: Any) -> None:
    get(obj, path[:-1])[path[-1]] = value


def group_of(path: Path) -> tuple[Any, ...]:
    """Paths that differ only in list indices or tensor/file names form one group."""
    return tuple(
        "#" if isinstance(p, int) else ("*" if i == 1 and path[0] in ("tensors", "files") else p)
        for i, p in enumerate(path)
    )


REGIONS = {"header": 0.2, "files": 0.15, "tensors": 0.35, "objects": 0.3}


def pick_node(rng: random.Random, man: dict[str, Any], want: Callable[[Path, Any], bool]) -> Path | None:
    """A node satisfying ``want``: region first, then a group uniformly, then a member."""
    regions = list(REGIONS)
    for _ in range(8):
        region = rng.choices(regions, weights=[REGIONS[r] for r in regions])[0]
        groups: dict[tuple[Any, ...], list[Path]] = {}
        for path, value in walk(man):
            if not path:
                continue
            top = path[0] if path[0] in ("files", "tensors", "objects") else "header"
            if top == region and want(path, value):
                groups.setdefault(group_of(path), []).append(path)
        if groups:
            members = groups[rng.choice(sorted(groups, key=repr))]
            return rng.choice(members)
    return None


def is_leaf(path: Path, value: Any) -> bool:
    return not isinstance(value, (dict, list)) or not value


def value_edits(v: Any) -> list[tuple[str, Any]]:
    """Replacements for a JSON value: other numbers, types, signs, strings, null."""
    common: list[tuple[str, Any]] = [("null", None), ("list", [v] if not isinstance(v, list) else []),
                                     ("object", {}), ("bool", True)]
    if isinstance(v, bool):
        return [("not", not v), ("int", int(v)), ("string", str(v).lower()), ("null", None)]
    if isinstance(v, int):
        return common + [("+1", v + 1), ("-1", v - 1), ("negate", -v - 1), ("zero", 0),
                         ("2**63", 2**63), ("10**30", 10**30), ("-2**63", -(2**63)),
                         ("float", float(v)), ("+0.5", v + 0.5), ("string", str(v)), ("false", False)]
    if isinstance(v, float):
        return common + [("negate", -v), ("double", v * 2 if v else 1.0), ("zero", 0.0),
                         ("int", int(v) if math.isfinite(v) else 0), ("nan", math.nan),
                         ("inf", math.inf), ("string", repr(v))]
    if isinstance(v, str):
        return common + [("empty", ""), ("append", v + "x"), ("chop", v[:-1]), ("upper", v.upper()),
                         ("dotdot", "../" + v), ("absolute", "/etc/hostname"), ("int", 0),
                         ("long", v * 1000 if v else "x" * 1000), ("nul", v + "\x00"),
                         ("unicode", v + "\u00e9"), ("lone surrogate", v + "\ud800")]
    if v is None:
        return [("zero", 0), ("empty string", ""), ("false", False), ("object", {}), ("list", [])]
    if isinstance(v, dict):
        return [("null", None), ("list", []), ("string", "x"), ("one key", {"x": 1})]
    return [("null", None), ("object", {}), ("string", "x"), ("one item", [0])]


# Fields whose change breaks an invariant of the format (for forged edits).
_INVARIANT_FIELDS = {"format", "format_version", "world_size", "size", "start", "end", "offsets",
                     "sizes", "file", "shape", "dtype", "kind", "@tensor"}


def _invalid_leaf(path: Path) -> bool | None:
    if path and path[0] in ("metadata", "metrics", "step", "created_at", "created_unix",
                            "safeckpt_version", "torch_version"):
        return False
    names = {p for p in path if isinstance(p, str)}
    return True if names & _INVARIANT_FIELDS else None


# ------------------------------------------------------------------ manifest generators
Gen = Callable[[random.Random, BaseView], "tuple[str, Any, bool | None] | None"]
"""A manifest generator returns (description, new parsed manifest, invalid) or None."""


def g_value(rng: random.Random, v: BaseView) -> tuple[str, Any, bool | None] | None:
    man = copy.deepcopy(v.manifest)
    path = pick_node(rng, man, is_leaf)
    if path is None:
        return None
    old = get(man, path)
    label, new = rng.choice(value_edits(old))
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
             "kind", "step", "files", "xxh3_64", "placement"]


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
    kind = rng.choice(["kind", "drop", "add", "tree-type", "node", "node", "node", "node", "rank_trees"])
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
    kind = rng.choice(["dtype", "dtype", "shape", "shape", "scope", "drop", "rename", "extra-dim", "add"])
    where = f"tensors[{key!r}]"
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
        rec["shape"] = new
        if label.startswith("transpose"):
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
    if kind == "extra-dim":
        rec["shape"] = [*rec["shape"], 1]
        for c in rec["chunks"]:
            c["offsets"] = [*c["offsets"], 0]
            c["sizes"] = [*c["sizes"], 1]
        return f"{where}: extra trailing dim of size 1 in shape and chunks (consistent)", man, False
    man["tensors"]["unused"] = copy.deepcopy(rec)
    return f"add an unreferenced copy of {where} as 'unused'", man, True


def g_chunks(rng: random.Random, v: BaseView) -> tuple[str, Any, bool | None] | None:
    """Chunk lists and boxes: removal, duplication, swaps, splits with overlaps and gaps, fields."""
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
        return f"{where}: duplicate chunk {i} (overlapping boxes)", man, True
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
        return f"{where}[{i}]: byte range shifted by {d}", man, True
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
        for c in r["chunks"]:
            if c["file"] == name:
                c["file"] = new
    return f"rename file {name!r} -> {new!r} in the manifest" + (f" and on disk ({disk[0]})" if disk else ""), man, invalid, ops


def g_header(rng: random.Random, v: BaseView) -> tuple[str, Any, bool | None] | None:
    """Top-level fields and the manifest's own type."""
    man = copy.deepcopy(v.manifest)
    field_, new = rng.choice([
        ("format", "torch"), ("format", None), ("format_version", 1), ("format_version", 3),
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
            (("write", MANIFEST, text),), _changed(text, v))


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
        return f"manifest byte {at} {raw[at:at + 1]!r} -> {bytes([new])!r}", (("write", MANIFEST, text),), _changed(text, v)
    if kind == "nonutf8":
        at = rng.randrange(len(raw))
        text = raw[:at] + b"\xc3\x28" + raw[at:]
        return f"invalid UTF-8 inserted at byte {at}", (("write", MANIFEST, text),), True
    if kind == "bom":
        return "UTF-8 BOM prefix", (("write", MANIFEST, b"\xef\xbb\xbf" + raw),), _changed(b"\xef\xbb\xbf" + raw, v)
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


def _changed(text: bytes, v: BaseView) -> bool:
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


# ------------------------------------------------------------------ data files and directory
def _data_name(rng: random.Random, v: BaseView) -> str:
    return rng.choice(sorted(v.files))


def _header_len(data: bytes) -> int:
    return struct.unpack("<Q", data[:8])[0]


def g_data(rng: random.Random, v: BaseView, kind: str) -> tuple[str, tuple[Any, ...]] | None:
    name = _data_name(rng, v)
    data = v.files[name]
    hl = 8 + _header_len(data)
    if kind == "bitflip_header":
        at, bit = rng.randrange(hl), rng.randrange(8)
        return f"{name}: flip bit {bit} of byte {at} (header, {hl} bytes)", (("xor", name, at, 1 << bit),)
    if kind == "bitflip_data":
        if len(data) <= hl:
            return None
        at, bit = rng.randrange(hl, len(data)), rng.randrange(8)
        return f"{name}: flip bit {bit} of byte {at} (data)", (("xor", name, at, 1 << bit),)
    if kind == "truncate":
        n = rng.choice([0, 4, 8, rng.randrange(8, hl), hl, rng.randrange(hl, len(data)), len(data) - 1])
        return f"{name}: truncated to {n} of {len(data)} bytes", (("truncate", name, n),)
    if kind == "extend":
        if rng.random() < 0.2:
            return f"{name}: extended to 1 GiB with a sparse hole", (("truncate", name, 1 << 30),)
        extra = rng.choice([b"\x00", b"\x00" * 8, os.urandom(rng.randrange(1, 4096))])
        return f"{name}: {len(extra)} bytes appended", (("append", name, extra),)
    if kind == "header_len":
        old = hl - 8
        new = rng.choice([0, 1, old - 1, old + 1, old - 8, old + 8, len(data), 2**63, 2**64 - 1])
        return f"{name}: header length {old} -> {new}", (("patch", name, 0, struct.pack("<Q", new)),)
    if kind == "special":
        what = rng.choice(["empty", "dir", "fifo", "fifo", "socket", "zero-device", "null-device"])
        op = {"empty": ("write", name, b""), "dir": ("mkdir", name), "fifo": ("fifo", name),
              "socket": ("socket", name), "zero-device": ("chardev", name, 1, 5),
              "null-device": ("chardev", name, 1, 3)}[what]
        return f"{name} replaced by {what}", (op,)
    if kind == "link":
        what = rng.choice(["symlink-outside-same", "symlink-etc", "symlink-inside", "symlink-loop",
                           "symlink-dangling", "hardlink-outside-same", "hardlink-outside-other",
                           "symlink-older"])
        ops: dict[str, tuple[Any, ...]] = {
            "symlink-outside-same": (("copy", name, "@outside/same"), ("symlink", name, "@outside/same")),
            "symlink-etc": (("symlink", name, "/etc/hostname"),),
            "symlink-inside": (("copy", name, ".copy"), ("symlink", name, ".copy")),
            "symlink-loop": (("symlink", name, name),),
            "symlink-dangling": (("symlink", name, "@outside/nothing"),),
            "hardlink-outside-same": (("copy", name, "@outside/same"), ("hardlink", name, "@outside/same")),
            "hardlink-outside-other": (("write", "@outside/other", os.urandom(len(data))),
                                       ("hardlink", name, "@outside/other")),
            "symlink-older": (("symlink", name, f"../step-0000000001/{name}"),),
        }
        return f"{name} replaced by {what}", ops[what]
    if kind == "swap":
        if len(v.files) > 1:
            a, b = sorted(v.files)[:2]
            return f"swap {a} and {b}", (("rename", a, ".tmp"), ("rename", b, a), ("rename", ".tmp", b))
        older = v.older_files.get(name)
        if older is None:
            return None
        return f"{name} replaced by the older checkpoint's {name}", (("write", name, older),)
    if kind == "perm":
        if os.geteuid() == 0:
            return None  # root reads anything: meaningless
        return f"{name} made unreadable (chmod 000)", (("chmod", name, 0),)
    raise ValueError(kind)


DATA_KINDS = {"bitflip_header": 3, "bitflip_data": 3, "truncate": 2, "extend": 1, "header_len": 2,
              "special": 2, "link": 2, "swap": 1, "perm": 0.5}


def g_dir(rng: random.Random, v: BaseView, kind: str) -> tuple[str, tuple[Any, ...]] | None:
    if kind == "extra":
        name, op = rng.choice([
            ("junk file", ("write", "junk.bin", b"junk")),
            ("extra rank file", ("copy", sorted(v.files)[0], "rank-00009.safetensors")),
            ("extra fifo", ("fifo", "rank-00009.safetensors")),
            ("extra subdirectory", ("mkdir", "sub")),
            ("extra symlink to /etc", ("symlink", "extra", "/etc")),
            ("manifest backup", ("write", "manifest.json.bak", v.manifest_raw)),
            ("staging-like dotfile", ("write", ".safeckpt-staging-x", b"")),
        ])
        return f"extra entry in the checkpoint: {name}", (op,)
    if kind == "missing":
        what = rng.choice(sorted(v.files) + [MANIFEST, "*all data*"])
        if what == "*all data*":
            return "every data file removed", tuple(("remove", n) for n in v.files)
        return f"{what} removed", (("remove", what),)
    if kind == "manifest_special":
        what = rng.choice(["dir", "fifo", "fifo", "symlink-outside-same", "symlink-inside",
                           "hardlink-outside-same", "zero-device", "socket", "symlink-older"])
        ops: dict[str, tuple[Any, ...]] = {
            "dir": (("mkdir", MANIFEST),),
            "fifo": (("fifo", MANIFEST),),
            "symlink-outside-same": (("copy", MANIFEST, "@outside/m.json"), ("symlink", MANIFEST, "@outside/m.json")),
            "symlink-inside": (("copy", MANIFEST, ".m.json"), ("symlink", MANIFEST, ".m.json")),
            "hardlink-outside-same": (("copy", MANIFEST, "@outside/m.json"), ("hardlink", MANIFEST, "@outside/m.json")),
            "zero-device": (("chardev", MANIFEST, 1, 5),),
            "socket": (("socket", MANIFEST),),
            "symlink-older": (("symlink", MANIFEST, f"../step-0000000001/{MANIFEST}"),),
        }
        return f"{MANIFEST} replaced by {what}", ops[what]
    if kind == "checkpoint_dir":
        what = rng.choice(["symlink-outside", "file", "empty-dir", "fifo"])
        ckpt = f"@root/{STEP_B}"
        ops = {
            "symlink-outside": (("rename", ckpt, "@outside/ck"), ("symlink", ckpt, "@outside/ck")),
            "file": (("rmtree", ckpt), ("write", ckpt, b"x")),
            "empty-dir": (("rmtree", ckpt), ("mkdir", ckpt)),
            "fifo": (("rmtree", ckpt), ("fifo", ckpt)),
        }
        return f"the checkpoint directory replaced by {what}", ops[what]
    if kind == "all_damaged":  # restore has nothing to fall back to: it must raise, not start fresh
        older = f"@root/{STEP_A}/"
        name = sorted(v.older_files)[0]
        a = rng.choice([("xor", older + name, len(v.older_files[name]) - 1, 1),
                        ("truncate", older + MANIFEST, 100), ("write", older + MANIFEST, b"{}"),
                        ("remove", older + name)])
        b = rng.choice([("xor", name, len(v.files[name]) - 1, 1), ("truncate", MANIFEST, 100),
                        ("remove", MANIFEST), ("remove", name)])
        return f"both checkpoints damaged: older {a[0]} {a[1].rsplit('/', 1)[1]}, newer {b[0]} {b[1]}", (a, b)
    raise ValueError(kind)


DIR_KINDS = {"extra": 2, "missing": 1.5, "manifest_special": 2, "checkpoint_dir": 1, "all_damaged": 1}


# ------------------------------------------------------------------ the mutant stream
CLASS_WEIGHTS: dict[str, float] = {
    **{f"manifest.{k}": w for k, (w, _) in MANIFEST_GENS.items()},
    **{f"forged.{k}": w * 0.8 for k, (w, _) in MANIFEST_GENS.items()},
    "manifest.dup_key": 2, "manifest.syntax": 3, "manifest.nesting": 2, "manifest.huge": 0.4,
    "manifest.benign": 1.5,
    **{f"data.{k}": w for k, w in DATA_KINDS.items()},
    **{f"dir.{k}": w for k, w in DIR_KINDS.items()},
}


def make(rng: random.Random, v: BaseView, cls: str, *, huge: int) -> tuple[str, tuple[Any, ...], bool, bool, bool | None] | None:
    """One mutant of class ``cls``: (desc, ops, changed, forged, invalid), or None if n/a."""
    family, kind = cls.split(".", 1)
    if family in ("manifest", "forged") and kind in MANIFEST_GENS:
        out = MANIFEST_GENS[kind][1](rng, v)
        if out is None:
            return None
        desc, man, invalid, *extra = out
        ops = tuple(extra[0]) if extra else ()
        text = forge(man) if family == "forged" else dumps(man)
        if text is None:
            return None
        changed = _changed(text, v)
        if family == "forged" and not changed:
            return None
        return desc, ops + (("write", MANIFEST, text),), changed, family == "forged", invalid
    if family == "manifest":
        if kind == "huge":
            out = g_huge(rng, v, huge)
        else:
            gen = {"dup_key": g_dup_key, "syntax": g_syntax, "nesting": g_nesting, "benign": g_benign}[kind]
            out = gen(rng, v)
        return None if out is None else (*out, False, None)
    gen2 = g_data if family == "data" else g_dir
    out2 = gen2(rng, v, kind)
    return None if out2 is None else (*out2, False, False, None)


def generate(views: dict[str, BaseView], seed: int, count: int, *, huge: int = 300 << 20,
             classes: list[str] | None = None, start: int = 0) -> Iterator[Mutant]:
    """``count`` mutants; mutant ``i`` depends only on (seed, i, the bases, classes)."""
    names = sorted(views)
    pool = [c for c in CLASS_WEIGHTS if classes is None or any(c.startswith(p) for p in classes)]
    if not all(views[n].forge_ok for n in names):
        pool = [c for c in pool if not c.startswith("forged.")]
    weights = [CLASS_WEIGHTS[c] for c in pool]
    for i in range(start, start + count):
        rng = random.Random(f"{seed}:{i}")
        for _ in range(50):
            base = names[0] if len(names) == 1 else rng.choices(names, [3] + [1] * (len(names) - 1))[0]
            cls = rng.choices(pool, weights)[0]
            out = make(rng, views[base], cls, huge=huge)
            if out is not None:
                desc, ops, changed, forged, invalid = out
                yield Mutant(i, base, cls, desc, ops, changed, forged, invalid)
                break


# ------------------------------------------------------------------ applying
def apply(ops: tuple[tuple[Any, ...], ...], ws: str, ckpt: str) -> None:
    """Run ``ops`` on the checkpoint ``ckpt`` inside the workspace ``ws``.

    Names are relative to the checkpoint, or ``@root/...`` / ``@outside/...`` (a directory
    beside the root, outside every checkpoint); symlink targets of that form become absolute.
    """

    def at(name: str) -> str:
        if name.startswith("@root/"):
            return os.path.join(ws, "root", name[6:])
        if name.startswith("@outside/"):
            return os.path.join(ws, "outside", name[9:])
        return os.path.join(ckpt, name)

    for op, *args in ops:
        if op in ("write", "truncate", "append", "patch", "xor", "splice", "mkdir", "fifo", "socket",
                  "chardev", "symlink", "hardlink"):
            path = at(args[0])
            os.makedirs(os.path.dirname(path), exist_ok=True)
        if op in ("write", "mkdir", "fifo", "socket", "chardev", "symlink", "hardlink"):
            _clear(at(args[0]))
        if op == "write":
            with open(at(args[0]), "wb") as f:
                f.write(args[1])
        elif op == "truncate":
            os.truncate(at(args[0]), args[1])
        elif op == "append":
            with open(at(args[0]), "ab") as f:
                f.write(args[1])
        elif op == "patch":
            with open(at(args[0]), "r+b") as f:
                f.seek(args[1])
                f.write(args[2])
        elif op == "xor":
            with open(at(args[0]), "r+b") as f:
                f.seek(args[1])
                b = f.read(1)[0] ^ args[2]
                f.seek(args[1])
                f.write(bytes([b]))
        elif op == "splice":
            _splice(at(args[0]), *args[1:])
        elif op == "remove":
            _clear(at(args[0]))
        elif op == "rmtree":
            _clear(at(args[0]))
        elif op == "mkdir":
            os.makedirs(at(args[0]))
        elif op == "fifo":
            os.mkfifo(at(args[0]))
        elif op == "socket":
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.bind(at(args[0]))
        elif op == "chardev":
            os.mknod(at(args[0]), stat.S_IFCHR | 0o600, os.makedev(args[1], args[2]))
        elif op == "symlink":
            target = args[1]
            os.symlink(at(target) if target.startswith("@") else target, at(args[0]))
        elif op == "hardlink":
            os.link(at(args[1]), at(args[0]))
        elif op == "copy":
            os.makedirs(os.path.dirname(at(args[1])), exist_ok=True)
            shutil.copyfile(at(args[0]), at(args[1]))
        elif op == "rename":
            os.makedirs(os.path.dirname(at(args[1])), exist_ok=True)
            os.rename(at(args[0]), at(args[1]))
        elif op == "chmod":
            os.chmod(at(args[0]), args[1])
        else:
            raise ValueError(op)


def _clear(path: str) -> None:
    if os.path.islink(path) or (os.path.lexists(path) and not os.path.isdir(path)):
        os.unlink(path)
    elif os.path.isdir(path):
        shutil.rmtree(path)


def _splice(path: str, head: bytes, kind: str, n: int, tail: bytes) -> None:
    """head + n bytes of filler + tail, streamed in 1 MiB pieces."""
    piece = {"ws": b" " * (1 << 20), "string": b"a" * (1 << 20), "array": b"0," * (1 << 19),
             "records": None}[kind]
    with open(path, "wb") as f:
        f.write(head)
        if kind == "string":
            f.write(b'"')
        elif kind == "array":
            f.write(b"[")
        elif kind == "records":
            f.write(b"[")
        written = 0
        if kind == "records":
            rec = b'{"dtype":"F32","shape":[1],"chunks":[{"offsets":[0],"sizes":[1]}]},'
            block = rec * ((1 << 20) // len(rec))
            while written < n:
                f.write(block)
                written += len(block)
            f.write(b"{}]")
        else:
            assert piece is not None
            while written < n:
                f.write(piece)
                written += len(piece)
            f.write({"ws": b"", "string": b'"', "array": b"0]"}[kind])
        f.write(tail)
