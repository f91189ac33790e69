"""Offline access to a checkpoint: no process group, any machine, never unpickles."""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import CheckpointError, StorageError
from ..format.manifest import retry_io, safe_file_path
from ..format.shardfile import header_problems
from ..format.tree import decode, escape_key
from ..storage.base import Storage, is_remote, resolve, storage_for
from .extra import listed as listed_files
from .extra import problems as extra_problems
from .reader import TensorReader, open_data_file, open_manifest


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
    path: str | os.PathLike[str], deep: bool = True, *, progress: Callable[[int], None] | None = None,
    storage_options: Mapping[str, Any] | None = None, storage_errors: str = "report",
) -> VerifyReport:
    """Check a checkpoint with the same validation a load runs: the manifest (its checksum and
    every field, chunks tiling every tensor), every file present, regular and of the right size
    with a safetensors header that matches the manifest, and with ``deep`` every file's
    checksum and every chunk's, from one read of each file (``progress(n)`` is told about
    every n bytes hashed).
    ``storage_options``: the fsspec filesystem's options for a URL ``path``.

    A storage failure that says nothing about the checkpoint (no credentials, an unreachable
    endpoint, EIO/ESTALE after retries) is reported as a problem too (``ok`` False); pass
    ``storage_errors="raise"`` to get it as :class:`~safeckpt.StorageError` instead (the CLI
    does: exit 74, not "corrupt")."""
    ckpt = resolve(path)
    try:
        return verify_on(storage_for(ckpt, storage_options), ckpt, deep, progress=progress)
    except StorageError as exc:
        if storage_errors == "raise":
            raise
        return VerifyReport(ckpt, False, [f"the storage failed, not the checkpoint: {exc}"], deep=deep)


def verify_on(store: Storage, ckpt: str, deep: bool = True, *,
              progress: Callable[[int], None] | None = None, indexes: bool = True,
              manifest: dict[str, Any] | None = None) -> VerifyReport:
    """:func:`verify` of the resolved path ``ckpt`` on ``store`` (the manager's, whose calls
    are bounded by its timeout). ``indexes=False`` (the manager's choice of a checkpoint to
    restore): for format 3, the manifest and every file's presence and size only, without
    reading every file's index on one rank (at 16k ranks of FSDP2 that is gigabytes); the load
    itself then checks the indexes and chunks each rank reads, and a failure falls back.
    ``manifest``: the checkpoint's manifest as ``store.read_manifest`` returned it (the caller
    read it already: it is not read again). On an object store each file is looked up once (one
    HEAD), ``CHECK_THREADS`` at a time."""
    problems: list[str] = []
    try:
        stored = manifest if manifest is not None else open_manifest(ckpt, store, full=False)
        names = sorted(stored["files"])
        paths = [safe_file_path(ckpt, name) for name in names]
        sizes = _sizes(store, paths) if is_remote(ckpt) else None
        present = [s is not None for s in sizes] if sizes is not None else [_present(p) for p in paths]
        missing = [f"missing file {name}" for name, there in zip(names, present) if not there]
        if missing:  # said plainly, before format 3's indexes are read from those files
            return VerifyReport(ckpt, False, missing, stored.get("step"), 0, deep)
        if not indexes and not deep and stored.get("format_version") == 3:
            if sizes is None:
                sizes = [store.size(p) for p in paths]
            for name, size in zip(names, sizes):
                rec = stored["files"][name]
                if size != rec["size"]:
                    problems.append(f"{name}: {size} bytes, the manifest says {rec['size']} (truncated or replaced)")
            nbytes = sum(int(rec["size"]) for rec in stored["files"].values())
            problems += _extras(store, ckpt, stored, deep, indexes)
            return VerifyReport(ckpt, not problems, problems, stored.get("step"), nbytes, deep)
        # format 3: the manifest as format 2 shapes it, every file's index read (once more: the
        # stored form is a different object); older formats are used as stored
        man = stored if stored.get("format_version") != 3 else open_manifest(ckpt, store)
    except StorageError:
        raise  # the storage failed (EMFILE, EIO, ESTALE after retries): says nothing of the checkpoint
    except (CheckpointError, OSError) as exc:
        return VerifyReport(ckpt, False, [str(exc)], deep=deep)
    nbytes = 0
    by_file: dict[str, list[dict[str, Any]]] = {}
    for key, rec in man["tensors"].items():
        for c in rec["chunks"]:
            by_file.setdefault(c["file"], []).append({**c, "dtype": rec["dtype"], "key": key})
    for name, rec in sorted(man["files"].items()):
        try:
            f = open_data_file(ckpt, name, rec["size"], store)
        except StorageError:
            raise
        except CheckpointError as exc:
            problems.append(f"{name}: {exc}")
            continue
        try:
            nbytes += rec["size"]
            problems += [f"{name}: {p}" for p in header_problems(f.read, rec["size"], by_file.get(name, []))]
        finally:
            f.close()
        if deep:
            problems += _deep_problems(store, ckpt, name, rec, by_file.get(name, []), progress)
    # files beside the tensors (extra: a framework's own; written: a DeepSpeed engine's): see _extra
    problems += _extras(store, ckpt, man, deep, indexes)
    return VerifyReport(ckpt, not problems, problems, man.get("step"), nbytes, deep)


def _extras(store: Storage, ckpt: str, man: dict[str, Any], deep: bool, indexes: bool) -> list[str]:
    """Problems of the files beside the tensors (extra: a framework's own; written: a DeepSpeed
    engine's): see _extra. The manager's pick (``indexes=False``) also checks the checksums of
    the coordinator's extra files, a few KB each (Trainer's state): an object-store overwrite
    that failed between its manifest and them leaves the old ones, often of the same size."""
    if deep or indexes or not man.get("extra"):
        return extra_problems(store, ckpt, man, deep=deep)
    small = set(man["extra"])  # each file stat'ed (or HEAD-requested) once: checksummed or sized
    return (extra_problems(store, ckpt, man, deep=True, names=sorted(small))
            + extra_problems(store, ckpt, man, deep=False, names=sorted(set(listed_files(man)) - small)))


MAX_NAMED = 10  # corrupt chunks named per file; the rest are counted


def _deep_problems(store: Storage, ckpt: str, name: str, rec: dict[str, Any], chunks: list[dict[str, Any]],
                   progress: Callable[[int], None] | None) -> list[str]:
    """The data file ``name`` against its xxh3-128 and each of its ``chunks`` against its own
    xxh3-64, from one read of the file (``Storage.hash`` with the chunks' spans). The chunks
    are checked too, as a load checks them: a file rewritten with its whole-file checksum
    recomputed (a buggy tool) must not verify and then fail to load."""
    chunks = [c for c in chunks if c["end"] > c["start"]]
    spans = sorted({(c["start"], c["end"]) for c in chunks})
    try:
        got = store.hash(safe_file_path(ckpt, name), progress=progress, spans=spans)
    except StorageError:
        raise
    except (CheckpointError, OSError) as exc:
        return [f"{name}: {exc}"]
    problems = []
    if got.size != rec["size"] or got.xxh3_128 != rec.get("xxh3_128"):
        problems.append(f"{name}: checksum mismatch (corrupt data)")
    digests = dict(zip(spans, got.spans, strict=True))
    bad = [c for c in chunks if digests[(c["start"], c["end"])] != c.get("xxh3_64")]
    bad.sort(key=lambda c: c["start"])
    problems += [f"{name}: checksum mismatch in bytes {c['start']}-{c['end']} (tensor {c['key']!r}): "
                 "the data is corrupt" for c in bad[:MAX_NAMED]]
    if len(bad) > MAX_NAMED:
        problems.append(f"{name}: {len(bad) - MAX_NAMED} more corrupt chunks")
    return problems


CHECK_THREADS = 16  # object-store lookups (HEAD requests) of one checkpoint's files at once


def _sizes(store: Storage, paths: list[str]) -> list[int | None]:
    """``store.size`` of each path (None: absent), ``CHECK_THREADS`` requests at a time."""
    if len(paths) <= 1:
        return [store.size(p) for p in paths]
    with concurrent.futures.ThreadPoolExecutor(min(CHECK_THREADS, len(paths))) as pool:
        return list(pool.map(store.size, paths))


def read_state_dict(
    path: str | os.PathLike[str], *, verify_checksums: bool = True, nested: bool = False,
    storage_options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The whole checkpoint with full (unsharded) CPU tensors; per-rank state is rank 0's.

    Flat by default: ``{key: Tensor | value}`` with keys ``entry/sub/key``
    (``model/layer.weight``), each path component escaped with :func:`escape_key` (so a ``/``
    inside a dict key, e.g. a file path, stays distinguishable). ``nested=True`` gives the
    saved trees instead: ``{entry: state}`` exactly as each entry's ``state_dict()`` was.
    ``storage_options``: the fsspec filesystem's options for a URL ``path``.
    """
    ckpt = resolve(path)
    store = storage_for(ckpt, storage_options)
    man = open_manifest(ckpt, store)
    reader = TensorReader(ckpt, man, rank=0, verify=verify_checksums, store=store)
    out: dict[str, Any] = {}
    try:
        for name, obj in man["objects"].items():
            value = decode(obj["tree"], reader.new)
            if nested:
                out[name] = value
            else:
                _flatten(value, escape_key(name), out)
    finally:
        reader.close()
    return out


def _flatten(value: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(value, dict) and value and not isinstance(value, torch.Tensor):
        for k, v in value.items():
            _flatten(v, f"{prefix}/{escape_key(str(k))}", out)
    else:
        out[prefix] = value


def _present(path: str) -> bool:
    """Whether a data file is there (not following a link): only ENOENT/ENOTDIR say it is not;
    a transient error (ESTALE, EIO) is tried again, then raised as StorageUnavailable, never
    taken for a missing file (a restore would fall back over it)."""
    try:
        retry_io(lambda: os.lstat(path), f"stat {path}")
    except (FileNotFoundError, NotADirectoryError):
        return False
    return True
