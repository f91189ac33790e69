"""Offline access to a checkpoint: no process group, any machine, never unpickles."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ._manifest import safe_file_path
from ._reader import TensorReader, open_manifest
from ._shardfile import hash_file
from ._storage import is_remote, resolve
from ._tree import decode
from .errors import CheckpointError


@dataclass
class VerifyReport:
    """Result of :func:`verify`: ``ok`` is True only when no problem was found."""

    path: str
    ok: bool
    problems: list[str] = field(default_factory=list)
    step: int | None = None
    nbytes: int = 0
    deep: bool = False

    def __bool__(self) -> bool:
        return self.ok


def verify(
    path: str | os.PathLike[str], deep: bool = True, *, progress: Callable[[int], None] | None = None
) -> VerifyReport:
    """Check a checkpoint: manifest, files present with the right sizes, chunks covering every
    tensor, and with ``deep`` every file's checksum (reads all bytes once; ``progress(n)`` is
    told about every n bytes hashed)."""
    ckpt = resolve(path)
    remote = is_remote(ckpt)
    if remote:
        from ._remote import hash_file as remote_hash_file
        from ._remote import locate, size_of
    problems: list[str] = []
    try:
        man = open_manifest(ckpt)
    except (CheckpointError, OSError) as exc:
        return VerifyReport(ckpt, False, [str(exc)], deep=deep)
    nbytes = 0
    for name, rec in sorted(man["files"].items()):
        try:
            fpath = safe_file_path(ckpt, name)
        except CheckpointError as exc:
            problems.append(str(exc))
            continue
        if remote:
            size = size_of(locate(fpath))
            if size is None:
                problems.append(f"missing file {name}")
                continue
        elif not os.path.isfile(fpath):
            problems.append(f"missing file {name}")
            continue
        else:
            size = os.path.getsize(fpath)
        nbytes += size
        if size != rec["size"]:
            problems.append(f"{name}: {size} bytes on disk, manifest says {rec['size']} (truncated?)")
            continue
        if deep:
            _, digest = (remote_hash_file if remote else hash_file)(fpath, progress=progress)
            if digest != rec.get("xxh3_128"):
                problems.append(f"{name}: checksum mismatch (corrupt data)")
    for key, rec in man["tensors"].items():
        need = math.prod(rec["shape"])
        chunks = rec["chunks"]
        if rec.get("scope") == "per_rank":
            ranks = sorted(c.get("rank", -1) for c in chunks)
            if ranks != list(range(int(man.get("world_size", 1)))):
                problems.append(f"tensor {key!r}: per-rank copies for ranks {ranks}")
            continue
        have = sum(math.prod(c["sizes"]) for c in chunks)
        if have != need:
            problems.append(f"tensor {key!r}: chunks hold {have} of {need} elements")
    return VerifyReport(ckpt, not problems, problems, man.get("step"), nbytes, deep)


def read_state_dict(path: str | os.PathLike[str], *, verify_checksums: bool = True) -> dict[str, Any]:
    """The whole checkpoint as a flat ``{key: Tensor | value}`` dict with full (unsharded) CPU
    tensors. Keys are ``entry/sub/key`` (``model/layer.weight``); per-rank state is rank 0's."""
    ckpt = resolve(path)
    man = open_manifest(ckpt)
    reader = TensorReader(ckpt, man, rank=0, verify=verify_checksums)
    out: dict[str, Any] = {}
    try:
        for name, obj in man["objects"].items():
            _flatten(decode(obj["tree"], reader.new), name, out)
    finally:
        reader.close()
    return out


def _flatten(value: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(value, dict) and value and not isinstance(value, torch.Tensor):
        for k, v in value.items():
            _flatten(v, f"{prefix}/{k}", out)
    else:
        out[prefix] = value
