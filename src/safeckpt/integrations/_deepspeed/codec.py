"""DeepSpeed's checkpoint dicts <-> values safeckpt stores without pickle.

DeepSpeed hands its checkpoint engine dicts that hold, besides tensors and plain values, a few
Python objects it normally pickles: loss scalers, ``fragment_address`` dataclasses,
``torch.Size`` shapes, ``torch.dtype`` and enums such as ``ZeroStageEnum``. Each known type is
written as a small tagged JSON dict (``{"__safeckpt_deepspeed__": "DynamicLossScaler", ...}``)
and rebuilt on load from an explicit allowlist, never by importing a name read from the file.
Enums that are ints or strings (``IntEnum``) are stored as their plain value, which compares
equal. Key order matters to DeepSpeed (``param_shapes`` lists the flattened parameters in
order) but safeckpt manifests store string-keyed dicts sorted, so a dict whose keys are not in
sorted order carries its order under the same reserved key (``{TAG: [keys...], ...}``). Anything else that is not a tensor or JSON value is refused when saving, with the path
of the offending value, so a checkpoint never holds something it cannot give back.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import torch

from ...errors import CheckpointError

TAG = "__safeckpt_deepspeed__"


def _loss_scaler_classes() -> dict[str, type]:
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler

    return {"LossScaler": LossScaler, "DynamicLossScaler": DynamicLossScaler}


def _enum_classes() -> dict[str, type[enum.Enum]]:
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

    return {"ZeroStageEnum": ZeroStageEnum, "OffloadDeviceEnum": OffloadDeviceEnum}


def _fragment_address() -> type:
    from deepspeed.utils.tensor_fragment import fragment_address

    return fragment_address


def encode(value: Any, path: str = "") -> Any:
    """``value`` with every known DeepSpeed object replaced by its tagged JSON form."""
    if isinstance(value, torch.Tensor) or value is None or isinstance(value, (bool, float)):
        return value
    if isinstance(value, enum.Enum):
        return _encode_enum(value, path)
    if isinstance(value, (int, str)):
        return value
    if isinstance(value, torch.Size):
        return {TAG: "torch.Size", "dims": list(value)}
    if isinstance(value, torch.dtype):
        return {TAG: "torch.dtype", "name": str(value).removeprefix("torch.")}
    if isinstance(value, dict):
        if TAG in value:
            raise CheckpointError(f"the key {TAG!r} at {path or '/'} is reserved by safeckpt")
        out = {k: encode(v, f"{path}/{k}") for k, v in value.items()}
        keys = list(value)
        if all(isinstance(k, str) for k in keys) and keys != sorted(keys):
            out[TAG] = keys  # the order: manifests store string-keyed dicts sorted
        return out
    if isinstance(value, tuple):
        return tuple(encode(v, f"{path}/{i}") for i, v in enumerate(value))
    if isinstance(value, list):
        return [encode(v, f"{path}/{i}") for i, v in enumerate(value)]
    if type(value) is _fragment_address():
        return {TAG: "fragment_address", "numel": int(value.numel), "start": int(value.start)}
    for name, cls in _loss_scaler_classes().items():
        if type(value) is cls:
            return {TAG: name, "attrs": encode(dict(vars(value)), f"{path}/{name}")}
    return value  # numpy values and the like; safeckpt refuses what it cannot store


def _encode_enum(value: enum.Enum, path: str) -> Any:
    for name, cls in _enum_classes().items():
        if type(value) is cls:
            return {TAG: "enum", "class": name, "value": value.value}
    if isinstance(value, (int, str)):
        return value.value  # IntEnum / StrEnum: the plain value compares equal
    raise CheckpointError(
        f"cannot checkpoint enum {type(value).__qualname__} at {path!r} without pickle; store "
        "its .value instead"
    )


def decode(value: Any, path: str = "") -> Any:
    """Rebuild the objects :func:`encode` tagged; everything else is returned as is."""
    if isinstance(value, dict):
        order = value.get(TAG)
        if isinstance(order, list):
            items = {k: v for k, v in value.items() if k != TAG}
            if sorted(map(str, order)) != sorted(items):
                raise CheckpointError(f"malformed key order at {path or '/'}: the checkpoint was edited")
            return {k: decode(items[k], f"{path}/{k}") for k in order}
        if TAG in value:
            return _decode_tagged(value, path)
        return {k: decode(v, f"{path}/{k}") for k, v in value.items()}
    if isinstance(value, list):
        return [decode(v, f"{path}/{i}") for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return tuple(decode(v, f"{path}/{i}") for i, v in enumerate(value))
    return value


def _decode_tagged(value: dict[str, Any], path: str) -> Any:
    kind = value[TAG]
    builders: dict[str, Callable[[], Any]] = {
        "torch.Size": lambda: torch.Size(int(d) for d in value["dims"]),
        "torch.dtype": lambda: _dtype(value["name"], path),
        "fragment_address": lambda: _fragment_address()(numel=int(value["numel"]), start=int(value["start"])),
        "enum": lambda: _enum_classes()[value["class"]](value["value"]),
    }
    try:
        if kind in builders:
            return builders[kind]()
        cls = _loss_scaler_classes()[kind]
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(
            f"unknown or malformed DeepSpeed value {kind!r} at {path or '/'} ({type(exc).__name__}: "
            f"{exc}); it was written by a newer safeckpt or edited"
        ) from None
    obj = cls.__new__(cls)
    obj.__dict__.update(decode(value["attrs"], f"{path}/{kind}"))
    return obj


def _dtype(name: str, path: str) -> torch.dtype:
    found = getattr(torch, str(name), None)
    if not isinstance(found, torch.dtype):
        raise CheckpointError(f"unknown torch dtype {name!r} at {path or '/'}")
    return found
