"""A DeepSpeed engine's own checkpoint inside one safeckpt commit (Trainer or Accelerate with a
DeepSpeed config; Accelerate uses the save hook and the check, under its tag ``pytorch_model``).

Under DeepSpeed the model, the optimizer (ZeRO partitions, one per rank) and DeepSpeed's LR
scheduler live inside the engine, and only the engine can save and load them. So a Trainer
checkpoint is the engine's checkpoint plus Trainer's own state, and the whole of it is one
safeckpt commit (``CheckpointManager.save(write_files=...)``, see ``safeckpt.engine.extra``):

- save: inside the commit's write phase every rank runs ``engine.save_checkpoint(staging)``
  (DeepSpeed's layout: ``global_stepN/``, ``latest``, its scripts, as stock Trainer writes them
  into ``checkpoint-N``); every rank then reports its share of those files (size, xxh3-128), the
  manifest lists them (``written``), and the one rename publishes them with Trainer's state (RNG of every rank,
  sampler, ``trainer_state.json``). A rank killed anywhere in it leaves no ``checkpoint-N``.
- resume: before Trainer's loop starts (Trainer cannot run it twice with a DeepSpeed engine, so
  a damaged checkpoint must be found first) the engine's files are checked (each rank hashes its
  share: CorruptCheckpoint on every rank, and the resume falls back to an older checkpoint) and
  Trainer's own state is read; inside the loop DeepSpeed's own ``load_checkpoint`` reads the
  engine's files from the committed checkpoint.

The engine's files are what its checkpoint engine writes: DeepSpeed's pickles by default, or
safeckpt's pickle-free files when ``safeckpt.integrations.deepspeed.install_on_initialize()``
ran before the Trainer was created.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...coord.dist import distributed_active
from ...engine.extra import WriteFiles, tree_share, verify_files
from ...errors import IncompatibleCheckpoint
from .common import DeferredRNG, inner_scheduler, load_entries, read_json_entries


def enabled(trainer: Any) -> bool:
    return bool(getattr(trainer, "is_deepspeed_enabled", False))


def engine_files(engine: Any, *, exclude_frozen: bool) -> WriteFiles:
    """The save hook of one engine under DeepSpeed's own tag (``global_stepN``), as Trainer saves it."""
    return engines_files([(engine, None)], exclude_frozen=exclude_frozen)


def engines_files(engines: Sequence[tuple[Any, str | None]], *, exclude_frozen: bool = False,
                  **save_kwargs: Any) -> WriteFiles:
    """The save hook: DeepSpeed writes each engine's checkpoint under its tag (None: DeepSpeed's
    ``global_stepN``; Accelerate's ``pytorch_model``) into the staging directory (collective;
    DeepSpeed's save ends in a barrier, so every rank then sees every file) and each rank
    reports every world_size-th of the files, in a sorted listing all ranks share."""

    def write(staging: str) -> list[str]:
        import torch.distributed as dist

        for engine, tag in engines:
            kw = dict(save_kwargs)
            if exclude_frozen and "exclude_frozen_parameters" in inspect.signature(engine.save_checkpoint).parameters:
                kw["exclude_frozen_parameters"] = True  # as Trainer does for PEFT models
            engine.save_checkpoint(staging, tag=tag, **kw)
        distributed = distributed_active()
        rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
        return tree_share(staging, rank, world)

    return write


def check_engine(path: str, *, tags: Sequence[str] = (), timeout: float | None) -> None:
    """Collective, before DeepSpeed reads the engine's files of the committed checkpoint at
    ``path``: it holds an engine checkpoint (each tag of ``tags``, or DeepSpeed's
    ``global_stepN``) and every listed file verifies (each rank hashes its share).
    CorruptCheckpoint on every rank otherwise (a resume then falls back);
    IncompatibleCheckpoint if an engine checkpoint is missing."""
    from ...engine.reader import open_manifest
    from ...storage.base import resolve, storage_for

    ckpt = resolve(path)
    written = open_manifest(ckpt, storage_for(ckpt), full=False).get("written", {})
    missing = [p for p in ([f"{t}/" for t in tags] or ["global_step"])
               if not any(name.startswith(p) for name in written)]
    if missing:
        what = f"no DeepSpeed engine checkpoint {missing[0].rstrip('/')!r}" if tags else "no DeepSpeed engine checkpoint"
        raise IncompatibleCheckpoint(
            f"{path} holds {what} (it was saved without DeepSpeed, or with fewer models); a "
            "DeepSpeed run resumes only from checkpoints saved with DeepSpeed")
    verify_files(ckpt, timeout=timeout)


@dataclass
class Resume:
    """What a resume under DeepSpeed read from the checkpoint before Trainer's loop: the
    entries Trainer reads as files, every rank's RNG (applied later by Trainer's schedule), the
    sampler's and Trainer's own scheduler's state (applied once they exist)."""

    head: dict[str, Any]
    rng: DeferredRNG
    sampler: Any
    scheduler: Any

    def apply(self, lr_scheduler: Any, path: str) -> None:
        """Trainer's own LR scheduler (DeepSpeed's is restored by the engine), as saved."""
        own = type(lr_scheduler).__name__ != "DeepSpeedSchedulerWrapper"
        if own != (self.scheduler is not None):
            raise IncompatibleCheckpoint(
                f"cannot resume from {path}: it was saved with "
                f"{'Trainer' if self.scheduler is not None else 'DeepSpeed'}'s LR scheduler, this run has "
                f"{'Trainer' if own else 'DeepSpeed'}'s (was the DeepSpeed config's scheduler changed?)")
        if own:
            inner_scheduler(lr_scheduler).load_state_dict(self.scheduler)


def check_and_read(path: str, *, timeout: float | None) -> Resume:
    """Collective, before Trainer's loop (Trainer cannot rerun its loop with a DeepSpeed engine,
    so a damaged checkpoint must be found now): every file of the engine verifies (each rank
    hashes its share), Trainer's entries are read from the manifest, and every rank's RNG by
    one verified load. CorruptCheckpoint on every rank otherwise (the resume then falls back);
    IncompatibleCheckpoint if the checkpoint holds no engine checkpoint."""
    from ...storage.base import resolve

    ckpt = resolve(path)
    head = read_json_entries(ckpt, ("trainer_state", "side_files", "safeckpt", "sampler"),
                             optional=("scheduler",), timeout=timeout, where="resume")
    check_engine(ckpt, timeout=timeout)
    rng = DeferredRNG()
    load_entries(ckpt, {"rng": rng}, timeout=timeout, where="resume")
    return Resume(head, rng, head["sampler"]["seedable"], head.get("scheduler"))


def load_engine(engine: Any, path: str, *, strict: bool) -> None:
    """DeepSpeed's own load of the (checked) engine checkpoint in ``path``, as Trainer calls it."""
    from transformers.integrations.deepspeed import deepspeed_load_checkpoint

    deepspeed_load_checkpoint(engine, path, load_module_strict=strict)
