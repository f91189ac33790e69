"""Who writes which bytes: a deterministic plan every rank computes identically.

Replicated tensors (the same on every rank, e.g. under DDP) are written once in total. Large
tensors are cut into row ranges so that each rank writes about 1/N of the bytes; pieces are
assigned largest first to the least-loaded rank. The plan depends only on the agreed layout,
so ranks need not exchange it.

Only as many ranks as the bytes need (``ceil(total / target)``, at least MIN_PIECE each) take
part: the small replicated state of a sharded job (FSDP2's optimizer ``step`` scalars) lands in
a few files instead of one per rank, so a rank that loads it opens a few files' indexes, not
thousands (see ``safeckpt.format.v3``).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from ..format.fileindex import IndexBuilder
from ..format.manifest_text import dumps as manifest_dumps
from ..format.sharding import Mesh, dims_of, placement_of, writes
from ..format.tree import Leaf, local_of

MIN_PIECE = 4 << 20


class Piece(NamedTuple):  # a tuple: cheap to create by the thousand
    key: str
    row_start: int  # along dim 0; (0, rows) for the whole tensor
    rows: int
    nbytes: int
    rank: int = -1


def plan_replicated(specs: Sequence[tuple[str, Sequence[int], int]], world_size: int,
                    loads_before: Sequence[int] | None = None) -> list[Piece]:
    """Assign replicated tensors ``(key, shape, element_size)`` to writer ranks.
    ``loads_before``: bytes each rank writes already (its named files), balanced against."""
    sizes = [(key, list(shape), math.prod(shape) * es) for key, shape, es in specs]
    total = sum(n for _, _, n in sizes)
    target = max(math.ceil(total / max(world_size, 1)), MIN_PIECE)
    pieces: list[Piece] = []
    for key, shape, nbytes in sizes:
        rows = shape[0] if shape else 1
        if shape and rows > 1 and nbytes > target:
            row_bytes = nbytes // rows
            per = max(1, target // max(row_bytes, 1))
            for start in range(0, rows, per):
                n = min(per, rows - start)
                pieces.append(Piece(key, start, n, n * row_bytes))
        else:
            pieces.append(Piece(key, 0, rows, nbytes))
    pieces.sort(key=lambda p: (-p.nbytes, p.key, p.row_start))
    writers = max(1, min(world_size, math.ceil(total / target)))
    if loads_before is not None:  # every rank may take some: the named files weigh already
        writers = world_size
    loads = [(loads_before[r] if loads_before is not None else 0, r) for r in range(writers)]
    heapq.heapify(loads)
    out = []
    for p in pieces:
        load, rank = heapq.heappop(loads)
        out.append(Piece(p.key, p.row_start, p.rows, p.nbytes, rank))
        heapq.heappush(loads, (load + p.nbytes, rank))
    return out


class MeshInfo(NamedTuple):
    """A device mesh of this save: its manifest record, that record's JSON (part of the layout
    hash) and the Mesh built once from it (with explicit ranks, building one is O(ranks): not
    something to redo for every tensor)."""

    rec: dict[str, Any]
    json: str
    mesh: Mesh


class NamedPlan(NamedTuple):
    """One named file of a save (see ``engine.request.NamedLayout``): its slot in the
    manifest's ``files`` (past the ranks' own), the rank that writes it, and its chunks."""

    name: str
    slot: int
    writer: int
    specs: list[tuple[str, str, Any]]  # (name in the file, tensor key, None): whole tensors
    index: IndexBuilder


class SavePlan(NamedTuple):
    """One rank's save plan for one layout (cached: the same every save of a training loop)."""

    specs: list[tuple[str, str, Any]]  # (name in the file, tensor key, how: None | "local" | (start, rows))
    index: IndexBuilder  # this rank's file index, chunk text cached per file layout
    tensors_json: str  # the manifest's "tensors" object (the same on every rank)
    meshes: list[Any]  # the manifest's "meshes"
    named: tuple[NamedPlan, ...] = ()  # every named file of the save (each rank writes its own)


def plan_named(named: Mapping[str, Mapping[str, str]], leaves: Mapping[str, Leaf], from_rank0: set[str],
               world: int) -> tuple[list[NamedPlan], list[int]]:
    """Named files (file name -> {name in file: key}) in name order, slots ``world``, ...,
    spread over the ranks largest first (a file holding buffers DDP takes from rank 0 is rank
    0's); and the bytes each rank then writes."""
    loads = [0] * max(world, 1)
    names = sorted(named)
    sizes = {f: sum(math.prod(leaves[k].shape) * leaves[k].itemsize for k in named[f].values()) for f in names}
    writer: dict[str, int] = {}
    for f in sorted(names, key=lambda f: (-sizes[f], f)):
        r = 0 if any(k in from_rank0 for k in named[f].values()) else min(range(len(loads)), key=lambda i: (loads[i], i))
        writer[f] = r
        loads[r] += sizes[f]
    out = []
    for i, f in enumerate(names):
        specs = [(n, k, None) for n, k in sorted(named[f].items())]
        records = {n: (k, [0] * len(leaves[k].shape), list(leaves[k].shape)) for n, k, _ in specs}
        out.append(NamedPlan(f, world + i, writer[f], specs, IndexBuilder(records)))
    return out, loads


_PLANS: list[tuple[tuple, Any]] = []  # (plan key, SavePlan), newest last


def cached_plan(key: tuple, build: Callable[[], SavePlan]) -> tuple[tuple, SavePlan]:
    """The cached (key, plan) whose key equals ``key``, else (``key``, ``build()``), cached. Keys
    hold the layout itself and are compared, not hashed: comparing costs well under the 3 ms a
    digest of 4,000 tensors' layout takes, and the cached key object that is returned makes
    later comparisons (the snapshot pool's) identity checks. The newest 8 plans are kept."""
    for cached_key, plan in reversed(_PLANS):
        if cached_key == key:
            return cached_key, plan
    plan = build()
    _PLANS.append((key, plan))
    del _PLANS[:-8]
    return key, plan


def find_aliases(leaves: Mapping[str, Leaf]) -> dict[str, str]:
    """Tensors that are the same memory (tied weights: one Parameter under two names, or two
    identical views of one storage): each maps to the first such key in sorted order, whose
    bytes alone are written. Views that differ (another offset, shape or stride) are stored as
    separate tensors. Computed from the tensors alone, so every rank finds the same aliases."""
    plain = [leaf.tensor.data_ptr() for leaf in leaves.values() if leaf.scope != "sharded"]
    if len(set(plain)) == len(plain) and len(plain) == len(leaves):
        return {}  # no two tensors start at one address (the common case, checked in C)
    first_at: dict[int, str] = {}  # address -> a key there
    shared: dict[int, list[str]] = {}  # address -> every key there, where there are several
    for k, leaf in leaves.items():
        if 0 in leaf.shape:
            continue
        t = leaf.tensor
        if leaf.scope == "sharded":
            t = local_of(t)
            if not t.numel():
                continue
        ptr = t.data_ptr()
        other = first_at.setdefault(ptr, k)
        if other != k:
            shared.setdefault(ptr, [other]).append(k)
    aliases: dict[str, str] = {}
    for keys in shared.values():  # rare (tied weights): only these keys are sorted and compared
        first: dict[tuple, str] = {}
        for k in sorted(keys):
            leaf = leaves[k]
            t = local_of(leaf.tensor) if leaf.scope == "sharded" else leaf.tensor
            ident = (leaf.scope, t.device, leaf.dtype, tuple(t.shape), t.stride(), tuple(leaf.shape))
            if ident in first:
                aliases[k] = first[ident]
            else:
                first[ident] = k
    return aliases


def build_plan(leaves: Mapping[str, Leaf], aliases: Mapping[str, str], irregular: Mapping[str, list[list[Any]]],
               meshes_of: Mapping[int, MeshInfo], from_rank0: set[str], rank: int, world: int,
               named: Mapping[str, Mapping[str, str]] | None = None) -> SavePlan:
    """This rank's save plan: what its file holds (specs and index) and the manifest's tensor
    records, the same on every rank. ``meshes_of``: id(device mesh) -> its record, this save.
    ``named``: file name -> {name in file: key} of the tensors laid out as named files (whole,
    replicated, not aliases: the caller checked)."""
    specs: list[tuple[str, str, Any]] = []  # (name in file, key, how to take it from the leaf)
    records: dict[str, tuple[str, list[int], list[int]]] = {}  # name -> (key, offsets, sizes)
    table: dict[str, dict[str, Any]] = {}
    meshes: list[Any] = []  # the manifest's "meshes" records
    plan_meshes: list[Mesh] = []  # the same meshes, ready for lookups
    mesh_ids: dict[str, int] = {}

    def add(name: str, key: str, how: Any, offsets: list[int], sizes: list[int]) -> None:
        specs.append((name, key, how))
        records[name] = (key, offsets, sizes)

    for k, leaf in sorted(leaves.items()):
        rec: dict[str, Any] = {"dtype": leaf.dtype, "shape": leaf.shape, "scope": leaf.scope}
        if k in aliases:
            rec["alias_of"] = aliases[k]
        elif leaf.scope == "sharded":
            rec["placement"] = placement_of(leaf.tensor)
            if k in irregular:
                rec["boxes"] = irregular[k]
            else:
                info = meshes_of[id(leaf.tensor.device_mesh)]
                mesh_json = info.json
                if mesh_json not in mesh_ids:
                    mesh_ids[mesh_json] = len(meshes)
                    meshes.append(info.rec)
                    plan_meshes.append(info.mesh)
                rec["sharding"] = {"mesh": mesh_ids[mesh_json], "dims": dims_of(leaf.tensor)}
        elif leaf.scope == "replicated":
            rec["pieces"] = []
        table[k] = rec

    named_plans, loads_before = plan_named(named, leaves, from_rank0, world) if named else ([], None)
    in_named = set()
    for nf in named_plans:
        for _, k, _ in nf.specs:
            table[k]["pieces"] = [[nf.slot, 0, leaves[k].shape[0] if leaves[k].shape else 1]]
            in_named.add(k)
    # Replicated: rank 0 writes the buffers DDP takes from it; the rest is spread by the plan.
    for k in sorted(from_rank0 - in_named):
        leaf = leaves[k]
        table[k]["pieces"] = [[0, 0, leaf.shape[0] if leaf.shape else 1]]
        if rank == 0:
            add(k, k, None, [0] * len(leaf.shape), leaf.shape)
    specs_r = [(k, leaf.shape, leaf.itemsize) for k, leaf in sorted(leaves.items())
               if leaf.scope == "replicated" and k not in aliases and k not in from_rank0 and k not in in_named]
    for piece in plan_replicated(specs_r, world, loads_before):
        shape = leaves[piece.key].shape
        table[piece.key]["pieces"].append([piece.rank, piece.row_start, piece.rows])
        if piece.rank != rank:
            continue
        if shape and (piece.row_start, piece.rows) != (0, shape[0]):
            add(f"{piece.key}@{piece.row_start}", piece.key, (piece.row_start, piece.rows),
                [piece.row_start] + [0] * (len(shape) - 1), [piece.rows, *shape[1:]])
        else:
            add(piece.key, piece.key, None, [0] * len(shape), shape)
    for rec in table.values():
        if "pieces" in rec:
            rec["pieces"].sort(key=lambda p: p[1])

    for k, leaf in sorted(leaves.items()):
        if leaf.scope == "replicated" or k in aliases:
            continue
        if leaf.scope == "per_rank":
            add(k, k, None, [0] * len(leaf.shape), leaf.shape)
        elif k in irregular:
            for r, offsets, sizes in irregular[k]:
                if r == rank:
                    add(f"{k}@" + ",".join(map(str, offsets)), k, "local", offsets, sizes)
        else:
            sh = table[k]["sharding"]
            box = writes(k, leaf.shape, plan_meshes[sh["mesh"]], sh["dims"], rank)
            if box is not None:
                add(f"{k}@" + ",".join(map(str, box[0])), k, "local", box[0], box[1])
    return SavePlan(specs, IndexBuilder(records), manifest_dumps(table), meshes, tuple(named_plans))
