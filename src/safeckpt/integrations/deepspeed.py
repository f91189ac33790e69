"""DeepSpeed: atomic, collective, pickle-free checkpoints through DeepSpeed's own save and load.

One call on every rank after ``deepspeed.initialize``::

    engine, optimizer, _, scheduler = deepspeed.initialize(model=model, config=cfg, ...)
    safeckpt.integrations.deepspeed.install(engine)
    engine.load_checkpoint(save_dir)        # newest valid tag, agreed by all ranks; (None, None) if none
    ...
    engine.save_checkpoint(save_dir)        # every rank; tag "global_step<N>" unless given

For engines created by someone else (Hugging Face ``Trainer``, Accelerate), call
:func:`install_on_initialize` before they are created: every engine built afterwards is
installed the moment DeepSpeed sets up its checkpointing.

What :func:`install` changes: ``engine.checkpoint_engine`` becomes a
:class:`SafeckptCheckpointEngine`, and ``engine.save_checkpoint`` / ``engine.load_checkpoint``
are wrapped (same signatures) so that DeepSpeed still decides what every rank saves and loads,
while safeckpt decides where, how and when it becomes visible. Call sequence of one save
(DeepSpeed's ``save_checkpoint`` drives it):

1. ``create``  (all ranks)    agree on directory and tag (else RankMismatch, nothing written);
                              the coordinator sweeps leftovers of crashed saves and creates a
                              hidden staging directory next to the tag; every rank checks it
                              sees it (shared storage).
2. ``save``    (writer ranks) each file DeepSpeed saves is written at once, by the rank that
                              saves it, as a one-rank safeckpt checkpoint (safetensors + JSON,
                              fsynced, checksummed) in the staging directory. Known DeepSpeed
                              objects are converted to JSON; others are refused. An error is
                              kept for step 3, so no rank is left waiting.
3. ``commit``  (all ranks)    every rank reports its files (or its error: then the same error
                              is raised on every rank and the staging directory removed); the
                              coordinator checks every file, writes the index, publishes the
                              tag with one rename (replacing an older tag of the same name in
                              one step) and then writes ``latest`` atomically.

NVMe offload files are copied by each rank into its own directory inside the staging
directory, with checksums, and published with the tag. A load picks the newest committed tag
(or the one asked for) on the coordinator, checks it, and has every rank read and verify the
files it needs before DeepSpeed touches the model; a damaged tag is skipped on every rank
together. DeepSpeed's ``zero_to_fp32.py`` is not copied (it cannot read this format): use
:func:`export` / :func:`get_fp32_state_dict`, or ``python -m safeckpt.integrations.deepspeed``.
"""

from __future__ import annotations

import contextlib
import os
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import MethodType
from typing import Any

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import (
    CheckpointCommitInfo,
    CheckpointEngine,
)

from .. import read_state_dict
from ..coord.dist import distributed_active
from ..errors import (
    CheckpointError,
    CheckpointNotFound,
    CorruptCheckpoint,
    RankFailure,
    RankMismatch,
    SafeckptWarning,
)
from ._deepspeed import codec
from ._deepspeed.export import (
    export,
    get_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    main,
    serve_zero_to_fp32,
)
from ._deepspeed.tags import (
    OFFLOAD_DIR,
    Coordinator,
    TagInfo,
    check_offload,
    check_tag,
    copy_offload,
    list_tags,
    new_index,
    new_staging,
    next_seq,
    pick,
    publish_tag,
    read_index,
    remove_tree,
    resolve,
    save_local,
    sweep,
    tag_problems,
    wait_visible,
    write_index,
    write_latest,
)

__all__ = [
    "SafeckptCheckpointEngine",
    "TagInfo",
    "TagMismatch",
    "export",
    "get_fp32_state_dict",
    "get_fp32_state_dict_from_zero_checkpoint",
    "install",
    "install_on_initialize",
    "list_tags",
    "load_checkpoint",
    "save_checkpoint",
]

_NOT_PUBLISHED = "The tag was not published; the previous checkpoints and `latest` are intact."
_ENTRY_RE = re.compile(r"^[^/@][^/]*$")
_FILE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")  # what a checkpoint may name


@dataclass
class _Save:
    """One save_checkpoint in progress on this rank."""

    coord: Coordinator
    save_dir: str
    tag: str
    staging: str
    latest: bool
    engine_info: dict[str, Any]
    local: str = ""  # save_dir/<this rank's own tag> (differs from final only under WARN/IGNORE)
    files: dict[str, Any] = field(default_factory=dict)
    offload: dict[str, Any] = field(default_factory=dict)
    error: BaseException | None = None

    @property
    def final(self) -> str:
        return os.path.join(self.save_dir, self.tag)


class TagMismatch(RankMismatch, AssertionError):
    """Ranks called ``save_checkpoint`` with different tags under ``tag_validation: FAIL``
    (an ``AssertionError`` too, the type DeepSpeed's own tag check raises)."""


@dataclass
class _Plain:
    """One save_16bit_model in progress on this rank: rank 0 writes a hidden temporary file,
    every rank reports at commit, and only then is it renamed into place (or removed)."""

    coord: Coordinator
    path: str
    tmp: str | None = None
    error: BaseException | None = None

    def write(self, state_dict: Any, path: str) -> None:
        if self.error is not None:
            return
        try:
            if resolve(path) != self.path:
                raise CheckpointError(f"DeepSpeed saved {path}, not the agreed {self.path}")
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            self.tmp = os.path.join(os.path.dirname(self.path),
                                    f".{os.path.basename(self.path)}.safeckpt-tmp-{os.getpid()}")
            _save_plain(state_dict, self.path, self.tmp)
        except Exception as exc:  # noqa: BLE001 - raised on every rank at commit
            self.error = exc

    def commit(self) -> None:
        hint = f"{self.path} was not written (an existing file there is unchanged)."

        def report() -> None:
            if self.error is not None:
                raise self.error

        def publish() -> None:
            if self.coord.is_coordinator:
                if self.tmp is None:
                    raise CheckpointError("rank 0 saved no weights")
                from ._deepspeed.tags import fsync_dir

                os.replace(self.tmp, self.path)
                self.tmp = None
                fsync_dir(os.path.dirname(self.path))

        try:
            self.coord.run("16bit-report", report, hint=hint)
            self.coord.run("16bit-publish", publish, hint=hint)
        finally:
            if self.tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(self.tmp)


class SafeckptCheckpointEngine(CheckpointEngine):
    """DeepSpeed ``CheckpointEngine`` writing safeckpt checkpoints (see the module docstring
    for the call sequence). Created and set by :func:`install`."""

    def __init__(self, *, timeout: float | None = None) -> None:
        super().__init__(None)
        self.name = "SafeckptCheckpointEngine"
        self.timeout = timeout
        self._save: _Save | None = None  # set by prepare(), for one save_checkpoint
        self._plain: _Plain | None = None  # set by prepare_plain(), for one save_16bit_model
        self._cache: dict[str, Any] = {}  # files read ahead by load_checkpoint, by path

    # ----------------------------------------------------------------- saving
    def prepare(self, save_dir: str, tag: str, latest: bool, engine_info: dict[str, Any],
                validation: str) -> None:
        """Every rank, before DeepSpeed's save starts: agree on directory and tag (else an error
        on every rank, nothing written), then the coordinator sweeps leftovers of crashed saves
        and creates a hidden staging directory next to the tag; every rank checks it sees it.

        ``validation`` is DeepSpeed's ``checkpoint.tag_validation``: with ``FAIL`` ranks giving
        different tags raise :class:`TagMismatch` (an ``AssertionError`` too, as DeepSpeed's
        own check raises); with ``WARN`` (warned) or ``IGNORE`` every rank's files are saved
        under rank 0's tag, so the save stays one atomic tag."""
        own = str(tag)
        save_dir = resolve(save_dir)
        coord = Coordinator(self.timeout, what=f"DeepSpeed save to {save_dir}")
        asked = coord.run("agree", lambda: {"dir": save_dir, "tag": own}, hint="Nothing was written.")
        rank0 = asked[0]
        dirs = [f"rank {r}: {a['dir']}" for r, a in enumerate(asked) if a["dir"] != rank0["dir"]]
        if dirs:
            raise RankMismatch(
                f"save_checkpoint: ranks were called with different directories (rank 0: {rank0['dir']}; "
                f"{'; '.join(dirs)}); nothing was written. Pass the same save_dir on every rank."
            )
        tags = [f"rank {r}: {a['tag']!r}" for r, a in enumerate(asked) if a["tag"] != rank0["tag"]]
        if tags and validation == "FAIL":
            raise TagMismatch(
                f"save_checkpoint: ranks were called with different tags (rank 0: {rank0['tag']!r}; "
                f"{'; '.join(tags)}); nothing was written. Pass the same tag on every rank, or set "
                "checkpoint.tag_validation to WARN or IGNORE to save every rank's files under "
                "rank 0's tag."
            )
        if tags and validation == "WARN":
            warnings.warn(
                f"save_checkpoint: ranks were called with different tags (rank 0: {rank0['tag']!r}; "
                f"{'; '.join(tags)}); tag_validation is WARN, so every rank's files are saved under "
                f"rank 0's tag {rank0['tag']!r}.", SafeckptWarning, stacklevel=4,
            )
        tag = check_tag(rank0["tag"])
        coord.what = f"DeepSpeed save of tag {tag!r} to {save_dir}"

        def stage() -> str | None:
            if not coord.is_coordinator:
                return None
            os.makedirs(save_dir, exist_ok=True)
            sweep(save_dir)
            final = os.path.join(save_dir, tag)
            if os.path.lexists(final) and not os.path.isdir(final):
                raise CheckpointError(f"{final} exists and is not a directory; move it away")
            return new_staging(final)

        staging = coord.run("stage", stage, hint="Nothing was written.")[0]
        try:
            coord.run("probe", lambda: wait_visible(staging), hint="Nothing was written.")
        except BaseException:
            if coord.is_coordinator:
                remove_tree(staging)
            raise
        self._save = _Save(coord, save_dir, tag, staging, latest, engine_info,
                           local=os.path.join(save_dir, own))

    def prepare_plain(self, save_dir: str, filename: str) -> None:
        """Every rank, before ``save_16bit_model`` gathers anything: agree on the target (else
        an error on every rank together, nothing gathered or written)."""
        path = os.path.join(resolve(save_dir), str(filename))
        coord = Coordinator(self.timeout, what=f"DeepSpeed save_16bit_model to {path}")
        asked = coord.run("agree-16bit", lambda: path, hint="Nothing was written.")
        if any(a != asked[0] for a in asked):
            raise RankMismatch(
                "save_16bit_model: ranks were called with different targets ("
                + "; ".join(f"rank {r}: {a}" for r, a in enumerate(asked))
                + "); nothing was written. Pass the same save_dir and save_filename on every rank."
            )
        self._plain = _Plain(coord, path)

    def create(self, info: CheckpointCommitInfo) -> None:
        # The agreement ran in prepare()/prepare_plain(), before DeepSpeed acted. A create()
        # without either is a save that does not go through the installed methods: plain files.
        return

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        if self._save is not None and resolve(path) in (self._save.final, self._save.local):
            return  # the tag directory appears at commit; files go to the staging directory
        if self._plain is not None:
            return  # save_16bit_model: rank 0 creates the directory when it writes
        os.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict: Any, path: str) -> None:
        if self._plain is not None:
            self._plain.write(state_dict, path)
            return
        s = self._save
        if s is None:
            _save_plain(state_dict, path, path)
            return
        if s.error is not None:
            return
        try:
            name = os.path.basename(path)
            if resolve(os.path.dirname(path)) not in (s.final, s.local):
                raise CheckpointError(
                    f"DeepSpeed saved {path}, outside the tag directory {s.final}; safeckpt can only "
                    "publish files inside the tag atomically"
                )
            if not _FILE_RE.match(name):
                raise CheckpointError(f"DeepSpeed saved a file named {name!r}; safeckpt indexes only "
                                      "names of letters, digits and . _ - (no leading dot)")
            save_local(os.path.join(s.staging, name), _file_state(state_dict, name),
                       metadata={"deepspeed": {"file": name, "tag": s.tag, "rank": s.coord.rank}},
                       timeout=self.timeout)
            s.files[name] = {"rank": s.coord.rank}
        except Exception as exc:  # noqa: BLE001 - raised on every rank at commit
            s.error = exc

    def copy_offload(self, rank: int, swap_folder: str) -> None:
        """This rank's NVMe swap files into its own directory of the staging tag."""
        s = self._save
        if s is None or s.error is not None:
            return
        rank_dir = f"rank{rank:0>2d}"
        try:
            s.offload[rank_dir] = copy_offload(swap_folder, os.path.join(s.staging, OFFLOAD_DIR, rank_dir))
        except Exception as exc:  # noqa: BLE001 - raised on every rank at commit
            s.error = exc

    def commit(self, info: CheckpointCommitInfo) -> bool:
        plain, self._plain = self._plain, None
        if plain is not None:
            plain.commit()
            return True
        s, self._save = self._save, None
        if s is None:
            return True
        coord = s.coord
        try:
            reports = coord.run("report", lambda: _report(s), hint=_NOT_PUBLISHED)
            coord.run("publish", lambda: _publish(s, reports) if coord.is_coordinator else None,
                      hint=_NOT_PUBLISHED)
        except BaseException:
            if coord.is_coordinator and os.path.lexists(s.staging):
                remove_tree(s.staging)
            raise
        return True

    def preserves_storage_sharing(self) -> bool:
        return False  # each tensor's own bytes are written; DeepSpeed need not clone them

    # ---------------------------------------------------------------- loading
    def load(self, path: str, map_location: Any = None) -> Any:
        key = resolve(path)
        obj = _copy_containers(self._cache[key]) if key in self._cache else read_file(key)
        if isinstance(map_location, (str, torch.device)):
            obj = _to_device(obj, torch.device(map_location))
        return obj

    def prefetch(self, engine: Any, tag_dir: str) -> None:
        """Read (and verify) what this rank's DeepSpeed load will ask for."""
        index = read_index(tag_dir)
        for name in _needed(engine, index):
            self._cache[resolve(os.path.join(tag_dir, name))] = read_file(os.path.join(tag_dir, name))
        rank_dir = f"rank{_global_rank():0>2d}"
        if rank_dir in index["offload"]:
            check_offload(tag_dir, rank_dir, index["offload"][rank_dir])


def _report(s: _Save) -> dict[str, Any]:
    if s.error is not None:
        raise s.error
    return {"files": s.files, "offload": s.offload}


def _publish(s: _Save, reports: list[dict[str, Any]]) -> None:
    """Coordinator: check every rank's files, write the index, publish, then `latest`."""
    files: dict[str, Any] = {}
    offload: dict[str, Any] = {}
    for r, rep in enumerate(reports):
        for name, rec in rep["files"].items():
            if name in files:
                raise CheckpointError(f"ranks {files[name]['rank']} and {r} both saved {name}")
            files[name] = rec
        offload.update(rep["offload"])
    problems = tag_problems(s.staging, {"files": files, "offload": offload})
    if problems:
        raise CheckpointError("files in the staging directory do not match what the ranks wrote: "
                              + "; ".join(problems[:10]))
    index = new_index(tag=s.tag, seq=next_seq(s.save_dir), latest=s.latest, world_size=s.coord.world_size,
                      files=files, offload=offload, engine_info=s.engine_info)
    write_index(s.staging, index)
    publish_tag(s.staging, s.final)
    if s.latest:
        write_latest(s.save_dir, s.tag)


def _file_state(state_dict: Any, name: str) -> dict[str, Any]:
    if not isinstance(state_dict, dict):
        raise CheckpointError(f"DeepSpeed saved a {type(state_dict).__name__} as {name}; expected a dict")
    for key in state_dict:
        if not isinstance(key, str) or not _ENTRY_RE.match(key):
            raise CheckpointError(
                f"{name}: top-level key {key!r} cannot name a checkpoint entry (keys of "
                "client_state must be non-empty strings without '/' and not starting with '@')"
            )
    return codec.encode(dict(state_dict), name)


def read_file(path: str) -> dict[str, Any]:
    """One file DeepSpeed saved, as DeepSpeed gave it (known objects rebuilt), never unpickled."""
    try:
        return codec.decode(read_state_dict(path, nested=True))
    except CheckpointNotFound as exc:
        raise CheckpointNotFound(
            f"DeepSpeed asked for {path}, which safeckpt did not write ({exc}). A checkpoint "
            "saved without safeckpt loads once with load_checkpoint(..., allow_pickle=True).",
            path=path,
        ) from None


def _save_plain(state_dict: Any, path: str, tmp: str) -> None:
    """``save_16bit_model``'s weights as one plain file written to ``tmp`` and fsynced (its
    caller renames it into place), or with ``tmp == path`` written next to it and renamed at
    once. A ``.safetensors`` name gets safetensors; any other name (DeepSpeed's default
    ``pytorch_model.bin``) what DeepSpeed itself writes there, ``torch.save`` of the weights:
    a file of tensors only, which ``torch.load(path, weights_only=True)`` and Hugging Face's
    ``from_pretrained`` read without unpickling code. safeckpt never reads it back."""
    from ._deepspeed.tags import fsync_dir

    if not isinstance(state_dict, dict) or not all(isinstance(v, torch.Tensor) for v in state_dict.values()):
        raise CheckpointError(f"save_16bit_model: expected a dict of tensors for {path}")
    own_tmp = tmp == path
    out = f"{path}.tmp-{os.getpid()}" if own_tmp else tmp
    if str(path).endswith(".safetensors"):
        from safetensors.torch import save_file

        seen: set[int] = set()
        tensors = {}
        for k, v in state_dict.items():
            v = v.detach().cpu().contiguous()
            tensors[k] = v.clone() if v.data_ptr() in seen else v  # tied weights: own bytes
            seen.add(v.data_ptr())
        save_file(tensors, out, metadata={"format": "pt"})
    else:
        torch.save(state_dict, out)
    with open(out, "rb+") as f:
        os.fsync(f.fileno())
    if own_tmp:
        os.replace(out, path)
        fsync_dir(os.path.dirname(os.path.abspath(path)))


def _copy_containers(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _copy_containers(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_copy_containers(v) for v in obj]
    return obj


def _to_device(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_device(v, device) for v in obj]
    return obj


def _global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if distributed_active() else 0


def _needed(engine: Any, index: dict[str, Any]) -> list[str]:
    """The files DeepSpeed's load on this rank asks for: its model-parallel rank's files, its
    own ZeRO partition (all partitions with ``elastic_checkpoint``), files of no partition."""
    import torch.distributed as dist

    group = getattr(getattr(engine, "optimizer", None), "dp_process_group", None)
    dp_rank = dist.get_rank(group=group) if group is not None else _global_rank()
    mp_rank = int(getattr(engine, "checkpoint_mp_rank", 0) or 0)
    elastic = engine.zero_optimization_stage() in (1, 2) and bool(engine.zero_elastic_checkpoint())
    out = []
    for name in index["files"]:
        mp = re.search(r"mp_rank_(\d+)", name)
        zero = re.search(r"zero_pp_rank_(\d+)_", name)
        if mp and int(mp.group(1)) != mp_rank:
            continue
        if zero is None or int(zero.group(1)) == dp_rank or (elastic and name.endswith("_optim_states.pt")):
            out.append(name)
    return out


# ------------------------------------------------------------------ install
def install(engine: Any, *, timeout: float | None = None) -> SafeckptCheckpointEngine:
    """Make ``engine``'s checkpoints safeckpt checkpoints (every rank, after
    ``deepspeed.initialize``; idempotent). Returns the installed checkpoint engine.

    ``timeout``: seconds a rank waits for the others in a save or load (default 600 or
    ``$SAFECKPT_TIMEOUT``).
    """
    current = getattr(engine, "checkpoint_engine", None)
    if isinstance(current, SafeckptCheckpointEngine):
        return current
    if engine.use_node_local_storage():
        raise CheckpointError(
            "safeckpt needs the checkpoint directory on storage shared by all ranks; this "
            "engine has checkpoint.use_node_local_storage=true. Turn it off to use safeckpt."
        )
    ce = SafeckptCheckpointEngine(timeout=timeout)
    engine.checkpoint_engine = ce
    engine.save_checkpoint = MethodType(_save_checkpoint_method, engine)
    engine.load_checkpoint = MethodType(_load_checkpoint_method, engine)
    engine.save_16bit_model = MethodType(_save_16bit_model_method, engine)
    engine._copy_recovery_script = lambda save_path: None  # zero_to_fp32.py cannot read this format
    return ce


def install_on_initialize(*, timeout: float | None = None) -> None:
    """Install safeckpt into every DeepSpeed engine created from now on in this process (for
    engines built by Hugging Face ``Trainer`` or Accelerate). Idempotent."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    configure = DeepSpeedEngine._configure_checkpointing
    if getattr(configure, "_safeckpt", False):
        return

    def _configure_checkpointing(self: Any) -> None:
        configure(self)
        install(self, timeout=timeout)

    _configure_checkpointing._safeckpt = True  # type: ignore[attr-defined]
    DeepSpeedEngine._configure_checkpointing = _configure_checkpointing  # type: ignore[method-assign]


def _installed(engine: Any) -> SafeckptCheckpointEngine:
    ce = engine.checkpoint_engine
    if not isinstance(ce, SafeckptCheckpointEngine):
        raise CheckpointError(
            "engine.checkpoint_engine was replaced after safeckpt.integrations.deepspeed.install; "
            "call install(engine) again"
        )
    return ce


@contextlib.contextmanager
def _own_offload_copy(engine: Any, ce: SafeckptCheckpointEngine) -> Iterator[None]:
    """DeepSpeed copies NVMe swap files straight into the final tag directory; instead, at the
    same point of its save (where it asks ``zero_nvme_offload_optimizer()``), copy them into
    this rank's directory of the staging tag and tell DeepSpeed not to."""
    if not engine.zero_nvme_offload_optimizer():
        yield
        return

    def copy_instead() -> bool:
        ce.copy_offload(_global_rank(), engine.optimizer.optimizer_swapper.swap_folder)
        return False

    shadowed = engine.__dict__.get("zero_nvme_offload_optimizer")
    engine.zero_nvme_offload_optimizer = copy_instead
    try:
        yield
    finally:
        if shadowed is None:
            del engine.zero_nvme_offload_optimizer
        else:
            engine.zero_nvme_offload_optimizer = shadowed


def _engine_info(engine: Any) -> dict[str, Any]:
    import deepspeed

    return {"zero_stage": int(engine.zero_optimization_stage()), "global_steps": int(engine.global_steps),
            "deepspeed_version": deepspeed.__version__}


def _tag_validation(engine: Any) -> str:
    if not engine.checkpoint_tag_validation_enabled():
        return "IGNORE"
    return "FAIL" if engine.checkpoint_tag_validation_fail() else "WARN"


def _save_checkpoint_method(self: Any, save_dir: str, tag: Any = None, client_state: Any = None,
                            save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
    ce = _installed(self)
    if not save_dir:
        raise ValueError(f"save_dir must be a non-empty string, got {save_dir!r}")
    tag = str(tag) if tag is not None else f"global_step{self.global_steps}"
    # Agree first (an error here is raised on every rank, nothing written), then let DeepSpeed act.
    ce.prepare(save_dir, tag, bool(save_latest), _engine_info(self), _tag_validation(self))
    try:
        with _own_offload_copy(self, ce):
            # save_latest=False: DeepSpeed would rewrite `latest` in place; commit writes it atomically
            return type(self).save_checkpoint(self, save_dir, tag=tag, client_state=client_state or {},
                                              save_latest=False,
                                              exclude_frozen_parameters=exclude_frozen_parameters)
    except Exception as exc:
        if ce._save is not None:
            # DeepSpeed raised here before commit: the other ranks may be waiting in commit, so
            # finish it with this error (raised on every rank, staging removed).
            ce._save.error = ce._save.error or exc
            with _deepspeeds_own_error():
                ce.commit(None)  # type: ignore[arg-type]
        raise
    finally:
        ce._save = None


def _save_16bit_model_method(self: Any, save_dir: str, save_filename: str = "pytorch_model.bin",
                             exclude_frozen_parameters: bool = False) -> bool:
    ce = _installed(self)
    ce.prepare_plain(save_dir, save_filename)  # agreed, and refused on every rank together
    try:
        saved = type(self).save_16bit_model(self, save_dir, save_filename,
                                            exclude_frozen_parameters=exclude_frozen_parameters)
        if ce._plain is not None:  # DeepSpeed returned without saving (ZeRO-3 not gathering)
            ce._plain = None
        return saved
    except Exception as exc:
        if ce._plain is not None:
            # raised here before commit (in the gather, or rank 0's write): tell the others,
            # who wait in commit, and raise the same error everywhere
            ce._plain.error = ce._plain.error or exc
            with _deepspeeds_own_error():
                ce.commit(None)  # type: ignore[arg-type]
        raise
    finally:
        ce._plain = None


def _load_checkpoint_method(self: Any, load_dir: str, tag: Any = None, load_module_strict: bool = True,
                            load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                            load_module_only: bool = False, custom_load_fn: Any = None) -> tuple[Any, Any]:
    return load_checkpoint(self, load_dir, tag, load_module_strict=load_module_strict,
                           load_optimizer_states=load_optimizer_states,
                           load_lr_scheduler_states=load_lr_scheduler_states,
                           load_module_only=load_module_only, custom_load_fn=custom_load_fn)


# ------------------------------------------------------------------ public calls
def save_checkpoint(engine: Any, save_dir: str | os.PathLike[str], tag: str | None = None, *,
                    client_state: dict[str, Any] | None = None, save_latest: bool = True,
                    exclude_frozen_parameters: bool = False) -> str:
    """``engine.save_checkpoint`` through safeckpt (installs it first); returns the tag's
    directory. Collective: every rank calls it with the same arguments."""
    install(engine)
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    engine.save_checkpoint(os.fspath(save_dir), tag=tag, client_state=client_state or {},
                           save_latest=save_latest, exclude_frozen_parameters=exclude_frozen_parameters)
    return os.path.join(resolve(save_dir), tag)


def load_checkpoint(engine: Any, load_dir: str | os.PathLike[str], tag: str | None = None, *,
                    allow_pickle: bool = False, **kwargs: Any) -> tuple[str | None, dict[str, Any] | None]:
    """``engine.load_checkpoint`` through safeckpt (collective). Returns DeepSpeed's
    ``(load_path, client_state)``, or ``(None, None)`` when ``load_dir`` holds no checkpoint.

    Without ``tag``: the newest committed tag saved with ``save_latest`` (by commit order, not
    by ``latest``) that passes the checks; a damaged one is skipped with a SafeckptWarning on
    every rank; if none loads, CorruptCheckpoint (never a silent fresh start). Other keyword
    arguments are DeepSpeed's (``load_optimizer_states``, ``load_module_only``, ...).
    ``allow_pickle=True`` loads a checkpoint DeepSpeed wrote without safeckpt, with DeepSpeed's
    own (unpickling) reader, to migrate a run: save it again and it is safeckpt's.
    """
    ce = install(engine)
    if engine.load_universal_checkpoint():
        raise CheckpointError("universal checkpoints (load_universal_checkpoint=true) are not "
                              "supported by safeckpt; load a tag saved by safeckpt instead")
    load_dir = resolve(load_dir)
    coord = Coordinator(ce.timeout, what=f"DeepSpeed load from {load_dir}")
    asked = coord.run("pick", lambda: {"dir": load_dir, "tag": tag,
                                       "pick": pick(load_dir, tag) if coord.is_coordinator else None})
    if any(a["dir"] != load_dir or a["tag"] != tag for a in asked):
        raise RankMismatch("load_checkpoint: ranks were called with different directories or tags: "
                           + "; ".join(f"rank {r}: {a['dir']} {a['tag']!r}" for r, a in enumerate(asked)))
    picked = asked[0]["pick"]
    for note in picked["warnings"]:
        warnings.warn(note, SafeckptWarning, stacklevel=2)
    reasons = list(picked["damaged"])
    for cand in picked["candidates"]:
        tag_dir = os.path.join(load_dir, cand)
        try:
            coord.run("read", lambda d=tag_dir: ce.prefetch(engine, d),
                      hint="Nothing was loaded; the model and optimizer are unchanged.")
        except (CorruptCheckpoint, CheckpointNotFound) as exc:
            ce._cache.clear()
            reasons.append(f"tag {cand}: {exc}")
            warnings.warn(f"tag {cand} in {load_dir} does not load, trying an older one: {exc}",
                          SafeckptWarning, stacklevel=2)
            continue
        box: dict[str, Any] = {}

        def apply(cand: str = cand, tag_dir: str = tag_dir, box: dict[str, Any] = box) -> None:
            with _zero3_weights_from(engine, tag_dir):
                box["out"] = type(engine).load_checkpoint(engine, load_dir, tag=cand, **kwargs)

        try:
            # DeepSpeed's own load, then one exchange: an error on any rank is raised on all
            with _deepspeeds_own_error():
                coord.run("apply", apply, hint=f"DeepSpeed failed to apply tag {cand}; the engine may "
                          "be partly loaded on some ranks: load again before training.")
            return box["out"]
        finally:
            ce._cache.clear()
    if reasons:
        raise CorruptCheckpoint(f"no tag under {load_dir} could be loaded (refusing to start fresh "
                                "when checkpoints exist):\n  " + "\n  ".join(reasons), path=load_dir)
    stock = tag in picked["foreign"] if tag is not None else bool(picked["foreign"])
    if stock and allow_pickle:
        return _load_stock(engine, load_dir, tag, **kwargs)
    if stock:
        raise CheckpointNotFound(
            f"{load_dir} holds DeepSpeed checkpoints written without safeckpt ("
            f"{', '.join(picked['foreign'][:5])}) and none written by it. Loading them needs "
            "unpickling: if you trust them, pass allow_pickle=True once, then save again.",
            path=load_dir,
        )
    if tag is not None:
        raise CheckpointNotFound(f"no tag {tag!r} under {load_dir}", path=load_dir)
    return None, None


@contextlib.contextmanager
def _deepspeeds_own_error() -> Iterator[None]:
    """When DeepSpeed's own code failed on every rank (a refusal such as loading a ZeRO
    checkpoint with another data-parallel size, ``ZeRORuntimeException``), every rank raises
    DeepSpeed's exception, as it would without safeckpt, so code catching its type keeps
    working; a note names the failing ranks. When only some ranks failed, every rank raises the
    same ``RankFailure`` naming them."""
    try:
        yield
    except RankFailure as err:
        own = err.__cause__
        if (isinstance(own, Exception) and not isinstance(own, CheckpointError)
                and sorted(err.failures) == list(range(_world_size()))):
            own.add_note(f"(safeckpt: {err})")
            raise own from None
        raise


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if distributed_active() else 1


@contextlib.contextmanager
def _zero3_weights_from(engine: Any, tag_dir: str) -> Iterator[None]:
    """ZeRO-3 loads without optimizer state take full fp32 weights from
    ``get_fp32_state_dict_from_zero_checkpoint`` (which reads pickles): point it at ours."""
    import deepspeed.runtime.engine as ds_engine

    original = ds_engine.get_fp32_state_dict_from_zero_checkpoint
    ds_engine.get_fp32_state_dict_from_zero_checkpoint = lambda *a, **k: get_fp32_state_dict(tag_dir)
    try:
        yield
    finally:
        ds_engine.get_fp32_state_dict_from_zero_checkpoint = original


def _load_stock(engine: Any, load_dir: str, tag: str | None, **kwargs: Any) -> tuple[Any, Any]:
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    ce = engine.checkpoint_engine
    engine.checkpoint_engine = TorchCheckpointEngine(engine._config)
    try:
        return type(engine).load_checkpoint(engine, load_dir, tag=tag, **kwargs)
    finally:
        engine.checkpoint_engine = ce


serve_zero_to_fp32()  # DeepSpeed's own zero_to_fp32 functions read safeckpt tags from now on

if __name__ == "__main__":
    raise SystemExit(main())
