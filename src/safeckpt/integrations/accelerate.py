"""Accelerate's ``save_state`` / ``load_state`` through safeckpt.

Replace ``Accelerator`` by :class:`SafeckptAccelerator` (same arguments)::

    accelerator = SafeckptAccelerator(project_config=ProjectConfiguration(
        project_dir="run", automatic_checkpoint_naming=True, total_limit=3))
    model, opt, dl, sched = accelerator.prepare(model, opt, dl, sched)
    accelerator.load_state()            # newest valid checkpoint under run/checkpoints, if any
    ...
    if step % 500 == 0 or accelerator.preempted:
        accelerator.save_state()        # one collective, atomic commit; retention afterwards

or call :func:`save_state` / :func:`load_state` with a plain ``Accelerator``.

One checkpoint holds every prepared model (DDP replicas written once, FSDP2 shards as
DTensors), optimizer, scheduler, the grad scaler, every ``register_for_checkpointing`` object
(tensors and JSON only; anything else is refused with the object's name), each prepared
dataloader's seedable-sampler state (and a stateful dataloader's position, per rank),
``accelerator.step``, the save iteration and every rank's RNG. With
``automatic_checkpoint_naming`` checkpoints are ``project_dir/checkpoints/checkpoint_N``
(Accelerate's names; N = the save iteration), ``total_limit`` is applied only after the new one is committed, and
``load_state()`` takes the newest one that verifies and restores the iteration, so the next
save gets the next number. Nothing is pickled.

With a DeepSpeed config the engines hold the models, optimizers and DeepSpeed's LR schedulers,
and only they can save them: inside the commit's write phase every rank runs
``engine.save_checkpoint(<staging>, "pytorch_model")`` (Accelerate's tag and layout), the
manifest lists the engine's files and the one rename publishes them with the rest, so a rank
killed inside a save leaves no ``checkpoint_N``. ``load_state`` checks the engine's files (each
rank hashes its share; a damaged checkpoint is passed over for the next older one) before
DeepSpeed's own ``load_checkpoint`` reads them (see ``safeckpt.integrations._hf.deepspeed``).
"""

from __future__ import annotations

import os
import tempfile
import warnings
from typing import Any

from accelerate import Accelerator
from accelerate.utils import DistributedType

from .. import CheckpointManager, PerRank, RNGState, load
from ..errors import (
    CheckpointError,
    CheckpointExists,
    CheckpointNotFound,
    CorruptCheckpoint,
    IncompatibleCheckpoint,
    SafeckptWarning,
)
from ._hf import common
from ._hf import deepspeed as ds
from ._hf.layout import tensors_layout

FORMAT = "safeckpt.accelerate/1"


def _check(acc: Accelerator, where: str) -> None:
    if acc.distributed_type == DistributedType.MEGATRON_LM:
        raise CheckpointError(f"{where}: Megatron-LM engines are not supported by safeckpt")


def _deepspeed(acc: Accelerator) -> bool:
    return acc.distributed_type == DistributedType.DEEPSPEED


def _engines(acc: Accelerator) -> list[tuple[Any, str]]:
    """Under DeepSpeed: each prepared model's engine and its tag, as Accelerate saves them."""
    from accelerate.utils import MODEL_NAME

    if not _deepspeed(acc):
        return []
    return [(engine, MODEL_NAME if i == 0 else f"{MODEL_NAME}_{i}") for i, engine in enumerate(acc._models)]


def accelerator_state(acc: Accelerator, *, loading: bool = False) -> dict[str, Any]:
    """The safeckpt state dict of everything ``acc`` checkpoints (same layout to save and load).
    Under DeepSpeed the models, optimizers, DeepSpeed's schedulers and the loss scaling are the
    engines' to save (``_engines``): they are not in it."""
    where = "load_state" if loading else "save_state"
    _check(acc, where)
    engine = _deepspeed(acc)
    state: dict[str, Any] = {}
    for i, model in enumerate([] if engine else acc._models):
        common.refuse_fsdp1(model, where)
        state[f"model_{i}"] = model
    for i, opt in enumerate([] if engine else acc._optimizers):
        state[f"optimizer_{i}"] = common.inner_optimizer(opt)
    for i, sched in enumerate(acc._schedulers):
        if engine and type(sched).__name__ == "DeepSpeedSchedulerWrapper":
            continue  # inside the engine's checkpoint
        state[f"scheduler_{i}"] = common.inner_scheduler(sched)
    for i, dl in enumerate(acc._dataloaders):
        state[f"dataloader_{i}"] = {"sampler": None if loading else common.sampler_state(dl)}
        if getattr(dl, "use_stateful_dataloader", False):
            # Per-rank values are top-level entries (a PerRank inside a tree is refused by the
            # core). The position is JSON plus the sampler generator's state tensor.
            position = None if loading else dl.state_dict()
            if position is not None:
                common.check_plain(f"stateful dataloader {i}", position)
            state[f"dataloader_{i}_position"] = PerRank(position)
    for i, obj in enumerate(acc._custom_objects):
        if not loading:
            common.check_plain(f"register_for_checkpointing object {i} ({type(obj).__name__})",
                               obj.state_dict())
        state[f"custom_{i}"] = obj
    if acc.scaler is not None and not engine:
        state["scaler"] = acc.scaler
    state["rng"] = RNGState()
    state["accelerator"] = {"format": FORMAT, "step": int(acc.step),
                            "iteration": int(acc.project_configuration.iteration)}
    return state


def _apply(acc: Accelerator, state: dict[str, Any]) -> None:
    """After a load: what is not restored in place (samplers, positions, counters)."""
    for i, dl in enumerate(acc._dataloaders):
        entry = state[f"dataloader_{i}"]
        common.restore_sampler(dl, entry["sampler"], "load_state")
        position = state.get(f"dataloader_{i}_position")
        if position is not None and position.value is not None:
            dl.load_state_dict(position.value)
    meta = state["accelerator"]
    if meta.get("format") != FORMAT:
        raise IncompatibleCheckpoint(f"not an Accelerate checkpoint (format {meta.get('format')!r})")
    acc.step = int(meta["step"])
    acc.project_configuration.iteration = int(meta["iteration"]) + 1


def _save_hooks(acc: Accelerator) -> dict[str, bytes]:
    """Run ``register_save_state_pre_hook`` hooks as Accelerate does, but into a private
    directory: the plain files they write there (rank 0's) are committed inside the checkpoint,
    so the load hooks find them in the checkpoint directory. Models they pop from ``weights``
    are saved all the same (safeckpt saves every prepared model)."""
    hooks = list(acc._save_model_state_pre_hook.values())
    if not hooks:
        return {}

    def run() -> dict[str, bytes]:
        # as Accelerate: no weights under DeepSpeed (the engines save the models)
        weights = [] if _deepspeed(acc) else [m.state_dict() for m in acc._models]
        with tempfile.TemporaryDirectory(prefix="safeckpt-accelerate-hooks-") as tmp:
            for hook in hooks:
                hook(acc._models, weights, tmp)
            return common.read_hook_files(tmp, "save_state")

    files = common.agree_all(run, "save_state's pre-hooks")
    return files if common.rank() == 0 else {}


def _load_hooks(acc: Accelerator, path: str) -> list[Any]:
    """Run ``register_load_state_pre_hook`` hooks with the checkpoint directory (which holds
    the files the save hooks wrote); returns the models list they leave (as Accelerate: empty
    under DeepSpeed, whose engines load the models)."""
    models = [] if _deepspeed(acc) else list(acc._models)
    hooks = list(acc._load_model_state_pre_hook.values())
    if hooks:
        def run() -> None:
            for hook in hooks:
                hook(models, path)

        common.agree_all(run, "load_state's pre-hooks")
    return models


def _root(acc: Accelerator) -> str:
    return os.path.join(os.path.abspath(acc.project_dir), "checkpoints")


def _manager(acc: Accelerator, timeout: float | None) -> CheckpointManager:
    mgr = getattr(acc, "_safeckpt_mgr", None)
    if mgr is None:
        cfg = acc.project_configuration
        mgr = CheckpointManager(_root(acc), keep_last=cfg.total_limit or None, timeout=timeout,
                                dirname=common.ACCELERATE_DIRNAME)
        acc._safeckpt_mgr = mgr
    return mgr



def model_files(acc: Accelerator, state: dict[str, Any]) -> dict[str, dict[str, str]] | None:
    """The models as stock ``save_state`` writes them (``model.safetensors``, ``model_1.safetensors``,
    ...: ``get_state_dict(model, unwrap=False)`` without tied duplicates), laid out as named files
    of the commit, so those files are there and the weights are written once. None where a model
    is sharded (FSDP2) or under DeepSpeed (the model is not in ``state``): safeckpt's own files."""
    from accelerate.utils.other import clean_state_dict_for_safetensors

    files: dict[str, dict[str, str]] = {}
    for i, model in enumerate(acc._models):
        entry = f"model_{i}"
        if entry not in state or common.is_sharded(model):
            return None
        sd = clean_state_dict_for_safetensors(dict(acc.get_state_dict(model, unwrap=False)))
        names, _ = tensors_layout(model, entry, sd)
        if names is None:
            return None
        if names:
            files["model.safetensors" if i == 0 else f"model_{i}.safetensors"] = names
    return files or None


def save_state(acc: Accelerator, output_dir: str | os.PathLike[str] | None = None, *,
               timeout: float | None = None, engine_kwargs: dict[str, Any] | None = None) -> str:
    """``acc.save_state`` through safeckpt (collective); returns the checkpoint's path.

    With ``automatic_checkpoint_naming`` the checkpoint is the save iteration's under
    ``project_dir/checkpoints`` (``output_dir`` is ignored, as Accelerate does) and
    ``total_limit`` retention runs after the commit; otherwise ``output_dir`` is written (an
    existing safeckpt checkpoint there is replaced atomically). Under DeepSpeed every engine's
    own checkpoint is written inside the commit (``engine_kwargs`` go to its ``save_checkpoint``).
    """
    state = accelerator_state(acc)
    engines = _engines(acc)
    hook = ds.engines_files(engines, **(engine_kwargs or {})) if engines else None
    extra = _save_hooks(acc)
    remote = "://" in os.fspath(output_dir or "") or "://" in str(acc.project_dir)
    named = None if remote else model_files(acc, state)  # named files need a filesystem directory
    cfg = acc.project_configuration
    if cfg.automatic_checkpoint_naming:
        mgr = _manager(acc, timeout)
        step = int(cfg.iteration)
        path = common.step_dir(_root(acc), step, common.ACCELERATE_DIRNAME)
        if common.share_from_rank0(lambda: os.path.exists(path)):
            raise CheckpointExists(
                f"{path} (save iteration {step}) exists already: call load_state() first to "
                "continue this project, or set project_configuration.iteration."
            )
        info = mgr.save(step, state, extra_files=extra, write_files=hook, named=named)
        path = info.path if info is not None else path
    else:
        if output_dir is None:
            raise CheckpointError("save_state: no output_dir given and automatic checkpoint "
                                  "naming is disabled")
        path = common.save_checkpoint(os.fspath(output_dir), state, timeout=timeout,
                                      extra_files=extra, write_files=hook, named=named).path
    cfg.iteration += 1
    return path


def _load_with_engines(acc: Accelerator, input_dir: str | os.PathLike[str] | None,
                       state: dict[str, Any], timeout: float | None, engine_kwargs: dict[str, Any]) -> str:
    """Under DeepSpeed: check the engines' files, load safeckpt's entries, then DeepSpeed's own
    ``load_checkpoint`` of each engine from the committed checkpoint. Without ``input_dir`` the
    newest checkpoint whose checks and load pass (a damaged one changes nothing and is passed
    over for the next older one, on every rank together)."""
    engines = _engines(acc)
    tags = [tag for _, tag in engines]

    def check_and_load(path: str) -> None:
        ds.check_engine(path, tags=tags, timeout=timeout)
        load(path, state, timeout=timeout)

    if input_dir is None:
        if not acc.project_configuration.automatic_checkpoint_naming:
            raise CheckpointError("load_state: no input_dir given and automatic checkpoint "
                                  "naming is disabled")
        mgr = _manager(acc, timeout)
        candidates, reasons = mgr.resume_candidates()
        if not candidates and not reasons:
            raise CheckpointNotFound(f"no committed checkpoint under {_root(acc)}", path=_root(acc))
        for step, path in candidates:
            try:
                check_and_load(path)
            except (CorruptCheckpoint, CheckpointNotFound) as exc:
                reasons.append(f"step {step}: {exc}")
                warnings.warn(f"checkpoint {path} is corrupt, falling back to an older one: {exc}",
                              SafeckptWarning, stacklevel=3)
                continue
            mgr.mark_restored(step)
            break
        else:
            raise CorruptCheckpoint(
                f"no checkpoint under {_root(acc)} could be loaded (refusing to start fresh when "
                "history exists):\n  " + "\n  ".join(reasons), path=_root(acc))
        _load_hooks(acc, path)
    else:
        path = os.path.abspath(os.fspath(input_dir))
        _load_hooks(acc, path)
        check_and_load(path)

    def load_engines() -> None:
        for engine, tag in engines:
            loaded, _ = engine.load_checkpoint(path, tag, **engine_kwargs)
            if loaded is None:  # DeepSpeed only logs a warning
                raise CheckpointError(f"load_state: DeepSpeed loaded nothing from {path} (tag {tag})")

    common.agree_all(load_engines, "load_state's DeepSpeed load_checkpoint")
    return path


def load_state(acc: Accelerator, input_dir: str | os.PathLike[str] | None = None, *,
               timeout: float | None = None, engine_kwargs: dict[str, Any] | None = None) -> str:
    """``acc.load_state`` through safeckpt (collective); returns the checkpoint's path.

    Without ``input_dir`` (automatic naming), the newest checkpoint that verifies, chosen once
    for all ranks; the save iteration continues after it. A missing piece raises
    IncompatibleCheckpoint before anything is changed. Under DeepSpeed ``engine_kwargs`` go to
    each engine's ``load_checkpoint``.
    """
    state = accelerator_state(acc, loading=True)
    if _deepspeed(acc):
        path = _load_with_engines(acc, input_dir, state, timeout, engine_kwargs or {})
        _apply(acc, state)
        return path
    if input_dir is None:
        if not acc.project_configuration.automatic_checkpoint_naming:
            raise CheckpointError("load_state: no input_dir given and automatic checkpoint "
                                  "naming is disabled")
        step = _manager(acc, timeout).restore(state)
        if step is None:
            raise CheckpointNotFound(f"no committed checkpoint under {_root(acc)}", path=_root(acc))
        path = common.step_dir(_root(acc), step, common.ACCELERATE_DIRNAME)
        # The pick is made with the load (newest that loads): the hooks see it afterwards.
        _load_hooks(acc, path)
    else:
        path = os.path.abspath(os.fspath(input_dir))
        models = _load_hooks(acc, path)
        popped = [i for i, m in enumerate(acc._models) if not any(m is k for k in models)]
        if popped:
            # A hook that takes a model out of the list loads it itself (as with Accelerate).
            for i in popped:
                del state[f"model_{i}"]
            common.load_entries(path, state, timeout=timeout, where="load_state")
        else:
            load(path, state, timeout=timeout)
    _apply(acc, state)
    return path


class SafeckptAccelerator(Accelerator):
    """``Accelerator`` whose ``save_state``/``load_state`` are safeckpt commits and loads.

    ``preempted`` (with automatic checkpoint naming): True on every rank once any rank got
    SIGTERM/SIGUSR1; collective, so call it at the same point on every rank.
    """

    def __init__(self, *args: Any, safeckpt_timeout: float | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.safeckpt_timeout = safeckpt_timeout
        self._safeckpt_mgr: CheckpointManager | None = None
        _check(self, "SafeckptAccelerator")
        if self.project_configuration.automatic_checkpoint_naming:
            _manager(self, safeckpt_timeout)  # watch preemption signals from now on

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True,
                   **save_model_func_kwargs: Any) -> str:
        return save_state(self, output_dir, timeout=self.safeckpt_timeout, engine_kwargs=save_model_func_kwargs)

    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None,
                   **load_model_func_kwargs: Any) -> None:
        load_state(self, input_dir, timeout=self.safeckpt_timeout, engine_kwargs=load_model_func_kwargs)

    @property
    def preempted(self) -> bool:
        if self._safeckpt_mgr is None:
            raise CheckpointError("preempted needs ProjectConfiguration(automatic_checkpoint_naming=True)")
        return self._safeckpt_mgr.preempted

    def safeckpt_close(self) -> None:
        """Release the checkpoint root's writer lease and the signal handlers (end_training
        calls it; call it yourself to keep the process group alive)."""
        mgr, self._safeckpt_mgr = self._safeckpt_mgr, None
        if mgr is not None:
            mgr.close()

    def end_training(self) -> None:
        self.safeckpt_close()
        super().end_training()
