"""PyTorch Lightning: collective, atomic, pickle-free checkpoints through Lightning's own hooks.

Lightning (2.4-2.6) saves through ``Strategy.save_checkpoint``, which calls the ``CheckpointIO`` on
global rank 0 only (FSDP and ModelParallel bypass it and write DCP plus a pickled ``meta.pt`` in
place), and resumes from ``ckpt_path="last"`` by file mtime on each rank. This module moves the
whole checkpoint lifecycle into the strategy, where every rank takes part:

- :class:`SafeckptStrategyMixin` (and the ready-made :class:`SafeckptDDPStrategy`,
  :class:`SafeckptFSDPStrategy`, :class:`SafeckptModelParallelStrategy`) overrides save, load and
  remove so they run collectively on every rank: the live LightningModule and optimizers are
  written (sharded ones as shards, no gather) and loaded in place (resharding onto any world
  size); the rest of Lightning's dict (loops, callbacks with ModelCheckpoint's ``best_k_models``,
  schedulers, hyper-parameters, precision and datamodule state) is stored exactly, per rank, as
  JSON plus tensors; each rank's RNG state is saved too. ``ckpt_path="last"`` becomes the newest
  checkpoint that verifies, chosen once by rank 0 for all ranks, falling back to older ones.
- :class:`SafeckptPreemption`: SIGTERM/SIGUSR1 on any rank makes every rank save the same step
  and stop (the signal handler only sets a flag; agreement is one all-reduce per batch).
- :class:`SafeckptIO`: a plain ``CheckpointIO`` for single-process training.
- :func:`read_checkpoint` / :func:`load_from_checkpoint`: offline, any machine, no pickle.

Checkpoints are safeckpt directories named like Lightning's files (``epoch=3-step=40.ckpt/``).
Entries: ``model`` (the LightningModule), ``optimizer_<i>``, ``lightning`` (everything else in
Lightning's dict, per rank) and ``rng`` (per rank; absent from weights-only checkpoints).

Not done here: DeepSpeed (its engine has its own hooks), ``AsyncCheckpointIO`` (use the
strategy; its saves are synchronous), ``save_last="link"`` stays Lightning's non-atomic symlink.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.core.saving import _load_state
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from lightning_utilities.core.apply_func import apply_to_collection

import safeckpt

# Internal safeckpt helpers used here (one place, so a rename breaks one import):
# the coordinator for agreed decisions, the manifest reader, and atomic removal.
from safeckpt._catalog import Entry, leftovers, remove_entry
from safeckpt._dist import Coordinator
from safeckpt._reader import open_manifest
from safeckpt._storage import is_remote
from safeckpt.errors import (
    CheckpointError,
    CheckpointNotFound,
    CorruptCheckpoint,
    IncompatibleCheckpoint,
    RankMismatch,
    SafeckptWarning,
)

__all__ = [
    "SafeckptDDPStrategy",
    "SafeckptFSDPStrategy",
    "SafeckptIO",
    "SafeckptModelParallelStrategy",
    "SafeckptPreemption",
    "SafeckptStrategyMixin",
    "load_from_checkpoint",
    "read_checkpoint",
]

MODEL = "model"
LIGHTNING = "lightning"
RNG = "rng"
FORMAT = "safeckpt-lightning"
_OPTIM_RE = re.compile(r"^optimizer_(\d+)$")
_NOT_STORED = ("state_dict", "optimizer_states")  # saved from the live objects instead


def _optimizer_name(i: int) -> str:
    return f"optimizer_{i}"


class _RankLocal:
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


def _metadata(checkpoint: Mapping[str, Any], weights_only: bool) -> dict[str, Any]:
    return {FORMAT: {
        "version": 1,
        "epoch": checkpoint.get("epoch"),
        "global_step": checkpoint.get("global_step"),
        "weights_only": weights_only,
    }}


def _step_of(checkpoint: Mapping[str, Any]) -> int | None:
    step = checkpoint.get("global_step")
    return int(step) if isinstance(step, int) and step >= 0 else None


def _norm(path: str) -> str:
    return path.rstrip("/") if is_remote(path) else os.path.normpath(path)


def _remove(path: str) -> None:
    """Delete a checkpoint so that it never looks complete half-way (rename aside, then delete);
    a plain file or symlink (a legacy ``.ckpt``, ``save_last="link"``) is unlinked."""
    if is_remote(path):
        remove_entry(Entry(os.path.basename(path.rstrip("/")), path, "committed", None))
    elif os.path.islink(path) or os.path.isfile(path):
        os.unlink(path)
    elif os.path.isdir(path):
        remove_entry(Entry(os.path.basename(os.path.normpath(path)), path, "committed", None))


# --------------------------------------------------------------------------- offline reading


def read_checkpoint(path: str | os.PathLike[str], map_location: Any = None) -> dict[str, Any]:
    """Lightning's checkpoint dict from a checkpoint written by this integration (offline, no
    process group, never unpickles): ``state_dict`` with full (unsharded) tensors,
    ``optimizer_states`` (if saved), and everything else as rank 0 saved it.

    ``map_location``: None (CPU) or a device to move every tensor to.
    """
    nested = safeckpt.read_state_dict(path, nested=True)
    if MODEL not in nested or LIGHTNING not in nested:
        raise IncompatibleCheckpoint(
            f"{os.fspath(path)} is a safeckpt checkpoint but not a Lightning one (entries: "
            f"{sorted(nested)}; expected {MODEL!r} and {LIGHTNING!r}). Load it with "
            "safeckpt.load or safeckpt.read_state_dict."
        )
    checkpoint = dict(nested[LIGHTNING])
    checkpoint["state_dict"] = nested[MODEL]
    optims = sorted((int(m.group(1)), k) for k in nested if (m := _OPTIM_RE.match(k)))
    if optims:
        checkpoint["optimizer_states"] = [nested[k] for _, k in optims]
    if map_location is not None:
        device = torch.device(map_location)
        checkpoint = apply_to_collection(checkpoint, torch.Tensor, lambda t: t.to(device))
    return checkpoint


def load_from_checkpoint(
    cls: type[LightningModule] | type[LightningDataModule],
    path: str | os.PathLike[str],
    map_location: Any = None,
    strict: bool | None = None,
    **kwargs: Any,
) -> LightningModule | LightningDataModule:
    """``cls.load_from_checkpoint(path)`` for a safeckpt checkpoint: build the module from the
    saved hyper-parameters (``kwargs`` override them) and load the weights, through Lightning's
    own loading code (``on_load_checkpoint``, ``configure_model``, ``strict_loading``). A
    checkpoint written by FSDP2 on N ranks loads into the plain module (tensors are unsharded)."""
    checkpoint = read_checkpoint(path, map_location)
    checkpoint.setdefault(cls.CHECKPOINT_HYPER_PARAMS_KEY, {})
    checkpoint[cls.CHECKPOINT_HYPER_PARAMS_KEY].update(kwargs)
    if issubclass(cls, LightningDataModule):
        return _load_state(cls, checkpoint, **kwargs)
    return _load_state(cls, checkpoint, strict=strict, **kwargs)


# --------------------------------------------------------------------------- CheckpointIO


class SafeckptIO(CheckpointIO):
    """A ``CheckpointIO`` writing safeckpt checkpoints, for **single-process** training.

    ``Trainer(plugins=[SafeckptIO()])``. Saves are atomic (complete or invisible) and replace an
    existing checkpoint atomically; loads never unpickle. Under DDP/FSDP Lightning calls a
    CheckpointIO on rank 0 only, which cannot drive a collective save: use a Safeckpt strategy.
    """

    def __init__(self, timeout: float | None = None) -> None:
        self.timeout = timeout

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("SafeckptIO.save_checkpoint does not take storage_options")
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise CheckpointError(
                f"SafeckptIO cannot save {os.fspath(path)} in a {dist.get_world_size()}-process job: "
                "Lightning calls a CheckpointIO on global rank 0 only, and a safeckpt save needs every "
                "rank. Use strategy=SafeckptDDPStrategy() / SafeckptModelParallelStrategy() "
                "(safeckpt.integrations.lightning) instead of the plugin."
            )
        state: dict[str, Any] = {MODEL: checkpoint.get("state_dict", {})}
        for i, opt_state in enumerate(checkpoint.get("optimizer_states", [])):
            state[_optimizer_name(i)] = opt_state
        state[LIGHTNING] = {k: v for k, v in checkpoint.items() if k not in _NOT_STORED}
        safeckpt.save(
            os.fspath(path), state, overwrite=True, step=_step_of(checkpoint),
            metadata=_metadata(checkpoint, "optimizer_states" not in checkpoint), timeout=self.timeout,
        )

    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None) -> dict[str, Any]:
        if map_location is not None and not isinstance(map_location, (str, torch.device)):
            map_location = None  # Lightning's storage callables keep tensors where they are: CPU here
        return read_checkpoint(path, map_location)

    def remove_checkpoint(self, path: Any) -> None:
        _remove(os.fspath(path))


# --------------------------------------------------------------------------- strategies


class SafeckptStrategyMixin:
    """Collective, atomic, in-place checkpointing for a Lightning ``ParallelStrategy``.

    Put it first in the bases: ``class MyStrategy(SafeckptStrategyMixin, DDPStrategy)``.
    ``save_checkpoint``, ``load_checkpoint`` and ``remove_checkpoint`` run on every rank (Lightning
    already calls them on every rank; only their bodies were gated on rank 0). Restoring happens
    after ``strategy.setup``, when the optimizers exist, so everything loads in one collective
    call in place. ``checkpoint_timeout`` is how long a rank waits for the others (safeckpt's
    ``timeout``); ``save_rng=False`` leaves the RNG state out.
    """

    def __init__(self, *args: Any, checkpoint_timeout: float | None = None, save_rng: bool = True,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.checkpoint_timeout = checkpoint_timeout
        self.save_rng = save_rng

    # Lightning asks the strategy for these while building its dict; the live objects are saved
    # instead, so nothing is gathered or copied (no full state dict on rank 0).
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {}

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # loaded in place by load_checkpoint

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # loaded in place by load_checkpoint

    # ------------------------------------------------------------------ save
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Every rank: write the live module, optimizers, RNG and the rest of ``checkpoint``."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take storage_options")
        full = "optimizer_states" in checkpoint  # absent when weights_only
        state: dict[str, Any] = {MODEL: self.lightning_module}
        if full:
            for i, opt in enumerate(self.optimizers):
                state[_optimizer_name(i)] = getattr(opt, "_optimizer", opt)
            if self.save_rng:
                state[RNG] = safeckpt.RNGState()
        state[LIGHTNING] = _RankLocal({k: v for k, v in checkpoint.items() if k not in _NOT_STORED})
        self._sync_ddp_buffers()
        safeckpt.save(
            os.fspath(filepath), state, overwrite=True, step=_step_of(checkpoint),
            metadata=_metadata(checkpoint, not full), timeout=self.checkpoint_timeout,
        )

    def _sync_ddp_buffers(self) -> None:
        """DDP with ``broadcast_buffers`` (the default) replaces every rank's buffers (BatchNorm
        statistics) with rank 0's at the next forward; do it now, so the checkpoint (written once
        for all ranks) equals the live state on every rank."""
        ddp = getattr(self, "model", None)
        if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel) or not ddp.broadcast_buffers:
            return
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return
        with torch.no_grad():
            for buf in ddp.module.buffers():
                dist.broadcast(buf, src=0)

    # ------------------------------------------------------------------ remove
    def remove_checkpoint(self, filepath: Any) -> None:
        """Every rank: rank 0 deletes atomically; a failure is raised on every rank."""
        path = os.fspath(filepath)
        coord = Coordinator(self.checkpoint_timeout, what=f"removal of {path}")
        paths = coord.run("remove-agree", lambda: path)
        if any(p != paths[0] for p in paths):
            raise RankMismatch(f"remove_checkpoint: ranks were called with different paths: {paths}")
        coord.run("remove", lambda: _remove(path) if coord.is_coordinator else None)

    # ------------------------------------------------------------------ load
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Every rank: agree on the checkpoint (for a "last" request, the newest that verifies),
        load model, optimizers and RNG in place, and return the rest of Lightning's dict."""
        trainer = self.lightning_module.trainer
        fitting = trainer.state.fn == TrainerFn.FITTING
        candidates = _agree_on_checkpoint(trainer, os.fspath(checkpoint_path), self.checkpoint_timeout)
        reasons: list[str] = []
        for i, cand in enumerate(candidates):
            try:
                rest = self._load_one(cand, fitting)
            except (CorruptCheckpoint, CheckpointNotFound) as exc:
                if len(candidates) == 1:
                    raise
                reasons.append(f"{cand['path']}: {exc}")
                if i + 1 < len(candidates):
                    warnings.warn(
                        f"checkpoint {cand['path']} could not be loaded, falling back to "
                        f"{candidates[i + 1]['path']}: {exc}", SafeckptWarning, stacklevel=2,
                    )
                continue
            if _norm(cand["path"]) != _norm(os.fspath(checkpoint_path)):
                rank_zero_info(f"safeckpt: resuming from {cand['path']} (newest valid checkpoint)")
            # Lightning protects the checkpoint it resumed from against top-k deletion.
            trainer._checkpoint_connector._ckpt_path = cand["path"]
            return rest
        raise CorruptCheckpoint(
            "no checkpoint could be loaded (refusing to start fresh when checkpoints exist):\n  "
            + "\n  ".join(reasons)
        )

    def _load_one(self, cand: dict[str, Any], fitting: bool) -> dict[str, Any]:
        entries = set(cand["entries"])
        holder = _RankLocal()
        state: dict[str, Any] = {MODEL: self.lightning_module, LIGHTNING: holder}
        if fitting and self.optimizers:
            if not any(_OPTIM_RE.match(e) for e in entries):
                raise IncompatibleCheckpoint(
                    f"{cand['path']} holds no optimizer state (saved with save_weights_only=True): "
                    "training cannot resume from it. Start from its weights with "
                    "load_from_checkpoint(...), or resume from a full checkpoint."
                )
            for i, opt in enumerate(self.optimizers):
                state[_optimizer_name(i)] = getattr(opt, "_optimizer", opt)
            if RNG in entries:
                state[RNG] = safeckpt.RNGState()
        left_out = sorted(entries - set(state))
        model_strict = self.lightning_module.strict_loading
        with warnings.catch_warnings():
            # Ranks the saving run did not have get rank 0's Lightning state below.
            warnings.filterwarnings("ignore", message=f"'{LIGHTNING}' is per-rank state", category=SafeckptWarning)
            info = safeckpt.load(cand["path"], state, strict=model_strict and not left_out,
                                 timeout=self.checkpoint_timeout)
        if model_strict and left_out:
            # Entries deliberately not loaded (optimizers, RNG outside fit) are the only
            # acceptable differences; anything else breaks strict loading.
            other = [s for s in info.skipped if not any(s.startswith(f"unexpected entry {n!r}") for n in left_out)]
            if other:
                raise IncompatibleCheckpoint(
                    f"checkpoint {cand['path']} does not fit the model (strict loading):\n  "
                    + "\n  ".join(other[:40])
                    + "\nSet LightningModule.strict_loading = False to load what fits."
                )
        rest = holder.value
        if info.world_size < self.world_size:
            # Saved by fewer ranks: new ranks take rank 0's loops/callbacks (as Lightning does).
            fallback = self.broadcast(rest if self.global_rank == 0 else None, src=0)
            if rest is None:
                rest = fallback
        return dict(rest or {})


def _agree_on_checkpoint(trainer: Trainer, requested: str, timeout: float | None) -> list[dict[str, Any]]:
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
            d = _norm(os.fspath(cb.dirpath))
            dirs.add(d)
            last_names.append((d, re.compile(rf"^{re.escape(cb.CHECKPOINT_NAME_LAST)}(-(\d+))?"), cb.FILE_EXTENSION))
        elif isinstance(cb, OnExceptionCheckpoint):
            paths.add(_norm(cb.ckpt_path))
        elif isinstance(cb, SafeckptPreemption):
            paths.add(_norm(cb.path(trainer)))
    dirs |= {os.path.dirname(p) for p in paths}
    return {"dirs": sorted(dirs), "last": last_names, "paths": sorted(paths)}


def _is_last_request(requested: str, sources: Mapping[str, Any]) -> bool:
    req = _norm(requested)
    if req in sources["paths"]:
        return True
    parent, name = os.path.split(req)
    stem, ext = os.path.splitext(name)
    return any(parent == d and ext == suffix and pattern.match(stem) for d, pattern, suffix in sources["last"])


def _pick(requested: str, sources: Mapping[str, Any], last: bool) -> dict[str, Any]:
    """Coordinator: candidates (path, entries, world size) newest first, plus warnings."""
    if not last:
        return {"candidates": [_describe(requested, open_manifest(requested))], "notes": []}
    _sweep(sources)
    found: list[tuple[float, int, dict[str, Any]]] = []
    notes: list[str] = []
    damaged: list[str] = []
    for path in sorted(_listed(sources) | {_norm(requested)}):
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
        for entry in leftovers(d):
            remove_entry(entry)


def _listed(sources: Mapping[str, Any]) -> set[str]:
    """Checkpoint-like names (``*.ckpt``, not hidden) in the checkpoint directories."""
    out = set(sources["paths"])
    for d in sources["dirs"]:
        fs = get_filesystem(d)
        if not fs.exists(d):
            continue
        for p in fs.ls(d, detail=False):
            name = os.path.basename(_norm(p))
            if name.endswith(".ckpt") and not name.startswith("."):
                out.add(os.path.join(d, name))
    return out


def _describe(path: str, man: Mapping[str, Any]) -> dict[str, Any]:
    return {"path": path, "entries": sorted(man["objects"]), "world_size": int(man.get("world_size", 1))}


class SafeckptDDPStrategy(SafeckptStrategyMixin, DDPStrategy):
    """``DDPStrategy`` with collective, atomic, in-place safeckpt checkpoints."""


class SafeckptModelParallelStrategy(SafeckptStrategyMixin, ModelParallelStrategy):
    """``ModelParallelStrategy`` (FSDP2 ``fully_shard`` / tensor parallel in ``configure_model``)
    with sharded safeckpt checkpoints: each rank writes its shards, loads reshard."""


class SafeckptFSDPStrategy(SafeckptStrategyMixin, FSDPStrategy):
    """``FSDPStrategy`` (FSDP1) with safeckpt checkpoints. Use ``use_orig_params=True``; FSDP2
    (``SafeckptModelParallelStrategy``) is the tested path."""


# --------------------------------------------------------------------------- preemption


class SafeckptPreemption(Callback):
    """SIGTERM (or SIGUSR1) on any rank: every rank saves the same step, then training stops.

    Lightning's own SIGTERM handler runs a collective inside the signal handler and only
    propagates rank 0's signal; this callback replaces it while training runs. The handler only
    sets a flag; at the end of each training batch every rank agrees on it (one tiny all-reduce
    on safeckpt's gloo group); if set, all save ``dirpath/filename.ckpt`` (default: next to
    ModelCheckpoint's checkpoints, ``last-preempted.ckpt``, which ``ckpt_path="last"`` finds)
    and raise Lightning's ``SIGTERMException`` (a ``SystemExit``) together.
    """

    def __init__(self, dirpath: str | os.PathLike[str] | None = None, filename: str = "last-preempted",
                 signals: Iterable[int] = (signal.SIGTERM, signal.SIGUSR1), timeout: float | None = None) -> None:
        self.dirpath = os.fspath(dirpath) if dirpath is not None else None
        self.filename = filename
        self.signals = tuple(signals)
        self.timeout = timeout
        self.flag = False
        self.saved_path: str | None = None
        self._previous: dict[int, Any] = {}

    def path(self, trainer: Trainer) -> str:
        d = self.dirpath
        if d is None:
            cb = trainer.checkpoint_callback
            d = getattr(cb, "dirpath", None) or os.path.join(trainer.default_root_dir, "checkpoints")
        return os.path.join(os.fspath(d), self.filename + ".ckpt")

    def _handle(self, signum: int, frame: Any) -> None:
        self.flag = True

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.flag = False
        if threading.current_thread() is not threading.main_thread():
            warnings.warn("SafeckptPreemption: not in the main thread, signals are not watched",
                          SafeckptWarning, stacklevel=2)
            return
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not Coordinator(self.timeout, what="preemption check").any_true(self.flag, "preempted"):
            return
        path = self.path(trainer)
        rank_zero_info(f"safeckpt: preemption signal received; every rank saves step {trainer.global_step} to {path}")
        trainer.save_checkpoint(path)
        self.saved_path = path
        raise SIGTERMException()

    def _restore(self) -> None:
        for sig, prev in self._previous.items():
            try:
                if signal.getsignal(sig) == self._handle:
                    signal.signal(sig, prev)
            except (ValueError, TypeError):
                pass
        self._previous.clear()

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._restore()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._restore()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._restore()
