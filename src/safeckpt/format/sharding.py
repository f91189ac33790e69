"""Where the chunks of a sharded tensor are, from a description of O(1) size.

A DTensor whose placements are ``Shard(d)`` and ``Replicate()`` on a device mesh (FSDP2, HSDP,
tensor parallel) is cut by a rule: along each mesh dimension that shards tensor dim ``d``, the
current extent is split like ``torch.chunk`` (ceil-sized pieces, the last ones short or empty).
So the manifest stores the mesh once and, per tensor, its placements; every rank's box follows
from the rank's mesh coordinate. Of the ranks holding the same box (the replicas along
``Replicate`` mesh dims) one writes it: the replica whose index over those dims is
``crc32(key) % replicas``, so writes spread over replicas and every reader computes the same
writer.

The save checks, rank by rank, that the rule gives exactly the box the DTensor holds; a tensor
where it does not (``_StridedShard``, ``Partial``, a custom uneven layout) is stored with an
explicit list of boxes instead (see ``_format3``).

Sizes: a mesh record is O(ranks) once per distinct mesh (O(1) when its ranks are a range), a
sharding record O(mesh dims) per tensor; :func:`overlapping` costs O(chunks it returns).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

Box = tuple[list[int], list[int]]  # (global offsets, sizes)


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

    out: list[list[Any]] = []
    for p in t.placements:
        if type(p) is Shard:  # exactly Shard: _StridedShard is a subclass with another rule
            out.append(["S", int(p.dim)])
        elif type(p) is Replicate:
            out.append(["R"])
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


def box_at(shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int], dims: Sequence[Sequence[Any]]) -> Box:
    """The box the rule gives the rank at mesh coordinate ``coord``."""
    offsets, sizes = [0] * len(shape), list(shape)
    for i, d in enumerate(dims):
        if d[0] == "S":
            start, length = _piece(sizes[d[1]], mesh_shape[i], coord[i])
            offsets[d[1]] += start
            sizes[d[1]] = length
    return offsets, sizes


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
    without visiting the others: along each sharding mesh dim only the coordinates whose piece
    meets ``want`` are tried."""
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
