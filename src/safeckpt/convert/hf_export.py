"""A checkpoint's model -> Hugging Face style safetensors files (``model.safetensors`` or
shards + index), as ``save_pretrained`` lays them out."""

from __future__ import annotations

import json
import os
import re

from ..engine.reader import TensorReader, open_manifest
from ..errors import CheckpointExists
from ..storage.base import resolve
from .consolidate import (
    DEFAULT_BUFFER,
    Progress,
    _fsync_dir,
    _nbytes,
    _select,
    _write_safetensors,
)

HF_SINGLE = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"
HF_SHARD = "model-{:05d}-of-{:05d}.safetensors"
_HF_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string such as ``"5GB"`` (10**9), ``"500MiB"`` (2**20)."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", str(size), re.IGNORECASE)
    if not m:
        raise ValueError(f"cannot read a size from {size!r}; use bytes or e.g. '5GB', '500MiB'")
    base = 1024 if m.group(3) else 1000
    power = " KMGT".index(m.group(2).upper() or " ")
    return int(float(m.group(1)) * base**power)


def export_hf(
    ckpt: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    only: str | None = "model",
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
    progress: Progress | None = None,
    verify_checksums: bool = True,
    buffer_bytes: int = DEFAULT_BUFFER,
) -> list[str]:
    """Export a checkpoint's model as Hugging Face style safetensors into ``out_dir``.

    Tensors under ``only`` (default ``"model"``; prefix stripped, so names are the plain
    module's ``state_dict`` keys) are written to ``model.safetensors`` when their total size is
    at most ``max_shard_size`` (bytes, or a string such as ``"5GB"``, ``"500MiB"``), else to
    ``model-00001-of-0000N.safetensors`` ... plus ``model.safetensors.index.json``
    (``{"metadata": {"total_size": bytes}, "weight_map": {name: file}}``), as
    ``transformers``' ``save_pretrained`` does; each file's metadata is ``{"format": "pt"}``.
    A tensor larger than ``max_shard_size`` gets a shard of its own.

    Streams like :func:`consolidate` (bounded memory, files appear atomically). Existing
    ``model*.safetensors`` / index files in ``out_dir`` raise :class:`CheckpointExists` unless
    ``overwrite=True``, which replaces them (stale shards of an earlier export are removed
    after the new files are in place). Returns the paths written, index last.
    """
    src = resolve(ckpt)  # a local path or an fsspec URL
    dst = os.path.abspath(os.fspath(out_dir))
    limit = parse_size(max_shard_size)
    if limit <= 0:
        raise ValueError(f"max_shard_size must be positive, got {max_shard_size!r}")
    man = open_manifest(src)
    tensors, _ = _select(man, only)
    os.makedirs(dst, exist_ok=True)
    existing = [f for f in os.listdir(dst) if f in (HF_SINGLE, HF_INDEX) or _HF_SHARD_RE.match(f)]
    if existing and not overwrite:
        raise CheckpointExists(
            f"{dst} already holds {', '.join(sorted(existing))}; pass overwrite=True "
            "(CLI: --overwrite) to replace them, or export into an empty directory."
        )
    shards: list[list[tuple[str, str]]] = [[]]
    size = 0
    for name, key in sorted(tensors):
        n = _nbytes(man["tensors"][key])
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append((name, key))
        size += n
    total = sum(_nbytes(man["tensors"][k]) for _, k in tensors)
    reader = TensorReader(src, man, rank=0, verify=verify_checksums)
    written: list[str] = []
    weight_map: dict[str, str] = {}
    done = 0
    try:
        for i, entries in enumerate(shards):
            fname = HF_SINGLE if len(shards) == 1 else HF_SHARD.format(i + 1, len(shards))
            path = os.path.join(dst, fname)
            _, done = _write_safetensors(path, reader, entries, {"format": "pt"}, verify=verify_checksums,
                                         buffer_bytes=buffer_bytes, progress=progress, done=done, total=total)
            written.append(path)
            weight_map.update({name: fname for name, _ in entries})
    finally:
        reader.close()
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        path = os.path.join(dst, HF_INDEX)
        tmp = path + f".tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(index, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        written.append(path)
    keep = {os.path.basename(p) for p in written}
    for f in existing:
        if f not in keep:
            os.unlink(os.path.join(dst, f))
    _fsync_dir(dst)
    return written


# --------------------------------------------------------------------------- imports
