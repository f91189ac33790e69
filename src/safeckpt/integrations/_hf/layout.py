"""A checkpoint that is also a Hugging Face model directory (issue 30).

``save_pretrained`` decides what a model directory holds: which tensors (tied weights once,
the model's ``model._keys_to_ignore_on_save`` left out, PEFT adapters only, renamed as PEFT and weight
conversions rename them), in which files (``model.safetensors``, or shards named
``model-0000k-of-0000n.safetensors`` past ``max_shard_size`` with ``model.safetensors.index.json``),
and the small files beside them (``config.json``, ``generation_config.json``,
``adapter_config.json``, a README). :func:`pretrained_layout` runs that very ``save_pretrained``
on rank 0 into a scratch directory with its safetensors writer replaced by a recorder: the small
files it writes are kept as bytes, and each tensor it would have written is matched (by memory:
the same storage, offset, shape and strides) to the key under which safeckpt saves it. The result
is a named layout for the core save (``{file: {name in file: key}}``): the model's bytes are
written once, into those files, inside the one atomic commit.

When a tensor ``save_pretrained`` would write is not one of the model's own (a conversion built
a new one), the layout is not used (None, with the reason): the checkpoint then holds the model
in safeckpt's own files, as before.

An FSDP2 (DTensor) model, where the caller opts in: :func:`gather_full` gives every rank the
full tensors (one all-gather per tensor, each moved to the CPU as it arrives), the recorded
``save_pretrained`` runs on that state dict (transformers' own gather and barrier switched off:
it runs on rank 0 alone), and :class:`FullView` is what the save is handed for the model: the
full tensors the files hold, the model's DTensors for the rest. The checkpoint then holds the
model once, in ``save_pretrained``'s files (replicated tensors, each file written by one rank);
a resume reads each rank's shard out of them.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ...format.tree import escape_key, is_dtensor, unwrap_module
from ...storage.posix import rmtree_quiet

MAX_SMALL_FILE = 64 << 20  # a file save_pretrained writes beside the weights, taken into the commit


def _ident(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype,
            t.device.type)


@contextlib.contextmanager
def _recording(calls: list[tuple[str, dict[str, torch.Tensor], dict[str, str] | None]]) -> Iterator[None]:
    """Replace the safetensors writers of transformers and PEFT by a recorder."""
    import transformers.modeling_utils as mu

    def record(tensors: dict[str, torch.Tensor], filename: str, metadata: dict[str, str] | None = None) -> None:
        calls.append((os.fspath(filename), dict(tensors), metadata))

    targets: list[tuple[Any, str]] = [(mu, "safe_save_file")]
    try:
        import peft.peft_model as pm

        targets.append((pm, "safe_save_file"))
    except ImportError:  # pragma: no cover - PEFT is optional
        pass
    try:
        import transformers.trainer as tr

        if hasattr(tr, "safetensors"):
            targets.append((tr.safetensors.torch, "save_file"))
    except ImportError:  # pragma: no cover
        pass
    saved = [(obj, name, getattr(obj, name)) for obj, name in targets]
    try:
        for obj, name, _ in saved:
            setattr(obj, name, record)
        yield
    finally:
        for obj, name, fn in saved:
            setattr(obj, name, fn)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """No 'Writing model shards' progress bar from the recorded save_pretrained."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def _no_distributed_gather(model: Any) -> Iterator[None]:
    """``save_pretrained`` of a model sharded by transformers (``DistributedConfig``) gathers the
    full state dict itself (a collective, replacing the ``state_dict`` passed in) and ends with a
    barrier; on rank 0 alone, with the gathered state dict passed in, both are switched off."""
    names = [n for n in ("gather_sharded_state_dict_for_save", "barrier_after_gathered_checkpoint_save")
             if callable(getattr(model, n, None))]

    def keep(model_to_save: Any, state_dict: Any, *args: Any, **kwargs: Any) -> Any:
        return state_dict

    def nothing(*args: Any, **kwargs: Any) -> None:
        return None

    for n in names:
        object.__setattr__(model, n, keep if n.startswith("gather") else nothing)
    try:
        yield
    finally:
        for n in names:
            model.__dict__.pop(n, None)


def gather_full(model: Any) -> dict[str, torch.Tensor]:
    """Every rank (collective): the model's state dict with each DTensor replaced by its full
    tensor, on the CPU (one all-gather per tensor in state-dict order, the same on every rank).
    Tied weights (one parameter under several names) are gathered once and the names share the
    full tensor, as they share the parameter: ``save_pretrained`` then writes them once (the
    tied ``lm_head.weight`` left out, as for a model that is not sharded) and the save stores
    them once. ``state_dict()`` gives a new DTensor per name, so they are matched by the
    module's own parameters and buffers (the same on every rank), not by the DTensors. Holds
    one full copy of the model's sharded tensors in host memory until dropped."""
    module = unwrap_module(model)
    sd = module.state_dict()
    owner: dict[str, int] = {}  # state-dict name -> id of the parameter or buffer it is
    for name, p in module.named_parameters(remove_duplicate=False):
        owner[name] = id(p)
    for name, b in module.named_buffers(remove_duplicate=False):
        owner.setdefault(name, id(b))
    full: dict[str, Any] = {}
    seen: dict[tuple[str, int], torch.Tensor] = {}
    with torch.no_grad():
        for name, t in sd.items():
            if is_dtensor(t):
                key = ("param", owner[name]) if name in owner else ("sd", id(t))
                if key not in seen:
                    g = t.full_tensor()
                    seen[key] = g if g.device.type == "cpu" else g.to("cpu")
                full[name] = seen[key]
            else:
                full[name] = t
    return full


class FullView(nn.Module):
    """The model as a save sees it: its state dict is ``sd`` (full tensors where the named files
    hold them, the model's own tensors elsewhere); parameters and buffers are the model's (so an
    optimizer over its DTensors is still keyed by parameter name). Save only."""

    def __init__(self, model: nn.Module, sd: Mapping[str, Any]) -> None:
        super().__init__()
        object.__setattr__(self, "_sc_module", unwrap_module(model))
        object.__setattr__(self, "_sc_sd", dict(sd))

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return dict(self._sc_sd)

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        raise TypeError("FullView is a save-only view of a model")

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:  # type: ignore[override]
        return self._sc_module.named_parameters(*args, **kwargs)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:  # type: ignore[override]
        return self._sc_module.parameters(recurse)

    def named_buffers(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:  # type: ignore[override]
        return self._sc_module.named_buffers(*args, **kwargs)

    def buffers(self, recurse: bool = True) -> Iterator[torch.Tensor]:  # type: ignore[override]
        return self._sc_module.buffers(recurse)

    def __repr__(self) -> str:
        return f"FullView({type(self._sc_module).__name__})"


def full_view(model: Any, entry: str, full: Mapping[str, Any], files: Mapping[str, Mapping[str, str]]) -> FullView:
    """:class:`FullView` of ``model``: the tensors ``files`` (a layout from :func:`pretrained_layout`
    over ``full``) names are the full ones; every other entry stays the model's own (its DTensor
    shards, saved as such). Gathered tensors no file names are dropped here."""
    named = {key for names in files.values() for key in names.values()}
    sd = unwrap_module(model).state_dict()
    in_files = {name for name in sd if f"{escape_key(entry)}/{escape_key(name)}" in named}
    # a tied name the files leave out (lm_head.weight) shares its full tensor with one they
    # hold: stored as that one's alias, not as shards of its own
    shared = {id(full[name]) for name in in_files if name in full}
    return FullView(model, {name: full[name] if name in in_files or (name in full and id(full[name]) in shared
                                                                     and is_dtensor(t)) else t
                            for name, t in sd.items()})


def pretrained_layout(model: Any, entry: str, write: Callable[[str], None], skip: tuple[str, ...] = (),
                      sd: Mapping[str, Any] | None = None
                      ) -> tuple[dict[str, dict[str, str]] | None, dict[str, bytes], str]:
    """Run ``write(scratch_dir)`` (a ``save_pretrained`` of ``model``) with its safetensors
    writes recorded: (``{file: {name in file: key}}`` or None, the other files it wrote, why the
    layout is None). ``entry``: the state entry the model is saved under; ``skip``: files it
    writes that are left out (Trainer's pickled ``training_args.bin``); ``sd``: the state dict
    ``write`` passes to ``save_pretrained`` (:func:`gather_full`'s; default the model's own),
    whose tensors the recorded ones are matched to. Rank 0 only."""
    sd = unwrap_module(model).state_dict() if sd is None else sd
    by_ident: dict[tuple, str] = {}
    for name, t in sd.items():
        if isinstance(t, torch.Tensor):
            by_ident.setdefault(_ident(t), f"{escape_key(entry)}/{escape_key(name)}")
    calls: list[tuple[str, dict[str, torch.Tensor], dict[str, str] | None]] = []
    tmp = tempfile.mkdtemp(prefix="safeckpt-hf-layout-")
    try:
        with _recording(calls), _quiet(), _no_distributed_gather(unwrap_module(model)):
            write(tmp)
        small: dict[str, bytes] = {}
        for dirpath, _, names in os.walk(tmp):
            for n in names:
                p = os.path.join(dirpath, n)
                rel = os.path.relpath(p, tmp)
                if rel in skip:
                    continue
                if os.sep in rel:
                    return None, {}, f"save_pretrained wrote {rel} in a subdirectory"
                if os.path.getsize(p) > MAX_SMALL_FILE:
                    return None, {}, f"save_pretrained wrote {rel} of more than 64 MiB beside the weights"
                with open(p, "rb") as f:
                    small[rel] = f.read()
    finally:
        rmtree_quiet(tmp)
    files: dict[str, dict[str, str]] = {}
    used: set[str] = set()
    for filename, tensors, metadata in calls:
        fname = os.path.relpath(filename, tmp)
        if os.sep in fname or not fname.endswith(".safetensors"):
            return None, {}, f"save_pretrained wrote {fname}"
        if (metadata or {}) != {"format": "pt"}:
            return None, {}, f"save_pretrained wrote {fname} with metadata {metadata!r}"
        names: dict[str, str] = {}
        for name, t in tensors.items():
            key = by_ident.get(_ident(t)) if isinstance(t, torch.Tensor) else None
            if key is None:
                return None, {}, f"{fname}: tensor {name!r} is not one of the model's own (converted or copied)"
            if key in used:
                return None, {}, f"{fname}: tensor {name!r} is written twice (tied weights)"
            used.add(key)
            names[name] = key
        files[fname] = names
    if not files:
        return None, {}, "save_pretrained wrote no safetensors file"
    return files, small, ""


def tensors_layout(model: Any, entry: str, tensors: Mapping[str, Any]) -> tuple[dict[str, str] | None, str]:
    """{name in the file: key} for a state dict ``tensors`` a framework would write for
    ``model`` (Accelerate's ``get_state_dict`` after its tied-weight cleaning), each matched by
    memory to the key safeckpt saves it under; (None, why) when one is not the model's own."""
    sd = unwrap_module(model).state_dict()
    by_ident: dict[tuple, str] = {}
    for name, t in sd.items():
        if isinstance(t, torch.Tensor):
            by_ident.setdefault(_ident(t), f"{escape_key(entry)}/{escape_key(name)}")
    out: dict[str, str] = {}
    used: set[str] = set()
    for name, t in tensors.items():
        key = by_ident.get(_ident(t)) if isinstance(t, torch.Tensor) else None
        if key is None or key in used:
            return None, f"tensor {name!r} is not one of the model's own tensors"
        used.add(key)
        out[name] = key
    return out, ""
