"""safeckpt as the storage layer of ``torch.distributed.checkpoint`` (DCP).

One argument changes::

    import torch.distributed.checkpoint as dcp
    import safeckpt.dcp

    dcp.save(state, storage_writer=safeckpt.dcp.StorageWriter(path))        # was checkpoint_id=path
    dcp.async_save(state, storage_writer=safeckpt.dcp.StorageWriter(path))
    dcp.load(state, storage_reader=safeckpt.dcp.StorageReader(path))

DCP's planners still decide what is written (deduplication, resharding, ``get_state_dict`` /
``set_state_dict``); safeckpt decides how, through DCP's own protocol:

- ``prepare_local_plan`` (every rank) puts the rank's path in its plan; ``prepare_global_plan``
  (the coordinator, which sees every plan) compares them: ranks given different paths get
  :class:`~safeckpt.RankMismatch` (inside DCP's ``CheckpointException``, on every rank) before
  anything is written. Otherwise it checks the target and prepares the staging place (one
  hidden directory; on an object store, a token for the objects' names), which reaches every
  rank in the global plan.
- ``write_data`` (every rank) checks it sees that directory (bounded wait) and streams its
  items into one safetensors file there, hashing while writing (xxh3-64 per chunk, xxh3-128
  per file), fsynced. Non-tensor items are stored as JSON (never pickled).
- ``finish`` (the coordinator, which gets every rank's results) checks every file is there
  with the size its rank wrote, writes DCP's Metadata as JSON and a safeckpt manifest, and
  publishes the directory with one atomic rename (on an object store: the manifest's PUT,
  which then also holds DCP's Metadata). Before that nothing is visible at the path.
- :class:`StorageReader` validates manifest and metadata, verifies every chunk it reads
  against its checksum before copying anything into the caller's tensors, and unpickles nothing.

DCP turns any error raised in these steps into its ``CheckpointException`` (raised on every
rank; ``.failures`` maps each failing rank to the original error, and its message shows them).
:func:`translate_errors` re-raises the safeckpt error itself.

Any storage safeckpt serves works: local and shared filesystems (staging directory, one
rename) and object stores such as ``s3://bucket/prefix`` (token-named objects written in place,
the manifest PUT last as the commit point; pass ``storage_options`` as to ``safeckpt.save``).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import io
import os
import pickle
import traceback
import uuid
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as _dcp
import xxhash
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from .coord.dist import distributed_active
from .engine.reader import open_manifest
from .engine.save import manifest_head
from .errors import (
    PORTABLE_ERRORS,
    CheckpointError,
    CheckpointExists,
    CheckpointNotFound,
    CorruptCheckpoint,
    RankFailure,
    RankMismatch,
)
from .format.dcp_layout import (
    BYTES_DTYPE,
    DCP_FILE,
    DOT_METADATA,
    MANIFEST_KEY,
    MAX_DCP_FILE,
    build_layout,
    check_dcp_document,
    dcp_document,
    encode_document,
    encode_value,
    parse_dcp_document,
)
from .format.manifest import (
    dtype_code,
    encode_manifest,
    open_regular,
    parse_manifest,
    safe_file_path,
    torch_dtype,
)
from .format.shardfile import MappedFile
from .format.step_names import step_from_name
from .format.tree import decode
from .storage import commit as _commit
from .storage.base import Storage, is_remote, join, resolve, storage_for

__all__ = ["StorageReader", "StorageWriter", "manager_writer", "translate_errors"]

# The manifest format written here: 2, which every safeckpt release reads (the core save may
# move to a newer format; this module keeps writing the one all readers accept).
MANIFEST_FORMAT_VERSION = 2


# ----------------------------------------------------------------------------- what crosses ranks
@dataclasses.dataclass(frozen=True)
class _RankInfo:
    """A rank's local plan data: who it is and which path it was given."""

    rank: int
    path: str
    overwrite: bool = False


@dataclasses.dataclass(frozen=True)
class _Staging:
    """The coordinator's answer in the global plan: where every rank writes."""

    path: str  # the final path, as the coordinator resolved it
    staging: str  # the hidden staging directory the coordinator created
    token: str


@dataclasses.dataclass(frozen=True)
class _Stored:
    """One tensor chunk a rank wrote (a WriteResult's storage_data)."""

    file: str
    start: int
    end: int
    xxh3_64: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file_size: int
    file_xxh3_128: str


@dataclasses.dataclass(frozen=True)
class _Value:
    """One non-tensor item as a JSON tree (a WriteResult's storage_data)."""

    tree: Any


@dataclasses.dataclass(frozen=True)
class _Bytes:
    """One ``bytes`` item, stored as a 1-d uint8 tensor (a WriteResult's storage_data):
    ``chunk`` is where (None for empty bytes, which take no bytes in a file)."""

    chunk: _Stored | None


@dataclasses.dataclass(frozen=True)
class _RankFile:
    """The last WriteResult of every rank: its file (every rank writes one, as safeckpt.save's
    ranks do), or the error that stopped its write, so that the coordinator always gets to
    ``finish`` and removes the staging of a failed save."""

    rank: int
    file: str | None = None
    size: int = 0
    xxh3_128: str = ""
    error: BaseException | None = None
    trace: str = ""


# The index of the _RankFile result: a name no state dict holds (DCP's fqns never start with NUL).
_RANK_INDEX = MetadataIndex(fqn="\x00safeckpt.dcp.rank")
# What stock DCP's FileSystemReader finds in a .metadata written here, for every item: the name
# of a stream extension it does not know, so that it stops with this line (a ValueError
# "Unknown extension name='...'") before reading or unpickling any byte of the item.
STOCK_READER_POINTER = (
    "this is a safeckpt checkpoint (tensors in safetensors files, values in JSON), which the "
    "stock FileSystemReader cannot read: load it with dcp.load(state, "
    "storage_reader=safeckpt.dcp.StorageReader(path))"
)
assert "/" not in STOCK_READER_POINTER  # DCP splits an extension descriptor at its first "/"


def _describe_paths(infos: list[_RankInfo], attr: str = "path") -> str:
    by: dict[Any, list[int]] = {}
    for i in infos:
        by.setdefault(getattr(i, attr), []).append(i.rank)
    parts = []
    for value, ranks in by.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks[:16])) + (
            ", ..." if len(ranks) > 16 else "")
        parts.append(f"{who}: {value!r}")
    return "; ".join(parts)


def _check_same_path(infos: list[Any], op: str) -> None:
    if any(not isinstance(i, _RankInfo) for i in infos):
        raise CheckpointError(
            f"{op}: a rank's plan carries no safeckpt.dcp data: every rank must use "
            "safeckpt.dcp's storage writer/reader (and no plan caching)"
        )
    if len({i.path for i in infos}) > 1:
        raise RankMismatch(
            f"{op}: ranks were given different checkpoint paths ({_describe_paths(infos)}); "
            "nothing was written or read. Every rank must pass the same path: compute it once "
            "(e.g. on rank 0, then dist.broadcast_object_list) instead of from each rank's clock."
        )
    if len({i.overwrite for i in infos}) > 1:
        raise RankMismatch(
            f"{op}: ranks were given different overwrite flags "
            f"({_describe_paths(infos, 'overwrite')}); nothing was written."
        )


def _rank_of(kwargs: Mapping[str, Any]) -> int:
    rank = kwargs.get("rank")
    if isinstance(rank, int):
        return rank
    return dist.get_rank() if distributed_active() else 0


class _OnStorage:
    """The storage of a writer's or reader's path, made on first use and never pickled (DCP's
    process-mode async_save sends the writer to another process, which makes its own)."""

    path: str
    storage_options: dict[str, Any] | None
    timeout: float | None
    _store: Storage | None = None

    def storage(self) -> Storage:
        if self._store is None:
            self._store = storage_for(self.path, self.storage_options, timeout=self.timeout)
        return self._store

    def _at(self, path: str | os.PathLike[str]) -> None:
        self.path = resolve(path)
        self._store = None
        if is_remote(self.path):
            self.storage()  # fsspec and the scheme's package are installed, or a clear error now

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_store": None}


# ----------------------------------------------------------------------------- writer
class StorageWriter(_OnStorage, _dcp.StorageWriter):
    """DCP storage writer: agreed path, staged writes, checked atomic commit, no pickle.

    ``path``: the checkpoint directory (every rank must pass the same one; ``checkpoint_id``
    given to ``dcp.save`` replaces it). ``overwrite`` (default True, as stock DCP overwrites): an
    existing checkpoint there is replaced atomically (the old one stays until the new one is
    committed); ``overwrite=False`` refuses it with :class:`~safeckpt.CheckpointExists`. An
    existing *empty* directory is not in the way. ``metadata``: JSON stored in the manifest (``safeckpt inspect`` shows it).
    ``step``: the training step recorded in the manifest; by default taken from the directory's
    name when it is one frameworks use (``step-0000000100`` as CheckpointManager names them,
    torchtitan's ``step-100``, ``checkpoint-100``, ``checkpoint_100``, ``global_step100``,
    Lightning's ``epoch=2-step=100``), so a manager, ``safeckpt ls`` and ``safeckpt gc`` see it.
    ``dot_metadata`` (default: on for filesystem paths, off for object stores; ``False`` leaves it
    out): also commit a ``.metadata`` file holding DCP's own (pickled) ``Metadata``,
    for tools that recognise a DCP checkpoint by it (torchtitan's resume discovery, Lightning);
    its size and xxh3-128 are in the manifest, and no safeckpt reader opens it. Stock
    ``FileSystemReader`` given such a checkpoint stops at its first item with one line naming
    :class:`StorageReader` (filesystem paths only: an object store's prefix holds only what its
    manifest names). ``storage_options``: the fsspec filesystem's options for a URL ``path``
    (endpoint, credentials), as for ``safeckpt.save``; ``timeout``: bounds each storage call (a
    share of it).

    Items: tensors (and DTensor shards) go to one safetensors file per rank; ``bytes`` items are
    stored as they are (a 1-d uint8 tensor in that file) and loaded back as ``bytes`` (safeckpt
    never looks inside them; what the caller does with its own bytes is the caller's); other
    non-tensor items are stored as JSON, and an object JSON cannot hold is refused with its key.
    A save that fails on any rank publishes nothing and removes its staging directory (a rank
    that dies leaves it to the next save's sweep or ``safeckpt gc``).
    """

    def __init__(self, path: str | os.PathLike[str], *, overwrite: bool = True,
                 metadata: Mapping[str, Any] | None = None, step: int | None = None,
                 dot_metadata: bool | None = None,
                 storage_options: Mapping[str, Any] | None = None, timeout: float | None = None) -> None:
        super().__init__()
        self.storage_options = dict(storage_options) if storage_options else None
        self.timeout = timeout
        self._dot_choice = dot_metadata  # None: wherever the storage can hold it
        self.dot_metadata = False
        self._at(path)
        self.overwrite = bool(overwrite)
        self.step = step
        self.metadata = dict(metadata or {})
        encode_value(self.metadata, "metadata")  # JSON or a clear error now, not at commit
        self.is_coordinator = False
        self.rank = 0
        self.save_id = uuid.uuid4().hex
        self._staging: _Staging | None = None  # the coordinator's current, unpublished staging

    @property
    def checkpoint_id(self) -> str:
        """The path (DCP's logger reports it, as for its own writers)."""
        return self.path

    def _at(self, path: str | os.PathLike[str]) -> None:
        super()._at(path)
        choice = getattr(self, "_dot_choice", None)
        self.dot_metadata = (not is_remote(self.path)) if choice is None else bool(choice)
        if self.dot_metadata and is_remote(self.path):
            raise ValueError(
                f"dot_metadata=True writes a .metadata file beside the checkpoint's files, which "
                f"an object store prefix cannot hold ({self.path}): leave it out there")

    # -- setup
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self._at(checkpoint_id)
        self.save_id = uuid.uuid4().hex

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        try:
            resolve(checkpoint_id)
        except (TypeError, ValueError):
            return False
        return True

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives") is False:
            raise CheckpointError(
                "safeckpt.dcp.StorageWriter needs DCP's collectives (use_collectives=True, the "
                "default): without them ranks cannot agree on the path nor commit together"
            )
        self.is_coordinator = is_coordinator
        self.rank = _rank_of(kwargs)
        if is_coordinator:
            self._drop_staging()  # a previous save through this writer that failed after staging

    def _drop_staging(self) -> None:
        """Remove what a staged, unpublished save wrote (never raises: see commit.discard)."""
        if self._staging is not None:
            st = self._staging
            _commit.discard(self.storage(), st.path, {"path": st.staging, "token": st.token})
            self._staging = None

    # -- planning
    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if not plan.usable:
            raise CheckpointError(
                "safeckpt.dcp.StorageWriter does not support DCP's plan caching "
                "(DefaultSavePlanner(enable_plan_caching=True)): a cached plan would send ranks "
                "to the previous save's staging directory. Use a planner without it."
            )
        return dataclasses.replace(plan, storage_data=_RankInfo(self.rank, self.path, self.overwrite))

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        _check_same_path([p.storage_data for p in plans], "dcp.save")
        if any(not p.usable for p in plans):
            raise CheckpointError("safeckpt.dcp.StorageWriter does not support DCP's plan caching")
        begun = _begin(self.storage(), self.path, self.overwrite)
        self._staging = _Staging(self.path, begun["path"], begun["token"])
        return [dataclasses.replace(p, storage_data=self._staging) for p in plans]

    def _step(self) -> int | None:
        if self.step is not None:
            return self.step
        return step_from_name(self.path.rstrip("/").rsplit("/", 1)[-1].rsplit(os.sep, 1)[-1])

    # -- writing
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        staging = plan.storage_data
        if not isinstance(staging, _Staging):
            raise CheckpointError("safeckpt.dcp: the global plan carries no staging directory")
        if getattr(planner, "_enable_plan_caching", False):
            raise CheckpointError(
                "safeckpt.dcp.StorageWriter does not support DCP's plan caching "
                "(DefaultSavePlanner(enable_plan_caching=True)); use a planner without it."
            )
        store = self.storage()
        try:
            _commit.probe(store, {"path": staging.staging, "token": staging.token}, self.rank)
            results = _write_rank(store, staging, self.rank, plan, planner)
        except Exception as exc:  # noqa: BLE001 - to the coordinator, which removes the staging
            results = [WriteResult(index=_RANK_INDEX, size_in_bytes=0, storage_data=_RankFile(
                self.rank, error=_portable(exc), trace="".join(traceback.format_exception(exc))))]
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    # -- commit
    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        staging = self._staging
        if staging is None:
            raise CheckpointError("safeckpt.dcp: finish() without a staged save on the coordinator")
        try:
            _raise_write_failures(results, self.rank)
            _commit_save(self.storage(), staging, metadata, results, overwrite=self.overwrite,
                         user=self.metadata, step=self._step(), dot_metadata=self.dot_metadata)
        except BaseException:
            self._drop_staging()
            raise
        self._staging = None


class _ManagedWriter(StorageWriter):
    """A :class:`StorageWriter` saving one step under a :class:`~safeckpt.CheckpointManager`
    root (see :func:`manager_writer`), through the manager's public
    :meth:`~safeckpt.CheckpointManager.external_save`: entered by the coordinator when DCP's
    global plan is made (lease, sweep), left when the commit is done (retention)."""

    def __init__(self, mgr: Any, step: int, *, metadata: Mapping[str, Any] | None = None) -> None:
        super().__init__(join(mgr.root, mgr.dirname.format(step)), metadata=metadata, step=step,
                         storage_options=mgr.storage_options, timeout=mgr.timeout)
        self._mgr = mgr
        self._external: Any = None

    def __getstate__(self) -> Any:
        raise CheckpointError(
            "safeckpt.dcp.manager_writer cannot cross into another process (dcp.async_save in "
            "process mode): use thread mode, or StorageWriter(root/step-NNNNNNNNNN) and "
            "mgr.retain() after the save's future completes")

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None and resolve(checkpoint_id) != self.path:
            raise CheckpointError(
                f"safeckpt.dcp.manager_writer saves step {self.step} to {self.path}; dcp.save was "
                f"given checkpoint_id={os.fspath(checkpoint_id)!r} as well: leave it out")
        super().reset(None)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        _check_same_path([p.storage_data for p in plans], "dcp.save")  # same step everywhere first
        # the manager's writer lease, and leftovers of crashed saves swept
        self._external = self._mgr.external_save(self.step, coordinator=True)
        self._external.__enter__()
        return super().prepare_global_plan(plans)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        super().finish(metadata, results)
        self._external.__exit__(None, None, None)  # committed: retention


def manager_writer(mgr: Any, step: int, *, metadata: Mapping[str, Any] | None = None) -> StorageWriter:
    """A DCP storage writer that saves ``step`` under ``mgr``'s root as ``mgr.save`` would::

        dcp.save(state, storage_writer=safeckpt.dcp.manager_writer(mgr, step))

    Every rank passes its manager (same root) and the same step (else RankMismatch on every
    rank). The coordinator takes the manager's writer lease and sweeps leftovers of crashed
    saves before staging, and applies the manager's retention right after the commit (never
    the step just saved nor the restored one). ``mgr.restore(state)`` resumes from the newest
    checkpoint that loads, DCP-written or not; ``mgr.preempted`` works as with ``mgr.save``.
    With ``dcp.async_save``: thread mode only (the manager cannot cross into DCP's process),
    and wait for the previous save's future before the next one.
    """
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    mgr.wait()  # the manager's own background save, if any, commits (or raises) first
    return _ManagedWriter(mgr, step, metadata=metadata)


def _begin(store: Storage, target: str, overwrite: bool) -> dict[str, str]:
    """Check the target and prepare the staging place (on a filesystem, an empty directory at
    the target, as DCP users often create first, is not in the way)."""
    if (store.renames and not overwrite and os.path.isdir(target) and not os.path.islink(target)
            and not os.listdir(target)):
        token = uuid.uuid4().hex[:12]
        return {"token": token, "path": store.stage(target, token)}
    return _commit.begin(store, target, overwrite)


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it crosses to the coordinator (pickles), else a CheckpointError saying it."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any failure means: it does not travel
        return CheckpointError(f"{type(exc).__name__}: {exc}")


def _raise_write_failures(results: list[list[WriteResult]], me: int) -> None:
    """Coordinator: raise what stopped any rank's write (the caller removes the staging)."""
    failed = {}
    for rank_results in results:
        for res in rank_results:
            if isinstance(res.storage_data, _RankFile) and res.storage_data.error is not None:
                failed[res.storage_data.rank] = res.storage_data
    if not failed:
        return
    if set(failed) == {me}:  # the coordinator's own error, as it was raised
        raise failed[me].error  # type: ignore[misc]
    raise RankFailure(
        "dcp.save failed on rank(s) " + ", ".join(map(str, sorted(failed))) + ": "
        + "; ".join(f"rank {r}: {type(f.error).__name__}: {str(f.error).splitlines()[0] if str(f.error) else ''}"
                    for r, f in sorted(failed.items()))
        + ". Nothing was published and the save's staging directory was removed.",
        failures={r: f"{type(f.error).__name__}: {f.error}\n{f.trace}" for r, f in failed.items()},
    )


def _write_rank(store: Storage, staging: _Staging, rank: int, plan: SavePlan,
                planner: SavePlanner) -> list[WriteResult]:
    """Write this rank's file (always one, maybe without tensors); its WriteResults, the last
    one the :class:`_RankFile`."""
    tensor_items = []
    results: list[WriteResult] = []
    blobs = []  # (item, bytes) of the bytes items this rank writes
    for item in plan.items:
        if item.type == WriteItemType.BYTE_IO:
            value = _byte_io_value(item, planner)
            if type(value) is bytes:
                blobs.append((item, value))
            else:
                results.append(WriteResult(index=item.index, size_in_bytes=0,
                                           storage_data=_Value(encode_value(value, item.index.fqn))))
        else:
            tensor_items.append(item)
    named = []
    boxes = []
    for item, blob in blobs:
        if blob:
            named.append((_chunk_name(item), torch.frombuffer(bytearray(blob), dtype=torch.uint8)))
    for item in tensor_items:
        t = planner.resolve_data(item)
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"DCP item {item.index.fqn!r} resolved to a {type(t).__name__}, not a tensor")
        t = t.detach()
        chunk = item.tensor_data.chunk if item.tensor_data is not None else None
        sizes = tuple(chunk.sizes) if chunk is not None else tuple(t.shape)
        if tuple(t.shape) != sizes:
            raise CheckpointError(f"DCP item {item.index.fqn!r} has shape {tuple(t.shape)}, its plan says {sizes}")
        try:
            dtype_code(t.dtype)
        except TypeError as exc:
            raise CheckpointError(f"DCP item {item.index.fqn!r}: {exc}") from None
        named.append((_chunk_name(item), t))
        offsets = tuple(chunk.offsets) if chunk is not None else (0,) * t.dim()
        boxes.append((tuple(int(o) for o in offsets), tuple(int(n) for n in sizes)))
    fname, written = _commit.write(store, {"path": staging.staging, "token": staging.token}, rank, named,
                                   {"format": "safeckpt", "writer": "safeckpt.dcp"})
    where = {n: (span, digest) for n, span, digest in zip(written.names, written.spans, written.digests, strict=True)}

    def stored(name: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> _Stored:
        (start, end), digest = where[name]
        return _Stored(fname, start, end, digest, offsets, sizes, written.size, written.xxh3_128)

    for item, blob in blobs:
        chunk = stored(_chunk_name(item), (0,), (len(blob),)) if blob else None
        results.append(WriteResult(index=item.index, size_in_bytes=len(blob), storage_data=_Bytes(chunk)))
    for item, (offsets, sizes) in zip(tensor_items, boxes, strict=True):
        s = stored(_chunk_name(item), offsets, sizes)
        results.append(WriteResult(index=item.index, size_in_bytes=s.end - s.start, storage_data=s))
    results.append(WriteResult(index=_RANK_INDEX, size_in_bytes=0,
                               storage_data=_RankFile(rank, fname, written.size, written.xxh3_128)))
    return results


def _chunk_name(item: Any) -> str:
    off = item.index.offset
    return item.index.fqn if off is None else f"{item.index.fqn}@{','.join(map(str, off))}"


def _byte_io_value(item: Any, planner: SavePlanner) -> Any:
    """A non-tensor item's value, taken from the planner's state before DCP pickles it
    (``lookup_object``, which DCP's DefaultSavePlanner has); for other planners, what
    ``resolve_data`` pickled is read back with torch's restricted unpickler (plain values and
    bytes only)."""
    fqn = item.index.fqn
    lookup = getattr(planner, "lookup_object", None)
    if callable(lookup):
        value = lookup(item.index)
    else:
        data = planner.resolve_data(item)
        try:
            data.seek(0)
            value = torch.load(data, weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any refusal means: not plain values
            raise CheckpointError(
                f"DCP item {fqn!r} is a pickled object beyond plain values ({type(exc).__name__}); "
                "safeckpt.dcp stores non-tensor items as JSON"
            ) from None
    return value


def _properties(p: TensorProperties) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if p.requires_grad:
        out["requires_grad"] = True
    if p.pin_memory:
        out["pin_memory"] = True
    fmt = {torch.channels_last: "channels_last", torch.preserve_format: "preserve_format"}.get(p.memory_format)
    if fmt is not None:
        out["memory_format"] = fmt
    if p.layout != torch.strided:
        raise CheckpointError(f"tensor layout {p.layout} cannot be stored by safeckpt.dcp (strided only)")
    return out


def _commit_save(store: Storage, staging: _Staging, metadata: Metadata, results: list[list[WriteResult]], *,
                 overwrite: bool, user: dict[str, Any], step: int | None, dot_metadata: bool = False) -> None:
    """Coordinator: check every rank's file, write DCP metadata and manifest, publish."""
    chunks: dict[str, list[_Stored]] = {}
    values: dict[str, Any] = {}
    blobs: dict[str, _Bytes] = {}
    written: list[dict[str, Any]] = []
    where: dict[MetadataIndex, tuple[str, int, int]] = {}  # DCP's index -> (file, start, length), for .metadata
    for rank, rank_results in enumerate(results):
        mine = [res.storage_data for res in rank_results if isinstance(res.storage_data, _RankFile)]
        if len(mine) != 1 or mine[0].rank != rank or mine[0].file is None:
            raise CheckpointError(f"rank {rank} returned write results safeckpt.dcp did not make")
        written.append({"file": mine[0].file, "size": mine[0].size, "xxh3_128": mine[0].xxh3_128})
        for res in rank_results:
            sd = res.storage_data
            if isinstance(sd, _Value):
                values[res.index.fqn] = sd.tree
                where[res.index] = (MANIFEST_FILE, 0, 0)
            elif isinstance(sd, _Bytes):
                blobs[res.index.fqn] = sd
                where[res.index] = (MANIFEST_FILE, 0, 0) if sd.chunk is None else (
                    sd.chunk.file, sd.chunk.start, sd.chunk.end - sd.chunk.start)
            elif isinstance(sd, _Stored):
                if sd.file != mine[0].file:
                    raise CheckpointError(f"rank {rank} reported chunks in two files ({sd.file}, {mine[0].file})")
                chunks.setdefault(res.index.fqn, []).append(sd)
                where[res.index] = (sd.file, sd.start, sd.end - sd.start)
            elif not isinstance(sd, _RankFile):
                raise CheckpointError(f"rank {rank} returned a write result safeckpt.dcp did not make")
    if len({w["file"] for w in written}) != len(written):
        raise CheckpointError("two ranks reported the same file name")
    files = _commit.check_written(store, {"path": staging.staging, "token": staging.token}, written)
    sdm = metadata.state_dict_metadata
    fqns = list(sdm)
    tensor_fqns = {f for f, m in sdm.items() if isinstance(m, TensorStorageMetadata)}
    missing = [f for f in fqns if f not in tensor_fqns and f not in values and f not in blobs]
    missing += [f for f in tensor_fqns if f not in chunks and _numel(sdm[f].size) > 0]
    if missing:
        raise CheckpointError(f"no rank wrote DCP item {missing[0]!r} ({len(missing)} missing)")
    keys, objects = build_layout(fqns, tensor_fqns | set(blobs), values, metadata.planner_data)
    tensors: dict[str, Any] = {}
    entries: dict[str, Any] = {}
    for f in fqns:
        m = sdm[f]
        if f in blobs:
            c = blobs[f].chunk
            entries[f] = {"bytes": keys[f]}
            tensors[keys[f]] = {"dtype": BYTES_DTYPE, "shape": [0 if c is None else c.sizes[0]],
                                "scope": "replicated", "chunks": [] if c is None else [
                                    {"file": c.file, "start": c.start, "end": c.end, "xxh3_64": c.xxh3_64,
                                     "offsets": [0], "sizes": list(c.sizes)}]}
            continue
        if f not in tensor_fqns:
            entries[f] = {"value": values[f]}
            continue
        entries[f] = {"tensor": keys[f], "properties": _properties(m.properties)}
        if not entries[f]["properties"]:
            del entries[f]["properties"]
        stored = {s.offsets: s for s in chunks.get(f, [])}
        recs = []
        for c in m.chunks:  # DCP's chunk order, so the Metadata comes back the same
            s = stored.pop(tuple(c.offsets), None)
            if s is None:
                if _numel(c.sizes) == 0:
                    continue
                raise CheckpointError(f"no rank wrote the chunk at {list(c.offsets)} of DCP item {f!r}")
            recs.append({"file": s.file, "start": s.start, "end": s.end, "xxh3_64": s.xxh3_64,
                         "offsets": list(s.offsets), "sizes": list(s.sizes)})
        if stored:
            raise CheckpointError(f"ranks wrote chunks of DCP item {f!r} that its metadata does not list")
        scope = "replicated" if len(recs) == 1 and recs[0]["sizes"] == list(m.size) else "sharded"
        tensors[keys[f]] = {"dtype": dtype_code(m.properties.dtype), "shape": list(m.size), "scope": scope,
                            "chunks": recs}
    meta = metadata.storage_meta
    storage_meta = None if meta is None else {
        "checkpoint_id": None if meta.checkpoint_id is None else str(meta.checkpoint_id),
        "save_id": meta.save_id, "modules": [str(x) for x in (meta.modules or [])],
    }
    doc = dcp_document(entries, metadata.planner_data, storage_meta, metadata.version)
    if store.renames:  # a file in the staging directory, published with it by the rename
        raw_doc = encode_document(doc)
        _write_new(os.path.join(staging.staging, DCP_FILE), raw_doc)
        info: dict[str, Any] = {"file": DCP_FILE, "size": len(raw_doc), "xxh3_128": xxhash.xxh3_128_hexdigest(raw_doc)}
    else:  # inside the manifest, whose PUT is the commit (see format.dcp_layout)
        info = {"inline": doc}
    info["dcp_version"] = metadata.version
    if dot_metadata:  # DCP's own Metadata, for tools that look for it; published by the same rename
        raw_dot = _stock_metadata(metadata, where)
        _write_new(os.path.join(staging.staging, DOT_METADATA), raw_dot)
    man = {**manifest_head(step=step, world_size=max(1, len(results)), metadata={**user, MANIFEST_KEY: info},
                           metrics={}, files=files, format_version=MANIFEST_FORMAT_VERSION),
           "objects": objects, "tensors": tensors}
    if dot_metadata:  # listed with its checksum like any extra file: verify checks it
        man["extra"] = {DOT_METADATA: {"size": len(raw_dot), "xxh3_128": xxhash.xxh3_128_hexdigest(raw_dot)}}
    raw = encode_manifest(man)
    parse_manifest(raw, staging.staging)  # what is published must read back: validate it first
    target = staging.path
    if store.renames and not overwrite and os.path.isdir(target) and not os.path.islink(target):
        try:
            os.rmdir(target)  # the empty directory _begin let through
        except OSError:
            raise CheckpointExists(
                f"{target} appeared while saving (another job writing the same path?); nothing was replaced."
            ) from None
    _commit.commit(store, target, {"path": staging.staging, "token": staging.token}, raw,
                   overwrite=overwrite, files=files)


MANIFEST_FILE = "manifest.json"


def _stock_metadata(metadata: Metadata, where: Mapping[MetadataIndex, tuple[str, int, int]]) -> bytes:
    """DCP's ``Metadata`` as its FileSystemWriter pickles it into ``.metadata``: the same
    state_dict_metadata, planner_data and storage_meta, and a ``storage_data`` entry for every
    item (file, offset, length) whose stream transform is :data:`STOCK_READER_POINTER`, an
    extension no FileSystemReader knows: it stops at the first item with that line, before it
    reads (or unpickles) anything of it. Values live in JSON, not in a file: their entries point
    at ``manifest.json`` with length 0."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    pointer = [STOCK_READER_POINTER + "/1"]
    storage_data = {index: _StorageInfo(relative_path=file, offset=start, length=length,
                                        transform_descriptors=pointer)
                    for index, (file, start, length) in where.items()}
    return pickle.dumps(dataclasses.replace(metadata, storage_data=storage_data))


def _write_new(path: str, data: bytes) -> None:
    """A new local file holding ``data``, fsynced (the staging directory is fsynced at publish)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def _numel(size: Any) -> int:
    n = 1
    for d in size:
        n *= int(d)
    return n


# ----------------------------------------------------------------------------- reader
class StorageReader(_OnStorage, _dcp.StorageReader):
    """DCP storage reader for checkpoints written by :class:`StorageWriter`: validates the
    manifest and DCP metadata (JSON), verifies every chunk's xxh3-64 before copying it into the
    caller's tensors (``verify_checksums=False`` skips that), and unpickles nothing.
    ``storage_options`` and ``timeout``: as for :class:`StorageWriter`."""

    def __init__(self, path: str | os.PathLike[str], *, verify_checksums: bool = True,
                 storage_options: Mapping[str, Any] | None = None, timeout: float | None = None) -> None:
        super().__init__()
        self.storage_options = dict(storage_options) if storage_options else None
        self.timeout = timeout
        self._at(path)
        self.verify_checksums = verify_checksums
        self.rank = 0
        self.is_coordinator = False
        self._error: BaseException | None = None
        self._manifest: dict[str, Any] | None = None
        self._chunks: dict[tuple[str, tuple[int, ...]], dict[str, Any]] = {}
        self._values: dict[str, Any] = {}
        self._bytes: dict[str, dict[str, Any] | None] = {}  # a bytes item's chunk (None: empty)

    @property
    def checkpoint_id(self) -> str:
        return self.path

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self._at(checkpoint_id)
        self._error = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        path = os.fspath(checkpoint_id)
        return is_remote(path) or os.path.isfile(os.path.join(path, DCP_FILE))

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        # DCP swallows an Exception raised here into "metadata is None" (AssertionError); the
        # error is kept and raised from set_up_storage_reader instead, so the caller gets it.
        self._error = None
        try:
            return self._read_metadata()
        except CheckpointError as exc:
            self._error = exc
            return Metadata(state_dict_metadata={})

    def _read_metadata(self) -> Metadata:
        try:
            man = open_manifest(self.path, self.storage())
        except CheckpointNotFound:
            if self.storage().size(join(self.path, DOT_METADATA)) is not None:
                raise CheckpointError(
                    f"{self.path} was written by DCP's own FileSystemWriter (it holds .metadata, no "
                    "manifest.json): read it with dcp.load(state, checkpoint_id=path), or import it "
                    f"once with `safeckpt convert --from dcp {self.path} NEW_PATH` and load that "
                    "through safeckpt.dcp.StorageReader") from None
            raise
        info = (man.get("metadata") or {}).get(MANIFEST_KEY)
        if not isinstance(info, dict):
            raise CheckpointError(
                f"{self.path} is a safeckpt checkpoint written by safeckpt.save, not through "
                "torch.distributed.checkpoint: load it with safeckpt.load (or read_state_dict)"
            )
        if "inline" in info:
            doc = check_dcp_document(info["inline"], f"{join(self.path, 'manifest.json')} ({MANIFEST_KEY})",
                                     self.path, man)
        else:
            doc = parse_dcp_document(self._read_dcp_file(info), join(self.path, DCP_FILE), self.path, man)
        self._manifest = man
        sdm: dict[str, Any] = {}
        self._chunks, self._values, self._bytes = {}, {}, {}
        for fqn, e in doc["entries"].items():
            if "bytes" in e:
                sdm[fqn] = BytesStorageMetadata()
                chunks = man["tensors"][e["bytes"]]["chunks"]
                self._bytes[fqn] = {**chunks[0], "dtype": BYTES_DTYPE} if chunks else None
                continue
            if "value" in e:
                sdm[fqn] = BytesStorageMetadata()
                self._values[fqn] = e["value"]
                continue
            rec = man["tensors"][e["tensor"]]
            props = e.get("properties", {})
            fmt = {"channels_last": torch.channels_last, "preserve_format": torch.preserve_format}.get(
                props.get("memory_format", ""), torch.contiguous_format)
            chunks = []
            for c in rec["chunks"]:
                chunks.append(ChunkStorageMetadata(offsets=torch.Size(c["offsets"]), sizes=torch.Size(c["sizes"])))
                self._chunks[(fqn, tuple(c["offsets"]))] = {**c, "dtype": rec["dtype"]}
            sdm[fqn] = TensorStorageMetadata(
                properties=TensorProperties(dtype=torch_dtype(rec["dtype"]), requires_grad=props.get("requires_grad", False),
                                            memory_format=fmt, pin_memory=props.get("pin_memory", False)),
                size=torch.Size(rec["shape"]), chunks=chunks,
            )
        pdata = doc.get("planner_data")
        meta = doc.get("storage_meta")
        return Metadata(
            state_dict_metadata=sdm,
            planner_data=None if pdata is None else {k: tuple(v) for k, v in pdata.items()},
            storage_data=None,
            storage_meta=None if meta is None else StorageMeta(
                checkpoint_id=meta.get("checkpoint_id"), save_id=meta.get("save_id"),
                modules=list(meta.get("modules", []))),
            version=doc.get("dcp_version"),
        )

    def _read_dcp_file(self, info: dict[str, Any]) -> bytes:
        name, size, digest = info.get("file"), info.get("size"), info.get("xxh3_128")
        if not isinstance(size, int) or not isinstance(digest, str) or not 0 <= size <= MAX_DCP_FILE:
            raise CorruptCheckpoint(f"{self.path}/manifest.json: malformed '{MANIFEST_KEY}' metadata", path=self.path)
        path = safe_file_path(self.path, name)
        if is_remote(path):  # a checkpoint written on a filesystem, copied to an object store
            got = self.storage().read(path, size + 1)
            if got is None:
                raise CorruptCheckpoint(f"{path} is missing", path=self.path)
            raw = got
        else:
            fd = open_regular(path, self.path)
            try:
                actual = os.fstat(fd).st_size
                if actual != size:
                    raise CorruptCheckpoint(f"{path} has {actual} bytes, the manifest says {size}", path=self.path)
                with os.fdopen(fd, "rb", closefd=False) as f:
                    raw = f.read(size + 1)
            finally:
                os.close(fd)
        if len(raw) != size or xxhash.xxh3_128_hexdigest(raw) != digest:
            raise CorruptCheckpoint(f"checksum mismatch in {path}: it was damaged after the checkpoint was written",
                                    path=self.path)
        return raw

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self._error is not None:
            raise self._error
        self.is_coordinator = is_coordinator
        self.rank = _rank_of(kwargs)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return dataclasses.replace(plan, storage_data=_RankInfo(self.rank, self.path))

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        _check_same_path([p.storage_data for p in plans], "dcp.load")
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if self._manifest is None:
            raise CheckpointError("safeckpt.dcp.StorageReader: read_data before read_metadata")
        work = []
        blobs = []  # (ReadItem, chunk) of the bytes items: verified with the tensors' chunks
        needed: dict[str, list[tuple[int, int]]] = {}
        for ri in plan.items:
            if ri.type == LoadItemType.BYTE_IO:
                c = self._bytes.get(ri.storage_index.fqn)
                if c is not None:
                    needed.setdefault(c["file"], []).append((c["start"], c["end"]))
                    blobs.append((ri, c))
                continue
            key = (ri.storage_index.fqn, tuple(ri.storage_index.offset or ()))
            c = self._chunks.get(key)
            if c is None:
                raise CorruptCheckpoint(f"{self.path} holds no chunk of {key[0]!r} at {list(key[1])}", path=self.path)
            needed.setdefault(c["file"], []).append((c["start"], c["end"]))
            work.append((ri, c))
        store = self.storage()
        files: dict[str, Any] = {}  # MappedFile, or RemoteFile on an object store
        try:
            for name, ranges in needed.items():
                path = safe_file_path(self.path, name)
                size = self._manifest["files"][name]["size"]
                files[name] = MappedFile(path, size) if store.renames else store.open(path, size, self.path, ranges)
            # Targets first (resolving writes nothing), then every chunk verified, then copies:
            # nothing is copied from a damaged file. Hashing and reading release the GIL, so
            # both passes run on a few threads (a cold file is read while another is hashed).
            # An object is fetched by concurrent ranged GETs already, and kept (up to a bound)
            # for the copy: one thread there (its fetched windows are not shared across threads).
            threads = _READ_THREADS if store.renames else 1
            jobs = []
            for ri, c in work:
                target = planner.resolve_tensor(ri).detach()
                if tuple(target.shape) != tuple(ri.lengths):
                    raise CheckpointError(
                        f"DCP asked for {tuple(ri.lengths)} of {ri.storage_index.fqn!r} into a tensor of "
                        f"shape {tuple(target.shape)}")
                jobs.append((ri, c, target))
            if self.verify_checksums:
                seen: dict[tuple[str, int], tuple[Any, dict[str, Any]]] = {}
                for ri, c in work + blobs:
                    if c["end"] > c["start"]:
                        seen.setdefault((c["file"], c["start"]), (ri, c))
                _threaded([functools.partial(self._verify, files[c["file"]], ri, c) for ri, c in seen.values()],
                          threads)
            _threaded([functools.partial(_copy_chunk, files[c["file"]], ri, c, target) for ri, c, target in jobs],
                      threads)
            for ri, _, target in jobs:
                planner.commit_tensor(ri, target)
            for ri in plan.items:
                if ri.type == LoadItemType.BYTE_IO:
                    fqn = ri.storage_index.fqn
                    if fqn in self._bytes:
                        c = self._bytes[fqn]
                        blob = b"" if c is None else _read_blob(files[c["file"]], c)
                        self._deliver(ri, planner, blob)
                    else:
                        self._load_value(ri, planner)
        finally:
            for f in files.values():
                f.close()
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _verify(self, f: Any, ri: Any, c: dict[str, Any]) -> None:
        """Hash chunk ``c`` in place (a local file through a read-only mapping: the bytes reach
        the page cache once, for the copy that follows; an object's fetched bytes are kept for
        the copy) and compare with its recorded xxh3-64."""
        hashed = (f.hash_range_local if isinstance(f, MappedFile) else f.hash_range)(c["start"], c["end"], 64 << 20)
        if hashed != c["xxh3_64"]:
            raise CorruptCheckpoint(
                f"checksum mismatch in {join(self.path, c['file'])} bytes "
                f"{c['start']}-{c['end']} ({ri.storage_index.fqn!r}): the data is corrupt. "
                "Load an older checkpoint.", path=self.path)

    def _load_value(self, ri: Any, planner: LoadPlanner) -> None:
        fqn = ri.storage_index.fqn
        if fqn not in self._values:
            raise CorruptCheckpoint(f"{self.path} holds no value {fqn!r}", path=self.path)
        self._deliver(ri, planner, decode(self._values[fqn], _no_tensor))

    def _deliver(self, ri: Any, planner: LoadPlanner, value: Any) -> None:
        """Hand a non-tensor item's value (from JSON, or a bytes item's bytes) to the planner."""
        if isinstance(planner, DefaultLoadPlanner) and type(planner).load_bytes is DefaultLoadPlanner.load_bytes:
            # What DefaultLoadPlanner.load_bytes does after its torch.load, without the pickle.
            from torch.distributed.checkpoint._traverse import set_element

            if planner.flatten_state_dict:
                set_element(planner.original_state_dict, planner.mappings[ri.dest_index.fqn], value)
            else:
                planner.state_dict[ri.dest_index.fqn] = value
            return
        # A planner with its own load_bytes reads DCP's wire format: a torch.save of the value,
        # made here in memory from the validated JSON (nothing from disk is unpickled).
        buf = io.BytesIO()
        torch.save(value, buf)
        buf.seek(0)
        planner.load_bytes(ri, buf)


def _read_blob(f: Any, c: dict[str, Any]) -> bytes:
    """A bytes item's bytes (its chunk already checked)."""
    n = c["end"] - c["start"]
    return f.tensor(c["start"], c["end"], torch.uint8, [n], None).numpy().tobytes()


def _copy_chunk(f: Any, ri: Any, c: dict[str, Any], target: torch.Tensor) -> None:
    """Copy what ``ri`` asks of chunk ``c`` into ``target`` (already checked)."""
    dtype = torch_dtype(c["dtype"])
    if (isinstance(f, MappedFile) and not any(ri.storage_offsets) and list(ri.lengths) == list(c["sizes"]) and target.is_cpu
            and target.dtype == dtype and target.is_contiguous() and target.nbytes == c["end"] - c["start"] > 0):
        f.read_into(c["start"], _bytes_of(target))  # the whole chunk into a plain CPU tensor: preadv
        return
    src = f.tensor(c["start"], c["end"], dtype, c["sizes"], None)
    for dim, (off, n) in enumerate(zip(ri.storage_offsets, ri.lengths, strict=True)):
        src = src.narrow(dim, off, n)
    target.copy_(src)


_READ_THREADS = max(1, min(4, os.cpu_count() or 1))


def _threaded(tasks: list[Callable[[], None]], threads: int = _READ_THREADS) -> None:
    """Run I/O tasks (reads and hashes release the GIL) on a few threads; the first error wins."""
    if len(tasks) < 2 or threads < 2:
        for task in tasks:
            task()
        return
    with ThreadPoolExecutor(min(threads, len(tasks)), thread_name_prefix="safeckpt-dcp-read") as pool:
        for future in [pool.submit(task) for task in tasks]:
            future.result()


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor as a writable buffer (the caller keeps ``t`` alive)."""
    return memoryview((ctypes.c_char * t.nbytes).from_address(t.data_ptr())).cast("B")


def _no_tensor(key: str) -> torch.Tensor:
    raise CorruptCheckpoint(f"a DCP value refers to tensor {key!r}")


# ----------------------------------------------------------------------------- errors
def safeckpt_error(exc: BaseException) -> BaseException | None:
    """The safeckpt error behind DCP's ``CheckpointException`` ``exc``: the error itself when
    every failing rank raised the same kind of portable error (RankMismatch, CorruptCheckpoint,
    ...), else a :class:`~safeckpt.RankFailure` naming each rank's error; None when ``exc`` is
    not a CheckpointException."""
    failures = getattr(exc, "failures", None)
    if type(exc).__name__ != "CheckpointException" or not isinstance(failures, dict):
        return None
    errors = {r: (f[0] if isinstance(f, tuple) else f) for r, f in failures.items()}
    kinds = {type(e) for e in errors.values()}
    if len(kinds) == 1:
        first = next(iter(errors.values()))
        if isinstance(first, PORTABLE_ERRORS):
            return first
    return RankFailure(
        "torch.distributed.checkpoint failed on rank(s) "
        + ", ".join(map(str, sorted(errors))) + ": "
        + "; ".join(f"rank {r}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                    for r, e in sorted(errors.items())),
        failures={r: f"{type(e).__name__}: {e}" for r, e in errors.items()},
    )


@contextlib.contextmanager
def translate_errors() -> Iterator[None]:
    """Within the block, DCP's ``CheckpointException`` becomes the safeckpt error behind it
    (e.g. :class:`~safeckpt.RankMismatch` on every rank for ranks given different paths)::

        with safeckpt.dcp.translate_errors():
            dcp.save(state, storage_writer=safeckpt.dcp.StorageWriter(path))
    """
    try:
        yield
    except BaseException as exc:
        err = safeckpt_error(exc)
        if err is None:
            raise
        raise err from exc
