"""A checkpoint -> one full safetensors file, streamed in bounded memory (any world size's
shards are assembled piece by piece)."""

from __future__ import annotations

import itertools
import json
import math
import os
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..engine.reader import Box, TensorReader, open_manifest
from ..errors import CheckpointError
from ..format.manifest import torch_dtype
from ..storage.base import resolve

DEFAULT_BUFFER = 64 << 20

Progress = Callable[[int, int, str], None]


@dataclass(frozen=True)
class WrittenSafetensors:
    """What :func:`consolidate` wrote: the file, its tensor names (in file order) and the
    number of tensor bytes."""

    path: str
    names: tuple[str, ...]
    nbytes: int


# ------------------------------------------------------------------------- selection
def _select(man: dict[str, Any], only: str | None) -> tuple[list[tuple[str, str]], dict[str, Any]]:
    """(output name, manifest key) for every selected tensor, and the selected non-tensor
    values (``{output name: JSON tree}``)."""
    prefix = None if only is None else only.strip("/")
    if prefix == "":
        prefix = None

    def rename(key: str) -> str | None:
        if prefix is None:
            return key
        if key == prefix:
            return key.rsplit("/", 1)[-1]
        if key.startswith(prefix + "/"):
            return key[len(prefix) + 1 :]
        return None

    tensors = []
    for key in man["tensors"]:
        name = rename(key)
        if name is not None:
            tensors.append((name, key))
    values: dict[str, Any] = {}
    for obj_name, obj in man["objects"].items():
        _collect_values(obj["tree"], obj_name, values)
    values = {n: v for k, v in values.items() if (n := rename(k)) is not None}
    if not tensors and not values:
        entries = ", ".join(sorted(man["objects"])) or "none"
        raise CheckpointError(
            f"nothing in the checkpoint matches only={only!r}; its entries are: {entries}"
        )
    return tensors, values


def _collect_values(tree: Any, path: str, out: dict[str, Any]) -> None:
    if isinstance(tree, dict) and not any(k.startswith("@") for k in tree):
        if not tree:
            out[path] = {}
        for k, v in tree.items():
            _collect_values(v, f"{path}/{k}", out)
    elif not (isinstance(tree, dict) and "@tensor" in tree):
        out[path] = tree  # JSON; may hold {"@tensor": key} references to tensors


# ---------------------------------------------------------------- streaming writer
def _pieces(shape: Sequence[int], elem: int, limit: int) -> Iterator[Box]:
    """Boxes that tile a C-contiguous tensor in memory order, each at most ``limit`` bytes
    (or one element): consecutive boxes are consecutive byte ranges."""
    shape = list(shape)
    if not shape:
        yield [[], []]
        return
    if math.prod(shape) == 0:
        return
    # split along the first dim whose trailing block fits in the limit
    d = 0
    while d < len(shape) - 1 and math.prod(shape[d + 1 :]) * elem > limit:
        d += 1
    inner = math.prod(shape[d + 1 :]) * elem
    step = max(1, limit // max(inner, 1))
    for prefix in itertools.product(*[range(s) for s in shape[:d]]):
        for a in range(0, shape[d], step):
            n = min(step, shape[d] - a)
            yield [[*prefix, a] + [0] * (len(shape) - d - 1), [1] * d + [n] + shape[d + 1 :]]


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        n = os.write(fd, data)
        data = data[n:]


def _write_safetensors(path: str, reader: TensorReader, entries: Sequence[tuple[str, str]],
                       metadata: Mapping[str, str], *, verify: bool, buffer_bytes: int,
                       progress: Progress | None, done: int = 0, total: int = 0) -> tuple[list[str], int]:
    """Write ``entries`` (output name, manifest key) as one safetensors file at ``path``."""
    recs = {key: reader.record(key) for _, key in entries}
    dtypes = {key: torch_dtype(recs[key]["dtype"]) for _, key in entries}
    sizes = {key: math.prod(recs[key]["shape"]) * dtypes[key].itemsize for _, key in entries}
    order = sorted(entries, key=lambda e: (-dtypes[e[1]].itemsize, e[0]))  # as save_file: aligned
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for name, key in order:
        header[name] = {"dtype": recs[key]["dtype"], "shape": list(recs[key]["shape"]),
                        "data_offsets": [offset, offset + sizes[key]]}
        offset += sizes[key]
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    tmp = os.path.join(os.path.dirname(path) or ".", f".{os.path.basename(path)}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    scratch = torch.empty(0, dtype=torch.uint8)
    try:
        _write_all(fd, memoryview(struct.pack("<Q", len(raw)) + raw))
        for name, key in order:
            if verify:
                reader.verify_chunks(key, window=max(buffer_bytes, 1 << 20))
            shape, dtype = list(recs[key]["shape"]), dtypes[key]
            for box in _pieces(shape, dtype.itemsize, buffer_bytes):
                nbytes = math.prod(box[1]) * dtype.itemsize
                if scratch.numel() < nbytes:  # one reused buffer: no allocator churn
                    scratch = torch.empty(nbytes, dtype=torch.uint8)
                piece = scratch[:nbytes]
                reader.fill_box(key, piece.view(dtype).view(tuple(box[1])), box)
                if nbytes:
                    _write_all(fd, memoryview(piece.numpy()))
                reader.release()
            done += sizes[key]
            if progress is not None:
                progress(done, total, name)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    os.close(fd)
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))
    return [name for name, _ in order], done


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


# ---------------------------------------------------------------------- consolidate
def consolidate(
    ckpt: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    *,
    only: str | None = None,
    progress: Progress | None = None,
    verify_checksums: bool = True,
    buffer_bytes: int = DEFAULT_BUFFER,
) -> WrittenSafetensors:
    """Write the checkpoint at ``ckpt`` as one safetensors file of full (unsharded) tensors.

    Offline (no process group), never unpickles. Sharded tensors of any world size are
    assembled from their shards; per-rank tensors (RNG state) are rank 0's copy, as in
    :func:`safeckpt.read_state_dict`.

    Names: without ``only``, the checkpoint's keys (``model/layer.weight``,
    ``optim/state/layer.weight/exp_avg``). ``only`` selects one entry or sub-tree by key prefix
    and strips that prefix: ``only="model"`` gives ``layer.weight``, the names of the plain
    module's ``state_dict()``, so ``model.load_state_dict(safetensors.torch.load_file(out))``
    works (also for a checkpoint saved from FSDP2 or DDP).

    The file's ``__metadata__`` holds ``format="pt"``, ``"safeckpt.step"`` (when the checkpoint
    has one) and ``"safeckpt.values"``: a JSON object of the selected non-tensor values (such as
    ``step`` or ``optim/param_groups``) in safeckpt's tree encoding.

    Memory: tensor by tensor, each in pieces of at most ``buffer_bytes`` (default 64 MiB), so a
    checkpoint of any size needs about that much memory, never a full copy. With
    ``verify_checksums`` every stored chunk is checked against its checksum first (a second,
    cheap read of the bytes; raises :class:`CorruptCheckpoint`). The output appears atomically
    (temporary file, fsync, rename) and replaces an existing file.

    ``progress(done_bytes, total_bytes, name)`` is called after each tensor.
    Raises :class:`CheckpointNotFound`, :class:`CorruptCheckpoint`, or :class:`CheckpointError`
    when ``only`` matches nothing. Returns :class:`WrittenSafetensors` (path, names, nbytes).
    """
    src = resolve(ckpt)  # a local path or an fsspec URL
    out = os.path.abspath(os.fspath(out_path))
    man = open_manifest(src)
    tensors, values = _select(man, only)
    metadata = {"format": "pt"}
    if man.get("step") is not None:
        metadata["safeckpt.step"] = str(man["step"])
    if values:
        metadata["safeckpt.values"] = json.dumps(values, separators=(",", ":"))
    reader = TensorReader(src, man, rank=0, verify=verify_checksums)
    total = sum(_nbytes(man["tensors"][k]) for _, k in tensors)
    try:
        names, _ = _write_safetensors(out, reader, tensors, metadata, verify=verify_checksums,
                                      buffer_bytes=buffer_bytes, progress=progress, total=total)
    finally:
        reader.close()
    return WrittenSafetensors(out, tuple(names), total)


def _nbytes(rec: dict[str, Any]) -> int:
    return math.prod(rec["shape"]) * torch_dtype(rec["dtype"]).itemsize
