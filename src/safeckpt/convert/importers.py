"""Other formats -> a checkpoint: a ``torch.distributed.checkpoint`` directory, or a
``torch.save`` file (pickle only when the caller allows it)."""

from __future__ import annotations

import dataclasses
import enum
import importlib
import io
import os
import pickle
import re
import stat
import types
from collections.abc import Mapping
from typing import Any

import torch

from ..coord.dist import distributed_active
from ..errors import CheckpointError, CheckpointNotFound, CorruptCheckpoint


def _single_process(what: str) -> None:
    import torch.distributed as dist

    if distributed_active() and dist.get_world_size() > 1:
        raise CheckpointError(
            f"{what} runs in one process, but a process group of {dist.get_world_size()} ranks is "
            "initialised (safeckpt.save would wait for every rank). Run it outside torchrun, "
            "e.g. with `safeckpt convert`."
        )


def _as_state(obj: Any, entry: str | None, source: str) -> dict[str, Any]:
    """Top-level entries for safeckpt.save from a loaded object."""
    if isinstance(obj, torch.nn.Module):
        obj = obj.state_dict()
        entry = entry or "model"
    if entry is not None:
        return {entry: obj}
    if isinstance(obj, Mapping) and obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
        return {"model": dict(obj)}  # a bare state_dict: load it as {"model": module}
    if not isinstance(obj, Mapping) or not all(isinstance(k, str) for k in obj):
        raise CheckpointError(
            f"{source} holds a {type(obj).__name__}, not a dict of named entries; pass "
            "entry='name' (CLI: --entry) to store it under one entry."
        )
    return dict(obj)


class _UnimportableClass(Exception):
    """A pickle refers to a class that cannot be imported in this environment."""

    def __init__(self, qualname: str, cause: BaseException) -> None:
        super().__init__(qualname)
        self.qualname = qualname
        self.cause = cause

    def explain(self, src: str) -> str:
        return (
            f"cannot import {src}: it holds a pickled {self.qualname} object, and that class cannot be "
            f"imported here ({type(self.cause).__name__}: {self.cause}). Run the conversion where the "
            "code that defines it is importable (the training job's environment, e.g. with its "
            "PYTHONPATH), or save the state again with tensors, containers and plain values only"
        )


class _NamingUnpickler(pickle.Unpickler):
    """Full unpickling (trusted files only) that names the class it cannot import."""

    def find_class(self, module: str, name: str) -> Any:
        try:
            return super().find_class(module, name)
        except (ImportError, AttributeError) as exc:
            raise _UnimportableClass(f"{module}.{name}", exc) from exc


def _naming_load(file: Any, **kwargs: Any) -> Any:
    return _NamingUnpickler(file, **kwargs).load()


# For ``torch.load(pickle_module=...)``, which uses only ``Unpickler`` and ``load``.
_NAMING_PICKLE = types.SimpleNamespace(__name__="pickle", Unpickler=_NamingUnpickler, load=_naming_load)


def _first_line(exc: BaseException, width: int = 300) -> str:
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))
    line = next((part.strip() for part in text.splitlines() if part.strip()), type(exc).__name__)
    return line[:width]


_GLOBAL_RE = re.compile(r"GLOBAL ([\w.]+)")  # the class torch.load(weights_only=True) refused
_PATH_CLASSES = {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"}


class _RefusedGlobal(pickle.UnpicklingError):
    """DCP metadata naming a class outside DCP's metadata format (restricted unpickling)."""


class _DCPMetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` allowing only the types it is made of (DCP dataclasses and
    enums, torch.Size/dtype/layout/memory_format, paths, OrderedDict), never arbitrary code."""

    def find_class(self, module: str, name: str) -> Any:
        obj: Any = None
        if module.startswith("torch.distributed.checkpoint") and "." not in name:
            found = getattr(importlib.import_module(module), name, None)
            if isinstance(found, type) and (dataclasses.is_dataclass(found) or issubclass(found, enum.Enum)):
                obj = found
        elif module == "torch" and name == "Size":
            obj = torch.Size
        elif module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
            obj = getattr(torch, name)
        elif module == "torch.serialization" and name == "_get_layout":
            obj = getattr(importlib.import_module(module), name)
        elif module == "pathlib" and name in _PATH_CLASSES:
            obj = getattr(importlib.import_module(module), name)
        elif module == "collections" and name == "OrderedDict":
            from collections import OrderedDict

            obj = OrderedDict
        elif module == "builtins" and name in ("set", "frozenset", "slice", "complex"):
            obj = getattr(importlib.import_module(module), name)
        if obj is None:
            raise _RefusedGlobal(
                f"the DCP metadata refers to {module}.{name}, which is not part of DCP's metadata "
                "format; refusing to unpickle it (pass allow_pickle=True if you trust the files)"
            )
        return obj


def _dcp_classes(allow_pickle: bool) -> tuple[type, type]:
    """DCP's file reader and load planner with our unpicklers: restricted ones by default;
    with ``allow_pickle``, full unpickling that names a class it cannot import."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.metadata import StorageMeta

    metadata_unpickler = _NamingUnpickler if allow_pickle else _DCPMetadataUnpickler

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            rank = kwargs.get("rank")
            name = ".metadata" if rank is None else f"__{rank}.metadata"
            with open(os.path.join(os.fspath(self.path), name), "rb") as f:
                metadata = metadata_unpickler(f).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class SafePlanner(_EmptyStateDictLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            # DCP's planner unpickles these with weights_only=False: load them ourselves (torch's
            # restricted unpickler unless allow_pickle), then hand DCP a re-serialisation.
            fqn = read_item.dest_index.fqn
            try:
                if allow_pickle:
                    obj = torch.load(value, map_location="cpu", weights_only=False, pickle_module=_NAMING_PICKLE)
                else:
                    obj = torch.load(value, map_location="cpu", weights_only=True)
            except pickle.UnpicklingError as exc:
                if allow_pickle:
                    raise CorruptCheckpoint(f"DCP value {fqn!r} is not a readable pickle ({_first_line(exc)})") from exc
                raise CheckpointError(
                    f"DCP value {fqn!r} is a pickled object beyond tensors and plain containers"
                    + (f" ({m.group(1)})" if (m := _GLOBAL_RE.search(str(exc))) else "")
                    + "; importing it needs arbitrary unpickling, which can run code from the files: "
                    "pass allow_pickle=True (CLI: --allow-pickle) if you trust them"
                ) from exc
            buf = io.BytesIO()
            torch.save(obj, buf)
            buf.seek(0)
            super().load_bytes(read_item, buf)

    return SafeReader, SafePlanner


def _refuse_special_files(src: str) -> None:
    """DCP's reader opens the files it lists: a FIFO or a device there would block it forever."""
    for entry in os.scandir(src):
        try:
            mode = os.stat(entry.path).st_mode
        except OSError:
            continue  # a dangling symlink: DCP reports the missing file if it needs it
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise CorruptCheckpoint(
                f"cannot import {src}: {entry.name} is not a regular file (a FIFO, device or socket); "
                "refusing to read it", path=src,
            )


def _import_error(src: str, exc: BaseException) -> BaseException | None:
    """What to raise for ``exc``, raised while reading the DCP checkpoint at ``src`` (None:
    not recognised)."""
    if isinstance(exc, (CheckpointError, KeyboardInterrupt)):
        return exc
    if isinstance(exc, _UnimportableClass):
        return CheckpointError(exc.explain(src))
    if isinstance(exc, _RefusedGlobal):
        return CheckpointError(f"cannot import {src}: {exc}")
    return None


def _dcp_failures(exc: BaseException) -> list[BaseException]:
    """``exc`` and, for DCP's CheckpointException, the errors it wraps
    (``failures={rank: (exception, traceback)}``)."""
    failures = getattr(exc, "failures", None) if type(exc).__name__ == "CheckpointException" else None
    inner = [f[0] if isinstance(f, tuple) else f for f in (failures or {}).values()]
    return [exc, *(e for e in inner if isinstance(e, BaseException))]


def load_dcp(src_dir: str | os.PathLike[str], *, allow_pickle: bool = False) -> dict[str, Any]:
    """A ``torch.distributed.checkpoint`` directory as one nested dict of full CPU tensors and
    values, read by DCP's own reader in this process (memory: the whole checkpoint).

    DCP keeps its ``.metadata`` and non-tensor values as pickles. By default they are read with
    restricted unpicklers (DCP's metadata types only; ``torch.load(weights_only=True)`` for
    values), so nothing arbitrary runs; ``allow_pickle=True`` unpickles fully, for checkpoints
    holding custom objects (a class that cannot be imported here is named in the error).
    A damaged checkpoint raises :class:`CorruptCheckpoint`."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    src = os.path.abspath(os.fspath(src_dir))
    if not os.path.isfile(os.path.join(src, ".metadata")):
        raise CheckpointNotFound(f"{src} is not a torch.distributed.checkpoint directory (no .metadata)", path=src)
    _refuse_special_files(src)
    reader_class, planner_class = _dcp_classes(allow_pickle)
    reader, planner = reader_class(src), planner_class()
    try:  # check the metadata first: DCP would bury the reason in its own error
        reader.read_metadata()
    except Exception as exc:
        raise _import_error(src, exc) or CorruptCheckpoint(
            f"cannot import {src}: unreadable .metadata ({type(exc).__name__}: {_first_line(exc)})", path=src
        ) from None
    sd: dict[str, Any] = {}
    try:
        _load_state_dict(sd, storage_reader=reader, planner=planner, no_dist=True)
    except SystemExit:
        raise
    except BaseException as exc:  # DCP's CheckpointException derives from BaseException
        errors = _dcp_failures(exc)
        for err in errors:
            known = _import_error(src, err)
            if known is not None:
                raise known from None
        cause = errors[-1]
        raise CorruptCheckpoint(
            f"cannot import {src}: torch.distributed.checkpoint could not read it "
            f"({type(cause).__name__}: {_first_line(cause)})", path=src,
        ) from exc
    return sd


_PARAM_ID = re.compile(r"0|[1-9][0-9]*")


def rekey_optimizer_states(tree: Any) -> int:
    """Give optimizer state its integer keys back after DCP; returns how many entries changed.

    DCP stores dict keys as strings, so a plain ``optimizer.state_dict()`` saved through DCP
    (``{"model": m.state_dict(), "optim": opt.state_dict()}``, the recipe before
    ``get_state_dict``) comes back with ``state`` keyed ``"0"``, ``"1"``... while its
    ``param_groups`` still list the ints 0, 1...: ``Optimizer.load_state_dict`` would then
    attach that state to no parameter. Every optimizer-shaped dict in ``tree`` (``{"state":
    {...}, "param_groups": [{"params": [...]}, ...]}``) whose params are all ints gets each
    digit-string state key that names one of them replaced by that int, in place. State keyed
    by parameter name (``get_state_dict``) is left alone."""
    changed = 0
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            changed += _rekey_one(node)
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
    return changed


def _rekey_one(node: dict[Any, Any]) -> int:
    state, groups = node.get("state"), node.get("param_groups")
    if not (isinstance(state, dict) and isinstance(groups, list) and groups
            and all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups)):
        return 0
    ids = [p for g in groups for p in g["params"]]
    if not all(isinstance(p, int) and not isinstance(p, bool) for p in ids):
        return 0
    wanted = set(ids)
    rekeyed: dict[Any, Any] = {}
    changed = 0
    for key, value in state.items():
        if isinstance(key, str) and _PARAM_ID.fullmatch(key) and int(key) in wanted and int(key) not in state:
            key = int(key)
            changed += 1
        rekeyed[key] = value
    if changed:
        node["state"] = rekeyed
    return changed


def import_dcp(
    src_dir: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    entry: str | None = None,
    allow_pickle: bool = False,
    overwrite: bool = False,
    metadata: Mapping[str, Any] | None = None,
) -> Any:
    """Convert a ``torch.distributed.checkpoint`` directory into a safeckpt checkpoint at ``dst``.

    Run in one process (no multi-rank process group): DCP's reader loads the whole state into
    memory (any saving world size), then :func:`safeckpt.save` writes it. The DCP state's
    top-level keys become the checkpoint's entries, so ``{"model": ..., "optim": ...}`` saved
    with ``get_state_dict`` loads with ``safeckpt.load(dst, {"model": module, "optim": opt})``
    into plain or FSDP2 modules at any world size (the optimizer state is keyed by parameter
    name). A plain ``optimizer.state_dict()`` saved through DCP (state keyed by position) gets
    its integer state keys back (:func:`rekey_optimizer_states`), so it loads into the same
    optimizer with its state attached. A DCP state whose values are all tensors (a bare
    ``state_dict``) is stored under ``"model"``; ``entry="name"`` stores the whole state under
    that one entry.

    Pickle: see :func:`load_dcp` (restricted unpicklers unless ``allow_pickle=True``).
    Returns the :class:`CheckpointInfo` of the new checkpoint; ``metadata`` records
    ``imported_from`` plus what is given.
    """
    from ..engine.save import save

    _single_process("import_dcp")
    src = os.path.abspath(os.fspath(src_dir))
    loaded = load_dcp(src, allow_pickle=allow_pickle)
    rekey_optimizer_states(loaded)
    state = _as_state(loaded, entry, src)
    meta = {"imported_from": "torch.distributed.checkpoint", "source": src, **dict(metadata or {})}
    return save(dst, state, metadata=meta, overwrite=overwrite)


def _torch_load(src: str, weights_only: bool) -> Any:
    """``torch.load`` of a trusted file, its failures as safeckpt errors that say what to do."""
    try:
        mode = os.stat(src).st_mode
    except FileNotFoundError:
        raise CheckpointNotFound(f"no file at {src}", path=src) from None
    if not stat.S_ISREG(mode):
        what = "a directory" if stat.S_ISDIR(mode) else "not a regular file (a FIFO, device or socket)"
        raise CheckpointNotFound(f"{src} is {what}; a torch.save import reads one file", path=src)
    try:
        if weights_only:
            return torch.load(src, map_location="cpu", weights_only=True)
        return torch.load(src, map_location="cpu", weights_only=False, pickle_module=_NAMING_PICKLE)
    except _UnimportableClass as exc:
        raise CheckpointError(exc.explain(src)) from exc
    except pickle.UnpicklingError as exc:
        refused = _GLOBAL_RE.search(str(exc)) if weights_only else None
        if refused is None:
            raise CorruptCheckpoint(
                f"{src} is not a readable torch.save file ({_first_line(exc)}); is it truncated, "
                "damaged, or of another format?", path=src
            ) from exc
        raise CheckpointError(
            f"{src} holds a pickled {refused.group(1)} object, which torch.load(weights_only=True) "
            "refuses (it rebuilds only tensors and plain containers). If you trust the file, "
            "weights_only=False (CLI: --no-weights-only) unpickles it fully; safeckpt then stores it "
            "only if it is a tensor, a container or a JSON value"
        ) from exc
    except (OSError, MemoryError):
        raise
    except Exception as exc:  # torch's zip reader: RuntimeError, EOFError, ValueError...
        raise CorruptCheckpoint(
            f"{src} is not a readable torch.save file ({type(exc).__name__}: {_first_line(exc)}); "
            "is it truncated, damaged, or of another format?", path=src
        ) from exc


def import_torch_save(
    src_file: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    allow_pickle: bool = False,
    weights_only: bool = True,
    entry: str | None = None,
    overwrite: bool = False,
    metadata: Mapping[str, Any] | None = None,
) -> Any:
    """Convert a ``torch.save`` file into a safeckpt checkpoint at ``dst`` (one process).

    A ``torch.save`` file is a pickle: reading it runs the unpickler, which can execute code
    from the file. So this refuses (``CheckpointError``) unless ``allow_pickle=True`` (CLI:
    ``--allow-pickle``) says the file is trusted. It is then read with
    ``torch.load(weights_only=True)`` (torch's restricted unpickler: tensors, containers,
    numbers, strings); ``weights_only=False`` allows arbitrary objects. The checkpoint written
    is pickle-free.

    Entries: a dict with string keys becomes the checkpoint's entries (``{"model": sd,
    "optimizer": osd, "epoch": 3}``); a bare ``state_dict`` (all values tensors) or a pickled
    ``nn.Module`` is stored under ``"model"``; ``entry="name"`` stores the object under that
    one entry. Returns the :class:`CheckpointInfo` of the new checkpoint.
    """
    from ..engine.save import save

    src = os.path.abspath(os.fspath(src_file))
    if not allow_pickle:
        raise CheckpointError(
            f"{src} is a torch.save file, i.e. a pickle: importing it needs unpickling, which can "
            "run arbitrary code from the file. If you trust it, pass allow_pickle=True "
            "(CLI: --allow-pickle). safeckpt checkpoints themselves never need unpickling."
        )
    _single_process("import_torch_save")
    obj = _torch_load(src, weights_only)
    state = _as_state(obj, entry, src)
    meta = {"imported_from": "torch.save", "source": src, **dict(metadata or {})}
    return save(dst, state, metadata=meta, overwrite=overwrite)
