"""Where checkpoint bytes live: the one storage interface, and which backend serves a path.

Everything that touches storage (save, load, the catalog, the writer lease, the CLI) goes
through :class:`Storage`; nothing else knows whether a path is a local directory or an object
store. Backends, each one module:

- ``safeckpt.storage.posix.PosixStorage``  local and shared filesystems (and ``file://`` URLs): files
  written into a hidden staging directory, fsynced, published by one ``renameat2``; mmap reads.
- ``safeckpt.storage.fsspec_store.FsspecStorage``  any other fsspec URL: objects written in place under
  per-save names, ``manifest.json`` written last as the commit point, ranged reads; every call
  bounded by the timeout, and the filesystem's errors turned into :class:`StorageError`.
- ``safeckpt.storage.s3.S3Storage``  ``s3://``: the fsspec backend plus parallel multipart uploads and
  the listing and aborting of multipart uploads that killed writers left behind.

A new backend is one module with a :class:`Storage` subclass, registered for its URL scheme
with :func:`register_backend`. This module imports neither torch nor any backend (they load on
first use), so a local path never imports fsspec.

Storage options (fsspec's keyword arguments: endpoint, credentials, ...) are passed explicitly by
every public call; the CLI sets them once for the whole command with :func:`default_options`.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import importlib
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from .._settings import resolve_timeout
from ..errors import StorageError, StorageUnavailable  # noqa: F401 - defined in errors, exported here
from ..format.locations import LOCAL_SCHEME, is_remote
from .digest import FileDigest

IO_SHARE = 0.75  # one storage call may take this share of the timeout, so a rank stuck in I/O
# reports its error before its peers give up waiting for it (they wait the full timeout)


@dataclass(frozen=True)
class Item:
    """One entry of a listing: ``kind`` is ``"dir"`` (a directory or prefix), ``"file"``, or
    ``"gone"`` (listed, but vanished before it could be looked at)."""

    name: str
    kind: str
    size: int = 0


@dataclass(frozen=True)
class Upload:
    """An unfinished upload (an S3 multipart upload) that holds data but is no object yet."""

    path: str  # the object it would create
    upload_id: str
    nbytes: int = 0


class Storage(ABC):
    """Move bytes to and from one kind of storage; nothing about torch, ranks or checkpoints
    beyond what publication needs. Paths are the resolved strings of :func:`resolve`.

    Call sequence of one save (see ``safeckpt.storage.commit``): ``stage`` (coordinator) -> ``sees``
    (all ranks, shared-storage probe) -> ``write`` (all ranks) -> ``size`` (coordinator) ->
    ``publish`` (coordinator) -> on failure ``delete``/``delete_tree``/``abort`` (coordinator).
    """

    #: True: a save's files go to a hidden staging directory published by an atomic rename.
    #: False: objects are written in place under per-save (token) names and the manifest,
    #: written last, is the commit point.
    renames: ClassVar[bool] = True
    #: seconds to wait after creating the lease record before reading it back (stores without
    #: an atomic create-if-absent can let two writers both believe they created it)
    lease_settle: ClassVar[float] = 0.0

    def __init__(self, timeout: float | None = None) -> None:
        self.timeout = resolve_timeout(timeout)

    @property
    def io_timeout(self) -> float:
        """Seconds one storage call may take before it fails with StorageError."""
        return self.timeout * IO_SHARE

    def bounded(self, seconds: float) -> Storage:
        """This storage with every call bounded by ``seconds`` at most (for cleanups that must
        not keep an error waiting when the store is what failed)."""
        quick = copy.copy(self)
        quick.timeout = min(self.timeout, seconds / IO_SHARE)
        return quick

    # ------------------------------------------------------------------ names
    @abstractmethod
    def join(self, parent: str, name: str) -> str:
        """``parent/name``."""

    # ------------------------------------------------------------------ list and read
    @abstractmethod
    def list(self, path: str) -> list[Item] | None:
        """What is directly under ``path`` (never a cached answer); None when nothing is there."""

    @abstractmethod
    def size(self, path: str) -> int | None:
        """Size of the file or object at ``path``; None when there is none."""

    @abstractmethod
    def read(self, path: str, limit: int) -> bytes | None:
        """The whole (small) file at ``path``, at most ``limit`` bytes of it; None if absent."""

    @abstractmethod
    def read_manifest(self, ckpt: str) -> dict[str, Any]:
        """The validated manifest of the checkpoint at ``ckpt`` (read through
        ``safeckpt.format.manifest.parse_manifest``); CheckpointNotFound when it has none."""

    @abstractmethod
    def open(self, path: str, size: int, ckpt: str, likely: Sequence[tuple[int, int]] = ()) -> Any:
        """A data file for ranged reads (``read``, ``tensor``, hashing), checked to have ``size``
        bytes; CorruptCheckpoint if it is missing or of another size. ``likely``: byte ranges
        the reader will probably need (a hint for stores where requests are costly)."""

    @abstractmethod
    def hash(self, path: str, progress: Callable[[int], None] | None = None,
             spans: Sequence[tuple[int, int]] = ()) -> FileDigest:
        """(size, xxh3-128, [xxh3-64 of each of ``spans``]) of the file at ``path``, all from
        one streamed read (see ``safeckpt.storage.digest``): a deep verify checks the file and
        every chunk in it without reading (on an object store, downloading) the bytes twice.
        ``progress(n)`` is told about every n bytes read."""

    # ------------------------------------------------------------------ write
    @abstractmethod
    def write(self, path: str, items: Sequence[tuple[str, Any]], metadata: dict[str, str], index: Any = None) -> Any:
        """Stream ``items`` as one new safetensors file at ``path`` (hashed while written) and
        return its ``WrittenFile``. Durable once it returns; on failure nothing is completed."""

    @abstractmethod
    def put(self, path: str, data: bytes, *, exclusive: bool = False) -> None:
        """Write a small file atomically (whole or not at all). ``exclusive``: FileExistsError
        if something is already there."""

    # ------------------------------------------------------------------ delete
    @abstractmethod
    def delete(self, path: str) -> None:
        """Delete one file or object (absent is fine)."""

    def delete_many(self, paths: Sequence[str]) -> None:
        """Delete files or objects (absent is fine). Backends with a bulk or concurrent delete
        override it (S3's DeleteObjects); by default one after another."""
        for path in paths:
            self.delete(path)

    @abstractmethod
    def delete_tree(self, path: str) -> None:
        """Delete a directory or prefix and everything in it, so that it never looks committed
        half-way (absent is fine)."""

    # ------------------------------------------------------------------ publish
    @abstractmethod
    def stage(self, final: str, token: str) -> str:
        """Prepare the place where the files of one save of ``final`` go before it is
        published, and return it: a fresh hidden directory, or ``final`` itself."""

    @abstractmethod
    def data_name(self, rank: int, token: str) -> str:
        """Name of ``rank``'s data file in a save with this ``token``."""

    @abstractmethod
    def sees(self, staging: str) -> bool:
        """Whether this process sees the place ``stage`` prepared (on another rank)."""

    @abstractmethod
    def publish(self, staging: str, final: str, manifest: bytes, *, replace: bool) -> None:
        """Write ``manifest`` and make the save visible at ``final`` in one atomic step.
        Without ``replace``, FileExistsError if a checkpoint appeared at ``final`` meanwhile."""

    def put_back(self, final: str) -> bool:
        """Undo a replace of ``final`` (``publish(..., replace=True)``) that was killed half-way,
        if it can leave it so: nothing at ``final`` and the replaced checkpoint still set aside
        (a filesystem without an atomic swap) -> rename it back, True. Only the writer of the
        root calls this (never a reader: a live replace may be half-way)."""
        return False

    # ------------------------------------------------------------------ unfinished uploads
    def uploads(self, prefix: str) -> list[Upload]:
        """Unfinished uploads of objects under ``prefix`` (killed writers leave them behind)."""
        return []

    def abort(self, upload: Upload) -> None:
        """Drop an unfinished upload and its data."""
        raise NotImplementedError(f"{type(self).__name__} has no unfinished uploads")

    # ------------------------------------------------------------------ lease primitives
    @abstractmethod
    def create(self, path: str, data: bytes) -> None:
        """Create a small file only if absent (FileExistsError otherwise)."""

    @abstractmethod
    def touch(self, path: str, data: bytes) -> None:
        """Heartbeat of a lease record: mark it as fresh (``data`` is its new content where the
        storage keeps no modification time of its own)."""

    @abstractmethod
    def age(self, path: str, record: dict[str, Any]) -> float:
        """Seconds since the lease record at ``path`` (parsed: ``record``) was last touched."""

    @abstractmethod
    def take_over(self, path: str) -> None:
        """Remove a stale lease record so that only one contender can create the next one."""


# --------------------------------------------------------------------------- paths


def resolve(path: str | os.PathLike[str]) -> str:
    """The canonical form of a checkpoint path: an absolute local path, or the URL without a
    trailing slash. Every rank computes the same string from the same argument."""
    p = os.fspath(path)
    if not isinstance(p, str):
        p = os.fsdecode(p)
    if is_remote(p):
        scheme, _, rest = p.partition("://")
        rest = rest.rstrip("/")
        if not rest:
            raise ValueError(f"{p!r} names no bucket or prefix")
        return f"{scheme}://{rest}"
    return os.path.abspath(p.removeprefix(LOCAL_SCHEME))


def join(parent: str, name: str) -> str:
    """``parent/name`` for a resolved local path or URL."""
    return f"{parent}/{name}" if is_remote(parent) else os.path.join(parent, name)


def basename(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1] if is_remote(path) else os.path.basename(os.path.normpath(path))


# --------------------------------------------------------------------------- backends

_BACKENDS: dict[str, str] = {
    "file": "safeckpt.storage.posix:PosixStorage",
    "s3": "safeckpt.storage.s3:S3Storage",
    "s3a": "safeckpt.storage.s3:S3Storage",
    "*": "safeckpt.storage.fsspec_store:FsspecStorage",
}
_DEFAULT_OPTIONS: contextvars.ContextVar[Mapping[str, Any] | None] = contextvars.ContextVar(
    "safeckpt_storage_options", default=None
)


def register_backend(scheme: str, target: str) -> None:
    """Serve ``scheme://`` URLs with the Storage class named ``"package.module:Class"`` (its
    ``from_url(url, options, timeout)`` builds an instance); ``"*"`` is the fallback."""
    _BACKENDS[scheme] = target


def _backend(scheme: str) -> Any:
    module, _, name = _BACKENDS.get(scheme, _BACKENDS["*"]).partition(":")
    return getattr(importlib.import_module(module), name)


@contextlib.contextmanager
def default_options(options: Mapping[str, Any] | None) -> Iterator[None]:
    """Storage options used by calls that pass none (the CLI's ``--storage-option``)."""
    token = _DEFAULT_OPTIONS.set(dict(options) if options else None)
    try:
        yield
    finally:
        _DEFAULT_OPTIONS.reset(token)


def storage_for(
    path: str | os.PathLike[str], options: Mapping[str, Any] | None = None, *, timeout: float | None = None
) -> Storage:
    """The storage that serves ``path``. ``options`` are the fsspec filesystem's keyword
    arguments (ignored for local paths); ``timeout`` bounds each storage call (a share of it)."""
    p = resolve(path)
    if not is_remote(p):
        return _backend("file")(timeout)
    if options is None:
        options = _DEFAULT_OPTIONS.get()
    if options is not None and not isinstance(options, Mapping):
        raise TypeError(f"storage_options must be a dict of fsspec options, got {type(options).__name__}")
    return _backend(p.partition("://")[0]).from_url(p, dict(options or {}), timeout)


def parse_options(pairs: Sequence[str]) -> dict[str, Any]:
    """``KEY=VALUE`` strings (the CLI's ``--storage-option``) as storage options. VALUE is JSON
    when it parses as JSON (``true``, ``3``, ``{"a": 1}``), else a string; a dotted KEY nests
    (``client_kwargs.region_name=eu-west-1``). ValueError says what is wrong."""
    import json

    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip() or any(not k for k in key.strip().split(".")):
            raise ValueError(f"--storage-option takes KEY=VALUE (e.g. endpoint_url=http://127.0.0.1:9000), got {pair!r}")
        try:
            value: Any = json.loads(raw)
        except ValueError:
            value = raw
        *parents, last = key.strip().split(".")
        node = out
        for k in parents:
            child = node.setdefault(k, {})
            if not isinstance(child, dict):
                raise ValueError(f"--storage-option {pair!r}: {k} was given a value and sub-keys")
            node = child
        node[last] = value
    return out
