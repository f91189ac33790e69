"""Format 3: a manifest of O(tensors + files), chunk records in per-file indexes.

Format 2 listed every chunk (file, byte range, box, checksum) in the manifest: ~120 bytes per
(tensor, rank), so a large FSDP2 job's manifest grew past its own cap and every rank parsed
all of it. Format 3's manifest says, per tensor, how its chunks are placed, in a size that does
not grow with the world size:

- replicated: ``pieces`` [[writer rank, first row, rows], ...] (the plan spreads the bytes of
  all replicated tensors over the ranks: O(tensors + ranks) pieces in all);
- sharded by the DTensor rule: ``sharding`` {mesh, dims} (see ``safeckpt.format.sharding``), the mesh stored
  once in ``meshes``; sharded otherwise: ``boxes`` [[rank, offsets, sizes], ...];
- per-rank: nothing (every rank's file holds its own copy).

and per file: size, xxh3-128, writer rank, where its data starts and where its index is (with
the index's xxh3-64). The index (``safeckpt.format.fileindex``) has each chunk's byte range and checksum.
Ranks whose object trees differ from rank 0's (RNG states) are listed in ``rank_trees`` and
keep their trees in their own index.

:class:`Layout` answers "which files hold what overlaps this box" from the manifest alone and
reads only the indexes of those files, checking each against the manifest (every chunk the
manifest says the file holds, at a byte range inside the file's data, sized like its box, and
nothing else). :meth:`Layout.view` then gives the format-2 shaped manifest (``chunks`` per
tensor, ``rank_trees`` per object) that the reader, ``verify`` and the converters use, for the
files read (all of them for the offline tools).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import Any

from ..errors import CorruptCheckpoint
from .fileindex import HEADER_ENTRY_BYTES, MAX_INDEX, parse_index
from .manifest import safe_file_path
from .sharding import Box, Mesh, overlapping, writes
from .validate import _Bad, check_manifest, check_tree

FORMAT_V3 = 3


class Layout:
    """Chunk locations of a validated format-3 manifest ``man`` of the checkpoint ``ckpt``."""

    def __init__(self, man: dict[str, Any], ckpt: str, store: Any, dtype_size: Any) -> None:
        self.man = man
        self.ckpt = ckpt
        self.store = store
        self.dtype_size = dtype_size
        self.meshes = [Mesh(m) for m in man.get("meshes", [])]
        self.file_of = {int(rec["rank"]): name for name, rec in man["files"].items()}
        self.indexes: dict[str, dict[str, Any]] = {}  # file name -> parsed, checked index
        self._pieces: dict[int, list[tuple[str, list[int], list[int]]]] | None = None
        self._boxes: dict[int, list[tuple[str, list[int], list[int]]]] | None = None

    # ------------------------------------------------------------- locations
    def holders(self, key: str, want: Box | None, rank: int) -> Iterable[int]:
        """Ranks whose file holds a chunk of ``key`` overlapping ``want`` (None: the whole
        tensor); for per-rank state, ``rank``'s own copy."""
        rec = self.man["tensors"][key]
        if "alias_of" in rec:
            rec = self.man["tensors"][rec["alias_of"]]
        scope = rec["scope"]
        if scope == "per_rank":
            return [rank] if rank in self.file_of else []
        if "pieces" in rec:
            if want is None or not rec["shape"]:
                return sorted({p[0] for p in rec["pieces"]})
            lo, hi = want[0][0], want[0][0] + want[1][0]
            return sorted({p[0] for p in rec["pieces"] if p[1] < hi and p[1] + p[2] > lo or p[2] == 0})
        if "sharding" in rec:
            sh = rec["sharding"]
            mesh = self.meshes[sh["mesh"]]
            if want is not None and len(sh["dims"]) == 1 and sh["dims"][0][0] == "S":
                # one mesh dim sharding one tensor dim (FSDP2): the ranks whose rows meet want's
                dim, shape = sh["dims"][0][1], rec["shape"]
                piece = -(-shape[dim] // mesh.size) if shape[dim] else 0
                lo, n = want[0][dim], want[1][dim]
                if not piece or not n:
                    return []
                return [mesh.rank_at(c) for c in range(lo // piece, min(mesh.size - 1, (lo + n - 1) // piece) + 1)]
            return sorted({r for r, _ in overlapping(key, rec["shape"], mesh, sh["dims"], want)})
        out = set()
        for r, offsets, sizes in rec["boxes"]:
            if want is None or _meets((offsets, sizes), want):
                out.add(r)
        return sorted(out)

    def expected(self, rank: int) -> dict[tuple[str, tuple[int, ...]], list[int]]:
        """(key, offsets) -> sizes of every chunk the manifest says ``rank``'s file holds."""
        if self._pieces is None:
            self._pieces, self._boxes = {}, {}
            for key, rec in self.man["tensors"].items():
                for r, start, rows in rec.get("pieces", ()):
                    shape = rec["shape"]
                    offsets = [start] + [0] * (len(shape) - 1) if shape else []
                    sizes = [rows, *shape[1:]] if shape else []
                    self._pieces.setdefault(r, []).append((key, offsets, sizes))
                for r, offsets, sizes in rec.get("boxes", ()):
                    if 0 not in sizes:
                        self._boxes.setdefault(r, []).append((key, offsets, sizes))
        assert self._boxes is not None
        out: dict[tuple[str, tuple[int, ...]], list[int]] = {}
        for key, offsets, sizes in [*self._pieces.get(rank, ()), *self._boxes.get(rank, ())]:
            out[(key, tuple(offsets))] = sizes
        if rank >= int(self.man["world_size"]):  # a named file: replicated pieces only
            return out
        for key, rec in self.man["tensors"].items():
            if rec.get("scope") == "per_rank" and "alias_of" not in rec:
                out[(key, (0,) * len(rec["shape"]))] = list(rec["shape"])
            elif "sharding" in rec:
                sh = rec["sharding"]
                box = writes(key, rec["shape"], self.meshes[sh["mesh"]], sh["dims"], rank)
                if box is not None:
                    out[(key, tuple(box[0]))] = box[1]
        return out

    # ---------------------------------------------------------------- indexes
    def read_index(self, name: str) -> dict[str, Any]:
        """The index of file ``name``, read once, checked against its checksum and the manifest."""
        if name in self.indexes:
            return self.indexes[name]
        rec = self.man["files"][name]
        start, end, digest = rec["index"]
        where = f"{self.ckpt}/{name}"
        limit = min(MAX_INDEX, self.index_limit(int(rec["rank"]), int(rec["size"])))
        if end - start > limit:  # before reading or parsing any of it
            raise CorruptCheckpoint(
                f"{where}: an index of {end - start} bytes, more than the {limit} that the chunks and "
                "trees the manifest places in this file can take (damaged or forged)", path=self.ckpt)
        f = self.store.open(safe_file_path(self.ckpt, name), int(rec["size"]), self.ckpt)
        try:
            raw = bytes(f.read(start, end))
        finally:
            f.close()
        idx = parse_index(raw, where, self.ckpt, digest)
        try:
            self._check_index(name, rec, idx)
        except _Bad as exc:
            raise CorruptCheckpoint(f"{where}: {exc}", path=self.ckpt) from None
        self.indexes[name] = idx
        return idx

    def index_limit(self, rank: int, file_size: int) -> int:
        """The most bytes the index of ``rank``'s file can have: the JSON of every chunk the
        manifest places there (key, offsets, sizes as they are, byte offsets of at most
        ``file_size``'s digits, a checksum); a rank that keeps trees of its own (``rank_trees``)
        gets the reader's global cap (``MAX_INDEX``), since its trees may be any size.
        So an index is bounded by what the manifest expects before it is read: a forged 256
        MiB index costs its parse on every rank no more."""
        pos = 2 * len(str(file_size)) + 16 + 10  # start,end,"checksum", brackets, commas, quotes
        n = 64 + HEADER_ENTRY_BYTES  # {"trees":{},"header":"<xxh3-64>","chunks":[]}
        for (key, offsets), sizes in self.expected(rank).items():
            n += len(json.dumps(key)) + 2 * len(offsets) + 4 + sum(len(str(v)) for v in (*offsets, *sizes)) + pos
        if rank in set(self.man.get("rank_trees", ())):
            # A rank's own trees (its RNG state, a data position list) may legitimately be far
            # larger than rank 0's (an empty list there, a long one here): only the reader's
            # global cap bounds them. Rank 0's file, which every rank reads, never holds trees
            # of its own (trees are kept where they differ from rank 0's), so its bound stays
            # exact.
            return MAX_INDEX
        if rank >= int(self.man["world_size"]):  # a named file's index: a JSON string (quotes escaped)
            n = 2 * n + 2
        return n

    def _check_index(self, name: str, rec: dict[str, Any], idx: dict[str, Any]) -> None:
        rank = int(rec["rank"])
        data, index_start = int(rec["data"]), int(rec["index"][0])
        if rank >= int(self.man["world_size"]):  # a named file: its index is in the header
            index_start = int(rec["size"])
        tensors = self.man["tensors"]
        want = self.expected(rank)
        header = idx.get("header")  # the checksum of the file's safetensors tensor entries, if written
        chunks = []
        for key, offsets, sizes, start, end, digest in idx["chunks"]:
            tr = tensors.get(key)
            if tr is None or "alias_of" in tr:
                raise _Bad(f"its index lists tensor {key!r:.200}, which the manifest does not store")
            expect = want.pop((key, tuple(offsets)), None)
            if expect is None or expect != sizes:
                raise _Bad(f"its index lists a chunk of {key!r:.200} at {offsets[:8]} that the manifest "
                           "does not place in this file")
            start, end = data + start, data + end
            if end > index_start:
                raise _Bad(f"its index puts {key!r:.200} at bytes {start}-{end}, past the data")
            if end - start != math.prod(sizes) * self.dtype_size(tr["dtype"]):
                raise _Bad(f"its index gives {key!r:.200} {end - start} bytes for {sizes[:8]}")
            chunk = {"file": name, "start": start, "end": end, "offsets": offsets, "sizes": sizes,
                     "xxh3_64": digest}
            if tr["scope"] == "per_rank":
                chunk["rank"] = rank
            if header is not None:  # checked with the file's header (format.shardfile.header_problems)
                chunk["header"] = header
            chunks.append((key, chunk))
        if want:
            (key, offsets), _ = next(iter(want.items()))
            raise _Bad(f"its index lacks the chunk of {key!r:.200} at {list(offsets)[:8]} (and {len(want) - 1} more)")
        trees = idx["trees"]
        if rank in set(self.man.get("rank_trees", ())):
            for obj, tree in trees.items():
                if obj not in self.man["objects"]:
                    raise _Bad(f"its index holds a tree for unknown object {obj!r:.80}")
                check_tree(tree, f"rank {rank}'s tree of object {obj!r}", tensors)
        elif trees:
            raise _Bad("its index holds trees but the manifest does not list its rank in rank_trees")
        idx["checked"] = chunks

    # ------------------------------------------------------------------ views
    def files_for(self, targets: Iterable[tuple[str, Box | None]], rank: int) -> set[str]:
        """The files a rank reading ``targets`` (key, box) needs, plus its own file when it
        holds this rank's per-rank trees."""
        ranks: set[int] = set()
        for key, box in targets:
            ranks.update(self.holders(key, box, rank))
        if rank in set(self.man.get("rank_trees", ())):
            ranks.add(rank)
        return {self.file_of[r] for r in ranks if r in self.file_of}

    def view(self, files: Iterable[str] | None = None) -> dict[str, Any]:
        """The manifest in format 2's shape with the chunks of ``files`` (None: all, and then
        checked like a format-2 manifest: every tensor tiled, every per-rank copy present)."""
        names = sorted(self.man["files"]) if files is None else sorted(files)
        tensors = {k: {**rec, "chunks": []} for k, rec in self.man["tensors"].items()}
        objects = {k: dict(obj) for k, obj in self.man["objects"].items()}
        for name in names:
            idx = self.read_index(name)
            for key, chunk in idx["checked"]:
                tensors[key]["chunks"].append(chunk)
            rank = str(self.man["files"][name]["rank"])
            for obj, tree in idx["trees"].items():
                if tree != objects[obj].get("tree"):
                    objects[obj]["rank_trees"] = {**objects[obj].get("rank_trees", {}), rank: tree}
        for rec in tensors.values():
            rec["chunks"].sort(key=lambda c: (c.get("rank", 0), c["offsets"]))
        out = {**self.man, "tensors": tensors, "objects": objects}
        if files is None:
            check_manifest(out, f"{self.ckpt}", self.ckpt, file_ok=lambda n: None, dtype_size=self.dtype_size)
        return out


def _meets(a: Box, b: Box) -> bool:
    return all(max(o1, o2) < min(o1 + n1, o2 + n2) for o1, n1, o2, n2 in zip(a[0], a[1], b[0], b[1], strict=True)) \
        if a[0] else True
