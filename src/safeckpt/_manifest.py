"""What a checkpoint is on disk, and nothing else.

A checkpoint is a directory::

    <name>/
      manifest.json            written last, inside the staging directory, before publication
      rank-00000.safetensors   tensors written by rank 0 (chunks of replicated tensors, its
      rank-00001.safetensors   shards of sharded ones, its per-rank state), one file per rank

``manifest.json`` (JSON, never pickle) records the format version, step, world size, creation
time, library and torch versions, user metadata and metrics, every object's JSON tree, and for
each tensor its dtype, global shape, scope and chunks (file, byte range, global offsets, sizes,
xxh3-64 checksum); for each file its size and xxh3-128 checksum. Files are plain safetensors
and open with any safetensors reader.

Names inside a manifest are validated before use: no absolute paths, no ``..``, no separators.
On object stores (fsspec URLs) data files also carry a per-save token,
``rank-00000.<token>.safetensors`` (see ``safeckpt._remote``); readers use the names the
manifest lists, whatever they are.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from ._storage import is_remote
from .errors import CheckpointNotFound, CorruptCheckpoint

FORMAT = "safeckpt"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
STAGING_MARK = ".safeckpt-staging-"
TRASH_MARK = ".safeckpt-trash-"

_SAFE_FILE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")

DTYPE_TO_ST: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
}
for _name, _code in (
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e5m2", "F8_E5M2"),
    ("uint16", "U16"),
    ("uint32", "U32"),
    ("uint64", "U64"),
):
    if hasattr(torch, _name):
        DTYPE_TO_ST[getattr(torch, _name)] = _code
ST_TO_DTYPE = {v: k for k, v in DTYPE_TO_ST.items()}


def dtype_code(dtype: torch.dtype) -> str:
    try:
        return DTYPE_TO_ST[dtype]
    except KeyError:
        raise TypeError(f"dtype {dtype} cannot be stored in safetensors") from None


def torch_dtype(code: str) -> torch.dtype:
    try:
        return ST_TO_DTYPE[code]
    except KeyError:
        raise CorruptCheckpoint(f"unknown dtype {code!r} in manifest") from None


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def staging_name(final_name: str, token: str) -> str:
    return f".{final_name}{STAGING_MARK}{token}"


def is_staging_name(name: str) -> bool:
    return name.startswith(".") and (STAGING_MARK in name or TRASH_MARK in name)


def safe_file_path(ckpt_dir: str, name: Any) -> str:
    """Resolve a file named by a manifest, refusing anything that could leave ``ckpt_dir``."""
    if not isinstance(name, str) or not _SAFE_FILE.match(name) or ".." in name:
        raise CorruptCheckpoint(
            f"manifest names an unsafe file {name!r} (absolute path, '..' or separator); "
            "refusing to read it", path=ckpt_dir,
        )
    if is_remote(ckpt_dir):
        return f"{ckpt_dir}/{name}"  # an object key: no links to follow
    path = os.path.join(ckpt_dir, name)
    if os.path.islink(path):
        raise CorruptCheckpoint(f"{path} is a symlink; refusing to follow it", path=ckpt_dir)
    return path


def read_manifest(ckpt_dir: str) -> dict[str, Any]:
    """Read and structurally validate ``manifest.json``; raise CorruptCheckpoint if unusable."""
    path = os.path.join(ckpt_dir, MANIFEST)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        # Deleted (e.g. by retention) after the caller saw it: a safeckpt error, not a raw OSError.
        raise CheckpointNotFound(f"no checkpoint at {ckpt_dir} (it was deleted)", path=ckpt_dir) from None
    return parse_manifest(raw, ckpt_dir)


def parse_manifest(raw: bytes, ckpt_dir: str) -> dict[str, Any]:
    """Parse and structurally validate the bytes of ``manifest.json``."""
    path = f"{ckpt_dir}/{MANIFEST}" if is_remote(ckpt_dir) else os.path.join(ckpt_dir, MANIFEST)
    try:
        man = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptCheckpoint(f"{path} is not valid JSON ({exc})", path=ckpt_dir) from exc
    validate_manifest(man, ckpt_dir)
    return man


def validate_manifest(man: Any, ckpt_dir: str) -> None:
    where = f"{ckpt_dir}/{MANIFEST}" if is_remote(ckpt_dir) else os.path.join(ckpt_dir, MANIFEST)

    def bad(msg: str) -> CorruptCheckpoint:
        return CorruptCheckpoint(f"{where}: {msg}", path=ckpt_dir)

    if not isinstance(man, dict) or man.get("format") != FORMAT:
        raise bad("not a safeckpt manifest")
    version = man.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise bad(
            f"format version {version!r} is newer than this safeckpt understands "
            f"({FORMAT_VERSION}); upgrade safeckpt"
        )
    for key in ("files", "tensors", "objects"):
        if not isinstance(man.get(key), dict):
            raise bad(f"missing or malformed {key!r}")
    for name, rec in man["files"].items():
        safe_file_path(ckpt_dir, name)
        if not isinstance(rec, dict) or not isinstance(rec.get("size"), int):
            raise bad(f"malformed record for file {name!r}")
    for key, rec in man["tensors"].items():
        if not isinstance(rec, dict) or not isinstance(rec.get("chunks"), list):
            raise bad(f"malformed record for tensor {key!r}")
        torch_dtype(rec.get("dtype", "?"))
        for ch in rec["chunks"]:
            if ch.get("file") not in man["files"]:
                raise bad(f"tensor {key!r} points at unknown file {ch.get('file')!r}")
            start, end = ch.get("start"), ch.get("end")
            if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end):
                raise bad(f"tensor {key!r} has an invalid byte range")
            if end > man["files"][ch["file"]]["size"]:
                raise bad(f"tensor {key!r} extends past the end of {ch['file']!r}")


@dataclass(frozen=True)
class CheckpointInfo:
    """What a committed checkpoint is: returned by save/load and listed by the manager."""

    path: str
    step: int | None
    world_size: int
    created_at: str
    metrics: dict[str, Any] = field(default_factory=dict)
    nbytes: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)
    skipped: tuple[str, ...] = ()

    @classmethod
    def from_manifest(cls, path: str, man: dict[str, Any], skipped: tuple[str, ...] = ()) -> CheckpointInfo:
        return cls(
            path=path,
            step=man.get("step"),
            world_size=int(man.get("world_size", 1)),
            created_at=str(man.get("created_at", "")),
            metrics=dict(man.get("metrics") or {}),
            nbytes=sum(int(f["size"]) for f in man["files"].values()),
            metadata=dict(man.get("metadata") or {}),
            skipped=skipped,
        )
