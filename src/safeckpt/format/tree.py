"""Turn a user's ``state`` dict into JSON trees plus tensor leaves, and back.

Each top-level entry becomes an *object* of one kind:

- ``module``   an ``nn.Module`` (DDP / ``torch.compile`` wrappers are unwrapped, so a checkpoint
               from a wrapped model loads into the plain one and back); loaded in place.
- ``stateful`` anything with ``state_dict``/``load_state_dict`` (optimizers, schedulers,
               GradScaler, RNGState, user objects); loaded through ``load_state_dict``.
- ``tensor``   a tensor; copied into in place.
- ``tree``     nested dicts/lists of JSON values and tensors; tensors copied in place, plain
               values replaced.

A tree is JSON with three tags, so that no information is lost and nothing needs pickle:
``{"@tensor": key}``, ``{"@tuple": [...]}`` and ``{"@dict": [[key, value], ...]}`` (for dicts
whose keys are not all strings, e.g. optimizer state keyed by int). Tensor keys are the path
components joined with ``/`` (``model/layer.weight``, ``optim/state/0/exp_avg``), each component
escaped by :func:`escape_key` (``%`` ``/`` ``@`` become ``%25`` ``%2F`` ``%40``), so any string
key round-trips and no two paths share a key.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import CheckpointError
from .manifest import dtype_code

SEP = "/"
PER_RANK_ATTR = "__safeckpt_per_rank__"
_ESCAPES = (("%", "%25"), ("/", "%2F"), ("@", "%40"))


def escape_key(component: str) -> str:
    """One path component of a tensor key, with the characters that have a meaning in keys
    (``/`` separates components, ``@`` marks pieces in data files) escaped."""
    if "%" not in component and "/" not in component and "@" not in component:
        return component  # the common case, kept cheap: saves escape every key component
    for raw, esc in _ESCAPES:
        component = component.replace(raw, esc)
    return component


def unescape_key(component: str) -> str:
    for raw, esc in reversed(_ESCAPES):
        component = component.replace(esc, raw)
    return component


def join_key(path: list[str]) -> str:
    return SEP.join(escape_key(p) for p in path)

try:  # DTensor is optional in old torch builds
    from torch.distributed.tensor import DTensor
except Exception:  # pragma: no cover
    DTensor = ()  # type: ignore[assignment,misc]


class Leaf:
    """One tensor of the state: where it lives in the tree and how it is shared across ranks.

    A plain class with slots, not a dataclass: one is made per tensor of every save and load
    (the dataclass __init__ + __post_init__ pair was a third of encoding 4,000 tensors)."""

    __slots__ = ("key", "tensor", "scope", "shape", "dtype", "itemsize")

    def __init__(self, key: str, tensor: torch.Tensor, scope: str) -> None:
        self.key = key
        self.tensor = tensor
        self.scope = scope  # "replicated" | "per_rank" | "sharded"
        # Computed once: a save looks at each of these several times, and for states of
        # thousands of tensors torch attribute access is a large part of the time save() blocks.
        self.shape = list(tensor.shape)
        self.dtype = dtype_code(tensor.dtype)  # safetensors code
        self.itemsize = tensor.element_size()

    def __repr__(self) -> str:
        return f"Leaf({self.key!r}, {self.scope}, {self.dtype}{self.shape})"


@dataclass
class EncodedObject:
    name: str
    kind: str
    tree: Any


def is_dtensor(t: Any) -> bool:
    return bool(DTensor) and isinstance(t, DTensor)


def local_of(t: Any) -> Any:
    """A DTensor's local shard, the tensor itself (``to_local()`` goes through autograd and
    cost ~15 us per call: a sixth of an FSDP2 save of 1,000 tensors)."""
    local = getattr(t, "_local_tensor", None)
    return local if local is not None else t.to_local()


def unwrap_module(module: nn.Module) -> nn.Module:
    """Strip DDP/DataParallel and torch.compile wrappers so keys carry no prefixes."""
    while True:
        if isinstance(module, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            module = module.module
        elif hasattr(module, "_orig_mod") and isinstance(module._orig_mod, nn.Module):
            module = module._orig_mod
        else:
            return module


def is_wrapped_ddp(value: Any) -> bool:
    seen = value
    while True:
        if isinstance(seen, nn.parallel.DistributedDataParallel):
            return True
        inner = getattr(seen, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return False
        seen = inner


def is_stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(
        getattr(value, "load_state_dict", None)
    )


def kind_of(value: Any) -> str:
    if isinstance(value, nn.Module):
        return "module"
    if isinstance(value, torch.Tensor):
        return "tensor"
    if is_stateful(value):
        return "stateful"
    return "tree"


def state_dict_of(kind: str, value: Any, param_names: Mapping[int, str] | None = None) -> Any:
    if kind == "module":
        return unwrap_module(value).state_dict()
    if kind == "stateful":
        if param_names is not None and isinstance(value, torch.optim.Optimizer):
            return optimizer_state_dict(value, param_names)
        return value.state_dict()
    return value


def optimizer_params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's parameters in state_dict order (groups in order, params in order)."""
    return [p for g in opt.param_groups for p in g["params"]]


def param_names(state: Mapping[str, Any]) -> dict[int, str]:
    """``id(parameter) -> name`` over every module in ``state`` (names as in its state_dict).

    A name that two different parameters would share (two modules with the same layout) is
    left out, so such optimizers keep the positional (param id) keys.
    """
    names: dict[int, str] = {}
    seen: dict[str, int] = {}
    clash: set[str] = set()
    for value in state.values():
        if not isinstance(value, nn.Module):
            continue
        for fqn, p in unwrap_module(value).named_parameters(remove_duplicate=False):
            if fqn in seen and seen[fqn] != id(p):
                clash.add(fqn)
            seen[fqn] = id(p)
            names.setdefault(id(p), fqn)
    return {pid: fqn for pid, fqn in names.items() if fqn not in clash}


def optimizer_state_dict(opt: torch.optim.Optimizer, names: Mapping[int, str]) -> Any:
    """``opt.state_dict()``, keyed by parameter name (FQN) when its parameters are DTensors.

    FSDP2/DTensor optimizers are saved keyed by FQN, like
    ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` (``{"state": {fqn:
    {...}}, "param_groups": [{..., "params": [fqn, ...]}]}``), so they load onto another world
    size, into a plain optimizer and back, and match DCP checkpoints. That function is not used
    because it runs a zero-lr ``step()`` on an optimizer with empty state (before the first
    step), which would change the training run being checkpointed. Plain optimizers keep
    ``state_dict()``'s integer keys (the layout of non-sharded checkpoints is unchanged).
    """
    sd = opt.state_dict()
    params = optimizer_params(opt)
    if not any(is_dtensor(p) for p in params):
        return sd
    fqns = [names.get(id(p)) for p in params]
    ids = [i for g in sd["param_groups"] for i in g["params"]]
    if None in fqns or len(set(fqns)) != len(fqns) or len(ids) != len(fqns):
        return sd
    to_fqn = dict(zip(ids, fqns, strict=True))
    return {
        **sd,
        "state": {to_fqn[i]: st for i, st in sd["state"].items()},
        "param_groups": [{**g, "params": [to_fqn[i] for i in g["params"]]} for g in sd["param_groups"]],
    }


def _good_name(name: Any) -> bool:
    """Whether ``name`` may be a top-level state key: a non-empty string without ``/`` or a
    leading ``@`` (the one rule; :func:`check_name` raises where it fails)."""
    return isinstance(name, str) and bool(name) and SEP not in name and not name.startswith("@")


def check_name(name: Any) -> str:
    if not _good_name(name):
        raise CheckpointError(
            f"state keys must be non-empty strings without '/' or a leading '@', got {name!r}"
        )
    return name


def encode_state(state: Mapping[Any, Any], leaves: list[Leaf],
                 param_names: Mapping[int, str] | None = None) -> list[EncodedObject]:
    """:func:`encode_object` of every entry of a save's ``state`` (names checked), appending
    their tensors to ``leaves``. Entries that are plain tensors (no autograd, no PerRank mark:
    a flat state of thousands) are encoded inline, without the calls per entry that were a
    third of the time an async save of 4,000 tensors spent encoding."""
    objects = []
    for name, value in state.items():
        if (type(value) is torch.Tensor and not value.requires_grad and _good_name(name)
                and not getattr(value, PER_RANK_ATTR, False)):
            key = escape_key(name)
            leaves.append(Leaf(key, value, "replicated"))
            objects.append(EncodedObject(name, "tensor", {"@tensor": key}))
        else:
            objects.append(encode_object(check_name(name), value, leaves, param_names))
    return objects


def encode_object(name: str, value: Any, leaves: list[Leaf],
                  param_names: Mapping[int, str] | None = None) -> EncodedObject:
    """Encode one top-level entry, appending its tensors to ``leaves``.

    ``param_names`` (from :func:`param_names` of the whole state) lets optimizers over DTensor
    parameters be keyed by parameter name instead of position.
    """
    if isinstance(value, torch.Tensor):  # a flat state of tensors: one entry per tensor, kept short
        key = escape_key(name)
        leaves.append(_leaf(value, key, False))  # _leaf reads the tensor's own PerRank mark
        return EncodedObject(name, "tensor", {"@tensor": key})
    per_rank = bool(getattr(value, PER_RANK_ATTR, False))
    kind = kind_of(value)
    tree = _encode(state_dict_of(kind, value, param_names), escape_key(name), leaves, per_rank)
    return EncodedObject(name, kind, tree)


def _encode(value: Any, key: str, leaves: list[Leaf], per_rank: bool) -> Any:
    """``key``: the escaped path of ``value`` (its tensor key, if it is a tensor)."""
    if isinstance(value, torch.Tensor):
        leaves.append(_leaf(value, key, per_rank))
        return {"@tensor": key}
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("@") for k in value):
            return {k: _encode(v, f"{key}{SEP}{escape_key(k)}", leaves, per_rank) for k, v in value.items()}
        items = []
        for k, v in value.items():
            if not isinstance(k, (str, int, float, bool)) and k is not None:
                raise _unsupported(k, key, "dict key")
            items.append([k, _encode(v, f"{key}{SEP}{escape_key(str(k))}", leaves, per_rank)])
        return {"@dict": items}
    if isinstance(value, tuple):  # includes torch.Size and namedtuples (restored as tuples)
        return {"@tuple": [_encode(v, f"{key}{SEP}{i}", leaves, per_rank) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, f"{key}{SEP}{i}", leaves, per_rank) for i, v in enumerate(value)]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"@float": repr(value)}
    if hasattr(value, "item") and hasattr(value, "dtype") and getattr(value, "shape", None) == ():
        return _encode(value.item(), key, leaves, per_rank)  # numpy scalar
    if type(value).__module__ == "numpy" and hasattr(value, "shape"):
        return _encode(torch.from_numpy(value.copy()), key, leaves, per_rank)
    raise _unsupported(value, key, "value")


def _leaf(value: torch.Tensor, key: str, per_rank: bool) -> Leaf:
    """The leaf of tensor ``value`` at ``key`` (``per_rank``: inside a PerRank entry)."""
    per_rank = per_rank or bool(getattr(value, PER_RANK_ATTR, False))
    scope = "sharded" if isinstance(value, DTensor) else ("per_rank" if per_rank else "replicated")
    return Leaf(key, value.detach() if value.requires_grad else value, scope)


def _unsupported(value: Any, key: str, what: str) -> CheckpointError:
    return CheckpointError(
        f"cannot checkpoint {what} of type {type(value).__name__} at {key!r} without "
        "pickle. Store tensors, JSON values (numbers, strings, bools, None, lists, dicts), or "
        "an object with state_dict()/load_state_dict() that returns those."
    )


def decode(tree: Any, tensor_for: Callable[[str], torch.Tensor]) -> Any:
    """Rebuild Python values from a tree; ``tensor_for(key)`` supplies each tensor."""
    if isinstance(tree, list):
        return [decode(v, tensor_for) for v in tree]
    if isinstance(tree, dict):
        if "@tensor" in tree:
            return tensor_for(tree["@tensor"])
        if "@tuple" in tree:
            return tuple(decode(v, tensor_for) for v in tree["@tuple"])
        if "@dict" in tree:
            return {k: decode(v, tensor_for) for k, v in tree["@dict"]}
        if "@float" in tree:
            return float(tree["@float"])
        return {k: decode(v, tensor_for) for k, v in tree.items()}
    return tree


def tensor_keys(tree: Any) -> Iterator[str]:
    if isinstance(tree, list):
        for v in tree:
            yield from tensor_keys(v)
    elif isinstance(tree, dict):
        if "@tensor" in tree:
            yield tree["@tensor"]
        elif "@tuple" in tree:
            yield from tensor_keys(tree["@tuple"])
        elif "@dict" in tree:
            for _, v in tree["@dict"]:
                yield from tensor_keys(v)
        else:
            for v in tree.values():
                yield from tensor_keys(v)


KEEP = object()
"""Placeholder in a decoded tree: keep the target's value here (a tensor already filled in place,
so the caller's object, e.g. a Parameter, stays; or a tensor skipped by a non-strict load)."""


def _holds_keep(value: Any) -> bool:
    if value is KEEP:
        return True
    if isinstance(value, dict):
        return any(_holds_keep(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_keep(v) for v in value)
    return False


def merge_into(target: Any, loaded: Any) -> Any:
    """Update ``target`` with ``loaded`` keeping containers; :data:`KEEP` keeps the target's value."""
    if loaded is target or loaded is KEEP:
        return target
    if isinstance(target, dict) and isinstance(loaded, dict):
        for k, v in loaded.items():
            if k in target:
                target[k] = merge_into(target[k], v)
            elif not _holds_keep(v):
                target[k] = v
        return target
    if isinstance(target, list) and isinstance(loaded, list) and len(target) == len(loaded):
        for i, v in enumerate(loaded):
            target[i] = merge_into(target[i], v)
        return target
    if type(target) is tuple and type(loaded) is tuple and len(target) == len(loaded):
        return tuple(merge_into(t, v) for t, v in zip(target, loaded, strict=True))
    return target if _holds_keep(loaded) else loaded
