"""Which checkpoint a restore loads: the newest committed one under a root that verifies.

Run on the coordinator only (the manager shares its answer with every rank). The root is
listed once and the checkpoint directories are ordered newest first by the step in their
names, without reading anything else; then they are judged one at a time, newest first, and
judging stops at the first that passes the cheap verify (manifest, every file present with its
size, the extra files). Each judged checkpoint costs one manifest read and one lookup per file
(on an object store a HEAD each, ``CHECK_THREADS`` at a time, see ``engine.offline``); the
older ones are left unjudged in ``rest``, and judged only if the newer one fails to load
(:func:`judge` again, on the coordinator, just before the next load is tried).

Checking every kept checkpoint instead (each manifest read twice, two HEADs per file, one
after another) made a restore of 20 kept checkpoints of 1,024 files on S3 ~41,000 serial
requests inside a timed phase.

A directory is judged as the catalog's scan judges it (``storage.catalog``): a readable manifest
is a committed checkpoint; an unreadable one is corrupt (damaged history: a restore that finds
nothing else raises rather than starting fresh); none at all is a save in progress or killed
(its leftovers), a checkpoint being deleted, or, under safeckpt's own name pattern, an
incomplete directory (said in a warning).
"""

from __future__ import annotations

from typing import Any

from ..errors import CheckpointError, CheckpointNotFound, StorageError
from ..storage.base import Storage
from ..storage.catalog import DirName, _inspect, _match
from .offline import verify_on

ATTEMPTS = 10  # listings of the root while every directory listed vanishes before it is judged


def queue(store: Storage, root: str, dirnames: tuple[DirName, ...], step: int | None) -> list[list[Any]]:
    """``[step, path, name, default_name]`` of every checkpoint directory under ``root`` (of
    ``step`` only, if given), newest first, from one listing; nothing is read."""
    out = []
    items = store.list(root) or []
    names = {i.name for i in items}
    for item in items:
        if item.kind != "dir":
            continue
        found, default_name = _match(item.name, dirnames)
        if found is None:
            final = _replaced_final(item.name) if store.renames else None
            if final is None:
                continue
            # An overwrite killed between its two renames (filesystems without an atomic swap):
            # the checkpoint set aside is the step's while nothing holds its name.
            found, default_name = _match(final, dirnames)
            if found is None or final in names:
                continue
        if step is None or found == step:
            out.append([found, store.join(root, item.name), item.name, default_name])
    out.sort(key=lambda c: (c[0], c[2]), reverse=True)
    return out


def _replaced_final(name: str) -> str | None:
    try:
        from ..storage.posix import replaced_final
    except ImportError:  # a storage layer without replaced directories
        return None
    return replaced_final(name)


def judge(store: Storage, pending: list[list[Any]]) -> dict[str, Any]:
    """Judge ``pending`` (from :func:`queue`) newest first until one verifies.

    Returns ``candidates``: ``[[step, path]]`` of the one that verified (or none), ``rest``:
    those not judged yet (older), ``warnings``: notes to show on every rank, ``damaged``:
    reasons of checkpoints that exist but cannot be used, ``vanished``: how many were gone
    when judged (deleted meanwhile)."""
    notes: list[str] = []
    damaged: list[str] = []
    vanished = 0
    for i, (step, path, name, default_name) in enumerate(pending):
        try:
            man = store.read_manifest(path)
        except CheckpointNotFound:
            # no manifest: leftovers of a save, a deleted checkpoint, or an incomplete directory
            entries = _inspect(store, name, path, step, False, True, default_name)
            if not entries:
                vanished += 1
            for e in entries:
                if e.status == "incomplete":
                    notes.append(f"ignoring {e.path}: {e.status} ({e.problem})")
                elif e.status == "committed":  # its manifest landed meanwhile
                    return _judged(store, pending, i, e.path, step, None, notes, damaged, vanished)
            continue
        except StorageError:
            raise  # the storage failed (after retries), not the checkpoint: never a fallback
        except (CheckpointError, OSError) as exc:
            notes.append(f"ignoring {path}: corrupt ({exc})")
            damaged.append(f"step {step}: unreadable manifest ({exc})")
            continue
        out = _judged(store, pending, i, path, step, man, notes, damaged, vanished)
        if out["candidates"]:
            return out
    return {"candidates": [], "rest": [], "warnings": notes, "damaged": damaged, "vanished": vanished}


def _judged(store: Storage, pending: list[list[Any]], i: int, path: str, step: int, man: dict[str, Any] | None,
            notes: list[str], damaged: list[str], vanished: int) -> dict[str, Any]:
    """The answer if the committed checkpoint ``pending[i]`` verifies; else its problems are
    noted and the answer has no candidate (the caller goes on)."""
    report = verify_on(store, path, deep=False, indexes=False, manifest=man)
    if report.ok:
        return {"candidates": [[step, path]], "rest": pending[i + 1 :], "warnings": notes,
                "damaged": damaged, "vanished": vanished}
    notes.append(f"skipping checkpoint step {step} at {path}: " + "; ".join(report.problems))
    damaged.append(f"step {step}: " + "; ".join(report.problems))
    return {"candidates": [], "rest": [], "warnings": notes, "damaged": damaged, "vanished": vanished}


def first_valid(store: Storage, root: str, dirnames: tuple[DirName, ...], step: int | None) -> dict[str, Any]:
    """:func:`judge` of the whole root: the newest checkpoint that verifies, and the older
    ones left to judge. If every directory listed vanished before it was judged (retention
    of a job still running deleted them after committing newer ones), the root is listed
    again, so a restore never starts fresh while a checkpoint exists."""
    seen: set[str] = set()
    out: dict[str, Any] = {"candidates": [], "rest": [], "warnings": [], "damaged": [], "vanished": 0}
    for _ in range(ATTEMPTS):
        pending = [c for c in queue(store, root, dirnames, step) if c[1] not in seen]
        if not pending:
            break
        seen.update(c[1] for c in pending)
        got = judge(store, pending)
        out = {**got, "warnings": out["warnings"] + got["warnings"], "damaged": out["damaged"] + got["damaged"]}
        if got["candidates"] or not got["vanished"]:
            break
    return out
