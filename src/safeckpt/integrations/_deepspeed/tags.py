"""What a DeepSpeed save directory looks like with safeckpt, and single-process work on it.

::

    save_dir/
    ├── latest                                    newest tag saved with save_latest (atomic)
    ├── global_step100/                           one committed tag, published by one rename
    │   ├── safeckpt-deepspeed.json               the index, written last before publication
    │   ├── mp_rank_00_model_states.pt/           every file DeepSpeed saves is a one-rank
    │   ├── zero_pp_rank_0_mp_rank_00_optim_states.pt/   safeckpt checkpoint under the name
    │   ├── zero_pp_rank_1_mp_rank_00_optim_states.pt/   DeepSpeed gave the file, so its own
    │   └── offloaded_tensors/rank00/...          globs find them; NVMe swap files as raw bytes
    └── .global_step200.safeckpt-staging-3f9c...  a save in progress (or a crashed one)

A tag counts as committed when its directory is not hidden and holds the index. Which tag is
"newest" comes from the index (a sequence number the coordinator assigns at commit), never
from ``latest`` or file times, so a crash between publication and the ``latest`` update, or a
``latest`` written by a stock DeepSpeed run, cannot send a resume to the wrong tag.

No collectives here: :mod:`safeckpt.integrations.deepspeed` runs these on the right ranks.
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import xxhash

from ... import save, verify
from ..._version import __version__
from ...errors import CheckpointError, CheckpointNotFound, CorruptCheckpoint

# safeckpt internals the DeepSpeed integration builds on, imported in this one place only (so
# a refactor of them breaks one import block): the coordinator and one-process saves, the
# POSIX commit primitives, leftover sweeping, name checks and file hashing.
from ...storage.catalog import sweep as sweep_root  # isort: skip
from ...format.manifest import safe_file_path, staging_name  # isort: skip
from ...format.shardfile import hash_file  # isort: skip
from ...coord.dist import Coordinator as Coordinator  # isort: skip  (re-exported)
from ...storage.base import resolve as resolve  # isort: skip  (re-exported)
from ...storage.posix import fsync_dir, rename_publish, write_bytes_atomic  # isort: skip
from ...storage.posix import remove_tree as remove_tree  # isort: skip  (re-exported)

INDEX = "safeckpt-deepspeed.json"
FORMAT = "safeckpt-deepspeed"
FORMAT_VERSION = 1
LATEST = "latest"
OFFLOAD_DIR = "offloaded_tensors"
_TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._+=-]{0,200}$")


@dataclass(frozen=True)
class TagInfo:
    """One committed tag under a save directory (from its index)."""

    tag: str
    path: str
    seq: int
    created_at: str
    global_steps: int | None
    world_size: int
    zero_stage: int | None
    latest: bool


def check_tag(tag: str) -> str:
    if not isinstance(tag, str) or not _TAG_RE.match(tag) or tag == LATEST or ".." in tag:
        raise CheckpointError(
            f"checkpoint tag {tag!r} cannot be a directory name safeckpt publishes atomically: "
            "use letters, digits and . _ + = - (no '/', no leading '.', not 'latest')."
        )
    return tag


# ------------------------------------------------------------------ writing
def save_local(path: str, state: dict[str, Any], *, metadata: dict[str, Any], timeout: float | None) -> None:
    """Write ``state`` to ``path`` as a one-rank safeckpt checkpoint, without any collective.

    ``safeckpt.save`` is collective over the default process group; DeepSpeed saves each file
    on the ranks that own it, so each file is its own single-rank checkpoint (atomic, fsynced,
    checksummed) inside the tag's staging directory.
    """
    save(path, state, metadata=metadata, timeout=timeout, check_replicas="off", collective=False)


def new_staging(final: str) -> str:
    """A fresh hidden staging directory next to ``final`` (coordinator)."""
    parent, name = os.path.split(os.path.normpath(final))
    staging = os.path.join(parent, staging_name(name, uuid.uuid4().hex[:12]))
    os.mkdir(staging)
    fsync_dir(parent)
    return staging


def wait_visible(staging: str, wait: float = 5.0) -> None:
    """Every rank: the coordinator's staging directory is visible here (NFS attribute caches
    may lag), or a clear error: the save directory must be storage shared by all ranks."""
    deadline = time.monotonic() + wait
    while not os.path.isdir(staging):
        if time.monotonic() > deadline:
            raise CheckpointError(
                f"the staging directory {staging} created by rank 0 is not visible on this rank "
                f"after {wait:.0f}s: the save directory must be on storage shared by all ranks "
                "(a shared filesystem mounted at the same path everywhere)"
            )
        time.sleep(0.05)


def publish_tag(staging: str, final: str) -> None:
    """Make ``staging`` visible as ``final`` in one rename; an existing tag of that name is
    swapped out in the same step (``renameat2(RENAME_EXCHANGE)``), then deleted."""
    rename_publish(staging, final, replace=True)


def sweep(save_dir: str) -> None:
    """Remove staging/trash leftovers of crashed saves (coordinator, before a new save)."""
    sweep_root(save_dir)  # also puts back a checkpoint an overwrite killed between its renames set aside


def next_seq(save_dir: str) -> int:
    seqs = [info.seq for info in list_tags(save_dir)]
    return max(seqs, default=0) + 1


def write_index(staging: str, index: dict[str, Any]) -> None:
    write_bytes_atomic(os.path.join(staging, INDEX), json.dumps(index, indent=1).encode())


def new_index(*, tag: str, seq: int, latest: bool, world_size: int, files: dict[str, Any],
              offload: dict[str, Any], engine_info: dict[str, Any]) -> dict[str, Any]:
    now = time.time()
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "tag": tag,
        "seq": seq,
        "latest": latest,
        "created_at": datetime.fromtimestamp(now, UTC).isoformat(timespec="seconds").replace("+00:00", "Z"),
        "created_unix": now,
        "world_size": world_size,
        "safeckpt_version": __version__,
        **engine_info,
        "files": files,
        "offload": offload,
    }


def write_latest(save_dir: str, tag: str) -> None:
    """``latest`` for DeepSpeed's own tools: temp file, fsync, rename (never truncated in place)."""
    write_bytes_atomic(os.path.join(save_dir, LATEST), tag.encode())


def copy_offload(src: str, dst: str) -> dict[str, Any]:
    """Copy NVMe swap files (not gradient ones, as DeepSpeed does) into this rank's own
    directory ``dst``; returns ``{relative path: {"size", "xxh3_128"}}``, every file fsynced."""
    records: dict[str, Any] = {}
    for root, dirs, names in os.walk(src):
        dirs[:] = sorted(d for d in dirs if "gradient" not in d)
        rel_root = os.path.relpath(root, src)
        os.makedirs(os.path.join(dst, rel_root), exist_ok=True)
        for name in sorted(n for n in names if "gradient" not in n):
            rel = os.path.normpath(os.path.join(rel_root, name))
            records[rel] = _copy_file(os.path.join(root, name), os.path.join(dst, rel))
        fsync_dir(os.path.join(dst, rel_root))
    return records


def _copy_file(src: str, dst: str, block: int = 8 << 20) -> dict[str, Any]:
    h = xxhash.xxh3_128()
    size = 0
    with open(src, "rb") as fin, open(dst, "xb") as fout:
        while chunk := fin.read(block):
            h.update(chunk)
            fout.write(chunk)
            size += len(chunk)
        fout.flush()
        os.fsync(fout.fileno())
    return {"size": size, "xxh3_128": h.hexdigest()}


# ------------------------------------------------------------------ reading
def read_index(tag_dir: str) -> dict[str, Any]:
    """The validated index of a committed tag (CheckpointNotFound / CorruptCheckpoint)."""
    path = os.path.join(tag_dir, INDEX)
    try:
        with open(path, "rb") as f:
            raw = f.read(16 << 20)
    except FileNotFoundError:
        raise CheckpointNotFound(
            f"{tag_dir} is not a tag saved by safeckpt (no {INDEX}); a DeepSpeed checkpoint "
            "written without safeckpt, or a save that never committed", path=tag_dir,
        ) from None
    try:
        index = json.loads(raw)
        ok = (isinstance(index, dict) and index.get("format") == FORMAT
              and isinstance(index.get("files"), dict) and isinstance(index.get("offload"), dict)
              and isinstance(index.get("seq"), int) and isinstance(index.get("world_size"), int))
    except ValueError:
        ok = False
    if not ok:
        raise CorruptCheckpoint(f"{path} is not a valid safeckpt-deepspeed index", path=tag_dir)
    if index.get("format_version", 0) > FORMAT_VERSION:
        raise CorruptCheckpoint(
            f"{path} has format version {index['format_version']}; this safeckpt reads up to "
            f"{FORMAT_VERSION}: upgrade safeckpt", path=tag_dir,
        )
    for name in index["files"]:
        safe_file_path(tag_dir, name)
    for rank_dir, files in index["offload"].items():
        safe_file_path(tag_dir, rank_dir)
        for rel in files:
            for part in str(rel).split("/"):
                safe_file_path(tag_dir, part)
    return index


def tag_problems(tag_dir: str, index: dict[str, Any]) -> list[str]:
    """Structural problems of a committed tag: each file's checkpoint verifies (sizes, no
    checksums) and every NVMe offload file has its recorded size."""
    problems = []
    for name in sorted(index["files"]):
        report = verify(os.path.join(tag_dir, name), deep=False)
        problems += [f"{name}: {p}" for p in report.problems]
    for rank_dir, files in sorted(index["offload"].items()):
        for rel, rec in sorted(files.items()):
            path = os.path.join(tag_dir, OFFLOAD_DIR, rank_dir, rel)
            size = os.path.getsize(path) if os.path.isfile(path) else None
            if size != rec["size"]:
                problems.append(f"{OFFLOAD_DIR}/{rank_dir}/{rel}: {size} bytes, index says {rec['size']}")
    return problems


def check_offload(tag_dir: str, rank_dir: str, files: dict[str, Any]) -> None:
    """Deep-check one rank's NVMe offload files against their checksums before DeepSpeed
    copies them back into the swap folder."""
    for rel, rec in sorted(files.items()):
        path = os.path.join(tag_dir, OFFLOAD_DIR, rank_dir, rel)
        size, digest = hash_file(path)
        if (size, digest) != (rec["size"], rec["xxh3_128"]):
            raise CorruptCheckpoint(f"{path}: size or checksum differs from the index (corrupt)", path=tag_dir)


def list_tags(save_dir: str | os.PathLike[str]) -> list[TagInfo]:
    """Committed tags under ``save_dir``, oldest first (by commit order). No process group."""
    out = []
    for tag, path, index, _ in _scan(os.fspath(save_dir)):
        if index is not None:
            out.append(TagInfo(tag, path, index["seq"], str(index.get("created_at", "")),
                               index.get("global_steps"), index["world_size"],
                               index.get("zero_stage"), bool(index.get("latest", True))))
    return sorted(out, key=lambda t: (t.seq, t.tag))


def _scan(save_dir: str) -> list[tuple[str, str, dict[str, Any] | None, str]]:
    """(tag, path, index or None, problem) for every tag directory under ``save_dir``:
    committed ones, damaged ones, and ("foreign") tags DeepSpeed wrote without safeckpt."""
    try:
        names = sorted(os.listdir(save_dir))
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        path = os.path.join(save_dir, name)
        if name.startswith(".") or not os.path.isdir(path) or os.path.islink(path):
            continue
        try:
            out.append((name, path, read_index(path), ""))
        except CheckpointNotFound:
            if any(f.endswith("model_states.pt") for f in os.listdir(path)):
                out.append((name, path, None, "foreign"))  # a tag DeepSpeed wrote on its own
        except (CheckpointError, OSError) as exc:
            out.append((name, path, None, str(exc)))
    return out


def pick(save_dir: str, tag: str | None) -> dict[str, Any]:
    """Tags to try, best first: ``tag`` if given, else every tag saved with ``save_latest``,
    newest commit first. Tags that fail the structural check are reported, not returned."""
    candidates: list[str] = []
    notes: list[str] = []
    damaged: list[str] = []
    foreign: list[str] = []
    found = []
    for name, path, index, problem in _scan(save_dir):
        if index is None:
            if problem == "foreign":
                foreign.append(name)
            elif tag is None or name == tag:
                damaged.append(f"tag {name}: {problem}")
            continue
        if tag is not None and name != tag:
            continue
        if tag is None and not index.get("latest", True):
            continue
        found.append((index["seq"], float(index.get("created_unix", 0)), name, path, index))
    for _, _, name, path, index in sorted(found, reverse=True):
        problems = tag_problems(path, index)
        if problems:
            notes.append(f"skipping tag {name} in {save_dir}: " + "; ".join(problems[:5]))
            damaged.append(f"tag {name}: " + "; ".join(problems[:5]))
        else:
            candidates.append(name)
    return {"candidates": candidates, "warnings": notes, "damaged": damaged, "foreign": foreign}
