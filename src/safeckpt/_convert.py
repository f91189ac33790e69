"""Consolidate sharded checkpoints, and convert to and from other formats.

Offline functions (one process; :func:`consolidate` and :func:`export_hf` need no process
group and work on any machine, like :func:`safeckpt.read_state_dict`):

- :func:`consolidate`        a checkpoint -> one full safetensors file, streamed
- :func:`export_hf`          a checkpoint's model -> Hugging Face style safetensors files
- :func:`import_dcp`         a ``torch.distributed.checkpoint`` directory -> a checkpoint
- :func:`import_torch_save`  a ``torch.save`` file -> a checkpoint (needs ``allow_pickle=True``)

Streaming: outputs are written tensor by tensor, and each tensor piece by piece (at most
``buffer_bytes`` of tensor data in memory at a time, plus one piece's worth of mapped file
pages, which are dropped after each piece). Each piece is assembled from the overlapping parts
of the stored chunks (shards of any world size), so a checkpoint of any size consolidates in
bounded memory. Every file is written under a temporary name, fsynced and renamed into place.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import io
import itertools
import json
import math
import os
import pickle
import re
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ._manifest import torch_dtype
from ._reader import Box, TensorReader, open_manifest
from ._storage import resolve
from .errors import CheckpointError, CheckpointExists

DEFAULT_BUFFER = 64 << 20
HF_SINGLE = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"
HF_SHARD = "model-{:05d}-of-{:05d}.safetensors"
_HF_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")

Progress = Callable[[int, int, str], None]


@dataclass(frozen=True)
class WrittenSafetensors:
    """What :func:`consolidate` wrote: the file, its tensor names (in file order) and the
    number of tensor bytes."""

    path: str
    names: tuple[str, ...]
    nbytes: int


# ------------------------------------------------------------------------- selection
def _select(man: dict[str, Any], only: str | None) -> tuple[list[tuple[str, str]], dict[str, Any]]:
    """(output name, manifest key) for every selected tensor, and the selected non-tensor
    values (``{output name: JSON tree}``)."""
    prefix = None if only is None else only.strip("/")
    if prefix == "":
        prefix = None

    def rename(key: str) -> str | None:
        if prefix is None:
            return key
        if key == prefix:
            return key.rsplit("/", 1)[-1]
        if key.startswith(prefix + "/"):
            return key[len(prefix) + 1 :]
        return None

    tensors = []
    for key in man["tensors"]:
        name = rename(key)
        if name is not None:
            tensors.append((name, key))
    values: dict[str, Any] = {}
    for obj_name, obj in man["objects"].items():
        _collect_values(obj["tree"], obj_name, values)
    values = {n: v for k, v in values.items() if (n := rename(k)) is not None}
    if not tensors and not values:
        entries = ", ".join(sorted(man["objects"])) or "none"
        raise CheckpointError(
            f"nothing in the checkpoint matches only={only!r}; its entries are: {entries}"
        )
    return tensors, values


def _collect_values(tree: Any, path: str, out: dict[str, Any]) -> None:
    if isinstance(tree, dict) and not any(k.startswith("@") for k in tree):
        if not tree:
            out[path] = {}
        for k, v in tree.items():
            _collect_values(v, f"{path}/{k}", out)
    elif not (isinstance(tree, dict) and "@tensor" in tree):
        out[path] = tree  # JSON; may hold {"@tensor": key} references to tensors


# ---------------------------------------------------------------- streaming writer
def _pieces(shape: Sequence[int], elem: int, limit: int) -> Iterator[Box]:
    """Boxes that tile a C-contiguous tensor in memory order, each at most ``limit`` bytes
    (or one element): consecutive boxes are consecutive byte ranges."""
    shape = list(shape)
    if not shape:
        yield [[], []]
        return
    if math.prod(shape) == 0:
        return
    # split along the first dim whose trailing block fits in the limit
    d = 0
    while d < len(shape) - 1 and math.prod(shape[d + 1 :]) * elem > limit:
        d += 1
    inner = math.prod(shape[d + 1 :]) * elem
    step = max(1, limit // max(inner, 1))
    for prefix in itertools.product(*[range(s) for s in shape[:d]]):
        for a in range(0, shape[d], step):
            n = min(step, shape[d] - a)
            yield [[*prefix, a] + [0] * (len(shape) - d - 1), [1] * d + [n] + shape[d + 1 :]]


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        n = os.write(fd, data)
        data = data[n:]


def _write_safetensors(path: str, reader: TensorReader, entries: Sequence[tuple[str, str]],
                       metadata: Mapping[str, str], *, verify: bool, buffer_bytes: int,
                       progress: Progress | None, done: int = 0, total: int = 0) -> tuple[list[str], int]:
    """Write ``entries`` (output name, manifest key) as one safetensors file at ``path``."""
    recs = {key: reader.record(key) for _, key in entries}
    dtypes = {key: torch_dtype(recs[key]["dtype"]) for _, key in entries}
    sizes = {key: math.prod(recs[key]["shape"]) * dtypes[key].itemsize for _, key in entries}
    order = sorted(entries, key=lambda e: (-dtypes[e[1]].itemsize, e[0]))  # as save_file: aligned
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for name, key in order:
        header[name] = {"dtype": recs[key]["dtype"], "shape": list(recs[key]["shape"]),
                        "data_offsets": [offset, offset + sizes[key]]}
        offset += sizes[key]
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    tmp = os.path.join(os.path.dirname(path) or ".", f".{os.path.basename(path)}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    scratch = torch.empty(0, dtype=torch.uint8)
    try:
        _write_all(fd, memoryview(struct.pack("<Q", len(raw)) + raw))
        for name, key in order:
            if verify:
                reader.verify_chunks(key, window=max(buffer_bytes, 1 << 20))
            shape, dtype = list(recs[key]["shape"]), dtypes[key]
            for box in _pieces(shape, dtype.itemsize, buffer_bytes):
                nbytes = math.prod(box[1]) * dtype.itemsize
                if scratch.numel() < nbytes:  # one reused buffer: no allocator churn
                    scratch = torch.empty(nbytes, dtype=torch.uint8)
                piece = scratch[:nbytes]
                reader.fill_box(key, piece.view(dtype).view(tuple(box[1])), box)
                if nbytes:
                    _write_all(fd, memoryview(piece.numpy()))
                reader.release()
            done += sizes[key]
            if progress is not None:
                progress(done, total, name)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    os.close(fd)
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))
    return [name for name, _ in order], done


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


# ---------------------------------------------------------------------- consolidate
def consolidate(
    ckpt: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    *,
    only: str | None = None,
    progress: Progress | None = None,
    verify_checksums: bool = True,
    buffer_bytes: int = DEFAULT_BUFFER,
) -> WrittenSafetensors:
    """Write the checkpoint at ``ckpt`` as one safetensors file of full (unsharded) tensors.

    Offline (no process group), never unpickles. Sharded tensors of any world size are
    assembled from their shards; per-rank tensors (RNG state) are rank 0's copy, as in
    :func:`safeckpt.read_state_dict`.

    Names: without ``only``, the checkpoint's keys (``model/layer.weight``,
    ``optim/state/layer.weight/exp_avg``). ``only`` selects one entry or sub-tree by key prefix
    and strips that prefix: ``only="model"`` gives ``layer.weight``, the names of the plain
    module's ``state_dict()``, so ``model.load_state_dict(safetensors.torch.load_file(out))``
    works (also for a checkpoint saved from FSDP2 or DDP).

    The file's ``__metadata__`` holds ``format="pt"``, ``safeckpt.step`` (when the checkpoint
    has one) and ``safeckpt.values``: a JSON object of the selected non-tensor values (such as
    ``step`` or ``optim/param_groups``) in safeckpt's tree encoding.

    Memory: tensor by tensor, each in pieces of at most ``buffer_bytes`` (default 64 MiB), so a
    checkpoint of any size needs about that much memory, never a full copy. With
    ``verify_checksums`` every stored chunk is checked against its checksum first (a second,
    cheap read of the bytes; raises :class:`CorruptCheckpoint`). The output appears atomically
    (temporary file, fsync, rename) and replaces an existing file.

    ``progress(done_bytes, total_bytes, name)`` is called after each tensor.
    Raises :class:`CheckpointNotFound`, :class:`CorruptCheckpoint`, or :class:`CheckpointError`
    when ``only`` matches nothing. Returns :class:`WrittenSafetensors` (path, names, nbytes).
    """
    src = resolve(ckpt)  # a local path or an fsspec URL
    out = os.path.abspath(os.fspath(out_path))
    man = open_manifest(src)
    tensors, values = _select(man, only)
    metadata = {"format": "pt"}
    if man.get("step") is not None:
        metadata["safeckpt.step"] = str(man["step"])
    if values:
        metadata["safeckpt.values"] = json.dumps(values, separators=(",", ":"))
    reader = TensorReader(src, man, rank=0, verify=verify_checksums)
    total = sum(_nbytes(man["tensors"][k]) for _, k in tensors)
    try:
        names, _ = _write_safetensors(out, reader, tensors, metadata, verify=verify_checksums,
                                      buffer_bytes=buffer_bytes, progress=progress, total=total)
    finally:
        reader.close()
    return WrittenSafetensors(out, tuple(names), total)


def _nbytes(rec: dict[str, Any]) -> int:
    return math.prod(rec["shape"]) * torch_dtype(rec["dtype"]).itemsize


# ------------------------------------------------------------------------ HF export
def parse_size(size: int | str) -> int:
    """Bytes from an int or a string such as ``"5GB"`` (10**9), ``"500MiB"`` (2**20)."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", str(size), re.IGNORECASE)
    if not m:
        raise ValueError(f"cannot read a size from {size!r}; use bytes or e.g. '5GB', '500MiB'")
    base = 1024 if m.group(3) else 1000
    power = " KMGT".index(m.group(2).upper() or " ")
    return int(float(m.group(1)) * base**power)


def export_hf(
    ckpt: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    only: str | None = "model",
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
    progress: Progress | None = None,
    verify_checksums: bool = True,
    buffer_bytes: int = DEFAULT_BUFFER,
) -> list[str]:
    """Export a checkpoint's model as Hugging Face style safetensors into ``out_dir``.

    Tensors under ``only`` (default ``"model"``; prefix stripped, so names are the plain
    module's ``state_dict`` keys) are written to ``model.safetensors`` when their total size is
    at most ``max_shard_size`` (bytes, or a string such as ``"5GB"``, ``"500MiB"``), else to
    ``model-00001-of-0000N.safetensors`` ... plus ``model.safetensors.index.json``
    (``{"metadata": {"total_size": bytes}, "weight_map": {name: file}}``), as
    ``transformers``' ``save_pretrained`` does; each file's metadata is ``{"format": "pt"}``.
    A tensor larger than ``max_shard_size`` gets a shard of its own.

    Streams like :func:`consolidate` (bounded memory, files appear atomically). Existing
    ``model*.safetensors`` / index files in ``out_dir`` raise :class:`CheckpointExists` unless
    ``overwrite=True``, which replaces them (stale shards of an earlier export are removed
    after the new files are in place). Returns the paths written, index last.
    """
    src = resolve(ckpt)  # a local path or an fsspec URL
    dst = os.path.abspath(os.fspath(out_dir))
    limit = parse_size(max_shard_size)
    if limit <= 0:
        raise ValueError(f"max_shard_size must be positive, got {max_shard_size!r}")
    man = open_manifest(src)
    tensors, _ = _select(man, only)
    os.makedirs(dst, exist_ok=True)
    existing = [f for f in os.listdir(dst) if f in (HF_SINGLE, HF_INDEX) or _HF_SHARD_RE.match(f)]
    if existing and not overwrite:
        raise CheckpointExists(
            f"{dst} already holds {', '.join(sorted(existing))}; pass overwrite=True "
            "(CLI: --overwrite) to replace them, or export into an empty directory."
        )
    shards: list[list[tuple[str, str]]] = [[]]
    size = 0
    for name, key in sorted(tensors):
        n = _nbytes(man["tensors"][key])
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append((name, key))
        size += n
    total = sum(_nbytes(man["tensors"][k]) for _, k in tensors)
    reader = TensorReader(src, man, rank=0, verify=verify_checksums)
    written: list[str] = []
    weight_map: dict[str, str] = {}
    done = 0
    try:
        for i, entries in enumerate(shards):
            fname = HF_SINGLE if len(shards) == 1 else HF_SHARD.format(i + 1, len(shards))
            path = os.path.join(dst, fname)
            _, done = _write_safetensors(path, reader, entries, {"format": "pt"}, verify=verify_checksums,
                                         buffer_bytes=buffer_bytes, progress=progress, done=done, total=total)
            written.append(path)
            weight_map.update({name: fname for name, _ in entries})
    finally:
        reader.close()
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        path = os.path.join(dst, HF_INDEX)
        tmp = path + f".tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(index, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        written.append(path)
    keep = {os.path.basename(p) for p in written}
    for f in existing:
        if f not in keep:
            os.unlink(os.path.join(dst, f))
    _fsync_dir(dst)
    return written


# --------------------------------------------------------------------------- imports
def _single_process(what: str) -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
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


_PATH_CLASSES = {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"}


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
            raise pickle.UnpicklingError(
                f"the DCP metadata refers to {module}.{name}, which is not part of DCP's metadata "
                "format; refusing to unpickle it (pass allow_pickle=True if you trust the files)"
            )
        return obj


def _safe_dcp_classes() -> tuple[type, type]:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            rank = kwargs.get("rank")
            name = ".metadata" if rank is None else f"__{rank}.metadata"
            with open(os.path.join(os.fspath(self.path), name), "rb") as f:
                metadata = _DCPMetadataUnpickler(f).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class SafePlanner(_EmptyStateDictLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            # DCP's planner unpickles these with weights_only=False; load them with torch's
            # restricted unpickler, then hand DCP a re-serialisation of the (safe) result.
            try:
                obj = torch.load(value, map_location="cpu", weights_only=True)
            except pickle.UnpicklingError as exc:
                raise CheckpointError(
                    f"DCP value {read_item.dest_index.fqn!r} is a pickled object beyond tensors and "
                    "plain containers; importing it needs arbitrary unpickling, which can run code "
                    "from the files: pass allow_pickle=True (CLI: --allow-pickle) if you trust them"
                ) from exc
            buf = io.BytesIO()
            torch.save(obj, buf)
            buf.seek(0)
            super().load_bytes(read_item, buf)

    return SafeReader, SafePlanner


def load_dcp(src_dir: str | os.PathLike[str], *, allow_pickle: bool = False) -> dict[str, Any]:
    """A ``torch.distributed.checkpoint`` directory as one nested dict of full CPU tensors and
    values, read by DCP's own reader in this process (memory: the whole checkpoint).

    DCP keeps its ``.metadata`` and non-tensor values as pickles. By default they are read with
    restricted unpicklers (DCP's metadata types only; ``torch.load(weights_only=True)`` for
    values), so nothing arbitrary runs; ``allow_pickle=True`` uses DCP's stock reader instead,
    for checkpoints holding custom objects."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    src = os.path.abspath(os.fspath(src_dir))
    if not os.path.isfile(os.path.join(src, ".metadata")):
        from .errors import CheckpointNotFound

        raise CheckpointNotFound(f"{src} is not a torch.distributed.checkpoint directory (no .metadata)", path=src)
    if allow_pickle:
        reader, planner = FileSystemReader(src), _EmptyStateDictLoadPlanner()
    else:
        safe_reader, safe_planner = _safe_dcp_classes()
        reader, planner = safe_reader(src), safe_planner()
        try:  # check the metadata first: DCP would bury the reason in its own error
            reader.read_metadata()
        except pickle.UnpicklingError as exc:
            raise CheckpointError(f"cannot import {src}: {exc}") from None
        except Exception as exc:
            raise CheckpointError(f"cannot import {src}: unreadable .metadata ({type(exc).__name__}: {exc})") from exc
    sd: dict[str, Any] = {}
    try:
        _load_state_dict(sd, storage_reader=reader, planner=planner, no_dist=True)
    except BaseException as exc:  # DCP's CheckpointException derives from BaseException
        # it wraps errors raised while reading: failures={rank: (exception, traceback)}
        failures = getattr(exc, "failures", None) if type(exc).__name__ == "CheckpointException" else None
        inner = [f[0] if isinstance(f, tuple) else f for f in (failures or {}).values()]
        for err in [exc, *inner]:
            if isinstance(err, CheckpointError):
                raise err from None
            if isinstance(err, pickle.UnpicklingError):
                raise CheckpointError(f"cannot import {src}: {err}") from None
        raise
    return sd


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
    name). A DCP state whose values are all tensors (a bare ``state_dict``) is stored under
    ``"model"``; ``entry="name"`` stores the whole state under that one entry.

    Pickle: see :func:`load_dcp` (restricted unpicklers unless ``allow_pickle=True``).
    Returns the :class:`CheckpointInfo` of the new checkpoint; ``metadata`` records
    ``imported_from`` plus what is given.
    """
    from ._save import save

    _single_process("import_dcp")
    src = os.path.abspath(os.fspath(src_dir))
    state = _as_state(load_dcp(src, allow_pickle=allow_pickle), entry, src)
    meta = {"imported_from": "torch.distributed.checkpoint", "source": src, **dict(metadata or {})}
    return save(dst, state, metadata=meta, overwrite=overwrite)


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
    from ._save import save

    src = os.path.abspath(os.fspath(src_file))
    if not allow_pickle:
        raise CheckpointError(
            f"{src} is a torch.save file, i.e. a pickle: importing it needs unpickling, which can "
            "run arbitrary code from the file. If you trust it, pass allow_pickle=True "
            "(CLI: --allow-pickle). safeckpt checkpoints themselves never need unpickling."
        )
    _single_process("import_torch_save")
    if not os.path.isfile(src):
        from .errors import CheckpointNotFound

        raise CheckpointNotFound(f"no file at {src}", path=src)
    try:
        obj = torch.load(src, map_location="cpu", weights_only=weights_only)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"{src}: torch.load(weights_only=True) refused it ({str(exc).splitlines()[0][:300]}). "
            "It holds objects beyond tensors and plain containers; pass weights_only=False only "
            "if you trust the file (that runs arbitrary unpickling)."
        ) from exc
    state = _as_state(obj, entry, src)
    meta = {"imported_from": "torch.save", "source": src, **dict(metadata or {})}
    return save(dst, state, metadata=meta, overwrite=overwrite)
