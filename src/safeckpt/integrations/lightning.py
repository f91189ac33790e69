"""PyTorch Lightning: collective, atomic, pickle-free checkpoints through Lightning's own hooks.

Lightning (2.4-2.6) saves through ``Strategy.save_checkpoint``, which calls the ``CheckpointIO`` on
global rank 0 only (FSDP and ModelParallel bypass it and write DCP plus a pickled ``meta.pt`` in
place), and resumes from ``ckpt_path="last"`` by file mtime on each rank. This module moves the
whole checkpoint lifecycle into the strategy, where every rank takes part:

- :class:`SafeckptStrategyMixin` (and the ready-made :class:`SafeckptDDPStrategy` and
  :class:`SafeckptModelParallelStrategy`, FSDP2/tensor parallel) overrides save, load and remove
  so they run collectively on every rank: the live LightningModule and optimizers are
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

Not done here: FSDP1 (``FSDPStrategy``: flat parameters, and it cannot run on CPU, so it could
not be tested; use FSDP2 through ``SafeckptModelParallelStrategy``), DeepSpeed (its engine has its
own hooks, see ``safeckpt.integrations.deepspeed``), ``AsyncCheckpointIO`` (the strategy's saves
are synchronous), and ``save_last="link"`` stays Lightning's non-atomic symlink.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_info

import safeckpt
from safeckpt.coord.dist import Coordinator
from safeckpt.engine import frozen as _frozen
from safeckpt.errors import (
    CheckpointError,
    CheckpointNotFound,
    CorruptCheckpoint,
    IncompatibleCheckpoint,
    RankMismatch,
    SafeckptWarning,
)
from safeckpt.format.step_names import step_from_name
from safeckpt.format.tree import is_dtensor

from ..coord.dist import distributed_active
from ._lightning.format import (
    FROZEN,
    LIGHTNING,
    MODEL,
    NOT_STORED,
    OPTIM_RE,
    RNG,
    RankLocal,
    fill_frozen,
    is_lightning_checkpoint,
    metadata,
    norm,
    optimizer_name,
    read_checkpoint,
    remove,
    step_of,
)
from ._lightning.preempt import SafeckptPreemption
from ._lightning.resume import agree_on_checkpoint, serve_tier_last
from ._lightning.values import check_hyperparameters, decode, encode

__all__ = [
    "SafeckptDDPStrategy",
    "SafeckptIO",
    "SafeckptModelParallelStrategy",
    "SafeckptPreemption",
    "SafeckptStrategyMixin",
    "load_from_checkpoint",
    "read_checkpoint",
]


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
    checkpoint = read_checkpoint(path, map_location)  # map_location: as torch.load takes it
    checkpoint.setdefault(cls.CHECKPOINT_HYPER_PARAMS_KEY, {})
    checkpoint[cls.CHECKPOINT_HYPER_PARAMS_KEY].update(kwargs)
    from lightning.pytorch.core import saving

    if issubclass(cls, LightningDataModule):
        return saving._load_state(cls, checkpoint, **kwargs)
    return saving._load_state(cls, checkpoint, strict=strict, **kwargs)  # frozen: see _serve_pl_load


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
        if distributed_active() and dist.get_world_size() > 1:
            raise CheckpointError(
                f"SafeckptIO cannot save {os.fspath(path)} in a {dist.get_world_size()}-process job: "
                "Lightning calls a CheckpointIO on global rank 0 only, and a safeckpt save needs every "
                "rank. Use strategy=SafeckptDDPStrategy() / SafeckptModelParallelStrategy() "
                "(safeckpt.integrations.lightning) instead of the plugin."
            )
        state: dict[str, Any] = {MODEL: checkpoint.get("state_dict", {})}
        for i, opt_state in enumerate(checkpoint.get("optimizer_states", [])):
            state[optimizer_name(i)] = opt_state
        state[LIGHTNING] = encode({k: v for k, v in checkpoint.items() if k not in NOT_STORED}, "checkpoint")
        safeckpt.save(
            os.fspath(path), state, overwrite=True, step=step_of(checkpoint),
            metadata=metadata(checkpoint, "optimizer_states" not in checkpoint), timeout=self.timeout,
        )

    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None) -> dict[str, Any]:
        return read_checkpoint(path, map_location)

    def remove_checkpoint(self, path: Any) -> None:
        remove(os.fspath(path))


# --------------------------------------------------------------------------- strategies


class SafeckptStrategyMixin:
    """Collective, atomic, in-place checkpointing for a Lightning ``ParallelStrategy``.

    Put it first in the bases: ``class MyStrategy(SafeckptStrategyMixin, DDPStrategy)``.
    ``save_checkpoint``, ``load_checkpoint`` and ``remove_checkpoint`` run on every rank (Lightning
    already calls them on every rank; only their bodies were gated on rank 0). The module is
    loaded in place where the base strategy restores (DDP: before ``setup``, so ``on_fit_start``
    sees restored weights and callbacks), the optimizers and RNG in place when Lightning
    restores the optimizers. ``checkpoint_timeout`` is how long a rank waits for the others (safeckpt's
    ``timeout``); ``save_rng=False`` leaves the RNG state out.

    ``frozen``: ``"fingerprint"`` (default): the LightningModule's frozen parameters
    (``requires_grad=False``: a LoRA base model, a frozen tower) are not stored; the checkpoint
    holds the trainable tensors and a fingerprint (xxh3 checksum, shape, dtype) of each frozen one,
    so it is the size of what trains. On resume the live frozen tensors (the base the module
    loads itself, as with stock PEFT) are checked against the fingerprints on every rank before
    anything is changed (a different base: ``IncompatibleCheckpoint`` naming the tensor) and the
    rest is restored. ``"full"``: frozen parameters are stored like the rest. Sharded (DTensor)
    parameters are always stored (see ``safeckpt.engine.frozen``).

    The fast-recovery tier (docs/concepts/fast-recovery.md), with
    :class:`~safeckpt.CheckpointManager`'s options: ``local_dir`` (node-local storage),
    ``durable_every``, ``replicas``, ``keep_local``, ``local_max_bytes``. Every checkpoint
    Lightning saves goes to the nodes' ``local_dir`` (and ``replicas`` other nodes) in the
    background; only every ``durable_every``-th step (by global step), and the newest step when
    training ends (``teardown``), is committed at the path Lightning named (in
    ``ModelCheckpoint``'s ``dirpath``). ``ckpt_path="last"`` resumes the newest step complete
    across the nodes' copies and the directory (``ModelCheckpoint(dirpath=...)`` must be given),
    each file from the nearest verified copy; any other path loads that checkpoint as usual.
    Lightning's ``save_last`` copy of the step just saved is not saved again. ``check_finite``
    (with or without ``local_dir``): a checkpoint whose floating tensors hold NaN/Inf is
    refused, naming them.
    """

    def __init__(self, *args: Any, checkpoint_timeout: float | None = None, save_rng: bool = True,
                 frozen: str = "fingerprint", local_dir: str | os.PathLike[str] | None = None,
                 durable_every: int | None = 10, replicas: int = 0, keep_local: int | None = 2,
                 local_max_bytes: int | None = None, check_finite: bool = False, **kwargs: Any) -> None:
        unsupported = {c.__name__ for c in type(self).__mro__} & {"FSDPStrategy", "DeepSpeedStrategy"}
        if unsupported:
            raise TypeError(
                f"{type(self).__name__}: the safeckpt strategy mixin does not support "
                f"{unsupported.pop()} (FSDP1 flat parameters / DeepSpeed's own engine). For FSDP use "
                "SafeckptModelParallelStrategy with fully_shard (FSDP2) in configure_model; for "
                "DeepSpeed use safeckpt.integrations.deepspeed."
            )
        super().__init__(*args, **kwargs)
        self.checkpoint_timeout = checkpoint_timeout
        self.save_rng = save_rng
        self.frozen = _frozen.check_frozen_mode(frozen)
        self._pending: dict[str, Any] | None = None  # the checkpoint whose optimizers load next
        self.local_dir = os.fspath(local_dir) if local_dir is not None else None
        self.tier_options = {"durable_every": durable_every, "replicas": replicas, "keep_local": keep_local,
                             "local_max_bytes": local_max_bytes}
        self.check_finite = bool(check_finite)
        self._managers: dict[str, safeckpt.CheckpointManager] = {}  # checkpoint directory -> its manager
        self._tier_step: int | None = None  # the step the local tier saved last

    # Lightning asks the strategy for these while building its dict; the live objects are saved
    # instead, so nothing is gathered or copied (no full state dict on rank 0).
    # Restoring happens where the base strategy restores (DDP: before setup, so on_fit_start
    # sees the restored module and callbacks; ModelParallel: after setup): the module in place
    # at load_checkpoint, the optimizers in place when Lightning restores them (after setup).
    @property
    def lightning_restore_optimizer(self) -> bool:
        return True

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {}

    def connect(self, model: Any) -> None:
        check_hyperparameters(model)  # refused before training starts, naming the key
        super().connect(model)  # type: ignore[misc]

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if "state_dict" in checkpoint:
            # not loaded in place: a user's load_state_dict / on_load_checkpoint, or a load
            # without a Trainer; Lightning's own code calls the module's load_state_dict
            super().load_model_state_dict(checkpoint, strict=strict)  # type: ignore[misc]

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        cand, self._pending = getattr(self, "_pending", None), None
        if cand is None:
            super().load_optimizer_state_dict(checkpoint)  # type: ignore[misc]
            return
        self._load_optimizers(cand)

    # ------------------------------------------------------------------ save
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Every rank: write the live module, optimizers, RNG and the rest of ``checkpoint``."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take storage_options")
        full = "optimizer_states" in checkpoint  # absent when weights_only
        state: dict[str, Any] = {MODEL: self.lightning_module}
        if full:
            for i, opt in enumerate(self.optimizers):
                state[optimizer_name(i)] = getattr(opt, "_optimizer", opt)
            if self.save_rng:
                state[RNG] = safeckpt.RNGState()
        state[LIGHTNING] = RankLocal(encode({k: v for k, v in checkpoint.items() if k not in NOT_STORED},
                                            "checkpoint"))
        self._sync_ddp_buffers()
        if self.local_dir is not None or self.check_finite:
            self._save_managed(checkpoint, os.fspath(filepath), state, full)
            return
        safeckpt.save(
            os.fspath(filepath), state, overwrite=True, step=step_of(checkpoint), frozen=self.frozen,
            metadata=metadata(checkpoint, not full), timeout=self.checkpoint_timeout,
        )

    def _manager(self, directory: str) -> safeckpt.CheckpointManager:
        """The manager of one checkpoint directory (created at its first use, closed at teardown).
        Lightning's ``ModelCheckpoint`` rotates its checkpoints itself: the manager deletes none."""
        directory = norm(directory)
        mgr = self._managers.get(directory)
        if mgr is None:
            tier = self.tier_options if self.local_dir is not None else {}
            mgr = safeckpt.CheckpointManager(
                directory, timeout=self.checkpoint_timeout, preemption_signals=(), frozen=self.frozen,
                retention=_KeepAll(), local_dir=self.local_dir, check_finite=self._finite_entries(), **tier)
            self._managers[directory] = mgr
        return mgr

    def _finite_entries(self) -> Any:
        """What ``check_finite`` checks: the module and optimizers, not Lightning's bookkeeping
        (``ModelCheckpoint`` keeps ``kth_value = inf``) nor the RNG state."""
        if not self.check_finite:
            return False
        return [MODEL, *(optimizer_name(i) for i in range(len(self.optimizers)))]

    def _save_managed(self, checkpoint: Mapping[str, Any], path: str, state: dict[str, Any], full: bool) -> None:
        """Through a :class:`~safeckpt.CheckpointManager` of the checkpoint's directory: the local
        tier (a durable step is committed at ``path``), ``check_finite``."""
        step = step_of(checkpoint)
        if step is None:
            raise CheckpointError(f"{path}: the checkpoint has no global_step; local_dir / check_finite need one")
        parent, name = os.path.split(norm(path))
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None) if module is not None else None
        preempting = self.local_dir is not None and trainer is not None and any(
            isinstance(cb, SafeckptPreemption) and norm(cb.path(trainer)) == norm(path) for cb in trainer.callbacks)
        if self.local_dir is not None and step == self._tier_step and not preempting:
            return  # save_last's copy of the step the tier just saved (nothing new to keep)
        mgr = self._manager(parent)
        if preempting:
            # Every rank is here together (the callback agreed): this step goes to the
            # directory now, under a name with its step (so that a restore finds it by step
            # when the nodes are gone), and the save completes before training stops.
            mgr._preempted = True
            if step_from_name(name) is None:
                name = None
        mgr.save(step, state, metadata=metadata(checkpoint, not full), name=name)
        if preempting:
            mgr.wait()
        if self.local_dir is not None:
            self._tier_step = step

    def teardown(self) -> None:
        """Close the checkpoint managers first (every rank: the newest local step is committed
        to its directory when training finished; after a failure nothing more is drained)."""
        managers, self._managers = self._managers, {}
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None) if module is not None else None
        failed = trainer is not None and trainer.state.status == TrainerStatus.INTERRUPTED  # set before teardown
        try:
            for mgr in managers.values():
                if not failed:
                    mgr.close()
                    continue
                with contextlib.suppress(Exception):  # a rank failed: no collective drain
                    mgr.close(drain=False)
        finally:
            super().teardown()  # type: ignore[misc]

    def resolve_tier_last(self, trainer: Any) -> str | None:
        """``ckpt_path="last"`` with ``local_dir`` (every rank, after the process group is up):
        the newest step complete across the nodes' copies and the first ``ModelCheckpoint``'s
        directory, assembled on every node; its location for the load, or None (nothing saved)."""
        dirpath = getattr(trainer.checkpoint_callback, "dirpath", None)
        if not dirpath:
            raise CheckpointError('ckpt_path="last" with local_dir needs ModelCheckpoint(dirpath=...): the '
                                  "directory whose run the node-local copies belong to")
        mgr = self._manager(os.fspath(dirpath))
        step = mgr.restore({}, strict=False)  # verifies and assembles; the load below reads it
        if step is None:
            return None
        self._tier_step = None
        return mgr.restored_path

    def _sync_ddp_buffers(self) -> None:
        """DDP with ``broadcast_buffers`` (the default) replaces every rank's buffers (BatchNorm
        statistics) with rank 0's at the next forward; do it now, so the checkpoint (written once
        for all ranks) equals the live state on every rank."""
        ddp = getattr(self, "model", None)
        if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel) or not ddp.broadcast_buffers:
            return
        if not distributed_active() or dist.get_world_size() == 1:
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
        coord.run("remove", lambda: remove(path) if coord.is_coordinator else None)

    # ------------------------------------------------------------------ load
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Every rank: agree on the checkpoint (for a "last" request, the newest that verifies),
        load the module in place, and return the rest of Lightning's dict (the optimizers and
        RNG are loaded in place when Lightning restores the optimizers). Without a Trainer (a
        strategy used on its own, as Lightning's connector allows): the whole dict, read."""
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None) if module is not None else None
        self._pending = None
        if trainer is None:
            return self._load_offline(os.fspath(checkpoint_path))
        fitting = trainer.state.fn == TrainerFn.FITTING
        candidates = agree_on_checkpoint(trainer, os.fspath(checkpoint_path), self.checkpoint_timeout)
        if fitting and len(candidates) > 1:
            # "last" for training: the newest checkpoint that can resume it (weights-only ones,
            # e.g. from a second ModelCheckpoint, cannot), if there is one.
            full = [c for c in candidates if any(OPTIM_RE.match(e) for e in c["entries"]) or RNG in c["entries"]]
            candidates = full or candidates
        reasons: list[str] = []
        for i, cand in enumerate(candidates):
            if fitting and not any(OPTIM_RE.match(e) or e == RNG for e in cand["entries"]):
                raise IncompatibleCheckpoint(
                    f"{cand['path']} holds no optimizer state (saved with save_weights_only=True): "
                    "training cannot resume from it. Start from its weights with "
                    "load_from_checkpoint(...), or resume from a full checkpoint."
                )
            try:
                rest = self._load_one(cand)
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
            if norm(cand["path"]) != norm(os.fspath(checkpoint_path)):
                rank_zero_info(f"safeckpt: resuming from {cand['path']} (newest valid checkpoint)")
            # Lightning protects the checkpoint it resumed from against top-k deletion.
            trainer._checkpoint_connector._ckpt_path = cand["path"]
            self._pending = cand if fitting else None
            return rest
        raise CorruptCheckpoint(
            "no checkpoint could be loaded (refusing to start fresh when checkpoints exist):\n  "
            + "\n  ".join(reasons)
        )

    def _load_offline(self, path: str) -> dict[str, Any]:
        """No Trainer: every rank reads the whole checkpoint dict (errors raised on every rank)."""
        coord = Coordinator(self.checkpoint_timeout, what=f"load of {path}")
        paths = coord.run("load-agree", lambda: norm(path))
        if any(p != paths[0] for p in paths):
            raise RankMismatch(f"load_checkpoint: ranks were called with different paths: {paths}")
        box: dict[str, Any] = {}
        module = self.lightning_module

        def read() -> None:
            checkpoint = read_checkpoint(path)
            if FROZEN in checkpoint and module is not None:
                # the module's load_state_dict gets its verified live frozen tensors
                fill_frozen(module, checkpoint)
            box.update(checkpoint=checkpoint)

        coord.run("load-read", read, hint="Nothing was loaded.")
        return box["checkpoint"]

    def _as_state_dict(self) -> bool:
        """Load the module through Lightning's ``load_state_dict`` call instead of in place:
        the user overrides ``load_state_dict`` or ``on_load_checkpoint`` (which may edit
        ``checkpoint["state_dict"]``), and nothing is sharded (full tensors would not fit)."""
        module = self.lightning_module
        custom = (type(module).load_state_dict is not torch.nn.Module.load_state_dict
                  or type(module).on_load_checkpoint is not LightningModule.on_load_checkpoint)
        return custom and not any(is_dtensor(t) for t in module.state_dict().values())

    def _load_one(self, cand: dict[str, Any]) -> dict[str, Any]:
        entries = set(cand["entries"])
        holder = RankLocal()
        as_dict = self._as_state_dict()
        module = self.lightning_module
        state: dict[str, Any] = {LIGHTNING: holder}
        live_frozen: dict[str, torch.Tensor] = {}
        if FROZEN in entries:
            # Saved with fingerprints: checked against the live frozen tensors first (a
            # stateful entry, applied on every rank before any tensor is copied), then the
            # module without its frozen parameters.
            live_frozen = _frozen.frozen_tensors(module)
            state = {FROZEN: _frozen.Fingerprints({MODEL: live_frozen} if live_frozen else {}, loading=True),
                     LIGHTNING: holder}
        if not as_dict:
            state[MODEL] = _frozen.TrainableView(module, frozenset(live_frozen)) if FROZEN in entries else module
        model_strict = self.lightning_module.strict_loading
        with warnings.catch_warnings():
            # Ranks the saving run did not have get rank 0's Lightning state below.
            warnings.filterwarnings("ignore", message=f"'{LIGHTNING}' is per-rank state", category=SafeckptWarning)
            # Strict loading: the model exactly (entries left out here, optimizers and RNG,
            # come later), checked before anything is changed.
            info = safeckpt.load(cand["path"], state, strict="entries" if model_strict else False,
                                 timeout=self.checkpoint_timeout)
        rest = holder.value
        if info.world_size < self.world_size:
            # Saved by fewer ranks: new ranks take rank 0's loops/callbacks (as Lightning does).
            fallback = self.broadcast(rest if self.global_rank == 0 else None, src=0)
            if rest is None:
                rest = fallback
        out = dict(decode(rest or {}))
        optims = sorted(int(m.group(1)) for e in entries if (m := OPTIM_RE.match(e)))
        if optims:
            out["optimizer_states"] = [{} for _ in optims]  # loaded in place by load_optimizer_state_dict
        if as_dict:
            coord = Coordinator(self.checkpoint_timeout, what=f"load of {cand['path']}")
            box: dict[str, Any] = {}
            coord.run("state-dict", lambda: box.update(sd=safeckpt.read_state_dict(cand["path"], nested=True)[MODEL]),
                      hint="The model is unchanged.")
            sd = box["sd"]
            for name, t in live_frozen.items():  # verified above: the override gets a full dict
                sd.setdefault(name, t.detach())
            out["state_dict"] = sd
        return out

    def _load_optimizers(self, cand: dict[str, Any]) -> None:
        """After setup, in Lightning's optimizer restore: the optimizers (and each rank's RNG)
        in place from the checkpoint agreed at load_checkpoint."""
        entries = set(cand["entries"])
        saved = sorted(e for e in entries if OPTIM_RE.match(e))
        if len(saved) != len(self.optimizers):
            raise IncompatibleCheckpoint(
                f"{cand['path']} holds {len(saved)} optimizer state(s), the model configures "
                f"{len(self.optimizers)}: training cannot resume from it. Start from its weights "
                "with load_from_checkpoint(...), or resume from a checkpoint of this configuration."
            )
        state: dict[str, Any] = {optimizer_name(i): getattr(opt, "_optimizer", opt) for i, opt in enumerate(self.optimizers)}
        if RNG in entries:
            state[RNG] = safeckpt.RNGState()
        # Only these entries (the model was loaded before), exactly: a state that does not fit
        # the optimizers raises IncompatibleCheckpoint before anything is changed.
        safeckpt.load(cand["path"], state, strict="entries", timeout=self.checkpoint_timeout)


class _KeepAll:
    """Retention of a Lightning checkpoint directory's manager: none (``ModelCheckpoint`` rotates)."""

    def delete(self, checkpoints: Any, protect: Any = ()) -> list[int]:
        return []


class SafeckptDDPStrategy(SafeckptStrategyMixin, DDPStrategy):
    """``DDPStrategy`` with collective, atomic, in-place safeckpt checkpoints."""


class SafeckptModelParallelStrategy(SafeckptStrategyMixin, ModelParallelStrategy):
    """``ModelParallelStrategy`` (FSDP2 ``fully_shard`` / tensor parallel in ``configure_model``)
    with sharded safeckpt checkpoints: each rank writes its shards, loads reshard."""


# --------------------------------------------------------------------------- load_from_checkpoint


def _serve_pl_load() -> None:
    """``Model.load_from_checkpoint(path)`` (Lightning's classmethod) reads through
    ``lightning.pytorch.core.saving.pl_load``: a safeckpt checkpoint directory is read by
    :func:`read_checkpoint` (pickle-free, ``map_location`` as torch.load takes it), anything
    else by Lightning's own loader, unchanged. Idempotent."""
    from lightning.pytorch.core import saving

    original = saving.pl_load
    if getattr(original, "_safeckpt", False):
        return

    def pl_load(path_or_url: Any, map_location: Any = None, weights_only: bool | None = None) -> Any:
        if is_lightning_checkpoint(path_or_url):
            return read_checkpoint(path_or_url, map_location)
        return original(path_or_url, map_location=map_location, weights_only=weights_only)

    pl_load._safeckpt = True  # type: ignore[attr-defined]
    saving.pl_load = pl_load

    original_load_state = saving._load_state

    def _load_state(cls: Any, checkpoint: dict[str, Any], strict: bool | None = None, **kwargs: Any) -> Any:
        """A checkpoint saved with frozen-parameter fingerprints: the module is built as
        Lightning builds it (its ``__init__`` loads the frozen base), then, after its
        ``on_load_checkpoint``, the live frozen tensors are verified against the fingerprints
        and added to ``state_dict`` before Lightning's ``load_state_dict``."""
        if FROZEN not in checkpoint or not (isinstance(cls, type) and issubclass(cls, LightningModule)):
            return original_load_state(cls, checkpoint, strict=strict, **kwargs)

        def on_load_checkpoint(obj: Any, ckpt: dict[str, Any]) -> None:
            cls.on_load_checkpoint(obj, ckpt)
            fill_frozen(obj, ckpt)

        sub = type(cls.__name__, (cls,), {"on_load_checkpoint": on_load_checkpoint,
                                          "__module__": cls.__module__, "__qualname__": cls.__qualname__})
        obj = original_load_state(sub, checkpoint, strict=strict, **kwargs)
        obj.__class__ = cls
        return obj

    _load_state._safeckpt = True  # type: ignore[attr-defined]
    saving._load_state = _load_state


_serve_pl_load()
serve_tier_last(SafeckptStrategyMixin)
