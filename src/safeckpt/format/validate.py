"""Validate everything a checkpoint says about itself before any of it is used.

One function, :func:`check_manifest`, checks a parsed ``manifest.json`` completely: types and
ranges of every field, file names, dtypes, shapes, chunk boxes (inside the tensor, tiling it
exactly: no gap, no overlap), byte ranges (inside their file, sized like their box), per-rank
copies (one per saving rank), object trees (well-formed tags, bounded nesting, every tensor
reference described and every described tensor referenced). Loading, ``verify``, the manager and
the CLI all read manifests through it, so a checkpoint that verifies also loads, and a damaged
one fails with :class:`CorruptCheckpoint` naming the field, before any tensor in memory is
touched. Callers may then index the manifest without defensive checks.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from typing import Any

from ..errors import CorruptCheckpoint

MAX_DIMS = 64
MAX_DEPTH = 200  # nesting of object trees (JSON itself may nest deeper; we refuse that)
MAX_WORLD = 1 << 20
SCOPES = ("replicated", "per_rank", "sharded")
KINDS = ("module", "stateful", "tensor", "tree")
TAGS = ("@tensor", "@tuple", "@dict", "@float")
_HEX = re.compile(r"^[0-9a-f]+$")
_FLOAT_WORDS = ("inf", "-inf", "nan")
_NAME_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")
MAX_WRITTEN_DEPTH = 16  # directory levels of a written file's name


def is_written_name(name: object) -> bool:
    """The name of a file the ranks wrote into a checkpoint themselves (manifest field
    ``written``): a relative path of plain components (letters, digits, ``. _ -``, no leading
    dot, no ``..``), not one of safeckpt's own files at the top (``manifest.json``, ``rank-*``)."""
    if not isinstance(name, str) or len(name) > 1000:
        return False
    parts = name.split("/")
    if len(parts) > MAX_WRITTEN_DEPTH or not all(_NAME_PART.match(p) and ".." not in p for p in parts):
        return False
    return parts[0] != "manifest.json" and not parts[0].startswith("rank-")


def is_named_file(name: object) -> bool:
    """A data file laid out under a name of the caller's (Hugging Face's ``model.safetensors``,
    ``model-00001-of-00002.safetensors``): a plain ``*.safetensors`` name, not ``rank-*``. Its
    manifest record's ``rank`` is a slot past the ranks' own files (``world_size``, ...), so
    ``pieces`` name it like a rank; its index is in its safetensors header (``__metadata__``)."""
    return (isinstance(name, str) and name.endswith(".safetensors") and "/" not in name
            and bool(_NAME_PART.match(name)) and ".." not in name and not name.startswith("rank-"))


def _slots(world: int, files: dict[str, Any]) -> int:
    """Files a format-3 save has: one per rank, then one per named file."""
    return world + sum(1 for name in files if is_named_file(name))


class _Bad(Exception):
    """A validation failure, before the checkpoint path is attached."""


def _int(value: Any, what: str, lo: int = 0, hi: int | None = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise _Bad(f"{what} must be an integer, got {value!r:.80}")
    if value < lo or (hi is not None and value > hi):
        raise _Bad(f"{what} is {value}, outside [{lo}, {hi if hi is not None else '...'}]")
    return value


def _dict(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _Bad(f"{what} must be a JSON object, got {type(value).__name__}")
    return value


def _list(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise _Bad(f"{what} must be a JSON array, got {type(value).__name__}")
    return value


def _hex(value: Any, what: str, length: int) -> str:
    if not isinstance(value, str) or len(value) != length or not _HEX.match(value):
        raise _Bad(f"{what} must be a {length}-digit hex checksum, got {value!r:.80}")
    return value


def check_manifest(man: dict[str, Any], where: str, ckpt: str, *,
                   file_ok: Any, dtype_size: Any) -> None:
    """Raise CorruptCheckpoint(naming ``where`` and the field) unless ``man`` is fully valid.

    ``file_ok(name)`` raises for an unsafe file name; ``dtype_size(code)`` gives the element
    size of a dtype code or raises for an unknown one (both from :mod:`safeckpt.format.manifest`).
    """
    _as_corrupt(_check, man, where, ckpt, file_ok, dtype_size)


def _as_corrupt(check: Any, man: dict[str, Any], where: str, ckpt: str, file_ok: Any, dtype_size: Any) -> None:
    """Run ``check``; whatever it finds wrong is CorruptCheckpoint naming ``where``."""
    try:
        check(man, file_ok, dtype_size)
    except _Bad as exc:
        raise CorruptCheckpoint(f"{where}: {exc}", path=ckpt) from None
    except CorruptCheckpoint as exc:
        raise CorruptCheckpoint(f"{where}: {exc}", path=ckpt) from None
    except RecursionError:
        raise CorruptCheckpoint(f"{where}: nested too deeply", path=ckpt) from None


def _check(man: dict[str, Any], file_ok: Any, dtype_size: Any) -> None:
    world = _check_head(man)
    files = _dict(man.get("files"), "'files'")
    tensors = _dict(man.get("tensors"), "'tensors'")
    objects = _dict(man.get("objects"), "'objects'")
    for name, rec in files.items():
        rec, _ = _file_record(name, rec, file_ok)
        if "rank" in rec:
            _int(rec["rank"], f"rank of file {name!r}", 0, _slots(world, files) - 1)
    for key, rec in tensors.items():
        if not isinstance(rec, dict):
            _dict(rec, f"tensor {key!r:.200}")  # raises; the message is built only then
        if "alias_of" in rec:
            _check_alias(key, rec, tensors)
        elif not _tensor_ok(key, rec, files, world, dtype_size):
            _check_tensor(key, rec, files, world, dtype_size)
    _check_objects(objects, tensors, world)


def _file_record(name: str, rec: Any, file_ok: Any) -> tuple[dict[str, Any], int]:
    """A data file's record (both formats): a safe name, a size and an xxh3-128; (it, size)."""
    file_ok(name)
    rec = _dict(rec, f"file {name!r}")
    size = _int(rec.get("size"), f"size of file {name!r}")
    _hex(rec.get("xxh3_128"), f"checksum of file {name!r}", 32)
    return rec, size


def _check_head(man: dict[str, Any]) -> int:
    """The top-level scalars; the world size."""
    world = _int(man.get("world_size"), "'world_size'", 1, MAX_WORLD)
    step = man.get("step")
    if step is not None:
        _int(step, "'step'")
    if not isinstance(man.get("created_at", ""), str):
        raise _Bad("'created_at' must be a string")
    for key in ("metadata", "metrics"):
        if man.get(key) is not None:
            _dict(man[key], f"{key!r}")
    return world


def _check_objects(objects: dict[str, Any], tensors: dict[str, Any], world: int) -> None:
    referenced: set[str] = set()
    for name, obj in objects.items():
        if not isinstance(name, str) or not name or "/" in name or name.startswith("@"):
            raise _Bad(f"object name {name!r} is not a valid state key")
        ref = _single_ref(obj)
        if ref is not None and ref in tensors:
            referenced.add(ref)
            continue
        obj = _dict(obj, f"object {name!r}")
        if "tree" not in obj:
            raise _Bad(f"object {name!r} has no tree")
        if obj.get("kind") not in KINDS:
            raise _Bad(f"object {name!r} has unknown kind {obj.get('kind')!r:.40}")
        trees = [obj.get("tree")]
        rank_trees = _dict(obj.get("rank_trees", {}), f"rank_trees of object {name!r}")
        for r, tree in rank_trees.items():
            if not r.isdigit() or not 0 < int(r) < world:
                raise _Bad(f"object {name!r} has a tree for rank {r!r:.20} of a {world}-rank save")
            trees.append(tree)
        for tree in trees:
            referenced.update(check_tree(tree, f"object {name!r}", tensors))
        if obj["kind"] == "tensor" and not (isinstance(obj["tree"], dict) and set(obj["tree"]) == {"@tensor"}):
            raise _Bad(f"object {name!r} is a tensor but its tree is not a tensor reference")
    orphans = sorted(set(tensors) - referenced)
    if orphans:
        raise _Bad(f"tensor {orphans[0]!r:.200} is described but no object refers to it")


def check_tree(tree: Any, what: str, tensors: dict[str, Any]) -> set[str]:
    """The tensor keys a well-formed ``tree`` refers to, each described in ``tensors``."""
    refs = set()
    for ref in _tree_refs(tree, what, 0):
        if ref not in tensors:
            raise _Bad(f"{what} refers to tensor {ref!r:.200} that the manifest does not describe")
        refs.add(ref)
    return refs


# ------------------------------------------------------------------ format 3
def check_manifest_v3(man: dict[str, Any], where: str, ckpt: str, *, file_ok: Any, dtype_size: Any) -> None:
    """:func:`check_manifest` for format 3 (chunks in per-file indexes, see ``safeckpt.format.v3``): every
    field of the manifest itself; each file's index is checked against it when it is read."""
    _as_corrupt(_check_v3, man, where, ckpt, file_ok, dtype_size)


def _check_v3(man: dict[str, Any], file_ok: Any, dtype_size: Any) -> None:
    world = _check_head(man)
    files = _dict(man.get("files"), "'files'")
    tensors = _dict(man.get("tensors"), "'tensors'")
    objects = _dict(man.get("objects"), "'objects'")
    meshes = _list(man.get("meshes", []), "'meshes'")
    has_file: set[int] = set()
    slots = _slots(world, files)
    for name, rec in files.items():
        rec, size = _file_record(name, rec, file_ok)
        what = f"file {name!r}"
        rank = _int(rec.get("rank"), f"rank of {what}", 0, slots - 1)
        if (rank >= world) != is_named_file(name):
            raise _Bad(f"{what} has slot {rank}: rank files take slots 0..{world - 1}, named files the ones after")
        if rank in has_file:
            raise _Bad(f"two files of rank {rank}")
        has_file.add(rank)
        index = _list(rec.get("index"), f"index of {what}")
        if len(index) != 3:
            raise _Bad(f"index of {what} is not [start, end, checksum]")
        start = _int(rec.get("data"), f"data start of {what}", 8, size)
        if rank >= world:  # a named file: the index is in its header, before the data
            start, size = 8, start
        start = _int(index[0], f"index start of {what}", start, size)
        _int(index[1], f"index end of {what}", start, size)
        _hex(index[2], f"index checksum of {what}", 16)
    if len(has_file) != slots:
        missing = sorted(set(range(slots)) - has_file)
        raise _Bad(f"no file of rank(s) {missing[:8]} of a {world}-rank save")
    extra = _dict(man.get("extra", {}), "'extra'")
    for name, rec in extra.items():
        file_ok(name)
        if name in files:
            raise _Bad(f"extra file {name!r} is also a data file")
        rec = _dict(rec, f"extra file {name!r}")
        _int(rec.get("size"), f"size of extra file {name!r}")
        _hex(rec.get("xxh3_128"), f"checksum of extra file {name!r}", 32)
    for name, rec in _dict(man.get("written", {}), "'written'").items():
        if not is_written_name(name):
            raise _Bad(f"written file name {name!r:.200} is not a relative path of plain names")
        if name in files or name in extra:
            raise _Bad(f"written file {name!r} is also a data or extra file")
        rec = _dict(rec, f"written file {name!r}")
        _int(rec.get("size"), f"size of written file {name!r}")
        _hex(rec.get("xxh3_128"), f"checksum of written file {name!r}", 32)
    for r in _list(man.get("rank_trees", []), "'rank_trees'"):
        _int(r, "a rank in 'rank_trees'", 1, world - 1)
    sizes, counts, mesh_shapes = [], [], []  # each mesh's dims, ranks and shape
    for i, mesh in enumerate(meshes):
        what = f"mesh {i}"
        mesh = _dict(mesh, what)
        shape = _list(mesh.get("shape"), f"shape of {what}")
        if not shape or len(shape) > MAX_DIMS:
            raise _Bad(f"{what} has {len(shape)} dimensions")
        for d in shape:
            _int(d, f"a dimension of {what}", 1, MAX_WORLD)
        n = math.prod(shape)
        if n > world:
            raise _Bad(f"{what} has {n} ranks, the save had {world}")
        if "ranks" in mesh:
            ranks = _list(mesh["ranks"], f"ranks of {what}")
            if len(ranks) != n or len(set(ranks)) != n:
                raise _Bad(f"{what} does not list {n} distinct ranks")
            for r in ranks:
                _int(r, f"a rank of {what}", 0, world - 1)
        else:
            _int(mesh.get("start"), f"first rank of {what}", 0, world - n)
        sizes.append(len(shape))
        counts.append(n)
        mesh_shapes.append(shape)
    for key, rec in tensors.items():
        what = f"tensor {key!r:.200}"
        rec = _dict(rec, what)
        if "alias_of" in rec:
            _check_alias(key, rec, tensors)
            continue
        _, shape, scope = _tensor_head(what, rec, dtype_size)
        if "chunks" in rec:
            raise _Bad(f"{what} lists chunks in a format-3 manifest")
        ways = [w for w in ("pieces", "sharding", "boxes") if w in rec]
        if scope == "per_rank":
            if ways:
                raise _Bad(f"{what} is per-rank but has {ways[0]}")
        elif scope == "replicated":
            if ways != ["pieces"]:
                raise _Bad(f"{what} is replicated but has no pieces")
            _check_pieces(what, shape, rec["pieces"], slots)
        elif ways == ["sharding"]:
            sh = _dict(rec["sharding"], f"sharding of {what}")
            m = _int(sh.get("mesh"), f"mesh of {what}", 0, len(meshes) - 1)
            dims = _list(sh.get("dims"), f"dims of {what}")
            if len(dims) != sizes[m]:
                raise _Bad(f"{what} has {len(dims)} placements on a {sizes[m]}-d mesh")
            strided = 1
            for i, d in enumerate(dims):
                if not (d == ["R"] or (isinstance(d, list) and len(d) == 2 and d[0] == "S"
                                       and type(d[1]) is int and 0 <= d[1] < len(shape))
                        or (isinstance(d, list) and len(d) == 3 and d[0] == "SS" and type(d[1]) is int
                            and 0 <= d[1] < len(shape) and type(d[2]) is int and 1 <= d[2] <= counts[m])):
                    raise _Bad(f"{what} has an unknown placement {d!r:.40}")
                if d[0] == "SS":
                    strided *= d[2]
                    # FSDP2's split factor: the ranks of the later mesh dims sharding this tensor dim
                    later = math.prod(mesh_shapes[m][j] for j in range(i + 1, len(dims))
                                      if isinstance(dims[j], list) and len(dims[j]) >= 2 and dims[j][0] in ("S", "SS")
                                      and dims[j][1] == d[1])
                    if d[2] != later:
                        raise _Bad(f"{what} has a strided placement {d!r:.40} whose split factor is not the "
                                   f"{later} ranks of the later mesh dims sharding that tensor dim")
            if strided > counts[m]:  # a rank's region is at most this many runs per dim
                raise _Bad(f"{what} has strided placements splitting by {strided}, more than its mesh's ranks")
        elif ways == ["boxes"]:
            boxes = []
            for i, b in enumerate(_list(rec["boxes"], f"boxes of {what}")):
                bwhat = f"box {i} of {what}"
                b = _list(b, bwhat)
                if len(b) != 3:
                    raise _Bad(f"{bwhat} is not [rank, offsets, sizes]")
                _int(b[0], f"rank of {bwhat}", 0, world - 1)
                boxes.append(_check_box(bwhat, shape, b[1], b[2]))
            _check_tiling(what, shape, boxes)
        else:
            raise _Bad(f"{what} is sharded but has neither a sharding nor boxes")
    _check_objects(objects, tensors, world)


def _check_box(what: str, shape: list[int], offsets: Any, sizes: Any) -> tuple[list[int], list[int]]:
    """A box's offsets and sizes: lists of one non-negative int per dimension, inside ``shape``."""
    offsets, sizes = _list(offsets, f"offsets of {what}"), _list(sizes, f"sizes of {what}")
    if len(offsets) != len(shape) or len(sizes) != len(shape):
        raise _Bad(f"{what} has {len(offsets)}/{len(sizes)} offsets/sizes for a {len(shape)}-d tensor")
    for d, (o, n) in enumerate(zip(offsets, sizes, strict=True)):
        _int(o, f"offset {d} of {what}")
        _int(n, f"size {d} of {what}")
        if o + n > shape[d]:
            raise _Bad(f"{what} reaches {o + n} along dim {d}, past the tensor's {shape[d]}")
    return offsets, sizes


def _check_pieces(what: str, shape: list[int], pieces: Any, world: int) -> None:
    """A replicated tensor's pieces ([rank, first row, rows]) cover its rows exactly once."""
    rows = shape[0] if shape else 1
    spans = []
    for i, p in enumerate(_list(pieces, f"pieces of {what}")):
        p = _list(p, f"piece {i} of {what}")
        if len(p) != 3:
            raise _Bad(f"piece {i} of {what} is not [rank, first row, rows]")
        _int(p[0], f"rank of piece {i} of {what}", 0, world - 1)
        spans.append((_int(p[1], f"first row of piece {i} of {what}"), _int(p[2], f"rows of piece {i} of {what}")))
    spans.sort()
    pos = 0
    for start, n in spans:
        if start != pos or (n == 0 and rows != 0):
            raise _Bad(f"{what}: its pieces do not cover rows {pos}.. exactly once")
        pos += n
    if pos != rows or (rows == 0 and len(spans) != 1) or not spans:
        raise _Bad(f"{what}: its pieces cover {pos} of its {rows} rows")


def _check_alias(key: str, rec: dict[str, Any], tensors: dict[str, Any]) -> None:
    """A tensor stored once under another key (tied weights): same dtype, shape and scope."""
    what = f"tensor {key!r:.200}"
    target = rec["alias_of"]
    if not isinstance(target, str) or target == key or target not in tensors:
        raise _Bad(f"{what} is an alias of {target!r:.200}, which the manifest does not describe")
    other = _dict(tensors[target], f"tensor {target!r:.200}")
    if "alias_of" in other:
        raise _Bad(f"{what} is an alias of {target!r:.200}, itself an alias")
    for d in _list(rec.get("shape"), f"shape of {what}"):
        _int(d, f"a dimension of {what}")
    for field in ("dtype", "shape", "scope"):
        if rec.get(field) != other.get(field):
            raise _Bad(f"{what} is an alias of {target!r:.200} but its {field} differs")
    if rec.get("chunks", []) != []:
        raise _Bad(f"{what} is an alias but has chunks of its own")


def _single_ref(obj: Any) -> str | None:
    """The tensor key of an object that is nothing but one tensor reference and a known kind
    (a flat state of tensors: thousands of them), else None (then the full checks run)."""
    if type(obj) is not dict or "rank_trees" in obj or obj.get("kind") not in KINDS:
        return None
    tree = obj.get("tree")
    if type(tree) is not dict or len(tree) != 1:
        return None
    ref = tree.get("@tensor")
    return ref if type(ref) is str and ref else None


def _tensor_ok(key: str, rec: dict[str, Any], files: dict[str, Any], world: int, dtype_size: Any) -> bool:
    """True if :func:`_check_tensor` accepts ``rec``, found without building a message per field
    (4,000 tensors took ~40 ms that way). False means "not shown here": _check_tensor then runs
    and names what is wrong, if anything. Any error raised here is the one _check_tensor raises
    at the same point (the dtype first, the tiling last), so messages are the same either way."""
    size = dtype_size(rec.get("dtype"))
    shape, scope, chunks = rec.get("shape"), rec.get("scope"), rec.get("chunks")
    if type(shape) is not list or len(shape) > MAX_DIMS or scope not in SCOPES or type(chunks) is not list:
        return False
    for d in shape:
        if type(d) is not int or d < 0:
            return False
    per_rank = scope == "per_rank"
    boxes = []
    for ch in chunks:
        if type(ch) is not dict:
            return False
        fname, start, end = ch.get("file"), ch.get("start"), ch.get("end")
        offsets, sizes = ch.get("offsets"), ch.get("sizes")
        if (type(fname) is not str or fname not in files or type(start) is not int or type(end) is not int
                or not 0 <= start <= end <= files[fname]["size"] or type(offsets) is not list
                or type(sizes) is not list or len(offsets) != len(shape) or len(sizes) != len(shape)):
            return False
        volume = 1
        for o, n, d in zip(offsets, sizes, shape, strict=True):
            if type(o) is not int or type(n) is not int or o < 0 or n < 0 or o + n > d:
                return False
            volume *= n
        if end - start != volume * size:
            return False
        if "xxh3_64" in ch or end > start:
            digest = ch.get("xxh3_64")
            if type(digest) is not str or len(digest) != 16 or not _HEX.match(digest):
                return False
        if per_rank:
            rank = ch.get("rank")
            if type(rank) is not int or not 0 <= rank < world or any(offsets) or sizes != shape:
                return False
        elif "rank" in ch:
            return False
        boxes.append((offsets, sizes))
    if per_rank:
        return sorted(ch["rank"] for ch in chunks) == list(range(world))
    if len(boxes) == 1:  # one box inside the tensor tiles it iff it holds as many elements
        return math.prod(boxes[0][1]) == math.prod(shape)
    _check_tiling(f"tensor {key!r:.200}", shape, boxes)
    return True


def _tensor_head(what: str, rec: dict[str, Any], dtype_size: Any) -> tuple[int, list[Any], Any]:
    """A tensor record's dtype (its element size), shape and scope, checked: the same fields
    in formats 2 and 3."""
    size = dtype_size(rec.get("dtype"))
    shape = _list(rec.get("shape"), f"shape of {what}")
    if len(shape) > MAX_DIMS:
        raise _Bad(f"{what} has {len(shape)} dimensions (at most {MAX_DIMS})")
    for d in shape:
        _int(d, f"a dimension of {what}")
    scope = rec.get("scope")
    if scope not in SCOPES:
        raise _Bad(f"{what} has unknown scope {scope!r:.40}")
    return size, shape, scope


def _check_tensor(key: str, rec: dict[str, Any], files: dict[str, Any], world: int, dtype_size: Any) -> None:
    what = f"tensor {key!r:.200}"
    size, shape, scope = _tensor_head(what, rec, dtype_size)
    chunks = _list(rec.get("chunks"), f"chunks of {what}")
    boxes = []
    for i, ch in enumerate(chunks):
        cwhat = f"chunk {i} of {what}"
        ch = _dict(ch, cwhat)
        fname = ch.get("file")
        if not isinstance(fname, str) or fname not in files:
            raise _Bad(f"{cwhat} points at unknown file {fname!r:.80}")
        start = _int(ch.get("start"), f"start of {cwhat}")
        end = _int(ch.get("end"), f"end of {cwhat}", start, files[fname]["size"])
        offsets, sizes = _check_box(cwhat, shape, ch.get("offsets"), ch.get("sizes"))
        if end - start != math.prod(sizes) * size:
            raise _Bad(f"{cwhat} has {end - start} bytes but its box holds {math.prod(sizes) * size}")
        if "xxh3_64" in ch or end > start:
            _hex(ch.get("xxh3_64"), f"checksum of {cwhat}", 16)
        if scope == "per_rank":
            _int(ch.get("rank"), f"rank of {cwhat}", 0, world - 1)
            if any(offsets) or sizes != shape:
                raise _Bad(f"{cwhat} is a per-rank copy but does not span the whole tensor")
        elif "rank" in ch:
            raise _Bad(f"{cwhat} has a rank but {what} is not per-rank")
        boxes.append((offsets, sizes))
    if scope == "per_rank":
        ranks = sorted(ch["rank"] for ch in chunks)
        if ranks != list(range(world)):
            raise _Bad(f"{what} is per-rank but has copies for ranks {ranks[:16]} of a {world}-rank save")
    else:
        _check_tiling(what, shape, boxes)


TILING_BUDGET = 1 << 22  # corner records the tiling check may count (chunks x 2^split dims)


def _check_tiling(what: str, shape: list[int], boxes: list[tuple[list[int], list[int]]]) -> None:
    """The boxes cover the tensor exactly: each element once, no gap, no overlap.

    O(k) for k boxes (was pairwise over boxes sharing a first offset: 6,000 boxes took 67 s).
    A box's indicator function is the n-dimensional prefix sum of its signed corners (+1 or -1
    at each of its 2^n corners by the parity of its upper coordinates); so the boxes' indicators
    add up to the tensor's exactly iff their signed corners add up to the tensor's own, which is
    checked by counting corners in a dict. Only the dims that some box splits count (a dim
    every box spans whole drops out of the sum), so a box costs 2^(split dims) corners: 2-4
    for FSDP2 and tensor parallel layouts; a manifest needing more than TILING_BUDGET is
    refused rather than checked for minutes."""
    total = math.prod(shape)
    volume = sum(math.prod(s) for _, s in boxes)
    if volume != total:
        raise _Bad(f"{what}: its chunks hold {volume} elements, the tensor has {total}")
    if not shape:
        if len([b for b in boxes if math.prod(b[1])]) > 1:
            raise _Bad(f"{what}: a scalar stored more than once")
        return
    solid = [b for b in boxes if math.prod(b[1])]
    split = [d for d in range(len(shape)) if any(o[d] or n[d] != shape[d] for o, n in solid)]
    if not split:  # every box is the whole tensor: volumes add up only if there is one
        return
    if len(split) > 20 or len(solid) << len(split) > TILING_BUDGET:
        raise _Bad(f"{what}: {len(solid)} chunks splitting {len(split)} dims, more than a "
                   f"checkpoint's tiling check counts ({TILING_BUDGET} corners)")
    corners: dict[tuple[int, ...], int] = {}
    get = corners.get
    masks = range(1 << len(split))
    for off, size in solid:
        lo = [off[d] for d in split]
        hi = [off[d] + size[d] for d in split]
        for mask in masks:
            point = tuple(hi[i] if mask >> i & 1 else lo[i] for i in range(len(split)))
            sign = -1 if bin(mask).count("1") & 1 else 1
            corners[point] = get(point, 0) + sign
    # The tensor's own corners: +-1 at [0, shape) along the split dims, 0 everywhere else.
    ends = [shape[d] for d in split]
    for mask in masks:
        point = tuple(ends[i] if mask >> i & 1 else 0 for i in range(len(split)))
        corners[point] = get(point, 0) - (-1 if bin(mask).count("1") & 1 else 1)
    bad = next((p for p, n in corners.items() if n), None)
    if bad is not None:
        at = [0] * len(shape)
        for i, d in enumerate(split):
            at[d] = bad[i]
        raise _Bad(f"{what}: its chunks overlap or leave a gap (around offsets {at[:8]})")


def _tree_refs(tree: Any, what: str, depth: int) -> Iterator[str]:
    """Tensor keys a tree refers to; raises _Bad for a malformed node."""
    if depth > MAX_DEPTH:
        raise _Bad(f"{what} is nested more than {MAX_DEPTH} levels deep")
    if isinstance(tree, list):
        for v in tree:
            yield from _tree_refs(v, what, depth + 1)
    elif isinstance(tree, dict):
        tags = [k for k in tree if k.startswith("@")]
        if not tags:
            for v in tree.values():
                yield from _tree_refs(v, what, depth + 1)
            return
        if len(tree) != 1 or tags[0] not in TAGS:
            raise _Bad(f"{what} has a malformed tagged node with keys {sorted(tree)[:4]!r:.80}")
        tag, body = tags[0], tree[tags[0]]
        if tag == "@tensor":
            if not isinstance(body, str) or not body:
                raise _Bad(f"{what} has a tensor reference that is not a key: {body!r:.80}")
            yield body
        elif tag == "@tuple":
            yield from _tree_refs(_list(body, f"a tuple in {what}"), what, depth + 1)
        elif tag == "@dict":
            seen = set()
            for pair in _list(body, f"a dict in {what}"):
                if not isinstance(pair, list) or len(pair) != 2:
                    raise _Bad(f"{what} has a dict item that is not a [key, value] pair")
                k = pair[0]
                if not (k is None or isinstance(k, (str, int, float, bool))):
                    raise _Bad(f"{what} has a dict key of type {type(k).__name__}")
                if (type(k), k) in seen:
                    raise _Bad(f"{what} has the dict key {k!r:.80} twice")
                seen.add((type(k), k))
                yield from _tree_refs(pair[1], what, depth + 1)
        elif not isinstance(body, str) or (body not in _FLOAT_WORDS and not _is_float(body)):
            raise _Bad(f"{what} has a malformed float {body!r:.80}")
    elif not (tree is None or isinstance(tree, (bool, int, float, str))):
        raise _Bad(f"{what} holds a value of type {type(tree).__name__}")


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return len(text) < 64
