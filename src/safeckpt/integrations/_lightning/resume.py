"""Which checkpoint a Lightning run resumes from, decided once for all ranks.

``ckpt_path="last"`` reaches the strategy as whichever ``last*.ckpt`` each rank found newest by
mtime. Such a request (or one for a preemption or on-exception checkpoint) is resolved again on
rank 0: every committed checkpoint in the trainer's checkpoint directories that verifies, newest
commit first; all ranks then try them in that order. Any other path is used as given and must
be the same on every rank.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Mapping
from typing import Any

from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint

import safeckpt
from safeckpt.coord.dist import Coordinator
from safeckpt.engine.reader import open_manifest
from safeckpt.errors import CheckpointNotFound, CorruptCheckpoint, RankMismatch, SafeckptWarning
from safeckpt.storage.catalog import sweep

from .format import norm, refuse_file
from .preempt import SafeckptPreemption


def agree_on_checkpoint(trainer: Trainer, requested: str, timeout: float | None) -> list[dict[str, Any]]:
    """The checkpoints to try, newest first, decided by rank 0 and the same on every rank.

    ``ckpt_path="last"`` reaches the strategy as whichever ``last*.ckpt`` each rank found newest
    by mtime. Such a request (or one for a preemption/on-exception checkpoint) is re-resolved
    here: every committed checkpoint in the trainer's checkpoint directories that verifies,
    newest commit first. Any other path is used as given and must be the same on every rank.
    """
    sources = _checkpoint_sources(trainer)
    is_last = _is_last_request(requested, sources)
    coord = Coordinator(timeout, what=f"choice of the checkpoint to load ({requested})")
    asked = coord.run("resume-request", lambda: {"path": requested, "last": is_last})
    if not all(a["last"] for a in asked) and any(a["path"] != asked[0]["path"] for a in asked):
        raise RankMismatch(
            "resume: ranks asked for different checkpoints: "
            + ", ".join(f"rank {r}: {a['path']!r}" for r, a in enumerate(asked))
            + ". Pass the same ckpt_path on every rank."
        )
    last = all(a["last"] for a in asked)
    picked = coord.run("resume-pick", lambda: _pick(requested, sources, last) if coord.is_coordinator else None)[0]
    for note in picked["notes"]:
        warnings.warn(note, SafeckptWarning, stacklevel=3)
    return picked["candidates"]


def _checkpoint_sources(trainer: Trainer) -> dict[str, Any]:
    """Where this trainer's checkpoints live: directories and "last"-style file names."""
    dirs: set[str] = set()
    last_names: list[tuple[str, re.Pattern[str], str]] = []
    paths: set[str] = set()
    for cb in trainer.callbacks:
        if isinstance(cb, ModelCheckpoint) and cb.dirpath:
            d = norm(os.fspath(cb.dirpath))
            dirs.add(d)
            last_names.append((d, re.compile(rf"^{re.escape(cb.CHECKPOINT_NAME_LAST)}(-(\d+))?"), cb.FILE_EXTENSION))
        elif isinstance(cb, OnExceptionCheckpoint):
            paths.add(norm(cb.ckpt_path))
        elif isinstance(cb, SafeckptPreemption):
            paths.add(norm(cb.path(trainer)))
    dirs |= {os.path.dirname(p) for p in paths}
    return {"dirs": sorted(dirs), "last": last_names, "paths": sorted(paths)}


def _is_last_request(requested: str, sources: Mapping[str, Any]) -> bool:
    req = norm(requested)
    if req in sources["paths"]:
        return True
    parent, name = os.path.split(req)
    stem, ext = os.path.splitext(name)
    return any(parent == d and ext == suffix and pattern.match(stem) for d, pattern, suffix in sources["last"])


def _pick(requested: str, sources: Mapping[str, Any], last: bool) -> dict[str, Any]:
    """Coordinator: candidates (path, entries, world size) newest first, plus warnings."""
    if not last:
        refuse_file(requested)
        return {"candidates": [_describe(requested, open_manifest(requested))], "notes": []}
    _sweep(sources)
    found: list[tuple[float, int, dict[str, Any]]] = []
    notes: list[str] = []
    damaged: list[str] = []
    for path in sorted(_listed(sources) | {norm(requested)}):
        try:
            man = open_manifest(path)
        except CheckpointNotFound:
            if os.path.isfile(path):
                notes.append(f"ignoring {path}: not a safeckpt checkpoint (a torch.save file?)")
            continue
        except CorruptCheckpoint as exc:
            notes.append(f"ignoring {path}: {exc}")
            damaged.append(f"{path}: {exc}")
            continue
        report = safeckpt.verify(path, deep=False)
        if not report.ok:
            notes.append(f"ignoring {path}: " + "; ".join(report.problems))
            damaged.append(f"{path}: " + "; ".join(report.problems))
            continue
        found.append((float(man.get("created_unix", 0.0)), man.get("step") or -1, _describe(path, man)))
    if not found:
        if damaged:
            raise CorruptCheckpoint(
                "no checkpoint could be loaded (refusing to start fresh when checkpoints exist):\n  "
                + "\n  ".join(damaged)
            )
        raise CheckpointNotFound(
            f"{requested}: no safeckpt checkpoint found in {sources['dirs']}", path=requested
        )
    found.sort(key=lambda f: (f[0], f[1]), reverse=True)
    return {"candidates": [f[2] for f in found], "notes": notes}


def _sweep(sources: Mapping[str, Any]) -> None:
    """Delete what killed saves left in the checkpoint directories (hidden staging and trash
    directories); at resume nothing of this job is being saved."""
    for d in sources["dirs"]:
        sweep(d)  # also puts back a checkpoint an overwrite killed between its renames set aside


def _listed(sources: Mapping[str, Any]) -> set[str]:
    """Checkpoint-like names (``*.ckpt``, not hidden) in the checkpoint directories."""
    out = set(sources["paths"])
    for d in sources["dirs"]:
        fs = get_filesystem(d)
        if not fs.exists(d):
            continue
        for p in fs.ls(d, detail=False):
            name = os.path.basename(norm(p))
            if name.endswith(".ckpt") and not name.startswith("."):
                out.add(os.path.join(d, name))
    return out


def _describe(path: str, man: Mapping[str, Any]) -> dict[str, Any]:
    return {"path": path, "entries": sorted(man["objects"]), "world_size": int(man.get("world_size", 1))}


TIER_LAST = "safeckpt-tier://last"  # ckpt_path="last" of a strategy with local_dir, until resolved


def serve_tier_last(mixin: type) -> None:
    """``ckpt_path="last"`` for a strategy with ``local_dir``: Lightning resolves "last" from the
    files in the checkpoint directories before the process group exists, so it would start
    fresh when the newest steps are on the nodes only. Its connector's ``_parse_ckpt_path``
    returns a placeholder for such a strategy instead, and ``resume_start`` (process group up)
    has the strategy resolve it (``resolve_tier_last``: the newest step across the tiers) and
    loads that, or starts fresh when no tier holds a step. Idempotent; other strategies and
    other requests are Lightning's, unchanged."""
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

    if getattr(_CheckpointConnector._parse_ckpt_path, "_safeckpt", False):
        return
    parse, resume = _CheckpointConnector._parse_ckpt_path, _CheckpointConnector.resume_start

    def tiered(connector: Any) -> Any:
        strategy = connector.trainer.strategy
        return strategy if isinstance(strategy, mixin) and getattr(strategy, "local_dir", None) else None

    def _parse_ckpt_path(self: Any, state_fn: Any, ckpt_path: Any, model_provided: bool,
                         model_connected: bool) -> Any:
        if ckpt_path == "last" and tiered(self) is not None:
            return TIER_LAST
        return parse(self, state_fn, ckpt_path, model_provided=model_provided, model_connected=model_connected)

    def resume_start(self: Any, checkpoint_path: Any = None, weights_only: Any = None) -> None:
        strategy = tiered(self)
        if checkpoint_path == TIER_LAST and strategy is not None:
            checkpoint_path = strategy.resolve_tier_last(self.trainer)
            if checkpoint_path is None:
                from lightning.pytorch.utilities.rank_zero import rank_zero_warn

                rank_zero_warn('ckpt_path="last": no checkpoint on any tier (local_dir, peers, the '
                               "checkpoint directory); training starts fresh")
                self._ckpt_path = None
                return
        resume(self, checkpoint_path, weights_only)

    _parse_ckpt_path._safeckpt = True  # type: ignore[attr-defined]
    _CheckpointConnector._parse_ckpt_path = _parse_ckpt_path
    _CheckpointConnector.resume_start = resume_start
