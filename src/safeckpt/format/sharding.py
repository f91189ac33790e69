"""Where the chunks of a sharded tensor are, from a description of O(1) size.

A DTensor whose placements are ``Shard(d)`` and ``Replicate()`` on a device mesh (FSDP2, HSDP,
tensor parallel) is cut by a rule: along each mesh dimension that shards tensor dim ``d``, the
current extent is split like ``torch.chunk`` (ceil-sized pieces, the last ones short or empty).
So the manifest stores the mesh once and, per tensor, its placements; every rank's box follows
from the rank's mesh coordinate. Of the ranks holding the same box (the replicas along
``Replicate`` mesh dims) one writes it: the replica whose index over those dims is
``crc32(key) % replicas``, so writes spread over replicas and every reader computes the same
writer.

``_StridedShard(d, split_factor=f)`` (FSDP2 over tensor parallelism: the weight is cut by the
TP mesh dim first, then by the FSDP dim) is ``["SS", d, f]``: the current extent is cut into
``f`` chunks, each chunk into the mesh dim's pieces, and a rank takes its piece of every chunk;
the placements after it then cut that list. A rank's region is tracked as runs of indices per
tensor dim (at most the split factors' product of them), and is a box when each dim has one
run: for every layout FSDP2 and TP produce. A region that is not a box is refused.

The save checks, rank by rank, that the rule gives exactly the box the DTensor holds; a tensor
where it does not (``Partial``, a custom uneven layout) is stored with an explicit list of boxes
instead (see ``v3``).

Sizes: a mesh record is O(ranks) once per distinct mesh (O(1) when its ranks are a range), a
sharding record O(mesh dims) per tensor; :func:`overlapping` costs O(chunks it returns).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

from ..errors import CheckpointError, CorruptCheckpoint
from .tree import is_dtensor, local_of

Box = tuple[list[int], list[int]]  # (global offsets, sizes)
Runs = list[tuple[int, int]]  # (first index, length), ascending and disjoint


def mesh_record(t: Any) -> dict[str, Any]:
    """The manifest record of a DTensor's device mesh: shape and global ranks (as a start when
    they are consecutive)."""
    mesh = t.device_mesh
    ranks = [int(r) for r in mesh.mesh.flatten().tolist()]
    rec: dict[str, Any] = {"shape": [int(s) for s in mesh.mesh.shape]}
    if ranks == list(range(ranks[0], ranks[0] + len(ranks))):
        rec["start"] = ranks[0]
    else:
        rec["ranks"] = ranks
    return rec


def dims_of(t: Any) -> list[list[Any]] | None:
    """The placements of a DTensor as ``[["S", d] | ["R"], ...]``, or None when a placement is
    not one the rule describes."""
    from torch.distributed.tensor import Replicate, Shard

    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:  # pragma: no cover - older torch
        _StridedShard = None  # noqa: N806
    out: list[list[Any]] = []
    for p in t.placements:
        if type(p) is Shard:  # exactly Shard (in older torch _StridedShard is a subclass)
            out.append(["S", int(p.dim)])
        elif type(p) is Replicate:
            out.append(["R"])
        elif _StridedShard is not None and type(p) is _StridedShard:
            out.append(["SS", int(p.dim), int(p.split_factor)])
        else:
            return None
    return out


class Mesh:
    """A mesh record, with rank <-> coordinate lookups."""

    def __init__(self, rec: dict[str, Any]) -> None:
        self.shape: list[int] = list(rec["shape"])
        self.size = math.prod(self.shape)
        self.start: int | None = rec.get("start")
        self.ranks: list[int] | None = rec.get("ranks")
        self._pos = {r: i for i, r in enumerate(self.ranks)} if self.ranks is not None else None

    def rank_at(self, pos: int) -> int:
        return self.start + pos if self.ranks is None else self.ranks[pos]  # type: ignore[operator]

    def coord_of(self, rank: int) -> list[int] | None:
        """``rank``'s mesh coordinate, or None if it is not in the mesh."""
        if self._pos is None:
            pos = rank - self.start  # type: ignore[operator]
            if not 0 <= pos < self.size:
                return None
        else:
            found = self._pos.get(rank)
            if found is None:
                return None
            pos = found
        coord = []
        for n in reversed(self.shape):
            coord.append(pos % n)
            pos //= n
        return coord[::-1]

    def rank_of(self, coord: Sequence[int]) -> int:
        pos = 0
        for c, n in zip(coord, self.shape, strict=True):
            pos = pos * n + c
        return self.rank_at(pos)


def _piece(extent: int, parts: int, i: int) -> tuple[int, int]:
    """(start, length) of piece ``i`` of ``extent`` split in ``parts`` like torch.chunk."""
    size = -(-extent // parts) if extent else 0
    start = min(i * size, extent)
    return start, min(start + size, extent) - start


def _strided(dims: Sequence[Sequence[Any]]) -> bool:
    return any(d[0] == "SS" for d in dims)


def _take(runs: Runs, pos: int, n: int) -> Runs:
    """The runs of the positions [pos, pos + n) of the index list ``runs``."""
    out = []
    for s, ln in runs:
        if n <= 0:
            break
        if pos >= ln:
            pos -= ln
            continue
        k = min(ln - pos, n)
        out.append((s + pos, k))
        n -= k
        pos = 0
    return out


def _merged(runs: Runs) -> Runs:
    out: Runs = []
    for s, ln in runs:
        if ln and out and out[-1][0] + out[-1][1] == s:
            out[-1] = (out[-1][0], out[-1][1] + ln)
        elif ln:
            out.append((s, ln))
    return out


def _cut(runs: Runs, d: Sequence[Any], parts: int, c: int) -> Runs:
    """The index list ``runs`` cut by placement ``d`` (``S`` or ``SS``) over ``parts``: piece ``c``."""
    total = sum(ln for _, ln in runs)
    if d[0] == "S":
        return _take(runs, *_piece(total, parts, c))
    out: Runs = []
    for k in range(d[2]):
        ks, kl = _piece(total, d[2], k)
        s, ln = _piece(kl, parts, c)
        out += _take(runs, ks + s, ln)
    return _merged(out)


def region_at(shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int],
              dims: Sequence[Sequence[Any]]) -> list[Runs]:
    """The indices, per tensor dim, the rule gives the rank at ``coord`` (as runs)."""
    runs: list[Runs] = [[(0, n)] if n else [] for n in shape]
    for i, d in enumerate(dims):
        if d[0] != "R":
            runs[d[1]] = _cut(runs[d[1]], d, mesh_shape[i], coord[i])
    return runs


def _box_of(runs: list[Runs], shape: Sequence[int]) -> Box | None:
    """The box a region is, or None when some dim has indices that are not one run."""
    offsets, sizes = [], []
    for dim, r in enumerate(runs):
        if len(r) > 1:
            return None
        offsets.append(r[0][0] if r else shape[dim])
        sizes.append(r[0][1] if r else 0)
    return offsets, sizes


def box_at(shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int], dims: Sequence[Sequence[Any]]) -> Box:
    """The box the rule gives the rank at mesh coordinate ``coord``. (With ``SS`` placements a
    region that is not a box gives its first indices and its sizes, as torch's own function
    does; :func:`strided_box` tells them apart.)"""
    if _strided(dims):
        runs = region_at(shape, mesh_shape, coord, dims)
        box = _box_of(runs, shape)
        if box is None:
            return [r[0][0] if r else n for r, n in zip(runs, shape, strict=True)], [sum(x[1] for x in r) for r in runs]
        return box
    offsets, sizes = [0] * len(shape), list(shape)
    for i, d in enumerate(dims):
        if d[0] == "S":
            start, length = _piece(sizes[d[1]], mesh_shape[i], coord[i])
            offsets[d[1]] += start
            sizes[d[1]] = length
    return offsets, sizes


def strided_box(shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int],
                dims: Sequence[Sequence[Any]]) -> Box | None:
    """:func:`box_at`, or None where the rule's region is not a box."""
    if not _strided(dims):
        return box_at(shape, mesh_shape, coord, dims)
    return _box_of(region_at(shape, mesh_shape, coord, dims), shape)


def writer_replica(key: str, mesh_shape: Sequence[int], dims: Sequence[Sequence[Any]]) -> list[int]:
    """The coordinate along each Replicate mesh dim (in order) of the replica that writes ``key``."""
    rep = [mesh_shape[i] for i, d in enumerate(dims) if d[0] == "R"]
    if not rep:
        return []
    index = zlib.crc32(key.encode()) % max(1, math.prod(rep))
    out = []
    for n in reversed(rep):
        out.append(index % n)
        index //= n
    return out[::-1]


def writes(key: str, shape: Sequence[int], mesh: Mesh, dims: Sequence[Sequence[Any]], rank: int) -> Box | None:
    """The box ``rank`` writes of ``key``, or None (not in the mesh, another replica writes it,
    or its box is empty)."""
    coord = mesh.coord_of(rank)
    if coord is None:
        return None
    owner = iter(writer_replica(key, mesh.shape, dims))
    for i, d in enumerate(dims):
        if d[0] == "R" and coord[i] != next(owner):
            return None
    box = strided_box(shape, mesh.shape, coord, dims)
    if box is None:
        raise CorruptCheckpoint(f"the placements {dims} of {key!r:.200} give rank {rank} indices that "
                                "are not a box")
    return None if 0 in box[1] else box


def overlapping(key: str, shape: Sequence[int], mesh: Mesh, dims: Sequence[Sequence[Any]],
                want: Box | None) -> Iterator[tuple[int, Box]]:
    """(writer rank, box) of every stored chunk of ``key`` that overlaps ``want`` (None: all),
    without visiting the others: along each sharding mesh dim only the coordinates whose piece
    meets ``want`` are tried."""
    if _strided(dims):
        yield from _overlapping_strided(key, shape, mesh, dims, want)
        return
    owner = writer_replica(key, mesh.shape, dims)
    ndim = len(shape)
    lo = list(want[0]) if want is not None else [0] * ndim
    hi = [o + s for o, s in zip(want[0], want[1], strict=True)] if want is not None else list(shape)
    if want is not None and ndim and any(h <= lo_ for lo_, h in zip(lo, hi, strict=True)):
        return

    def walk(i: int, coord: list[int], offsets: list[int], sizes: list[int], rep: int) -> Iterator[tuple[int, Box]]:
        if i == len(dims):
            if 0 not in sizes:
                yield mesh.rank_of(coord), (list(offsets), list(sizes))
            return
        d = dims[i]
        if d[0] == "R":
            yield from walk(i + 1, [*coord, owner[rep]], offsets, sizes, rep + 1)
            return
        dim, parts = d[1], mesh.shape[i]
        extent = sizes[dim]
        piece = -(-extent // parts) if extent else 0
        first, last = 0, parts - 1
        if piece:  # only the pieces that meet [lo, hi) along this tensor dim
            first = max(0, (lo[dim] - offsets[dim]) // piece)
            last = min(parts - 1, (hi[dim] - 1 - offsets[dim]) // piece)
        for c in range(first, last + 1):
            start, length = _piece(extent, parts, c)
            if length == 0:
                continue
            o = offsets[dim] + start
            if o >= hi[dim] or o + length <= lo[dim]:
                continue
            offs, szs = list(offsets), list(sizes)
            offs[dim], szs[dim] = o, length
            yield from walk(i + 1, [*coord, c], offs, szs, rep)

    yield from walk(0, [], [0] * ndim, list(shape), 0)


def _positions(runs: Runs, lo: int, hi: int) -> tuple[int, int]:
    """The positions [first, end) in the index list ``runs`` of the indices in [lo, hi) (the
    list is ascending, so they are consecutive); (0, 0) if none."""
    first, end, pos = -1, 0, 0
    for s, ln in runs:
        a, b = max(s, lo), min(s + ln, hi)
        if a < b:
            if first < 0:
                first = pos + a - s
            end = pos + b - s
        pos += ln
    return (first, end) if first >= 0 else (0, 0)


def _candidates(runs: Runs, d: Sequence[Any], parts: int, lo: int, hi: int) -> list[int]:
    """The coordinates along a sharding mesh dim whose piece may hold indices in [lo, hi)."""
    p0, p1 = _positions(runs, lo, hi)
    if p0 >= p1:
        return []
    total = sum(ln for _, ln in runs)
    chunks = [(0, total)] if d[0] == "S" else [_piece(total, d[2], k) for k in range(d[2])]
    out: set[int] = set()
    for ks, kl in chunks:
        a, b = max(p0, ks) - ks, min(p1, ks + kl) - ks
        piece = -(-kl // parts) if kl else 0
        if a < b and piece:
            out.update(range(a // piece, min(parts - 1, (b - 1) // piece) + 1))
    return sorted(out)


def _overlapping_strided(key: str, shape: Sequence[int], mesh: Mesh, dims: Sequence[Sequence[Any]],
                         want: Box | None) -> Iterator[tuple[int, Box]]:
    """:func:`overlapping` for placements with ``SS``: the same walk over the mesh dims, each
    tensor dim's indices kept as runs; along each sharding mesh dim only the coordinates whose
    piece (of any chunk) meets ``want`` are tried."""
    owner = writer_replica(key, mesh.shape, dims)
    ndim = len(shape)
    lo = list(want[0]) if want is not None else [0] * ndim
    hi = [o + n for o, n in zip(want[0], want[1], strict=True)] if want is not None else list(shape)
    if ndim and any(h <= lo_ for lo_, h in zip(lo, hi, strict=True)):
        return

    def walk(i: int, coord: list[int], runs: list[Runs], rep: int) -> Iterator[tuple[int, Box]]:
        if i == len(dims):
            box = _box_of(runs, shape)
            if box is None:
                raise CorruptCheckpoint(f"the placements {dims} of {key!r:.200} give the rank at {coord} "
                                        "indices that are not a box")
            if 0 not in box[1]:
                yield mesh.rank_of(coord), box
            return
        d = dims[i]
        if d[0] == "R":
            yield from walk(i + 1, [*coord, owner[rep]], runs, rep + 1)
            return
        dim = d[1]
        for c in _candidates(runs[dim], d, mesh.shape[i], lo[dim], hi[dim]):
            cut = _cut(runs[dim], d, mesh.shape[i], c)
            if _positions(cut, lo[dim], hi[dim])[1] == 0:
                continue
            yield from walk(i + 1, [*coord, c], [*runs[:dim], cut, *runs[dim + 1:]], rep)

    yield from walk(0, [], [[(0, n)] if n else [] for n in shape], 0)


# ------------------------------------------------------- a DTensor's own box
_BOXES: dict[tuple, tuple[Any, Box | None]] = {}  # (mesh id, placements, shape) -> (mesh, box)


def local_box(t: Any) -> list[list[int]]:
    """[global offsets, local sizes] of this rank's part of ``t`` (the whole of a plain tensor)."""
    if is_dtensor(t):
        return _dtensor_box(t)
    return [[0] * t.dim(), list(t.shape)]


def _dtensor_box(t: Any) -> list[list[int]]:
    """A DTensor's box by the rule above, cached per mesh, placements and shape, and checked
    against its local shard's shape; torch's own function (~0.3 ms a call: most of an FSDP2
    save of 1,000 tensors) for anything else. Placements the rule describes that give this
    rank indices that are not a box (a strided shard alone) are refused: no box holds them."""
    mesh = t.device_mesh
    key = (id(mesh), tuple(t.placements), tuple(t.shape))
    hit = _BOXES.get(key)
    if hit is None or hit[0] is not mesh:
        dims = dims_of(t)
        coord = mesh.get_coordinate()
        box: Box | None = None
        if dims is not None and coord is not None:
            box = strided_box(list(t.shape), list(mesh.shape), coord, dims)
            if box is None:
                raise CheckpointError(
                    f"a DTensor of shape {list(t.shape)} with placements {list(t.placements)} holds, on "
                    f"mesh coordinate {coord}, indices that are not one box; safeckpt cannot store or "
                    "load it (redistribute it, e.g. to Shard/Replicate placements, first).")
        hit = (mesh, box)
        if len(_BOXES) > 4096:
            _BOXES.clear()
        _BOXES[key] = hit
    box = hit[1]
    if box is not None and list(local_of(t).shape) == box[1]:
        return [list(box[0]), list(box[1])]
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return [list(offset), list(shape)]


def placement_of(t: Any) -> dict[str, Any] | None:
    """How a DTensor is laid out (recorded in the manifest for information; reading needs only
    each chunk's box): mesh shape and dim names, and one placement per mesh dim."""
    if not is_dtensor(t):
        return None
    mesh = t.device_mesh
    return {
        "mesh_shape": list(mesh.shape),
        "mesh_dim_names": list(mesh.mesh_dim_names) if mesh.mesh_dim_names else None,
        "placements": [str(p) for p in t.placements],
    }
