"""Where the chunks of a sharded tensor are, from a description of O(1) size.

A DTensor whose placements are ``Shard(d)`` and ``Replicate()`` on a device mesh (FSDP2, HSDP,
tensor parallel) is cut by a rule: along each mesh dimension that shards tensor dim ``d``, the
current extent is split like ``torch.chunk`` (ceil-sized pieces, the last ones short or empty).
So the manifest stores the mesh once and, per tensor, its placements; every rank's box follows
from the rank's mesh coordinate. Of the ranks holding the same box (the replicas along
``Replicate`` mesh dims) one writes it: the replica whose index over those dims is
``crc32(key) % replicas``, so writes spread over replicas and every reader computes the same
writer.

``_StridedShard(d, split_factor=f)`` (FSDP2 over tensor parallelism) is ``["SS", d, f]``: the
tensor is cut by the placements after it on ``d`` first (the TP mesh dims, ``f`` ways in all),
and then this rank's piece of that is cut by the SS mesh dim, as FSDP2 does: ``torch.chunk`` of
the TP shard. (torch's ``torch.distributed.tensor._utils._compute_local_shape_and_global_offset`` cuts ``f`` chunks first instead;
the two agree only when the shards are even.) So every rank's region is a box, also for uneven
shapes; an ``f`` other than the product of the later mesh sizes is not described.

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
    if _strided(out):
        try:  # a split factor other than FSDP2's is not the rule's: per-rank boxes
            _cut_order(out, list(t.device_mesh.shape))
        except CorruptCheckpoint:
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


def _cut_order(dims: Sequence[Sequence[Any]], mesh_shape: Sequence[int]) -> list[int]:
    """The sharding mesh dims in the order they cut the tensor, tensor dim by tensor dim.

    Along one tensor dim the placements cut in mesh order, except that ``["SS", d, f]`` cuts
    after all the placements after it on ``d``: FSDP2 chunks the shard tensor parallelism
    left, ``torch.chunk`` of ``torch.chunk``. ``f`` must be the product of those placements'
    mesh sizes, as FSDP2 sets it; any other ``f`` is not described (CorruptCheckpoint)."""
    order: list[int] = []
    for dim in sorted({d[1] for d in dims if d[0] != "R"}):
        on = [i for i, d in enumerate(dims) if d[0] != "R" and d[1] == dim]
        for k, i in enumerate(on):
            later = math.prod(mesh_shape[j] for j in on[k + 1:])
            if dims[i][0] == "SS" and dims[i][2] != later:
                raise CorruptCheckpoint(f"the placement {list(dims[i])} is followed by shards of dim {dim} "
                                        f"splitting it {later} ways, not {dims[i][2]}")
        order += _in_cut_order(dims, on)
    return order


def _in_cut_order(dims: Sequence[Sequence[Any]], on: list[int]) -> list[int]:
    """The placements ``on`` (one tensor dim's, in mesh order) in cut order: an ``S`` cuts
    before the ones after it, an ``SS`` after them."""
    if not on:
        return []
    rest = _in_cut_order(dims, on[1:])
    return [on[0], *rest] if dims[on[0]][0] == "S" else [*rest, on[0]]


def region_at(shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int],
              dims: Sequence[Sequence[Any]]) -> list[Runs]:
    """The indices, per tensor dim, the rule gives the rank at ``coord`` (one run, or none)."""
    offsets, sizes = box_at(shape, mesh_shape, coord, dims)
    return [[(o, n)] if n else [] for o, n in zip(offsets, sizes, strict=True)]


def box_at(shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int], dims: Sequence[Sequence[Any]]) -> Box:
    """The box the rule gives the rank at mesh coordinate ``coord``: each sharding mesh dim, in
    cut order (mesh order without ``SS``), takes its piece of the extent left so far."""
    order = _cut_order(dims, mesh_shape) if _strided(dims) else [i for i, d in enumerate(dims) if d[0] != "R"]
    offsets, sizes = [0] * len(shape), list(shape)
    for i in order:
        dim = dims[i][1]
        start, length = _piece(sizes[dim], mesh_shape[i], coord[i])
        offsets[dim] += start
        sizes[dim] = length
    return offsets, sizes


def strided_box(shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int],
                dims: Sequence[Sequence[Any]]) -> Box:
    """:func:`box_at` (kept for callers of the name: every region of the rule is a box)."""
    return box_at(shape, mesh_shape, coord, dims)


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
    box = box_at(shape, mesh.shape, coord, dims)
    return None if 0 in box[1] else box


def overlapping(key: str, shape: Sequence[int], mesh: Mesh, dims: Sequence[Sequence[Any]],
                want: Box | None) -> Iterator[tuple[int, Box]]:
    """(writer rank, box) of every stored chunk of ``key`` that overlaps ``want`` (None: all),
    without visiting the others: along each sharding mesh dim (in cut order) only the
    coordinates whose piece meets ``want`` are tried."""
    owner = writer_replica(key, mesh.shape, dims)
    ndim = len(shape)
    lo = list(want[0]) if want is not None else [0] * ndim
    hi = [o + s for o, s in zip(want[0], want[1], strict=True)] if want is not None else list(shape)
    if want is not None and ndim and any(h <= lo_ for lo_, h in zip(lo, hi, strict=True)):
        return
    if _strided(dims):
        order = _cut_order(dims, mesh.shape)
    else:
        order = [i for i, d in enumerate(dims) if d[0] != "R"]
    reps = [i for i, d in enumerate(dims) if d[0] == "R"]
    fixed = dict(zip(reps, owner, strict=True))

    def walk(k: int, at: dict[int, int], offsets: list[int], sizes: list[int]) -> Iterator[tuple[int, Box]]:
        if k == len(order):
            if 0 not in sizes:
                yield mesh.rank_of([at[i] for i in range(len(dims))]), (list(offsets), list(sizes))
            return
        i = order[k]
        dim, parts = dims[i][1], mesh.shape[i]
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
            yield from walk(k + 1, {**at, i: c}, offs, szs)

    yield from walk(0, fixed, [0] * ndim, list(shape))


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
    save of 1,000 tensors) for anything else (the save then stores that box explicitly). A
    ``_StridedShard`` the rule does not describe gets torch's own split's indices, refused
    when they are not one box."""
    mesh = t.device_mesh
    key = (id(mesh), tuple(t.placements), tuple(t.shape))
    hit = _BOXES.get(key)
    if hit is None or hit[0] is not mesh:
        dims = dims_of(t)
        coord = mesh.get_coordinate()
        box: Box | None = None
        if dims is not None and coord is not None:
            box = box_at(list(t.shape), list(mesh.shape), coord, dims)
        elif coord is not None and any(type(p).__name__ == "_StridedShard" for p in t.placements):
            box = _torch_strided_box(t, list(coord))
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


def _torch_strided_box(t: Any, coord: list[int]) -> Box:
    """This rank's box of a DTensor with a ``_StridedShard`` the rule does not describe (a
    split factor FSDP2 does not give): the indices torch's own split puts here (its
    ``_StridedShard`` cuts ``f`` chunks first), refused when they are not one box (torch's
    function would name a box that holds other indices)."""
    import torch
    from torch.distributed.tensor import Replicate

    offsets, sizes = [], []
    for dim, n in enumerate(t.shape):
        idx = torch.arange(int(n)).view([int(n) if k == dim else 1 for k in range(len(t.shape))])
        for i, p in enumerate(t.placements):
            if isinstance(p, Replicate) or getattr(p, "dim", None) != dim:
                continue  # Partial keeps the whole
            pieces, _ = p._split_tensor(idx, t.device_mesh.size(i), with_padding=False)
            idx = pieces[coord[i]] if coord[i] < len(pieces) else idx.narrow(dim, 0, 0)
        got = idx.flatten().tolist()
        if got and got != list(range(got[0], got[0] + len(got))):
            raise CheckpointError(
                f"a DTensor of shape {list(t.shape)} with placements {list(t.placements)} holds, on "
                f"mesh coordinate {coord}, indices that are not one box; safeckpt cannot store or "
                "load it (redistribute it, e.g. to Shard/Replicate placements, first).")
        offsets.append(got[0] if got else int(n))
        sizes.append(len(got))
    return offsets, sizes


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
