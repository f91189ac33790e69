"""What is under a checkpoint root: committed steps, leftovers, and things we do not own.

Read-only and lock-free: any process may scan a root at any time. A directory counts as a
committed checkpoint only if its name is a step name and it holds a valid manifest; publication
is one atomic rename, so a reader never sees a partial one. Staging and trash directories are
hidden (leading dot) and recognised by their markers; anything else is *foreign* and is never
touched by retention or gc.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ._commit import remove_tree
from ._manifest import MANIFEST, STAGING_MARK, TRASH_MARK, CheckpointInfo, read_manifest
from ._storage import is_remote
from .errors import CheckpointError

STEP_PREFIX = "step-"
_STEP_RE = re.compile(r"^step-(\d{10,})$")
_LEFTOVER_RE = re.compile(r"^\.(.+?)(" + re.escape(STAGING_MARK) + "|" + re.escape(TRASH_MARK) + r")[0-9a-f]+$")


def step_dirname(step: int) -> str:
    """Zero-padded so names sort like numbers: ``step-0000001200``."""
    return f"{STEP_PREFIX}{step:010d}"


def parse_step(name: str) -> int | None:
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class Entry:
    """One directory under a root and what we make of it."""

    name: str
    path: str
    status: str  # "committed" | "staging" | "trash" | "incomplete" | "corrupt"
    step: int | None
    info: CheckpointInfo | None = None
    problem: str = ""
    files: tuple[str, ...] = ()  # object-store leftovers: the stray objects (see _remote.scan)


def scan(root: str, attempts: int = 10) -> list[Entry]:
    """Every safeckpt-related directory under ``root``, by step then name; [] if root is absent.

    Lock-free against a concurrent writer: if an entry vanished between the listing and its
    inspection (a staging dir just published, an old checkpoint just moved aside by retention),
    the listing is stale and may miss the checkpoint that replaced it, so we list again.
    A remote root (fsspec URL) is scanned by :func:`safeckpt._remote.scan`.
    """
    if is_remote(root):
        from ._remote import scan as remote_scan

        return remote_scan(root)
    for _ in range(attempts - 1):
        out = _scan_once(root)
        if out is not None:
            return out
    return _scan_once(root, retry=False) or []


def _scan_once(root: str, retry: bool = True) -> list[Entry] | None:
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    out: list[Entry] = []
    for name in sorted(names):
        path = os.path.join(root, name)
        if not os.path.isdir(path) or os.path.islink(path):
            if retry and not os.path.lexists(path):
                return None  # vanished while we looked
            continue
        leftover = _LEFTOVER_RE.match(name)
        if leftover:
            kind = "staging" if leftover.group(2) == STAGING_MARK else "trash"
            out.append(Entry(name, path, kind, parse_step(leftover.group(1))))
            continue
        step = parse_step(name)
        if step is None:
            continue  # foreign: not ours, never touched
        if not os.path.isfile(os.path.join(path, MANIFEST)):
            if retry and not os.path.lexists(path):
                return None
            out.append(Entry(name, path, "incomplete", step, problem=f"no {MANIFEST}"))
            continue
        try:
            man = read_manifest(path)
        except FileNotFoundError:
            if retry:
                return None
            continue  # deleted while we looked
        except (CheckpointError, OSError) as exc:
            out.append(Entry(name, path, "corrupt", step, problem=str(exc)))
            continue
        out.append(Entry(name, path, "committed", step, CheckpointInfo.from_manifest(path, man)))
    out.sort(key=lambda e: (e.step if e.step is not None else -1, e.name))
    return out


def leftovers(root: str) -> list[Entry]:
    """Staging/trash leftovers only: on a local root, from names alone (no manifest is read, so
    the sweep before every save stays cheap however many checkpoints are kept)."""
    if is_remote(root):
        return [e for e in scan(root) if e.status in ("staging", "trash")]
    try:
        names = sorted(os.listdir(root))
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        m = _LEFTOVER_RE.match(name)
        path = os.path.join(root, name)
        if m and os.path.isdir(path) and not os.path.islink(path):
            kind = "staging" if m.group(2) == STAGING_MARK else "trash"
            out.append(Entry(name, path, kind, parse_step(m.group(1))))
    return out


def committed(root: str) -> list[Entry]:
    if is_remote(root):
        from ._remote import scan as remote_scan

        return [e for e in remote_scan(root, leftovers=False) if e.status == "committed"]
    return [e for e in scan(root) if e.status == "committed"]


def remove_entry(entry: Entry) -> None:
    """Delete a leftover or a committed checkpoint so that it never looks committed half-way."""
    if is_remote(entry.path):
        from ._remote import remove

        remove(entry)
    else:
        remove_tree(entry.path)
