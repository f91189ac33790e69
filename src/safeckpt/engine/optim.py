"""Load optimizer state across layouts: FSDP2/DTensor <-> plain, any world size.

``Optimizer.state_dict()`` keys state by position (param ids 0..n-1). Optimizers over DTensor
(FSDP2) parameters are saved keyed by parameter name instead (see
:func:`safeckpt.format.tree.optimizer_state_dict`), as DCP does. Loading maps the saved entries onto
the target optimizer's parameters:

- by name, when the saved keys are names and every target parameter has a name (from the
  modules in the same ``state`` dict); param groups are matched by their sets of names;
- else by position, as ``Optimizer.load_state_dict`` itself does (same number of groups and
  parameters per group).

Each saved state tensor shaped like its parameter is read into a fresh tensor laid out like
the *target* parameter: a DTensor with the target's mesh and placements when the parameter is a
DTensor (each rank reads only the bytes overlapping its shard), a full tensor otherwise. Other
state (``step``, scalars) is read whole. The result goes through the optimizer's own
``load_state_dict``, so hooks and dtype/device casting behave as usual.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..format.manifest import torch_dtype
from ..format.tree import decode, is_dtensor, optimizer_params, tensor_keys
from .reader import TensorReader


@dataclass
class OptimPlan:
    params: list[torch.Tensor]
    entries: list[tuple[int, Any]] = field(default_factory=list)  # (flat index, saved state tree)
    groups: list[tuple[Any, list[int]]] = field(default_factory=list)  # (saved group tree, indices)
    extra: dict[str, Any] = field(default_factory=dict)  # other top-level keys, as saved trees


def is_optimizer_tree(tree: Any) -> bool:
    return (
        isinstance(tree, dict)
        and isinstance(tree.get("state"), dict)
        and isinstance(tree.get("param_groups"), list)
        and all(isinstance(g, dict) and isinstance(g.get("params"), list)
                and all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in g["params"])
                for g in tree["param_groups"])
    )


def _state_items(state_tree: dict[str, Any]) -> list[tuple[Any, Any]]:
    if "@dict" in state_tree:
        return [(k, v) for k, v in state_tree["@dict"]]
    return list(state_tree.items())


def orphan_state_keys(tree: dict[str, Any]) -> list[Any]:
    """Saved state entries whose key is in no saved param group: state that
    ``Optimizer.load_state_dict`` would silently attach to nothing (e.g. DCP's digit-string
    keys next to integer param ids)."""
    params = {(type(k), k) for g in tree["param_groups"] for k in g["params"]}
    return [k for k, _ in _state_items(tree["state"]) if (type(k), k) not in params]


def needs_mapping(opt: Any, tree: Any) -> bool:
    """Whether to load ``tree`` into optimizer ``opt`` through this module (otherwise the
    optimizer's plain ``load_state_dict`` with full tensors is exact and cheapest)."""
    if not isinstance(opt, torch.optim.Optimizer) or not is_optimizer_tree(tree):
        return False
    saved_keys = [k for g in tree["param_groups"] for k in g["params"]]
    return any(is_dtensor(p) for p in optimizer_params(opt)) or any(isinstance(k, str) for k in saved_keys)


def plan_load(name: str, opt: torch.optim.Optimizer, tree: dict[str, Any], names: Mapping[int, str],
              record: Callable[[str], dict[str, Any]]) -> tuple[OptimPlan | None, list[str]]:
    """Match the saved optimizer ``tree`` to ``opt``; (plan, []) or (None, problems)."""
    params = optimizer_params(opt)
    target_groups = [list(g["params"]) for g in opt.param_groups]
    index = {id(p): i for i, p in enumerate(params)}
    saved_groups = tree["param_groups"]
    saved_keys = [k for g in saved_groups for k in g["params"]]
    fqns = [names.get(id(p)) for p in params]
    plan = OptimPlan(params=params)
    problems: list[str] = []
    by_name = (
        bool(saved_keys)
        and all(isinstance(k, str) for k in saved_keys)
        and None not in fqns
        and len(set(fqns)) == len(fqns)
    )
    key_to_index: dict[Any, int] = {}
    if by_name:
        fqn_index = {f: i for i, f in enumerate(fqns)}
        unused = list(range(len(saved_groups)))
        for gi, group in enumerate(target_groups):
            want = {fqns[index[id(p)]] for p in group}
            match = next((si for si in ([gi] if gi in unused else []) + unused
                          if set(saved_groups[si]["params"]) == want), None)
            if match is None:
                missing = sorted(want - set(saved_keys))
                problems.append(
                    f"{name}: no saved param group holds exactly the parameters of group {gi}"
                    + (f" (not in the checkpoint: {missing[:8]})" if missing else "")
                )
                continue
            unused.remove(match)
            plan.groups.append((saved_groups[match], [index[id(p)] for p in group]))
        if unused:
            extra_keys = sorted({k for si in unused for k in saved_groups[si]["params"]} - set(fqns))
            problems.append(
                f"{name}: the checkpoint has {len(saved_groups)} param groups, the optimizer "
                f"{len(target_groups)}" + (f"; parameters not in the optimizer: {extra_keys[:8]}" if extra_keys else "")
            )
        key_to_index = {k: fqn_index[k] for k in saved_keys if k in fqn_index}
    else:
        sizes = [len(g["params"]) for g in saved_groups]
        want = [len(g) for g in target_groups]
        if sizes != want:
            problems.append(
                f"{name}: the checkpoint's param groups have {sizes} parameters, the optimizer's "
                f"{want} (matched by position because parameter names are not available)"
            )
        else:
            flat = 0
            for group_tree, group in zip(saved_groups, target_groups, strict=True):
                plan.groups.append((group_tree, [index[id(p)] for p in group]))
            for k in saved_keys:
                key_to_index[k] = flat
                flat += 1
    for key, sub in _state_items(tree["state"]):
        if key not in key_to_index:
            if not problems:
                problems.append(f"{name}: state for parameter {key!r} that is in no param group")
            continue
        i = key_to_index[key]
        p = params[i]
        for tkey in tensor_keys(sub):
            shape = list(record(tkey)["shape"])
            if is_dtensor(p) and shape and shape != list(p.shape):
                problems.append(
                    f"{name}: state tensor {tkey!r} has shape {shape} but its parameter "
                    f"{fqns[i] or i} has {list(p.shape)}"
                )
        plan.entries.append((i, sub))
    plan.extra = {k: v for k, v in tree.items() if k not in ("state", "param_groups")}
    return (None, problems) if problems else (plan, [])


def plan_targets(plan: OptimPlan, record: Callable[[str], dict[str, Any]]) -> list[tuple[str, Any]]:
    """(tensor key, box or None for the whole tensor) of everything :func:`build_state_dict`
    reads: a DTensor parameter's state only in its local box, the rest whole."""
    from ..format.sharding import local_box

    out: list[tuple[str, Any]] = []
    for i, sub in plan.entries:
        p = plan.params[i]
        for key in tensor_keys(sub):
            rec = record(key)
            out.append((key, local_box(p) if is_dtensor(p) and list(rec["shape"]) == list(p.shape) else None))
    for group_tree, _ in plan.groups:
        out += [(k, None) for k in tensor_keys({k: v for k, v in group_tree.items() if k != "params"})]
    out += [(k, None) for v in plan.extra.values() for k in tensor_keys(v)]
    return out


def build_state_dict(plan: OptimPlan, reader: TensorReader) -> dict[str, Any]:
    """The ``state_dict`` to pass to the target optimizer's ``load_state_dict``."""

    def tensor_for(p: torch.Tensor) -> Callable[[str], torch.Tensor]:
        def read(key: str) -> torch.Tensor:
            rec = reader.record(key)
            if is_dtensor(p) and list(rec["shape"]) == list(p.shape):
                t = torch.empty_like(p, dtype=torch_dtype(rec["dtype"]))  # target's mesh/placements
                reader.fill(key, t, owned=True)
                return t
            return reader.new(key)

        return read

    state = {i: decode(sub, tensor_for(plan.params[i])) for i, sub in plan.entries}
    groups = []
    for group_tree, indices in plan.groups:
        g = decode({k: v for k, v in group_tree.items() if k != "params"}, reader.new)
        g["params"] = list(indices)
        groups.append(g)
    extra = {k: decode(v, reader.new) for k, v in plan.extra.items()}
    return {**extra, "state": state, "param_groups": groups}
