"""Hugging Face Trainer and TRL trainers with safeckpt as their checkpoint backend.

One line per training script::

    from safeckpt.integrations.hf import with_safeckpt
    trainer = with_safeckpt(Trainer)(model=model, args=args, ...)    # or with_safeckpt(SFTTrainer)
    trainer.train(resume_from_checkpoint=True)                        # newest valid checkpoint

Each save is one collective, atomic safeckpt commit under ``args.output_dir`` (directories
``checkpoint-N``, Trainer's names, with Trainer's ``trainer_state.json`` inside) holding the model (DDP replicas written once, FSDP2 shards as DTensors, not
gathered unless ``pretrained=True``), optimizer, LR scheduler, grad scaler, every rank's RNG, the TrainerState and the
seedable sampler's state. A ``checkpoint-N`` of a DDP or one-process model is also a Hugging
Face model directory: the model's weights are ``save_pretrained``'s files themselves
(``model.safetensors`` or its shards and index, PEFT's ``adapter_model.safetensors``), with
``config.json`` and ``generation_config.json``, written once as named files of the commit
(``safeckpt.integrations._hf.layout``); an FSDP2 model's too with ``pretrained=True`` (its full
tensors gathered for the save; by default its shards are saved as DTensors). Retention (``save_total_limit``, the best checkpoint by
``metric_for_best_model``) runs only after the commit. A SIGTERM on any rank makes every rank
save the same step and stop. ``save_model`` of an FSDP2 model writes ``from_pretrained``-loadable
safetensors without gathering the weights on one rank.

How it hooks in (Trainer has no backend slot; see INTEGRATIONS.md): ``with_safeckpt`` puts
:class:`SafeckptTrainerMixin` directly above ``Trainer`` in the MRO, so a subclass such as TRL's
SFTTrainer still runs its own ``_save_checkpoint`` additions, and the outermost
``_save_checkpoint`` commits once they are done. Files a subclass writes into
``output_dir/checkpoint-N`` during a save (TRL's GRPO writes one) are taken into the commit, as
files of the committed ``checkpoint-N``, where the subclass finds them on resume. The mixin replaces Trainer's checkpoint writing
and reading (``_save_checkpoint``, ``_load_from_checkpoint``, ``_load_optimizer_and_scheduler``,
``_load_scaler``, ``_load_rng_state``, ``_load_best_model``); everything else is Trainer's.

With a DeepSpeed config the engine's own checkpoint is written by every rank inside the commit
and loaded by DeepSpeed from the committed checkpoint (``safeckpt.integrations._hf.deepspeed``), so ``checkpoint-N``
is still one atomic commit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import secrets
import tempfile
import warnings
import weakref
from typing import Any, TypeVar

from transformers import Trainer, TrainingArguments
from transformers.trainer_callback import ExportableState, TrainerState
from transformers.trainer_utils import SaveStrategy

from .. import CheckpointManager, RNGState, load
from ..errors import (
    CheckpointError,
    CheckpointNotFound,
    CorruptCheckpoint,
    IncompatibleCheckpoint,
    SafeckptWarning,
)
from ..format.manifest import TRASH_MARK
from ..storage.posix import rmtree_quiet
from ._hf import common
from ._hf import deepspeed as ds
from ._hf.layout import full_view, gather_full, pretrained_layout

T = TypeVar("T", bound=type)

STATE_FILE = "trainer_state.json"  # committed inside each checkpoint, as Trainer writes it
TRAINING_ARGS = "training_args.bin"  # Trainer's pickled TrainingArguments: never written
SIDE_PREFIX = "checkpoint-"        # where Trainer subclasses put their own files during a save
MAX_SIDE_BYTES = 16 << 20
FORMAT = "safeckpt.hf.trainer/1"
_EXTRA_OK = re.compile(r"^(?!rank-)(?!manifest\.json$)[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")
# safeckpt's own hidden names in output_dir, never pushed to the Hub: the writer lease
# (.safeckpt.lock, naming the host) and its aside copies, the quarantine list, and staging,
# trash and replaced directories (.checkpoint-N.safeckpt-staging-<hex>/...); fnmatch patterns
# of paths relative to the uploaded folder, as huggingface_hub's upload_folder matches them.
HUB_IGNORE = [".safeckpt*", "*/.safeckpt*", ".*.safeckpt-*", "*/.*.safeckpt-*"]


class _HubIgnoringOurs:
    """The Hub client Trainer gets from ``transformers.trainer.hf_api()``, with HUB_IGNORE
    added to every ``upload_folder``'s ``ignore_patterns``."""

    def __init__(self, api: Any) -> None:
        self._api = api

    def __getattr__(self, name: str) -> Any:
        return getattr(self._api, name)

    def upload_folder(self, *args: Any, **kw: Any) -> Any:
        pats = kw.get("ignore_patterns")
        kw["ignore_patterns"] = ([pats] if isinstance(pats, str) else list(pats or ())) + HUB_IGNORE
        return self._api.upload_folder(*args, **kw)


@contextlib.contextmanager
def _default_shard_size(models: list[Any], size: Any) -> Any:
    """While Trainer._save runs: each of ``models`` with a ``save_pretrained`` gets one of its
    own (an instance attribute, removed after) passing ``max_shard_size=size`` unless given, so
    the whole of _save runs (the data collator's tokenizer, a subclass's override) with
    save_pretrained's sharding."""
    patched = []
    try:
        for m in {id(m): m for m in models}.values():
            bound = getattr(m, "save_pretrained", None)
            if bound is None or "save_pretrained" in vars(m):
                continue

            def sp(*args: Any, _bound: Any = bound, **kw: Any) -> Any:
                kw.setdefault("max_shard_size", size)
                return _bound(*args, **kw)

            object.__setattr__(m, "save_pretrained", sp)
            patched.append(m)
        yield
    finally:
        for m in patched:
            vars(m).pop("save_pretrained", None)


@contextlib.contextmanager
def _hub_ignoring_ours() -> Any:
    """While Trainer pushes (rank 0, the main thread): its ``hf_api()`` gives _HubIgnoringOurs."""
    import transformers.trainer as trainer_mod

    orig = getattr(trainer_mod, "hf_api", None)
    if orig is None or getattr(orig, "_safeckpt_wrapped", False):
        yield
        return

    def api(*args: Any, **kw: Any) -> Any:
        return _HubIgnoringOurs(orig(*args, **kw))

    api._safeckpt_wrapped = True  # type: ignore[attr-defined]
    trainer_mod.hf_api = api
    try:
        yield
    finally:
        trainer_mod.hf_api = orig


class _Damaged(Exception):
    """The resume's load found the picked checkpoint damaged on every rank (nothing was
    changed): train() takes the next older one."""


class _Hooks:
    """Agreed preemption and the sampler restore, at the moments Trainer offers callbacks.

    Not a TrainerCallback in ``callback_handler.callbacks`` (users and Trainer's own tests list
    those): the trainer's handler is given a subclass that runs these after the callbacks."""

    @staticmethod
    def install(trainer: SafeckptTrainerMixin) -> None:
        handler = trainer.callback_handler
        base = type(handler)
        if getattr(base, "_safeckpt_hooks", False):
            return
        trainer_ref = weakref.ref(trainer)

        def on_train_begin(self: Any, args: Any, state: Any, control: Any) -> Any:
            control = base.on_train_begin(self, args, state, control)
            t = trainer_ref()
            if t is not None and t._safeckpt_sampler is not None:
                common.restore_sampler(self.train_dataloader, t._safeckpt_sampler, "resume")
                t._safeckpt_sampler = None
            return control

        def on_step_end(self: Any, args: Any, state: Any, control: Any) -> Any:
            control = base.on_step_end(self, args, state, control)
            t = trainer_ref()
            mgr = t._safeckpt_mgr if t is not None else None
            # Collective on every rank at every optimizer step: one tiny all-reduce.
            if mgr is not None and mgr.preempted:
                t.safeckpt_preempted = True
                control.should_save = True
                control.should_training_stop = True
            return control

        handler.__class__ = type(base.__name__, (base,), {
            "on_train_begin": on_train_begin, "on_step_end": on_step_end,
            "_safeckpt_hooks": True, "__module__": base.__module__})


class _TrainerRotation:
    """Trainer's ``rotate_checkpoints`` rule as a manager retention policy: keep at most
    ``save_total_limit``, never the newest nor ``state.best_model_checkpoint``'s step, deleting
    the oldest first (steps stand for Trainer's mtime order: commits happen in step order)."""

    def __init__(self, trainer: SafeckptTrainerMixin) -> None:
        self.trainer = weakref.ref(trainer)
        self.final = False  # end of training with save_total_limit=1: all but the best go

    def delete(self, checkpoints: Any, protect: Any = ()) -> list[int]:
        t = self.trainer()
        if self.final and t is not None:
            best = t._safeckpt_best_step()
            return sorted(s for s, _ in checkpoints if s != best)
        limit = t.args.save_total_limit if t is not None else None
        steps = sorted(s for s, _ in checkpoints)
        if t is None or not limit or limit <= 0 or len(steps) <= limit:
            return []
        protected = {steps[-1]}
        best = t._safeckpt_best_step()
        if best is not None:
            protected.add(best)
        keep = max(limit, len(protected))
        doomed, remaining = [], len(steps)
        for s in steps:
            if remaining <= keep:
                break
            if s not in protected:
                doomed.append(s)
                remaining -= 1
        return doomed

    def __repr__(self) -> str:
        return "TrainerRotation()"


class SafeckptTrainerMixin(Trainer):
    """Trainer whose checkpoints are safeckpt commits. Prefer :func:`with_safeckpt`.

    Class attributes (set them on a subclass or pass them to ``with_safeckpt``):
    ``safeckpt_root`` (default: ``args.output_dir``), ``safeckpt_timeout`` (seconds any rank
    waits for the others; default ``$SAFECKPT_TIMEOUT`` or 600), ``safeckpt_frozen``
    (``"fingerprint"``: frozen parameters, e.g. a PEFT base model, are saved as checksums and
    verified on resume; ``"full"``: saved like the rest) and ``safeckpt_async`` (``True``: a save
    blocks training only while the state is copied aside; the checkpoint is written and
    committed in the background, while the next steps train) and ``safeckpt_pretrained``
    (``None``, the default: each ``checkpoint-N`` of a DDP or one-process model is also a
    Hugging Face model directory, the weights written once as ``save_pretrained`` lays them out;
    an FSDP2 model keeps its DTensor shards; ``False``: the model in safeckpt's own files only;
    ``True``: required, an error where it cannot be done, and for an FSDP2 model the opt-in:
    every rank gathers the full tensors for each save (one all-gather per tensor, a full copy
    of the model in host memory per rank while the save runs) and they are written once, as
    ``save_pretrained``'s files); ``safeckpt_max_shard_size`` (``save_pretrained``'s ``max_shard_size`` for
    those files, default its own, 50GB: past it ``model-0000k-of-0000n.safetensors`` and
    ``model.safetensors.index.json``, the shards spread over the ranks).

    The fast-recovery tier (docs/concepts/fast-recovery.md), :class:`~safeckpt.CheckpointManager`'s
    options as class attributes: ``safeckpt_local_dir`` (node-local storage; None: off),
    ``safeckpt_durable_every`` (10), ``safeckpt_replicas`` (0), ``safeckpt_keep_local`` (2),
    ``safeckpt_local_max_bytes`` (None) and ``safeckpt_check_finite`` (False; also without the
    tier). With ``local_dir`` every save goes to the nodes' ``local_dir``; only every
    ``durable_every``-th step (by global step), a preemption save and the newest step when
    ``train()`` returns are committed as ``output_dir/checkpoint-N`` (model directories as
    above); ``resume_from_checkpoint=True`` resumes the newest step across the tiers.
    """

    safeckpt_root: str | None = None
    safeckpt_timeout: float | None = None
    safeckpt_frozen: str = "fingerprint"
    safeckpt_async: bool = False
    safeckpt_pretrained: bool | None = None
    safeckpt_max_shard_size: int | str | None = None
    safeckpt_local_dir: str | None = None
    safeckpt_durable_every: int | None = 10
    safeckpt_replicas: int = 0
    safeckpt_keep_local: int | None = 2
    safeckpt_local_max_bytes: int | None = None
    safeckpt_check_finite: bool | tuple[str, ...] = False
    safeckpt_preempted: bool = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._safeckpt_mgr: CheckpointManager | None = None
        self._safeckpt_resume: dict[str, Any] | None = None
        self._safeckpt_rng: common.DeferredRNG | None = None
        self._safeckpt_sampler: dict[str, Any] | None = None
        self._safeckpt_outer = False
        self._safeckpt_side: str | None = None
        self._safeckpt_side_out: str | None = None  # the real args.output_dir while a subclass saves
        self._safeckpt_rotation: _TrainerRotation | None = None
        targs = next((a for a in [*args, *kwargs.values()] if isinstance(a, TrainingArguments)), None)
        model = kwargs.get("model", args[0] if args else None)
        # Trainer refuses full checkpoints of models sharded at load time (its own format cannot
        # hold their optimizer state); safeckpt can, so let its guard pass and restore the flag.
        bypass = (targs is not None and not targs.save_only_model
                  and getattr(model, "is_distributed_loading_by_transformers", False))
        if bypass:
            targs.save_only_model = True
        try:
            super().__init__(*args, **kwargs)
        finally:
            if bypass:
                targs.save_only_model = False
        self._safeckpt_check_supported()
        _Hooks.install(self)

    # ------------------------------------------------------------------ setup
    def _safeckpt_check_supported(self) -> None:
        where = type(self).__name__
        if ds.enabled(self) and self.args.save_only_model:
            raise CheckpointError(
                f"{where}: save_only_model=True with DeepSpeed: the model lives inside the "
                "engine's checkpoint with the optimizer, so safeckpt saves them together. Drop "
                "save_only_model, or export weights with trainer.save_model().")
        if getattr(self.args, "enable_jit_checkpoint", False):
            raise CheckpointError(
                f"{where}: enable_jit_checkpoint installs a per-rank SIGTERM handler, so ranks can "
                "save different steps; safeckpt's agreed preemption replaces it. Remove "
                "enable_jit_checkpoint=True (a SIGTERM still saves and stops every rank)."
            )
        if self.args.push_to_hub and self.args.hub_strategy != "end" and self.safeckpt_async:
            raise CheckpointError(
                f"{where}: hub_strategy={self.args.hub_strategy!r} with async saves: Trainer pushes "
                "checkpoint-N right after the save, before an async save has committed it. Use "
                "async_save=False, or hub_strategy='end'.")
        if self.safeckpt_async and ds.enabled(self):
            raise CheckpointError(
                f"{where}: async saves with DeepSpeed: the engine writes its own checkpoint files "
                "inside the save, which must finish before training goes on. Use "
                "with_safeckpt(..., async_save=False) with DeepSpeed.")
        if self.safeckpt_local_dir is not None and ds.enabled(self):
            raise CheckpointError(
                f"{where}: local_dir with DeepSpeed: the engine writes its own files into the checkpoint "
                "during the save, which the node-local tier does not take. Drop local_dir with DeepSpeed.")
        if self.safeckpt_local_dir is not None and self.args.load_best_model_at_end:
            raise CheckpointError(
                f"{where}: local_dir with load_best_model_at_end: the best step may live on the nodes "
                "only, where Trainer cannot load it by path. Drop one of them.")
        if self.args.save_on_each_node:
            warnings.warn(
                "save_on_each_node is ignored by safeckpt: every rank writes its share into one "
                "checkpoint on storage shared by all ranks.", SafeckptWarning, stacklevel=3,
            )

    @property
    def safeckpt_root_dir(self) -> str:
        return os.path.abspath(self.safeckpt_root or self.args.output_dir)

    def _safeckpt_manager(self) -> CheckpointManager:
        if self._safeckpt_mgr is None:
            a = self.args
            metric = self._safeckpt_metric()
            self._safeckpt_rotation = _TrainerRotation(self)
            self._safeckpt_mgr = CheckpointManager(
                self.safeckpt_root_dir,
                retention=self._safeckpt_rotation,
                best_metric=metric,
                best_mode="max" if a.greater_is_better else "min",
                timeout=self.safeckpt_timeout,
                frozen=self.safeckpt_frozen,
                dirname=common.TRAINER_DIRNAME,
                async_save=self.safeckpt_async,
                check_finite=self.safeckpt_check_finite,
                **self._safeckpt_tier_options(),
            )
            self._safeckpt_drop_legacy_links()
        return self._safeckpt_mgr

    def _safeckpt_tier_options(self) -> dict[str, Any]:
        if self.safeckpt_local_dir is None:
            return {}
        return {"local_dir": os.fspath(self.safeckpt_local_dir), "durable_every": self.safeckpt_durable_every,
                "replicas": self.safeckpt_replicas, "keep_local": self.safeckpt_keep_local,
                "local_max_bytes": self.safeckpt_local_max_bytes}

    def _safeckpt_durable(self, step: int) -> bool:
        """Whether a save of ``step`` is committed under the root now (always without the tier)."""
        every = self.safeckpt_durable_every
        return self.safeckpt_local_dir is None or (every is not None and step % every == 0) or self.safeckpt_preempted

    def _safeckpt_link(self, step: int) -> str:
        """``root/checkpoint-N``: where step N is committed (Trainer's name)."""
        return common.step_dir(self.safeckpt_root_dir, step, common.TRAINER_DIRNAME)

    def _safeckpt_best_step(self) -> int | None:
        path = self.state.best_model_checkpoint
        if not path:
            return None
        m = re.search(r"(?:checkpoint-|step-)(\d+)$", os.path.basename(os.path.normpath(path)))
        return int(m.group(1)) if m else None

    def _safeckpt_drop_legacy_links(self) -> None:
        """Rank 0: remove ``checkpoint-N -> step-N`` links an earlier version of this integration
        made (its commits were ``step-N``; they stay restorable under their own names)."""
        root = self.safeckpt_root_dir

        def drop() -> None:
            for name in os.listdir(root) if os.path.isdir(root) else ():
                link = os.path.join(root, name)
                if (re.fullmatch(r"checkpoint-\d+", name) and os.path.islink(link)
                        and re.fullmatch(r"step-\d{10,}", os.readlink(link))):
                    os.unlink(link)

        common.share_from_rank0(drop)

    def _safeckpt_peft(self) -> bool:
        from transformers.trainer import _is_peft_model

        return bool(_is_peft_model(self.model))

    def _safeckpt_metric(self) -> str | None:
        m = self.args.metric_for_best_model
        if not m:
            return None
        return m if m.startswith("eval_") else f"eval_{m}"

    # ------------------------------------------------------------------ train / resume
    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None,
              ignore_keys_for_eval: list[str] | None = None, **kwargs: Any) -> Any:
        """Trainer.train; ``resume_from_checkpoint=True`` takes the newest checkpoint under the
        root that loads (chosen once for all ranks), a path takes that checkpoint."""
        if trial is not None:
            raise CheckpointError("safeckpt's Trainer integration does not support "
                                  "hyperparameter search trials")
        self.safeckpt_preempted = False
        mgr = self._safeckpt_manager()
        failed = True
        try:
            if resume_from_checkpoint in (None, False):
                out = self._safeckpt_train(None, None, False, trial, ignore_keys_for_eval, kwargs)
            elif resume_from_checkpoint is True:
                out = self._safeckpt_train_newest(mgr, trial, ignore_keys_for_eval, kwargs)
            else:  # links of earlier versions: to step-N
                path = os.path.realpath(os.fspath(resume_from_checkpoint))
                out = self._safeckpt_train(path, None, False, trial, ignore_keys_for_eval, kwargs)
            if (self.args.save_total_limit == 1 and self.state.best_model_checkpoint is not None
                    and self._safeckpt_mgr is not None and not self.safeckpt_preempted):
                # Trainer, at the end of training: with save_total_limit=1 only the best remains.
                # Not after a preemption: the checkpoint just saved is where the run resumes.
                self._safeckpt_rotation.final = True
                try:
                    self._safeckpt_mgr.retain()
                finally:
                    self._safeckpt_rotation.final = False
            failed = False
            return out
        finally:
            self._safeckpt_resume = None
            mgr, self._safeckpt_mgr = self._safeckpt_mgr, None
            if mgr is not None and failed and self.safeckpt_local_dir is not None:
                # train() failed: the newest node-local step stays on the nodes (a collective
                # drain could wait on a rank that is gone); resume_from_checkpoint=True finds it.
                try:
                    mgr.close(drain=False)
                except Exception:  # noqa: BLE001 - the training error is the one raised
                    pass
            elif mgr is not None:
                mgr.close()  # with the tier: the newest step is committed under root first

    def _safeckpt_train_newest(self, mgr: CheckpointManager, trial: Any, ignore: Any,
                               kwargs: dict[str, Any]) -> Any:
        """Trainer.train from the newest checkpoint that loads. The load is one collective load
        of everything, inside Trainer's flow (after it built the optimizer); if it finds damage
        (CorruptCheckpoint on every rank: nothing was changed), train() runs again from the next
        older checkpoint, as Trainer's own retries (auto_find_batch_size) rerun its loop."""
        if self.safeckpt_local_dir is not None:
            # The newest step across the nodes' copies and the root, each file verified from its
            # nearest copy (damaged or missing ones are passed over inside the pick).
            step = mgr.restore({}, strict=False)
            if step is None:
                raise CheckpointNotFound(
                    f"No valid checkpoint found in output directory ({self.safeckpt_root_dir}): "
                    f"resume_from_checkpoint=True but neither {self.safeckpt_root_dir} nor the nodes' "
                    f"local_dir ({self.safeckpt_local_dir}) hold a checkpoint of this run.",
                    path=self.safeckpt_root_dir)
            return self._safeckpt_train(mgr.restored_path, step, False, trial, ignore, kwargs)
        candidates, reasons = mgr.resume_candidates()
        if not candidates and not reasons:
            raise CheckpointNotFound(  # Trainer's own words first: scripts and tests match them
                f"No valid checkpoint found in output directory ({self.safeckpt_root_dir}): "
                f"resume_from_checkpoint=True but {self.safeckpt_root_dir} holds no committed "
                "safeckpt checkpoint. Start without resume_from_checkpoint for a fresh run.",
                path=self.safeckpt_root_dir,
            )
        for step, path in candidates:
            try:
                return self._safeckpt_train(path, step, True, trial, ignore, kwargs)
            except _Damaged as exc:
                reasons.append(f"step {step}: {exc}")
                warnings.warn(f"checkpoint step {step} at {path} is corrupt, falling back to an "
                              f"older one: {exc}", SafeckptWarning, stacklevel=3)
        raise CorruptCheckpoint(
            f"no checkpoint under {self.safeckpt_root_dir} could be loaded (refusing to start fresh "
            "when history exists):\n  " + "\n  ".join(reasons), path=self.safeckpt_root_dir)

    def _safeckpt_train(self, path: str | None, step: int | None, fallback: bool, trial: Any,
                        ignore: Any, kwargs: dict[str, Any]) -> Any:
        tmp = self._safeckpt_prepare_resume(path, step, fallback) if path is not None else None
        try:
            return super().train(resume_from_checkpoint=tmp, trial=trial,
                                 ignore_keys_for_eval=ignore, **kwargs)
        finally:
            if tmp is not None:
                rmtree_quiet(tmp)
            self._safeckpt_resume = None

    def _safeckpt_prepare_resume(self, path: str, step: int | None, fallback: bool) -> str:
        """Read TrainerState and side files of the checkpoint at ``path`` from its manifest (no
        tensor is read: the one load comes later, in _load_optimizer_and_scheduler) and write
        them to a private directory that Trainer.train() reads as usual."""
        engine = None
        try:
            if ds.enabled(self):
                engine = ds.check_and_read(path, timeout=self.safeckpt_timeout)
                head = engine.head
            else:
                head = common.read_json_entries(path, ("trainer_state", "side_files", "safeckpt"),
                                                timeout=self.safeckpt_timeout, where="resume")
        except (CorruptCheckpoint, CheckpointNotFound) as exc:
            if fallback:
                raise _Damaged(str(exc)) from exc
            if isinstance(exc, CorruptCheckpoint):
                raise
            raise CheckpointNotFound(
                f"Can't find a valid checkpoint at {path}: it is not a committed safeckpt checkpoint "
                f"({exc}). Trainer-format "
                "checkpoints (checkpoint-N) cannot be resumed by the safeckpt integration; "
                "convert the model with `safeckpt convert` or start fresh.", path=path,
            ) from exc
        meta = head["safeckpt"] if isinstance(head["safeckpt"], dict) else {}
        if meta.get("format") != FORMAT:
            raise IncompatibleCheckpoint(f"{path} was not written by the safeckpt Trainer "
                                         f"integration (format {meta.get('format')!r})")
        if meta.get("save_only_model"):
            raise IncompatibleCheckpoint(
                f"{path} was saved with save_only_model=True: it holds the model and TrainerState "
                "but no optimizer, scheduler or RNG state, so training cannot resume from it. "
                "Load the weights with safeckpt.load(path, {'model': model}, strict=False) instead."
            )
        bad = [n for n in head["side_files"] if n in ("", ".", "..") or os.path.basename(n) != n]
        if bad:
            raise CorruptCheckpoint(f"{path}: side file names {bad!r} are not plain file names",
                                    path=path)
        tmp = tempfile.mkdtemp(prefix="safeckpt-hf-resume-")
        for name, text in head["side_files"].items():
            with open(os.path.join(tmp, name), "w", encoding="utf-8") as f:
                f.write(text)
        TrainerState(**head["trainer_state"]).save_to_json(os.path.join(tmp, STATE_FILE))
        # Under DeepSpeed everything was checked above, before Trainer's loop: Trainer cannot
        # run its loop a second time with a DeepSpeed engine, so no fallback from inside it.
        self._safeckpt_resume = {"dir": tmp, "path": path, "step": step, "engine": engine,
                                 "fallback": fallback and engine is None}
        return tmp

    def _safeckpt_ours(self, checkpoint: str | None) -> bool:
        r = self._safeckpt_resume
        if checkpoint is not None and r is not None and checkpoint == r["dir"]:
            return True
        if checkpoint is not None:
            raise CheckpointError(
                f"{checkpoint} is not a checkpoint chosen by the safeckpt integration; resume "
                "through trainer.train(resume_from_checkpoint=...) only."
            )
        return False

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        # The model is loaded with the optimizer, in one collective load, after prepare().
        self._safeckpt_ours(resume_from_checkpoint)

    def _prepare_for_training(self, max_steps: Any, train_dataloader: Any, resume_from_checkpoint: Any) -> Any:
        if not (ds.enabled(self) and resume_from_checkpoint is not None):
            return super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        # Trainer would point DeepSpeed at its resume directory (ours holds Trainer's files only):
        # prepare without it, then load the engine from the committed checkpoint (after checking it).
        out = super()._prepare_for_training(max_steps, train_dataloader, None)
        self._load_optimizer_and_scheduler(resume_from_checkpoint)
        self._load_scaler(resume_from_checkpoint)
        return out

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if not self._safeckpt_ours(checkpoint):
            return
        path = self._safeckpt_resume["path"]
        engine = self._safeckpt_resume["engine"]
        if engine is not None:  # checked and read before Trainer's loop; DeepSpeed loads its files
            ds.load_engine(self.model_wrapped, path, strict=not self._safeckpt_peft())
            engine.apply(self.lr_scheduler, path)
            self._safeckpt_rng, self._safeckpt_sampler = engine.rng, engine.sampler
            self._safeckpt_mark_restored()
            return
        state = self._safeckpt_state(loading=True)
        try:
            if common.overrides_load_state_dict(state["model"]):
                # Trainer calls the model's own load_state_dict on the loaded weights: the model
                # entry is read (checksums verified) before anything changes, the rest loads in
                # place, then the override gets the weights (a failure raised on every rank).
                model = state.pop("model")
                sd, prints = common.agree_all(lambda: common.read_entry_tensors(path, "model"), "resume")
                common.load_entries(path, state, timeout=self.safeckpt_timeout, where="resume")
                common.agree_all(lambda: common.load_through_override(model, path, "model", sd, prints, "resume"),
                                 "resume")
            else:
                load(path, state, strict=True, timeout=self.safeckpt_timeout)
        except IncompatibleCheckpoint as exc:
            raise IncompatibleCheckpoint(
                f"cannot resume from {path}: it does not hold exactly what this Trainer saves "
                f"(different model, optimizer, mixed precision or sampler setup?): {exc}"
            ) from exc
        except (CorruptCheckpoint, CheckpointNotFound) as exc:
            if self._safeckpt_resume["fallback"]:  # nothing was changed: an older one is next
                raise _Damaged(str(exc)) from exc
            raise
        self._safeckpt_sampler = state["sampler"]["seedable"]
        self._safeckpt_mark_restored()

    def _safeckpt_mark_restored(self) -> None:
        if self._safeckpt_resume["step"] is not None and self._safeckpt_mgr is not None:
            self._safeckpt_mgr.mark_restored(self._safeckpt_resume["step"])  # retention keeps it

    def _load_scaler(self, checkpoint: str | None) -> None:
        self._safeckpt_ours(checkpoint)  # loaded with the optimizer

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if self._safeckpt_ours(checkpoint) and self._safeckpt_rng is not None:
            self._safeckpt_rng.apply()

    def _load_best_model(self) -> None:
        if self._safeckpt_mgr is not None:
            self._safeckpt_mgr.wait()  # the best may be the save still committing in the background
        path = os.path.realpath(self.state.best_model_checkpoint)
        if ds.enabled(self):  # as Trainer: the engine's checkpoint, through DeepSpeed
            ds.check_and_read(path, timeout=self.safeckpt_timeout)
            ds.load_engine(self.model_wrapped, path, strict=not self._safeckpt_peft())
            return
        model = self._safeckpt_model()
        if common.overrides_load_state_dict(model):  # Trainer calls the model's own
            where = "load_best_model_at_end"
            sd, prints = common.agree_all(lambda: common.read_entry_tensors(path, "model"), where)
            common.agree_all(lambda: common.load_through_override(model, path, "model", sd, prints, where), where)
            return
        common.load_entries(path, {"model": model}, timeout=self.safeckpt_timeout,
                            where="load_best_model_at_end")

    # ------------------------------------------------------------------ save
    def _safeckpt_model(self) -> Any:
        wrapped = self.model_wrapped
        model = wrapped if wrapped is not None and hasattr(wrapped, "state_dict") else self.model
        common.refuse_fsdp1(model, "safeckpt")
        return model

    def _safeckpt_state(self, loading: bool = False) -> dict[str, Any]:
        """What one checkpoint holds; the same layout for saving and loading."""
        engine = ds.enabled(self)  # model, optimizer and scaler are the engine's to save
        state: dict[str, Any] = {} if engine else {"model": self._safeckpt_model()}
        save_all = not self.args.save_only_model or loading
        if save_all:
            if not engine:
                state["optimizer"] = common.inner_optimizer(self.optimizer)
            if not engine or type(self.lr_scheduler).__name__ != "DeepSpeedSchedulerWrapper":
                state["scheduler"] = common.inner_scheduler(self.lr_scheduler)  # Trainer's own
            scaler = getattr(self.accelerator, "scaler", None)
            if scaler is not None and not engine:
                state["scaler"] = scaler
            if loading:
                self._safeckpt_rng = common.DeferredRNG()
                state["rng"] = self._safeckpt_rng
            else:
                state["rng"] = RNGState()
            # never a bare None entry: {"seedable": None} when there is no seedable sampler
            state["sampler"] = {"seedable": None if loading else
                                common.sampler_state(self.callback_handler.train_dataloader)}
        state["trainer_state"] = {} if loading else json.loads(
            json.dumps(dataclasses.asdict(self.state)))
        state["side_files"] = {}
        state["safeckpt"] = {}
        return state

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        if self._safeckpt_outer:
            # Called from the outermost _save_checkpoint (with_safeckpt): subclasses may still
            # add files after us; the outermost one commits once they are done.
            if self._safeckpt_side is not None:
                os.makedirs(self._safeckpt_side, exist_ok=True)
            return
        self._safeckpt_commit(trial)

    def _safeckpt_side_begin(self) -> None:
        """Before a subclass's _save_checkpoint runs: it writes its own files into
        ``output_dir/checkpoint-N`` (TRL's pattern), so while it runs ``args.output_dir`` is a
        hidden scratch directory under the root, ``.checkpoint-N.safeckpt-trash-<hex>/<name of
        output_dir>``, one for all ranks: no ``checkpoint-N`` is visible before the commit (a kill there leaves
        only that hidden name, which ``get_last_checkpoint`` never matches and the next save's
        sweep removes), and the files are taken into the commit from there, also when the
        step is saved again over a committed ``checkpoint-N``."""
        root, step = self.safeckpt_root_dir, self.state.global_step
        # The scratch output_dir keeps the real one's last name: TRL names the model card it
        # writes during the save after it (Path(args.output_dir).name).
        base = os.path.basename(os.path.abspath(self.args.output_dir)) or "output"

        def make() -> str:
            name = f".{SIDE_PREFIX}{step}{TRASH_MARK}{secrets.token_hex(6)}"
            os.makedirs(os.path.join(root, name, base, f"{SIDE_PREFIX}{step}"))
            return name

        scratch = os.path.join(root, common.share_from_rank0(make), base)
        self._safeckpt_side = os.path.join(scratch, f"{SIDE_PREFIX}{step}")
        self._safeckpt_side_out = self.args.output_dir
        self.args.output_dir = scratch

    def _safeckpt_side_restore(self) -> None:
        """After the subclass's part of the save: ``args.output_dir`` is the real one again."""
        out, self._safeckpt_side_out = self._safeckpt_side_out, None
        if out is not None:
            self.args.output_dir = out

    def _safeckpt_side_files(self) -> dict[str, str]:
        """Rank 0's view of the files subclasses wrote during this save (text, <= 16 MiB each)."""
        d = self._safeckpt_side
        if d is None:
            return {}

        def read() -> dict[str, str]:
            # Anything written into output_dir itself meanwhile (a model card) goes there now.
            scratch, out_dir = os.path.dirname(d), self.args.output_dir
            for name in sorted(os.listdir(scratch)) if os.path.isdir(scratch) else ():
                if name != os.path.basename(d):
                    os.makedirs(out_dir, exist_ok=True)
                    try:
                        os.replace(os.path.join(scratch, name), os.path.join(out_dir, name))
                    except OSError as exc:  # a non-empty directory of that name there
                        warnings.warn(f"{name}, written into output_dir during the save, could not be "
                                      f"moved there ({exc}); it is dropped", SafeckptWarning, stacklevel=2)
            if not os.path.isdir(d):
                return {}
            out = {}
            for name in sorted(os.listdir(d)):
                p = os.path.join(d, name)
                try:
                    if not os.path.isfile(p) or os.path.getsize(p) > MAX_SIDE_BYTES:
                        raise ValueError("not a regular file of at most 16 MiB")
                    with open(p, encoding="utf-8") as f:
                        out[name] = f.read()
                except (OSError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
                    raise CheckpointError(
                        f"{p}: written by {type(self).__name__} during the save, but only text "
                        f"files of at most 16 MiB are taken into the checkpoint ({exc})"
                    ) from exc
            return out

        return common.share_from_rank0(read)

    def _safeckpt_side_end(self) -> None:
        d, self._safeckpt_side = self._safeckpt_side, None
        if d is not None and common.rank() == 0:
            rmtree_quiet(os.path.dirname(os.path.dirname(d)))  # the hidden scratch

    def _safeckpt_commit(self, trial: Any) -> None:
        if trial is not None:
            raise CheckpointError("safeckpt's Trainer integration does not support "
                                  "hyperparameter search trials")
        self.store_flos()  # all-gather: every rank, as Trainer does
        mgr = self._safeckpt_manager()
        mgr.wait()  # an async save still in flight: committed (or its error raised) first
        step = self.state.global_step
        root = self.safeckpt_root_dir
        path = common.step_dir(root, step, common.TRAINER_DIRNAME)
        metric_name = self._safeckpt_metric()
        metric = self._safeckpt_eval_metric(metric_name, step)
        metrics = {metric_name: metric} if metric is not None else {}
        # Trainer's rule, word for word: state.best_global_step is set by Trainer's own
        # _determine_best_metric (strictly better only, so ties keep the first); it names the
        # best checkpoint only if that step was saved (this one counts), else the old one stays.
        best = self.state.best_global_step
        if self.args.save_strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST) and best:
            if (best == step and self._safeckpt_durable(step)) or common.share_from_rank0(
                    lambda: any(os.path.isdir(common.step_dir(root, best, d))
                                for d in (common.TRAINER_DIRNAME, None))):
                self.state.best_model_checkpoint = self._safeckpt_link(best)
        self._safeckpt_export_callbacks()
        state = self._safeckpt_state()
        try:
            state["side_files"] = self._safeckpt_side_files()
        finally:
            # The subclass's scratch directory: gone before the save (its files are committed
            # inside the checkpoint below); a kill before this leaves it to the next sweep.
            self._safeckpt_side_end()
        state["safeckpt"] = {"format": FORMAT, "save_only_model": bool(self.args.save_only_model),
                             "trainer_class": type(self).__name__}
        # Trainer's own trainer_state.json (same bytes as TrainerState.save_to_json) and the
        # subclass's files, as files of the commit: log and dashboard tools read them there.
        extra = {name: text.encode("utf-8") for name, text in state["side_files"].items()
                 if _EXTRA_OK.match(name) and name != STATE_FILE}
        extra[STATE_FILE] = (json.dumps(dataclasses.asdict(self.state), indent=2, sort_keys=True)
                             + "\n").encode("utf-8")
        hook = ds.engine_files(self.model_wrapped, exclude_frozen=self._safeckpt_peft()) if ds.enabled(self) else None
        named, small, view = self._safeckpt_pretrained_layout()
        if view is not None:  # FSDP2, opted in: the gathered tensors the named files hold
            state["model"] = view
        for name, data in small.items():  # config.json, generation_config.json, adapter_config.json, ...
            if _EXTRA_OK.match(name) and name not in extra:
                extra[name] = data
        info = mgr.save(step, state, metrics=metrics, extra_files=extra, write_files=hook, named=named)
        if info is not None and self.safeckpt_local_dir is None and os.path.abspath(info.path) != path:
            raise CheckpointError(f"committed {info.path}, expected {path}")
        if self.args.push_to_hub and common.rank() == 0 and os.path.isfile(os.path.join(path, "manifest.json")):
            # As stock Trainer after its save (rank 0, hub_strategy != "end"): the model files of
            # the committed checkpoint-N go to output_dir and the Hub; "checkpoint" also uploads
            # checkpoint-N itself as last-checkpoint ("all_checkpoints" under its own name). A
            # step kept on the nodes only (local_dir) is not pushed.
            self._push_from_checkpoint(path)

    def _safeckpt_pretrained_layout(self) -> tuple[dict[str, dict[str, str]] | None, dict[str, bytes], Any]:
        """The model's files as ``Trainer._save`` (``save_pretrained``) lays them out, for this
        save: ({file: {name in file: key}}, the small files beside them on rank 0, the model entry
        to save or None for the model itself), or (None, {}, None) where the checkpoint keeps the
        model in safeckpt's own files (DeepSpeed, FSDP2 unless opted in, opted out). An FSDP2
        model with ``safeckpt_pretrained=True``: every rank gathers the full tensors (collective),
        the files hold them, and the model entry is a view with those in place of the shards."""
        want = self.safeckpt_pretrained
        if "://" in str(self.safeckpt_root or self.args.output_dir):  # an object store: token names there
            if want:
                raise CheckpointError("safeckpt_pretrained=True with an object-store root: named files "
                                      "need a filesystem checkpoint directory")
            return None, {}, None
        if want is False or ds.enabled(self):
            if want and ds.enabled(self):
                raise CheckpointError("safeckpt_pretrained=True with DeepSpeed: the model lives in the "
                                      "engine's own checkpoint; export it with trainer.save_model()")
            return None, {}, None
        model = self._safeckpt_model()
        full = None
        if common.is_sharded(model):
            if not want:  # the default for FSDP2: shards as DTensors, never gathered
                return None, {}, None
            full = gather_full(model)  # collective: the full tensors on every rank's CPU
        small: dict[str, bytes] = {}

        def write(d: str) -> None:  # Trainer's _save (a subclass's too), with the shard size where set
            # a copy: save_pretrained drops the tied names from the dict it is given (rank 0 only)
            sd = dict(full) if full is not None else None
            size = self.safeckpt_max_shard_size
            if size is None:
                self._save(d, state_dict=sd)
                return
            inner = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
            with _default_shard_size([self.model, inner], size):
                self._save(d, state_dict=sd)

        def on_rank0() -> dict[str, Any]:
            # Not the pickled TrainingArguments; not PEFT's boilerplate model card (README.md): no
            # part of what from_pretrained reads, rewritten at every save, and 5 KB that would put
            # a small LoRA checkpoint past 1.1x stock's size (test_hf_peft); save_model writes it.
            files, files_small, why = pretrained_layout(model, "model", write, skip=(TRAINING_ARGS, "README.md"),
                                                        sd=full)
            small.update(files_small)
            return {"files": files, "why": why}

        out = common.share_from_rank0(on_rank0)
        if out["files"] is None:
            if want:
                raise CheckpointError(f"safeckpt_pretrained=True but this model's checkpoint cannot be a Hugging "
                                      f"Face model directory: {out['why']}")
            if not getattr(self, "_safeckpt_warned_layout", False):
                self._safeckpt_warned_layout = True
                warnings.warn(f"checkpoints hold the model in safeckpt's own files, not as model.safetensors "
                              f"({out['why']}); export with trainer.save_model() for from_pretrained",
                              SafeckptWarning, stacklevel=3)
            return None, {}, None
        view = full_view(model, "model", full, out["files"]) if full is not None else None
        return out["files"], small, view

    def _safeckpt_eval_metric(self, name: str | None, step: int) -> float | None:
        if not name:
            return None
        for entry in reversed(self.state.log_history):
            if entry.get("step") != step:
                break
            if name in entry:
                return common.json_float(entry[name])
        return None

    def _safeckpt_export_callbacks(self) -> None:
        """As Trainer does before writing trainer_state.json: callbacks' state into the state."""
        for cb in [c for c in self.callback_handler.callbacks + [self.control]
                   if isinstance(c, ExportableState)]:
            name = cb.__class__.__name__
            if isinstance(self.state.stateful_callbacks.get(name), list):
                self.state.stateful_callbacks[name].append(cb.state())
            else:
                self.state.stateful_callbacks[name] = cb.state()

    # ------------------------------------------------------------------ the Hub
    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        with _hub_ignoring_ours():  # output_dir holds safeckpt's lease and hidden directories
            super()._push_from_checkpoint(checkpoint_folder)

    def push_to_hub(self, *args: Any, **kwargs: Any) -> Any:
        with _hub_ignoring_ours():
            return super().push_to_hub(*args, **kwargs)

    # ------------------------------------------------------------------ export
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """As Trainer.save_model; an FSDP2-sharded model is exported without being gathered
        (every rank writes its shards, rank 0 streams them into model.safetensors)."""
        model = self.model
        if not common.is_sharded(model):
            return super().save_model(output_dir, _internal_call=_internal_call)
        out = os.path.abspath(output_dir or self.args.output_dir)

        def extras(d: str) -> None:
            inner = self.accelerator.unwrap_model(model, keep_torch_compile=False)
            if getattr(inner, "config", None) is not None:
                inner.config.save_pretrained(d)
            gen = getattr(inner, "generation_config", None)
            if gen is not None and getattr(inner, "can_generate", lambda: False)():
                gen.save_pretrained(d)
            if self.processing_class is not None:
                self.processing_class.save_pretrained(d)

        common.export_pretrained(model, out, timeout=self.safeckpt_timeout, write_extras=extras)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)


_UNSET: Any = object()


def with_safeckpt(trainer_cls: T, *, root: str | None = None, timeout: float | None = None,
                  async_save: bool | None = None, pretrained: bool | None = None,
                  max_shard_size: int | str | None = None, local_dir: str | os.PathLike[str] | None = None,
                  durable_every: int | None = _UNSET, replicas: int = _UNSET, keep_local: int | None = _UNSET,
                  local_max_bytes: int | None = _UNSET, check_finite: bool | tuple[str, ...] = _UNSET) -> T:
    """``trainer_cls`` (Trainer, SFTTrainer, any Trainer subclass) with safeckpt checkpoints.

    ``pretrained``, ``max_shard_size``: see ``SafeckptTrainerMixin.safeckpt_pretrained`` (default:
    every ``checkpoint-N`` of a DDP or one-process model is also a ``from_pretrained`` directory;
    ``pretrained=True`` makes an FSDP2 model's checkpoints one too, its tensors gathered).

    ``local_dir``, ``durable_every``, ``replicas``, ``keep_local``, ``local_max_bytes``,
    ``check_finite``: the fast-recovery tier, passed to the trainer's
    :class:`~safeckpt.CheckpointManager` (see ``SafeckptTrainerMixin``).

    ``async_save=True``: each save blocks training only while the state is copied aside; it is
    written and committed in the background (the next save, ``load_best_model_at_end`` and the
    end of ``train()`` wait for it, and raise its error if it failed).

    The mixin is placed directly above ``Trainer`` in the MRO, so the subclass's own
    ``_save_checkpoint`` / ``_load_optimizer_and_scheduler`` additions still run; the returned
    class's ``_save_checkpoint`` commits after all of them.
    """
    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, Trainer)):
        raise TypeError(f"with_safeckpt needs a transformers.Trainer subclass, got {trainer_cls!r}")
    tier = {f"safeckpt_{k}": v for k, v in (("durable_every", durable_every), ("replicas", replicas),
                                            ("keep_local", keep_local), ("local_max_bytes", local_max_bytes),
                                            ("check_finite", check_finite)) if v is not _UNSET}
    if local_dir is not None:
        tier["safeckpt_local_dir"] = os.fspath(local_dir)
    if (issubclass(trainer_cls, SafeckptTrainerMixin) and root is None and timeout is None and async_save is None
            and pretrained is None and max_shard_size is None and not tier):
        return trainer_cls

    def _save_checkpoint(self: Any, model: Any, trial: Any) -> None:
        if capture:
            self._safeckpt_side_begin()
        self._safeckpt_outer = True
        try:
            super(cls, self)._save_checkpoint(model, trial)
        except BaseException:
            self._safeckpt_side_end()
            raise
        finally:
            self._safeckpt_outer = False
            self._safeckpt_side_restore()
        self._safeckpt_commit(trial)

    # Only a class that adds to _save_checkpoint can write files of its own during a save.
    capture = trainer_cls._save_checkpoint is not Trainer._save_checkpoint and not issubclass(
        trainer_cls, SafeckptTrainerMixin)
    ns: dict[str, Any] = {"_save_checkpoint": _save_checkpoint, "__module__": trainer_cls.__module__,
                          "__doc__": trainer_cls.__doc__}
    if root is not None:
        ns["safeckpt_root"] = os.fspath(root)
    if timeout is not None:
        ns["safeckpt_timeout"] = timeout
    if async_save is not None:
        ns["safeckpt_async"] = bool(async_save)
    if pretrained is not None:
        ns["safeckpt_pretrained"] = bool(pretrained)
    if max_shard_size is not None:
        ns["safeckpt_max_shard_size"] = max_shard_size
    ns.update(tier)
    if issubclass(trainer_cls, SafeckptTrainerMixin):
        bases: tuple[type, ...] = (trainer_cls,)
    elif trainer_cls is Trainer:
        bases = (SafeckptTrainerMixin,)
    else:
        bases = (trainer_cls, SafeckptTrainerMixin)
    cls = type(f"Safeckpt{trainer_cls.__name__}", bases, ns)
    mro = cls.__mro__
    if mro.index(Trainer) != mro.index(SafeckptTrainerMixin) + 1:  # pragma: no cover - C3 guarantees it
        raise TypeError(f"cannot place safeckpt directly above Trainer in {trainer_cls.__name__}'s MRO")
    return cls  # type: ignore[return-value]
