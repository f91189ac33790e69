"""The configs real Lightning projects keep in ``hyper_parameters`` and callback states, as JSON.

safeckpt's core stores tensors, JSON values, tuples and dicts with str/int/float/bool/None
keys. Lightning checkpoints also hold OmegaConf ``DictConfig``/``ListConfig`` (Hydra),
``argparse.Namespace``, Lightning's ``AttributeDict``, ``pathlib`` paths, enums, dataclasses of
such values, classes (a callback whose ``state_key`` is its type) and sets. :func:`encode`
turns each into a plain JSON record tagged with its type; :func:`decode` rebuilds it.

Never pickle, never an import chosen by the file: the types rebuilt are an allowlist (OmegaConf,
Namespace, AttributeDict, pathlib, set/frozenset), plus enums, dataclasses and classes whose
module the process has *already imported* (the one defining the LightningModule, typically).
A class not found that way comes back as its plain value (an enum's value, a dataclass's field
dict, a class's dotted name) with a SafeckptWarning. Anything else is refused by
:func:`encode`, naming its key.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import pathlib
import sys
import warnings
from typing import Any

import torch

from safeckpt.errors import CheckpointError, SafeckptWarning

TYPE = "__safeckpt_type__"
_PATHS = {c.__name__: c for c in (pathlib.PurePath, pathlib.PurePosixPath, pathlib.PureWindowsPath,
                                  pathlib.Path, pathlib.PosixPath, pathlib.WindowsPath)}
_PLAIN_KEYS = (str, int, float, bool, type(None))


def _omegaconf() -> Any:
    return sys.modules.get("omegaconf")


def _attribute_dict() -> Any:
    mod = sys.modules.get("lightning.fabric.utilities.data")
    return getattr(mod, "AttributeDict", None)


def _class_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _find_class(name: str) -> type | None:
    """A class by ``module:qualname`` among modules already imported (never imports)."""
    module, _, qualname = str(name).partition(":")
    obj: Any = sys.modules.get(module)
    for part in qualname.split("."):
        if obj is None or part == "<locals>":
            return None
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, type) else None


def encode(value: Any, key: str = "") -> Any:
    """``value`` with every non-JSON config object replaced by a tagged record (raises
    CheckpointError naming ``key`` for anything not on the list)."""
    if value is None or isinstance(value, (bool, int, float, str, torch.Tensor)):
        return value
    oc = _omegaconf()
    if oc is not None and isinstance(value, (oc.DictConfig, oc.ListConfig)):
        kind = "omegaconf.DictConfig" if isinstance(value, oc.DictConfig) else "omegaconf.ListConfig"
        return {TYPE: kind, "value": encode(oc.OmegaConf.to_container(value, resolve=False), key)}
    if isinstance(value, argparse.Namespace):
        return {TYPE: "argparse.Namespace", "value": encode(vars(value), key)}
    if isinstance(value, pathlib.PurePath):
        return {TYPE: "pathlib", "class": type(value).__name__, "value": str(value)}
    if isinstance(value, enum.Enum):
        return {TYPE: "enum", "class": _class_name(type(value)), "name": value.name,
                "value": encode(value.value, key)}
    if isinstance(value, type):
        return {TYPE: "class", "class": _class_name(value)}
    if dataclasses.is_dataclass(value):
        fields = {f.name: encode(getattr(value, f.name), f"{key}.{f.name}") for f in dataclasses.fields(value)}
        return {TYPE: "dataclass", "class": _class_name(type(value)), "value": fields}
    if isinstance(value, (set, frozenset)):
        return {TYPE: type(value).__name__, "value": [encode(v, key) for v in value]}
    if isinstance(value, dict):
        ad = _attribute_dict()
        if ad is not None and isinstance(value, ad):
            return {TYPE: "lightning.AttributeDict", "value": encode(dict(value), key)}
        if type(value) is not dict:
            value = dict(value)  # OrderedDict and other plain mappings: their items
        if all(isinstance(k, _PLAIN_KEYS) for k in value) and TYPE not in value:
            return {k: encode(v, f"{key}/{k}") for k, v in value.items()}
        return {TYPE: "dict", "items": [[encode(k, key), encode(v, f"{key}/{k}")] for k, v in value.items()]}
    if isinstance(value, list):
        return [encode(v, f"{key}/{i}") for i, v in enumerate(value)]
    if isinstance(value, tuple):  # namedtuples come back as tuples, as in the core
        return tuple(encode(v, f"{key}/{i}") for i, v in enumerate(value))
    if type(value).__module__ == "numpy":
        return value  # numpy scalars and arrays: the core stores them
    raise CheckpointError(
        f"cannot checkpoint {type(value).__module__}.{type(value).__qualname__} at {key!r} without "
        "pickle. Lightning checkpoints through safeckpt keep tensors, JSON values, tuples, "
        "OmegaConf configs, argparse.Namespace, pathlib paths, enums, dataclasses of those, "
        "classes and sets; convert this value to one of them (or leave it out of the "
        "hyper-parameters: save_hyperparameters(ignore=[...]))."
    )


def decode(value: Any) -> Any:
    """The inverse of :func:`encode` (identity on checkpoints without tagged records)."""
    if isinstance(value, list):
        return [decode(v) for v in value]
    if isinstance(value, tuple):
        return tuple(decode(v) for v in value)
    if not isinstance(value, dict):
        return value
    kind = value.get(TYPE)
    if kind is None:
        return {k: decode(v) for k, v in value.items()}
    if kind == "dict":
        return {_key(decode(k)): decode(v) for k, v in value["items"]}
    if kind in ("omegaconf.DictConfig", "omegaconf.ListConfig"):
        inner = decode(value["value"])
        try:
            from omegaconf import OmegaConf
        except ImportError:
            warnings.warn("an OmegaConf config comes back as plain containers: omegaconf is not "
                          "installed", SafeckptWarning, stacklevel=2)
            return inner
        return OmegaConf.create(inner)
    if kind == "argparse.Namespace":
        return argparse.Namespace(**decode(value["value"]))
    if kind == "lightning.AttributeDict":
        from lightning.fabric.utilities.data import AttributeDict

        return AttributeDict(decode(value["value"]))
    if kind == "pathlib":
        cls = _PATHS.get(value.get("class"), pathlib.Path)
        return (pathlib.Path if cls in (pathlib.PosixPath, pathlib.WindowsPath) else cls)(value["value"])
    if kind in ("set", "frozenset"):
        items = [decode(v) for v in value["value"]]
        return set(items) if kind == "set" else frozenset(items)
    if kind == "enum":
        cls = _find_class(value["class"])
        if cls is not None and issubclass(cls, enum.Enum) and value["name"] in cls.__members__:
            return cls[value["name"]]
        return _fallback(value, decode(value["value"]), "enum")
    if kind == "dataclass":
        fields = {k: decode(v) for k, v in value["value"].items()}
        cls = _find_class(value["class"])
        if cls is None or not dataclasses.is_dataclass(cls) or set(fields) != {f.name for f in dataclasses.fields(cls)}:
            return _fallback(value, fields, "dataclass")
        obj = cls.__new__(cls)
        for k, v in fields.items():
            object.__setattr__(obj, k, v)  # the saved state as it was (frozen ones too)
        return obj
    if kind == "class":
        cls = _find_class(value["class"])
        return cls if cls is not None else _fallback(value, value["class"], "class")
    raise CheckpointError(f"unknown value type {kind!r} in a Lightning checkpoint (written by a newer safeckpt?)")


def _key(k: Any) -> Any:
    return tuple(k) if isinstance(k, list) else k


def _fallback(record: dict[str, Any], plain: Any, what: str) -> Any:
    warnings.warn(
        f"the {what} {record['class']} is not defined in this process (its module is not imported), "
        f"so its saved value comes back plain ({plain!r}); import that module before loading to get "
        "the object back", SafeckptWarning, stacklevel=3,
    )
    return plain


def check_hyperparameters(owner: Any) -> None:
    """Refuse, naming the key, hyper-parameters that could not be saved (at the start of fit,
    before any step is trained, instead of at the first checkpoint)."""
    hparams = getattr(owner, "_hparams", None)
    if not hparams:
        return
    name = type(owner).__qualname__
    for k, v in dict(hparams).items():
        encode(v, f"{name}.hparams/{k}")
