"""The layout of a Lightning checkpoint in safeckpt, and reading it back offline.

A checkpoint is a safeckpt directory named like Lightning's file (``epoch=3-step=40.ckpt/``)
holding the entries ``model`` (the LightningModule), ``optimizer_<i>``, ``lightning`` (every
other key of Lightning's checkpoint dict, per rank) and ``rng`` (per rank; absent from
weights-only checkpoints). Reading needs no process group and never unpickles.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection

import safeckpt
from safeckpt.engine import frozen as _frozen
from safeckpt.errors import CheckpointNotFound, IncompatibleCheckpoint
from safeckpt.storage.base import is_remote
from safeckpt.storage.catalog import Entry, remove_entry

from .values import decode

MODEL = "model"
LIGHTNING = "lightning"
RNG = "rng"
FROZEN = _frozen.ENTRY  # fingerprints of frozen parameters (strategies' frozen="fingerprint")
FORMAT = "safeckpt-lightning"
OPTIM_RE = re.compile(r"^optimizer_(\d+)$")
NOT_STORED = ("state_dict", "optimizer_states")  # saved from the live objects instead


def optimizer_name(i: int) -> str:
    return f"optimizer_{i}"


class RankLocal:
    """Lightning's dict without model and optimizers, kept per rank: each rank gets back its own
    callbacks, loops and schedulers exactly as they were (a callback may hold rank-local values,
    e.g. metrics logged without ``sync_dist``)."""

    __safeckpt_per_rank__ = True

    def __init__(self, value: dict[str, Any] | None = None) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return self.value if self.value is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.value = state_dict


def metadata(checkpoint: Mapping[str, Any], weights_only: bool) -> dict[str, Any]:
    return {FORMAT: {
        "version": 1,
        "epoch": checkpoint.get("epoch"),
        "global_step": checkpoint.get("global_step"),
        "weights_only": weights_only,
    }}


def step_of(checkpoint: Mapping[str, Any]) -> int | None:
    step = checkpoint.get("global_step")
    return int(step) if isinstance(step, int) and step >= 0 else None


def norm(path: str) -> str:
    """Comparable form of a checkpoint path (Lightning hands over absolute local paths)."""
    return path.rstrip("/") if is_remote(path) else os.path.abspath(path)


def remove(path: str) -> None:
    """Delete a checkpoint so that it never looks complete half-way (rename aside, then delete);
    a plain file or symlink (a legacy ``.ckpt``, ``save_last="link"``) is unlinked."""
    if is_remote(path):
        remove_entry(Entry(os.path.basename(path.rstrip("/")), path, "committed", None))
    elif os.path.islink(path) or os.path.isfile(path):
        os.unlink(path)
    elif os.path.isdir(path):
        remove_entry(Entry(os.path.basename(os.path.normpath(path)), path, "committed", None))


def refuse_file(path: str) -> None:
    """A plain file where a checkpoint directory is expected: most likely a ``torch.save``
    checkpoint from Lightning's default IO, which is never unpickled here. Nothing there:
    Lightning's own ``FileNotFoundError`` message (``CheckpointNotFound`` is one)."""
    if not is_remote(path) and not os.path.exists(path):
        raise CheckpointNotFound(f"Checkpoint file not found: {path}", path=path)
    if not is_remote(path) and os.path.isfile(path):
        raise CheckpointNotFound(
            f"{path} is a file, not a safeckpt checkpoint directory (a checkpoint written by "
            "Lightning's default torch.save IO?). It is not unpickled here; start from its weights "
            "with Lightning's own load_from_checkpoint, or resume from a safeckpt checkpoint.",
            path=path,
        )


def read_checkpoint(path: str | os.PathLike[str], map_location: Any = None) -> dict[str, Any]:
    """Lightning's checkpoint dict from a checkpoint written by this integration (offline, no
    process group, never unpickles): ``state_dict`` with full (unsharded) tensors,
    ``optimizer_states`` (if saved), and everything else as rank 0 saved it (configs, enums,
    paths... rebuilt, see ``safeckpt.integrations._lightning.values``).

    ``map_location`` as ``torch.load`` takes it (tensors are read onto the CPU, location
    ``"cpu"``): None, a device or its name, a dict mapping ``"cpu"`` to one, or a callable
    ``(storage, "cpu") -> storage or None`` (None: leave the tensor where it is).
    """
    refuse_file(os.fspath(path))
    nested = safeckpt.read_state_dict(path, nested=True)
    if MODEL not in nested or LIGHTNING not in nested:
        raise IncompatibleCheckpoint(
            f"{os.fspath(path)} is a safeckpt checkpoint but not a Lightning one (entries: "
            f"{sorted(nested)}; expected {MODEL!r} and {LIGHTNING!r}). Load it with "
            "safeckpt.load or safeckpt.read_state_dict."
        )
    checkpoint = dict(decode(nested[LIGHTNING]))
    checkpoint["state_dict"] = nested[MODEL]
    optims = sorted((int(m.group(1)), k) for k in nested if (m := OPTIM_RE.match(k)))
    if optims:
        checkpoint["optimizer_states"] = [nested[k] for _, k in optims]
    if FROZEN in nested:
        # Frozen parameters were saved as fingerprints: ``state_dict`` lacks them, and this key
        # holds the fingerprints (:func:`fill_frozen` checks a live module against them).
        checkpoint[FROZEN] = nested[FROZEN]
    return map_tensors(checkpoint, map_location)


def fill_frozen(module: torch.nn.Module, checkpoint: dict[str, Any]) -> None:
    """Verify ``module``'s live frozen parameters against the fingerprints in ``checkpoint``
    (``IncompatibleCheckpoint`` naming each tensor that differs) and add them to its
    ``state_dict`` entry, so that the module's ``load_state_dict`` gets a complete dict."""
    saved = checkpoint.pop(FROZEN, None)
    if saved is None:
        return
    live = _frozen.frozen_tensors(module)
    problems = _frozen.compare({MODEL: live} if live else {}, saved)
    if problems:
        raise IncompatibleCheckpoint(
            "the module's frozen parameters are not the ones this checkpoint was trained on (a "
            "different base model?); nothing was loaded:\n  " + "\n  ".join(problems[:20]))
    sd = checkpoint.setdefault("state_dict", {})
    for name, t in live.items():
        sd.setdefault(name, t.detach())


def map_tensors(checkpoint: dict[str, Any], map_location: Any) -> dict[str, Any]:
    """Apply a ``torch.load``-style ``map_location`` to CPU tensors."""
    if map_location is None:
        return checkpoint
    if isinstance(map_location, Mapping):
        if "cpu" not in map_location:
            return checkpoint
        map_location = map_location["cpu"]
    if callable(map_location) and not isinstance(map_location, (str, torch.device)):
        fn = map_location

        def move(t: torch.Tensor) -> torch.Tensor:
            out = fn(t.untyped_storage(), "cpu")
            device = getattr(out, "device", None)
            return t if device is None or torch.device(device) == t.device else t.to(device)

        return apply_to_collection(checkpoint, torch.Tensor, move, allow_frozen=True)
    device = torch.device(map_location)
    return apply_to_collection(checkpoint, torch.Tensor, lambda t: t.to(device), allow_frozen=True)


def is_lightning_checkpoint(path: Any) -> bool:
    """A local directory (or URL) holding a committed safeckpt checkpoint (cheap check)."""
    try:
        p = os.fspath(path)
    except TypeError:
        return False
    if not isinstance(p, str):
        return False
    if not is_remote(p) and not os.path.isdir(p):
        return False
    from safeckpt.engine.reader import open_manifest

    try:
        open_manifest(p, full=False)
    except Exception:  # noqa: BLE001 - not ours: the caller's own loader decides
        return False
    return True
