"""Pieces shared by the Hugging Face Trainer and Accelerate integrations.

What lives here: unwrapping Accelerate's optimizer/scheduler wrappers, RNG state that is loaded
with the rest of a checkpoint but applied later, sampler state as JSON, checking that user
objects hold only tensors and JSON values, loading a subset of a checkpoint's entries without
skipping anything silently, and exporting a (possibly FSDP2-sharded) model as
``from_pretrained``-loadable safetensors without gathering it.

Nothing here imports transformers or accelerate at module level; callers already have them.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any

import torch

from ...coord.dist import distributed_active
from ...errors import CheckpointError, CorruptCheckpoint, IncompatibleCheckpoint
from ...rng import RNGState
from ...storage.posix import rmtree_quiet

TRAINER_DIRNAME = "checkpoint-{step}"     # transformers' PREFIX_CHECKPOINT_DIR + "-N"
ACCELERATE_DIRNAME = "checkpoint_{step}"  # accelerate's save_state(automatic_checkpoint_naming)


def step_dir(root: str, step: int, dirname: str | None = None) -> str:
    """Where a CheckpointManager under ``root`` with ``dirname`` commits ``step``."""
    from ...storage.catalog import step_dirname

    return os.path.join(root, step_dirname(step, dirname))


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if distributed_active() else 0


def share_from_rank0(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on rank 0 only and give every rank its JSON-able result, or its error.

    An error on rank 0 is raised on every rank (as CheckpointError naming rank 0), so no rank
    goes on while rank 0 failed.
    """
    import torch.distributed as dist

    distributed = distributed_active() and dist.get_world_size() > 1
    if not distributed:
        return fn()
    from ...coord.dist import Coordinator

    local: list[Exception] = []

    def on_rank0(_: Any) -> dict[str, Any]:
        try:
            return {"ok": fn()}
        except Exception as exc:  # noqa: BLE001 - sent to every rank, re-raised below
            local.append(exc)
            return {"error": f"{type(exc).__name__}: {exc}"}

    # safeckpt's own group, JSON on the wire (never the job's group, never pickle)
    box = Coordinator(what="a decision of rank 0").decide("share", lambda: None, on_rank0)
    if local:
        raise local[0]
    if "error" in box:
        raise CheckpointError(f"rank 0 failed (rank {dist.get_rank()} stops too): {box['error']}")
    return box["ok"]


# --------------------------------------------------------------------------- wrappers
def inner_optimizer(opt: Any) -> Any:
    """The torch optimizer inside Accelerate's AcceleratedOptimizer (or ``opt`` itself).

    safeckpt keys FSDP2 optimizer state by parameter name only for real torch optimizers, and
    the wrapper's load_state_dict adds nothing on CPU/GPU (device moves happen in place).
    """
    inner = getattr(opt, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else opt


def inner_scheduler(sched: Any) -> Any:
    """The LR scheduler inside Accelerate's AcceleratedScheduler (or ``sched`` itself)."""
    inner = getattr(sched, "scheduler", None)
    return inner if inner is not None and callable(getattr(inner, "state_dict", None)) else sched


def is_sharded(model: Any) -> bool:
    """True when the model's parameters are DTensors (FSDP2 / tensor parallel)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return False
    return any(isinstance(p, DTensor) for p in model.parameters())


def refuse_fsdp1(model: Any, where: str) -> None:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover
        return
    found = [m for m in ([model] + list(getattr(model, "modules", list)())) if isinstance(m, FullyShardedDataParallel)]
    if found:
        raise CheckpointError(
            f"{where}: the model is wrapped in FSDP1 (FullyShardedDataParallel), whose flat "
            "parameters safeckpt does not save. Use FSDP2 (fsdp_version=2 / fully_shard), "
            "whose DTensor shards safeckpt saves without gathering them."
        )



# --------------------------------------------------------------------------- RNG
class DeferredRNG(RNGState):
    """Every rank's RNG state, loaded with the checkpoint but applied only by :meth:`apply`.

    The Trainer restores RNG after it has skipped the batches already trained in the resumed
    epoch (skipping draws random numbers); loading everything in one collective call and
    applying RNG at that later moment keeps the resumed run bit-exact.
    """

    def __init__(self) -> None:
        super().__init__()
        self.pending: dict[str, Any] | None = None

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.pending = sd

    def apply(self) -> bool:
        if self.pending is None:
            return False
        sd, self.pending = self.pending, None
        RNGState.load_state_dict(self, sd)
        return True


# --------------------------------------------------------------------------- samplers
def sampler_of(dataloader: Any) -> Any:
    """Accelerate's SeedableRandomSampler behind a prepared dataloader, or None."""
    if dataloader is None:
        return None
    try:
        from accelerate.data_loader import SeedableRandomSampler, get_sampler
    except ImportError:  # pragma: no cover
        return None
    try:
        sampler = get_sampler(dataloader)
    except Exception:  # noqa: BLE001 - not an Accelerate-shaped loader
        sampler = getattr(dataloader, "sampler", None)
    return sampler if isinstance(sampler, SeedableRandomSampler) else None


def sampler_state(dataloader: Any) -> dict[str, int] | None:
    """The data order of a seedable sampler: its seed and epoch (JSON, no pickle)."""
    sampler = sampler_of(dataloader)
    if sampler is None:
        return None
    return {"initial_seed": int(sampler.initial_seed), "epoch": int(sampler.epoch)}


def restore_sampler(dataloader: Any, sd: Mapping[str, Any] | None, where: str) -> None:
    sampler = sampler_of(dataloader)
    if sd is None:
        return
    if sampler is None:
        raise IncompatibleCheckpoint(
            f"{where}: the checkpoint holds the state of a seedable sampler, but the current "
            "training dataloader has none (was use_seedable_sampler changed?)."
        )
    sampler.initial_seed = int(sd["initial_seed"])
    sampler.set_epoch(int(sd["epoch"]))


# --------------------------------------------------------------------------- values
def check_plain(where: str, value: Any, path: str = "") -> None:
    """Refuse values that are neither tensors nor JSON (safeckpt never pickles)."""
    if value is None or isinstance(value, (bool, int, str, torch.Tensor)):
        return
    if isinstance(value, float):
        return  # non-finite floats are tagged in the JSON tree
    if isinstance(value, Mapping):
        for k, v in value.items():
            if not isinstance(k, (str, int)):
                raise CheckpointError(
                    f"{where}: key {k!r} at {path or '/'} is a {type(k).__name__}; only str and "
                    "int keys can be saved without pickle."
                )
            check_plain(where, v, f"{path}/{k}")
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_plain(where, v, f"{path}/{i}")
        return
    if type(value).__module__ == "numpy" and hasattr(value, "item"):
        return  # numpy scalars and arrays are converted
    raise CheckpointError(
        f"{where}: its state_dict() holds a {type(value).__module__}.{type(value).__qualname__} "
        f"at {path or '/'}; safeckpt saves only tensors and JSON values (no pickle). Convert it "
        "in state_dict()/load_state_dict() (e.g. to a list, a string or a tensor)."
    )


def json_float(x: Any) -> float | None:
    try:
        f = float(x)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(f) else f


# --------------------------------------------------------------------------- loading
def load_entries(path: str, state: MutableMapping[str, Any], *, timeout: float | None,
                 where: str) -> Any:
    """Load only ``state``'s entries from the checkpoint at ``path`` (collective).

    A strict load needs every entry of the checkpoint; this one leaves the others out but,
    unlike ``strict=False``, refuses anything missing or mismatched in the entries asked for (a
    missing piece is an error, never a skip), before anything is changed.
    """
    from ... import load

    try:  # frozen parameters saved as fingerprints are verified by the load itself
        return load(path, state, strict="entries", timeout=timeout)
    except IncompatibleCheckpoint as exc:  # raised in the plan, on every rank: nothing changed
        raise IncompatibleCheckpoint(f"{where}: {exc}") from exc


def read_json_entries(path: str, names: Sequence[str], *, timeout: float | None, where: str,
                      optional: Sequence[str] = ()) -> dict[str, Any]:
    """The JSON entries ``names`` of the checkpoint at ``path``, from its manifest alone (no
    tensor file is opened): rank 0 reads it, every rank gets the same trees (one exchange).
    Raises on every rank: CheckpointNotFound or CorruptCheckpoint (the checkpoint's fault),
    IncompatibleCheckpoint (an entry missing, or holding tensors). ``optional`` entries are
    read when the checkpoint has them."""
    from ...coord.dist import Coordinator
    from ...engine.reader import open_manifest
    from ...format.tree import decode, tensor_keys
    from ...storage.base import resolve, storage_for

    ckpt = resolve(path)

    def read(_: Any) -> dict[str, Any]:
        objects = open_manifest(ckpt, storage_for(ckpt, timeout=timeout), full=False)["objects"]
        out = {}
        for name in [*names, *(n for n in optional if n in objects)]:
            if name not in objects:
                raise IncompatibleCheckpoint(f"{where}: checkpoint {path} holds no {name!r} entry "
                                             f"(entries: {sorted(objects)[:20]})")
            tree = objects[name].get("tree")
            if next(iter(tensor_keys(tree)), None) is not None:
                raise IncompatibleCheckpoint(f"{where}: entry {name!r} of {path} holds tensors")
            out[name] = tree
        return out

    trees = Coordinator(timeout, what=f"{where} from {ckpt}").decide("read-head", lambda: None, read)
    return {name: decode(tree, lambda key: None) for name, tree in trees.items()}


def save_checkpoint(path: str, state: Mapping[str, Any], *, timeout: float | None = None,
                    frozen: str = "fingerprint", extra_files: Mapping[str, bytes] | None = None,
                    write_files: Any = None, named: Any = None) -> Any:
    """``safeckpt.save(overwrite=True)`` with frozen parameters as fingerprints (collective);
    ``extra_files`` (rank 0's) and the files ``write_files`` makes every rank write (a
    DeepSpeed engine's) are committed inside the checkpoint (as ``CheckpointManager.save``)."""
    from ... import save

    return save(path, state, overwrite=True, timeout=timeout, frozen=frozen, extra_files=extra_files,
                write_files=write_files, named=named)


def overrides_load_state_dict(model: Any) -> bool:
    """The (unwrapped) model defines its own ``load_state_dict`` (e.g. to accept a resized
    buffer), which Trainer calls with the loaded weights, and nothing in it is sharded (the
    override needs full tensors on every rank)."""
    from ...format.tree import unwrap_module

    inner = unwrap_module(model)
    return (type(inner).load_state_dict is not torch.nn.Module.load_state_dict
            and not is_sharded(model))


def read_entry_tensors(path: str, entry: str) -> tuple[Any, Any]:
    """This rank reads the checkpoint's ``entry`` alone, every chunk checked against its
    checksum (``CorruptCheckpoint`` otherwise), plus the frozen-parameter fingerprints if the
    checkpoint holds them (``safeckpt.engine.frozen``): ``(state, fingerprints or None)``."""
    from ...engine import frozen as _frozen
    from ...engine.reader import TensorReader, open_manifest
    from ...format.tree import decode
    from ...storage.base import resolve, storage_for

    ckpt = resolve(path)
    store = storage_for(ckpt)
    man = open_manifest(ckpt, store)
    objects = man["objects"]
    if entry not in objects:
        raise IncompatibleCheckpoint(f"checkpoint {path} holds no {entry!r} entry (entries: {sorted(objects)})")
    reader = TensorReader(ckpt, man, rank=0, verify=True, store=store)
    try:
        value = decode(objects[entry]["tree"], reader.new)
        prints = decode(objects[_frozen.ENTRY]["tree"], reader.new) if _frozen.ENTRY in objects else None
    finally:
        reader.close()
    return value, prints


def load_through_override(model: Any, path: str, entry: str, sd: Mapping[str, Any], prints: Any, where: str) -> None:
    """Trainer's call on the loaded weights, ``model.load_state_dict(state_dict, False)``, with
    safeckpt's checks around it: frozen parameters saved as fingerprints are verified against the
    live ones and passed in as they are; missing or unexpected keys the override reports are
    refused (Trainer only warns)."""
    from ...engine import frozen as _frozen
    from ...format.tree import unwrap_module

    inner = unwrap_module(model)
    sd = dict(sd)
    if prints is not None:
        live = _frozen.frozen_tensors(inner)
        problems = _frozen.compare({entry: live} if live else {}, prints)
        if problems:
            raise IncompatibleCheckpoint(
                f"{where}: the model's frozen parameters are not the ones {path} was trained on (a "
                "different base model?); nothing was loaded:\n  " + "\n  ".join(problems[:20]))
        for name, t in live.items():
            sd.setdefault(name, t.detach())
    result = inner.load_state_dict(sd, False)
    missing = list(getattr(result, "missing_keys", []) or [])
    unexpected = list(getattr(result, "unexpected_keys", []) or [])
    if missing or unexpected:
        raise IncompatibleCheckpoint(
            f"{where}: {type(inner).__name__}.load_state_dict (the model's own) reported missing keys "
            f"{missing[:20]} and unexpected keys {unexpected[:20]} loading {path}")


MAX_HOOK_FILE = 64 << 20


def agree_all(fn: Callable[[], Any], where: str) -> Any:
    """Run ``fn`` on every rank; if it raised on any rank, raise on every rank (naming the
    ranks) before anyone goes on to a collective save or load."""
    import torch.distributed as dist

    local: Exception | None = None
    out = None
    try:
        out = fn()
    except Exception as exc:  # noqa: BLE001 - shared with every rank below
        local = exc
    if distributed_active() and dist.get_world_size() > 1:
        from ...coord.dist import Coordinator

        # on safeckpt's own group, as JSON (never the job's group, never pickle)
        error = None if local is None else [f"{type(local).__name__}: {local}",
                                            isinstance(local, CorruptCheckpoint)]
        errors = Coordinator(what=where).run("agree-all", lambda: error)
        bad = [(r, e) for r, e in enumerate(errors) if e is not None]
        if bad and local is None:
            # damage found by some ranks is the checkpoint's fault on every rank (a resume then
            # falls back together)
            cls = CorruptCheckpoint if all(e[1] for _, e in bad) else CheckpointError
            raise cls(f"{where} failed on " + "; ".join(f"rank {r}: {e[0]}" for r, e in bad)
                      + f" (rank {dist.get_rank()} stops too; nothing was written)")
    if local is not None:
        raise local
    return out


def read_hook_files(directory: str, where: str) -> dict[str, bytes]:
    """The plain files a user hook wrote into ``directory``, as extra files of a checkpoint."""
    from ...engine.extra import safe_extra_name

    out: dict[str, bytes] = {}
    for name in sorted(os.listdir(directory)):
        p = os.path.join(directory, name)
        if not os.path.isfile(p) or os.path.islink(p):
            raise CheckpointError(
                f"{where}: a save_state pre-hook wrote {name!r}, which is not a plain file; only "
                "plain files directly in output_dir are taken into the safeckpt checkpoint "
                "(models are saved by safeckpt itself; register other state with "
                "register_for_checkpointing)")
        if os.path.getsize(p) > MAX_HOOK_FILE:
            raise CheckpointError(f"{where}: a save_state pre-hook wrote {name!r} of more than 64 MiB; "
                                  "hook files are held in memory until the commit. Register large "
                                  "state with register_for_checkpointing (tensors) instead.")
        try:
            safe_extra_name(name)
        except CheckpointError as exc:
            raise CheckpointError(f"{where}: a save_state pre-hook wrote {name!r}: {exc}") from None
        with open(p, "rb") as f:
            out[name] = f.read()
    return out


# --------------------------------------------------------------------------- export
def export_pretrained(model: Any, out_dir: str, *, timeout: float | None,
                      write_extras: Callable[[str], None]) -> list[str]:
    """Write ``model`` (DDP, FSDP2 shards or plain) to ``out_dir`` as Hugging Face safetensors.

    Collective. Every rank saves its own shards into a hidden safeckpt checkpoint next to
    ``out_dir`` (nothing is gathered); rank 0 then streams it into ``model.safetensors`` (or
    shards plus index) in bounded memory, ``write_extras(out_dir)`` adds config and tokenizer,
    and the hidden checkpoint is removed. Returns the weight files written.
    """
    from ... import save
    from ...convert import export_hf

    out_dir = os.path.abspath(os.fspath(out_dir))
    parent = os.path.dirname(out_dir)
    tmp = os.path.join(parent, f".{os.path.basename(out_dir)}.safeckpt-export")
    save(tmp, {"model": model}, overwrite=True, timeout=timeout)

    def _export() -> list[str]:
        try:
            written = export_hf(tmp, out_dir, only="model", overwrite=True)
            write_extras(out_dir)
            return written
        finally:
            rmtree_quiet(tmp)

    return share_from_rank0(_export)
