"""Read tensors of one committed checkpoint into place: box arithmetic over chunks.

Every stored tensor is a set of chunks, each a box (global offsets, sizes) of the global tensor:
row ranges of a replicated tensor, shards of a DTensor, or one per-rank copy. A target is also
a box (the whole tensor, or this rank's shard of a DTensor). Reading copies every chunk/target
intersection, touching only the overlapping bytes (mmap), so resharding to another world size
costs only what the new shard needs. Chunks read whole are verified against their checksum.
"""

from __future__ import annotations

import mmap
import os
from typing import Any

import torch
import xxhash

from ._manifest import safe_file_path, torch_dtype
from ._shardfile import MappedFile
from ._storage import is_remote
from ._tree import is_dtensor
from .errors import CorruptCheckpoint

Box = list[list[int]]  # [offsets, sizes]


def local_box(t: torch.Tensor) -> Box:
    """[global offsets, local sizes] of this rank's part of ``t`` (the whole of a plain tensor)."""
    if is_dtensor(t):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        return [list(offset), list(shape)]
    return [[0] * t.dim(), list(t.shape)]


def placement_of(t: torch.Tensor) -> dict[str, Any] | None:
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


def _intersect(a: Box, b: Box) -> tuple[list[int], list[int]] | None:
    lo, hi = [], []
    for ao, asz, bo, bsz in zip(a[0], a[1], b[0], b[1], strict=True):
        start, stop = max(ao, bo), min(ao + asz, bo + bsz)
        if stop <= start:
            return None
        lo.append(start)
        hi.append(stop)
    return lo, hi


class TensorReader:
    """Serves tensors of the checkpoint at ``ckpt_dir`` described by ``manifest``."""

    def __init__(self, ckpt_dir: str, manifest: dict[str, Any], *, rank: int = 0, verify: bool = True) -> None:
        self.dir = ckpt_dir
        self.man = manifest
        self.rank = rank
        self.verify = verify
        self._files: dict[str, Any] = {}  # MappedFile, or _remote.RemoteFile for a URL
        self.nbytes_read = 0  # bytes copied out of the files (overlaps only), for tests and stats

    def _file(self, name: str) -> Any:
        if name not in self._files:
            path = safe_file_path(self.dir, name)
            if is_remote(path):
                from ._remote import RemoteFile

                self._files[name] = RemoteFile(path, int(self.man["files"][name]["size"]))
            else:
                self._files[name] = MappedFile(path, int(self.man["files"][name]["size"]))
        return self._files[name]

    def record(self, key: str) -> dict[str, Any]:
        try:
            return self.man["tensors"][key]
        except KeyError:
            raise CorruptCheckpoint(f"manifest tree refers to tensor {key!r} that it does not describe", path=self.dir) from None

    def fill(self, key: str, dst: torch.Tensor) -> None:
        """Copy the stored tensor ``key`` into ``dst`` (a tensor or DTensor) in place.

        A DTensor gets only its local shard, read from the chunks that overlap it.
        """
        self.fill_box(key, dst.to_local() if is_dtensor(dst) else dst, local_box(dst))

    def fill_box(self, key: str, local: torch.Tensor, box: Box) -> None:
        """Copy the region ``box`` ([global offsets, sizes]) of the stored tensor ``key`` into
        the plain tensor ``local`` (of shape ``box[1]``), touching only overlapping bytes."""
        rec = self.record(key)
        dtype = torch_dtype(rec["dtype"])
        chunks = rec["chunks"]
        if rec.get("scope") == "per_rank":
            chunks = [c for c in chunks if c.get("rank") == self.rank]
            if not chunks:
                raise CorruptCheckpoint(f"no per-rank copy of {key!r} for rank {self.rank}", path=self.dir)
        covered = 0
        with torch.no_grad():
            for c in chunks:
                cbox = [c["offsets"], c["sizes"]]
                if len(cbox[0]) != len(box[0]):
                    raise CorruptCheckpoint(f"chunk of {key!r} has the wrong rank", path=self.dir)
                inter = _intersect(box, cbox)
                if inter is None:
                    continue
                lo, hi = inter
                whole = lo == list(cbox[0]) and [h - o for h, o in zip(hi, cbox[0], strict=True)] == list(cbox[1])
                f = self._file(c["file"])
                src_at = cbox[0]
                if whole or not hasattr(f, "rows"):
                    src = f.tensor(
                        c["start"], c["end"], dtype, c["sizes"],
                        c.get("xxh3_64") if (self.verify and whole) else None,
                    )
                    if src.numel() * src.element_size() != c["end"] - c["start"]:
                        raise CorruptCheckpoint(f"chunk of {key!r} has a size that does not match its shape", path=self.dir)
                else:  # a remote file: fetch only the overlapping rows (dim 0) of the chunk
                    r0 = lo[0] - cbox[0][0]
                    src = f.rows(c["start"], c["end"], dtype, c["sizes"], r0, hi[0] - cbox[0][0])
                    src_at = [lo[0], *cbox[0][1:]]
                src_idx = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, src_at, strict=True))
                dst_idx = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, box[0], strict=True))
                local[dst_idx].copy_(src[src_idx])
                n = 1
                for a, b in zip(lo, hi, strict=True):
                    n *= b - a
                covered += n
                self.nbytes_read += n * src.element_size()
        if covered < local.numel():
            raise CorruptCheckpoint(
                f"tensor {key!r}: the checkpoint's chunks cover {covered} of {local.numel()} "
                "elements needed here", path=self.dir,
            )

    def verify_chunks(self, key: str, window: int = 64 << 20) -> None:
        """Check every chunk of ``key`` against its checksum, ``window`` bytes at a time, dropping
        the mapped pages after each window (so memory stays bounded for any chunk size).

        :meth:`fill_box` verifies only chunks it reads whole; streaming readers that cut chunks
        into pieces call this first."""
        rec = self.record(key)
        for c in rec["chunks"]:
            expect, start, end = c.get("xxh3_64"), c["start"], c["end"]
            if expect is None or end <= start:
                continue
            f = self._file(c["file"])
            if hasattr(f, "hash_range"):  # a remote file: ranged reads
                if f.hash_range(start, end, window) != expect:
                    raise CorruptCheckpoint(
                        f"checksum mismatch in {c['file']} bytes {start}-{end} (tensor {key!r}): "
                        "the file is corrupt.", path=self.dir,
                    )
                continue
            mm = getattr(f, "_mm", None)
            if mm is None:
                continue
            h = xxhash.xxh3_64()
            view = memoryview(mm)
            try:
                for off in range(start, end, window):
                    h.update(view[off : min(off + window, end)])
                    self.release()
            finally:
                view.release()
            if h.hexdigest() != expect:
                raise CorruptCheckpoint(
                    f"checksum mismatch in {c['file']} bytes {start}-{end} (tensor {key!r}): the "
                    "file is corrupt.", path=self.dir,
                )

    def release(self) -> None:
        """Drop the pages of the mapped files from this process's memory (they stay in the page
        cache and are read again on demand). Streaming readers call this between pieces."""
        for f in self._files.values():
            mm = getattr(f, "_mm", None)
            if mm is not None and hasattr(mmap, "MADV_DONTNEED"):
                try:
                    mm.madvise(mmap.MADV_DONTNEED)
                except OSError:  # pragma: no cover - best effort
                    pass

    def new(self, key: str) -> torch.Tensor:
        """The stored tensor ``key`` as a fresh CPU tensor (full, unsharded)."""
        rec = self.record(key)
        t = torch.empty(tuple(rec["shape"]), dtype=torch_dtype(rec["dtype"]))
        self.fill(key, t)
        return t

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


def open_manifest(ckpt_dir: str) -> dict[str, Any]:
    """Read a committed checkpoint's manifest or raise CheckpointNotFound / CorruptCheckpoint."""
    from ._manifest import MANIFEST, is_staging_name, read_manifest
    from .errors import CheckpointNotFound

    if is_remote(ckpt_dir):
        from ._remote import open_manifest as open_remote

        return open_remote(ckpt_dir)
    name = os.path.basename(os.path.normpath(ckpt_dir))
    if not os.path.isdir(ckpt_dir):
        raise CheckpointNotFound(f"no checkpoint at {ckpt_dir}: the directory does not exist", path=ckpt_dir)
    if is_staging_name(name) or not os.path.isfile(os.path.join(ckpt_dir, MANIFEST)):
        raise CheckpointNotFound(
            f"{ckpt_dir} is not a committed safeckpt checkpoint (no {MANIFEST}; an interrupted "
            "save never publishes one). Use `safeckpt ls` on its parent to see what is there.",
            path=ckpt_dir,
        )
    return read_manifest(ckpt_dir)
