"""Frozen parameters: saved as fingerprints, verified on load (PEFT/LoRA, frozen towers).

A module whose parameters include frozen ones (``requires_grad=False``) is saved, in the default
``"fingerprint"`` mode, as its state_dict *without* those parameters, plus one extra top-level
entry, :data:`ENTRY`, holding for each frozen tensor its fingerprint: the xxh3-64 checksum of
its bytes, its shape and its dtype. A LoRA checkpoint is then the size of the adapter (plus
optimizer state), not of the base model.

On load the live module must already hold the frozen tensors (the base model is loaded from
its own files, as with stock PEFT). They are checked against the fingerprints before anything
in the caller's state is changed: the fingerprint entry is a stateful object placed first in
the state, and the core loader hands stateful objects their state, in order, before it copies
any tensor in place (``safeckpt.engine.load``, apply phase). A different base model therefore raises
:class:`~safeckpt.errors.IncompatibleCheckpoint` naming the tensor, where stock resumes onto
any base. ``"full"`` mode saves frozen parameters like the rest.

Loading detects the layout from the checkpoint itself: a checkpoint without :data:`ENTRY`
(saved in full, or by an older safeckpt) loads the whole module as before.

What is not fingerprinted (saved in full even in ``"fingerprint"`` mode): buffers (they are
state, not weights, and are usually tiny), DTensor (FSDP2/TP-sharded) parameters (the
fingerprint of a shard depends on the layout; their bytes are spread over the ranks anyway)
and meta tensors. Fingerprints are cached per live tensor object (weakly referenced) with its
storage, offset and version counter, so a save hashes the frozen weights once per run, not per
save, and a new tensor at a freed tensor's address is hashed afresh.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

import torch
import xxhash
from torch import nn

from ..errors import IncompatibleCheckpoint
from ..format.tree import is_dtensor, unwrap_module

ENTRY = "_safeckpt_frozen"
MODES = ("fingerprint", "full")
FORMAT = 1


def check_frozen_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"frozen must be one of {MODES}, got {mode!r}")
    return mode


# --------------------------------------------------------------------------- fingerprints
# id(tensor) -> (weak reference to it, its storage/version key, digest). The weak reference is
# what makes a hit safe: a freed tensor's address (and id) is reused by the next tensor of the
# same size, often with the same version counter, so a key of address + version alone served
# a dead tensor's digest to a new one (a different base model then passed verification).
_CACHE: dict[int, tuple[weakref.ref, tuple, str]] = {}


def _key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()),
            t.dtype, t.device.type, t._version)


def _forget(ident: int) -> Any:
    def callback(_ref: weakref.ref) -> None:
        entry = _CACHE.get(ident)
        if entry is not None and entry[0] is _ref:
            del _CACHE[ident]
    return callback


def checksum(t: torch.Tensor) -> str:
    """xxh3-64 of the tensor's bytes in row-major order, as 16 hex digits (cached while the
    tensor object lives and its storage, view and version are unchanged)."""
    key = _key(t)
    hit = _CACHE.get(id(t))
    if hit is not None and hit[0]() is t and hit[1] == key:
        return hit[2]
    flat = t.detach()
    if flat.device.type != "cpu":
        flat = flat.cpu()
    flat = flat.contiguous().reshape(-1)
    data = flat.view(torch.uint8).numpy() if flat.numel() else b""
    digest = f"{xxhash.xxh3_64_intdigest(data):016x}"
    try:
        _CACHE[id(t)] = (weakref.ref(t, _forget(id(t))), key, digest)
    except TypeError:  # not weak-referenceable: no caching
        pass
    return digest


def fingerprint(t: torch.Tensor) -> dict[str, Any]:
    return {"xxh3": checksum(t), "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}


def frozen_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """State-dict name -> tensor of every frozen parameter that is fingerprinted (see module doc).

    A parameter shared under several names (tied weights) appears under each of its names in
    the state_dict, so each name is listed.
    """
    inner = unwrap_module(module)
    frozen = {fqn: p for fqn, p in inner.named_parameters(remove_duplicate=False)
              if not p.requires_grad and not is_dtensor(p) and p.device.type != "meta"}
    if not frozen:
        return {}
    sd = inner.state_dict(keep_vars=True)
    return {name: t for name, t in sd.items()
            if name in frozen and isinstance(t, torch.Tensor) and t is frozen[name]}


# --------------------------------------------------------------------------- state objects
class TrainableView(nn.Module):
    """A module as the core sees it in fingerprint mode: its state_dict without the frozen
    parameters; parameters, buffers and load_state_dict are the module's own."""

    def __init__(self, module: nn.Module, skip: frozenset[str]) -> None:
        super().__init__()
        object.__setattr__(self, "_sc_module", module)
        object.__setattr__(self, "_sc_skip", skip)

    def _inner(self) -> nn.Module:
        return unwrap_module(self._sc_module)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        sd = self._inner().state_dict(*args, **kwargs)
        for name in self._sc_skip:
            sd.pop(name, None)
        return sd

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,  # type: ignore[override]
                        assign: bool = False) -> Any:
        result = self._inner().load_state_dict(state_dict, strict=False, assign=assign)
        missing = [k for k in result.missing_keys if k not in self._sc_skip]
        if strict and (missing or result.unexpected_keys):
            raise RuntimeError(f"missing keys {missing}, unexpected keys {result.unexpected_keys}")
        return result

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:  # type: ignore[override]
        return self._inner().named_parameters(*args, **kwargs)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:  # type: ignore[override]
        return self._inner().parameters(recurse)

    def named_buffers(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:  # type: ignore[override]
        return self._inner().named_buffers(*args, **kwargs)

    def buffers(self, recurse: bool = True) -> Iterator[torch.Tensor]:  # type: ignore[override]
        return self._inner().buffers(recurse)

    def __repr__(self) -> str:
        return f"TrainableView({type(self._sc_module).__name__}, {len(self._sc_skip)} frozen)"


class Fingerprints:
    """The :data:`ENTRY` object: fingerprints on save, the check against them on load."""

    def __init__(self, frozen: dict[str, dict[str, torch.Tensor]], loading: bool) -> None:
        self.frozen = frozen
        self.loading = loading

    def state_dict(self) -> dict[str, Any]:
        if self.loading:
            return {}  # only the loader's rollback backup asks; nothing to roll back
        return {"format": FORMAT, "entries": {entry: {name: fingerprint(t) for name, t in tensors.items()}
                                              for entry, tensors in self.frozen.items()}}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        if not self.loading or not sd:
            return  # not sd: the loader's rollback handing back our (empty) backup
        problems = compare(self.frozen, sd)
        if problems:
            raise IncompatibleCheckpoint(
                "the live model's frozen parameters are not the ones this checkpoint was trained "
                "on (a different base model?); nothing was loaded:\n  " + "\n  ".join(problems[:20])
                + ("\n  ..." if len(problems) > 20 else "")
            )


def compare(live: dict[str, dict[str, torch.Tensor]], sd: Mapping[str, Any]) -> list[str]:
    """Every difference between the live frozen tensors and the saved fingerprints."""
    if sd.get("format") != FORMAT:
        return [f"frozen-parameter fingerprints of unknown format {sd.get('format')!r}"]
    saved = sd.get("entries") or {}
    problems = []
    for entry in sorted(set(saved) | set(live)):
        have, want = live.get(entry, {}), saved.get(entry, {})
        for name in sorted(set(have) - set(want)):
            problems.append(f"{entry}: {name!r} is frozen in the live model but was trainable (saved "
                            "in full) or absent when the checkpoint was written")
        for name in sorted(set(want) - set(have)):
            problems.append(f"{entry}: {name!r} was frozen when the checkpoint was written but is "
                            "trainable or absent in the live model")
        for name in sorted(set(have) & set(want)):
            now, then = fingerprint(have[name]), want[name]
            for field in ("shape", "dtype", "xxh3"):
                if now[field] != then.get(field):
                    what = "contents (xxh3 checksum)" if field == "xxh3" else field
                    problems.append(f"{entry}: frozen tensor {name!r} differs in {what}: checkpoint "
                                    f"{then.get(field)!r}, live {now[field]!r}")
                    break
    return problems


# --------------------------------------------------------------------------- state rewriting
def _split(state: Mapping[str, Any]) -> dict[str, dict[str, torch.Tensor]]:
    out = {}
    for name, value in state.items():
        if isinstance(value, nn.Module):
            frozen = frozen_tensors(value)
            if frozen:
                out[name] = frozen
    return out


def has_frozen(state: Mapping[str, Any]) -> bool:
    return any(isinstance(v, nn.Module) and frozen_tensors(v) for v in state.values())


def for_save(state: Mapping[str, Any], mode: str) -> Mapping[str, Any]:
    """The state to hand to the core save: ``state`` itself in full mode or without frozen
    parameters; else fingerprints first, then each module as a :class:`TrainableView`."""
    if mode == "full":
        return state
    frozen = _split(state)
    if not frozen:
        return state
    if ENTRY in state:
        raise ValueError(f"{ENTRY!r} is reserved for frozen-parameter fingerprints")
    out: dict[str, Any] = {ENTRY: Fingerprints(frozen, loading=False)}
    for name, value in state.items():
        out[name] = TrainableView(value, frozenset(frozen[name])) if name in frozen else value
    return out


def for_load(state: Mapping[str, Any], saved_fingerprints: bool) -> dict[str, Any] | None:
    """The state to hand to the core load when the checkpoint holds fingerprints (None: load
    ``state`` itself). Call :func:`copy_back` afterwards."""
    if not saved_fingerprints:
        return None
    frozen = _split(state)
    out: dict[str, Any] = {ENTRY: Fingerprints(frozen, loading=True)}
    for name, value in state.items():
        out[name] = TrainableView(value, frozenset(frozen[name])) if name in frozen else value
    return out


def copy_back(state: MutableMapping[str, Any], loaded: Mapping[str, Any]) -> None:
    """Plain (tree) entries the core load replaced in ``loaded``: put them into ``state``."""
    for name in list(state):
        value = loaded[name]
        if not isinstance(value, TrainableView) and value is not state[name]:
            state[name] = value


def saved_has_fingerprints(path: str, store: Any) -> bool:
    """Whether the committed checkpoint at ``path`` holds :data:`ENTRY` (reads its manifest)."""
    from .reader import open_manifest

    return ENTRY in open_manifest(path, store)["objects"]
