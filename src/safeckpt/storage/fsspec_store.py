"""Object stores through fsspec (any URL other than ``file://``): no renames, no mmap.

Layout: the same as a local checkpoint, as objects under a prefix, except that data files carry
a per-save token, so a save never overwrites an object another checkpoint refers to::

    s3://bucket/run/step-0000000040/manifest.json
    s3://bucket/run/step-0000000040/rank-00000.3f9c0a1b2c4d.safetensors

Publication: every rank writes its object straight to its final, token-named key; the
coordinator PUTs ``manifest.json`` last, and that PUT is the commit point (conditional,
``pipe_file(mode="create")``, when nothing may be replaced). See ``safeckpt.storage.commit``.

Every call is bounded: on async filesystems (s3fs, gcsfs, adlfs) it is cancelled after
``io_timeout`` seconds (a share of the collective timeout), so a hung endpoint becomes an error
on the rank that waits on it before its peers give up. The filesystem's errors (botocore,
aiohttp, permission, credentials) become :class:`~safeckpt.storage.base.StorageError` with a line
saying what to check; a missing bucket is CheckpointNotFound, never an empty root.

fsspec is imported on first use only; it is the ``remote`` extra.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ..errors import CheckpointError, CheckpointNotFound
from ..format.manifest import MANIFEST, max_manifest_bytes, parse_manifest
from ..format.shardfile import WrittenFile, stream_safetensors
from .base import Item, Storage, StorageError
from .digest import FileDigest
from .ranged import RemoteFile, stream_hash

INSTALL_HINT = (
    "pip install 'safeckpt[remote]' (fsspec), plus the package for your storage "
    "(s3fs for s3://, gcsfs for gs://, adlfs for az://)"
)
_CREDENTIALS = {
    "s3": "pass storage_options={'key': ..., 'secret': ...} (or 'profile': ...), or set "
          "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE",
    "gs": "pass storage_options={'token': 'path/to/key.json'}, or set GOOGLE_APPLICATION_CREDENTIALS",
    "az": "pass storage_options={'account_name': ..., 'account_key': ...} (or a sas_token), or "
          "set AZURE_STORAGE_CONNECTION_STRING",
}
_CREDENTIALS.update({"s3a": _CREDENTIALS["s3"], "gcs": _CREDENTIALS["gs"], "abfs": _CREDENTIALS["az"]})
DELETE_THREADS = 8  # deletes at once by delete_many where the store has no bulk delete
_UNREACHABLE = ("EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ClientConnectorError",
                "ServerDisconnectedError", "ClientOSError", "ConnectionClosedError", "ProxyConnectionError")


def token_name(rank: int, token: str) -> str:
    return f"rank-{rank:05d}.{token}.safetensors"


class FsspecStorage(Storage):
    """An object store reached through an fsspec filesystem (see the module docstring)."""

    renames = False
    lease_settle = 0.2

    def __init__(self, fs: Any, scheme: str, timeout: float | None = None) -> None:
        super().__init__(timeout)
        self.fs = fs
        self.scheme = scheme

    @classmethod
    def from_url(cls, url: str, options: dict[str, Any], timeout: float | None) -> FsspecStorage:
        try:
            import fsspec
        except ImportError:
            raise CheckpointError(f"{url} is a remote URL, which needs fsspec: {INSTALL_HINT}") from None
        try:
            fs, _ = fsspec.core.url_to_fs(url, **options)
        except ImportError as exc:
            raise CheckpointError(
                f"cannot open {url}: the filesystem package for this scheme is missing ({exc}); {INSTALL_HINT}"
            ) from None
        except (ValueError, TypeError) as exc:
            raise CheckpointError(f"cannot open {url}: {exc} (check the storage options)") from None
        return cls(fs, url.partition("://")[0], timeout)

    # ------------------------------------------------------------------ calls
    def _path(self, url: str) -> str:
        return self.fs._strip_protocol(url)

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """``fs.<name>(...)``, cancelled after ``io_timeout`` on async filesystems."""
        fs = self.fs
        if getattr(fs, "async_impl", False) and hasattr(fs, f"_{name}"):
            from fsspec.asyn import sync

            return sync(fs.loop, getattr(fs, f"_{name}"), *args, timeout=self.io_timeout, **kwargs)
        return getattr(fs, name)(*args, **kwargs)

    @contextlib.contextmanager
    def _errors(self, url: str, doing: str) -> Iterator[None]:
        """Translate the filesystem's errors into safeckpt's (FileNotFoundError and
        FileExistsError pass: callers give them their meaning)."""
        try:
            yield
        except (CheckpointError, FileNotFoundError, FileExistsError):
            raise
        except Exception as exc:  # noqa: BLE001 - translated
            if not _from_storage(exc):
                raise
            raise self.translate(exc, url, doing) from exc

    def translate(self, exc: BaseException, url: str, doing: str) -> CheckpointError:
        """The StorageError for ``exc`` raised while ``doing`` something with ``url``."""
        kind = type(exc).__name__
        text = " ".join(str(exc).split())[:300]
        if isinstance(exc, (asyncio.TimeoutError, TimeoutError)) or kind == "FSTimeoutError":
            return StorageError(
                f"{doing} {url}: no answer from the storage within {self.io_timeout:g}s (hung or "
                "unreachable endpoint); check the endpoint and the network. The timeout is "
                "safeckpt's `timeout` (or $SAFECKPT_TIMEOUT)."
            )
        if "credential" in kind.lower() or "credentials" in text.lower():
            hint = _CREDENTIALS.get(self.scheme, "pass the credentials in storage_options")
            return StorageError(f"{doing} {url}: no credentials found for this storage ({kind}); {hint}.")
        if isinstance(exc, PermissionError):
            hint = _CREDENTIALS.get(self.scheme, "check the credentials in storage_options")
            return StorageError(
                f"{doing} {url}: access denied ({text or kind}); check that the credentials are right "
                f"and may use this bucket ({hint})."
            )
        if kind in _UNREACHABLE or isinstance(exc, ConnectionError):
            return StorageError(
                f"{doing} {url}: cannot reach the storage endpoint ({kind}: {text}); check the "
                "endpoint (storage_options, e.g. {'endpoint_url': ...} for an S3-compatible "
                "store) and the network."
            )
        return StorageError(f"{doing} {url}: the storage failed ({kind}: {text}).")

    def _missing_bucket(self, url: str) -> CheckpointNotFound | None:
        """CheckpointNotFound if ``url``'s bucket does not exist (stores with buckets only)."""
        split = getattr(self.fs, "split_path", None)
        if split is None:
            return None
        with self._errors(url, "checking the bucket of"):
            bucket = split(self._path(url))[0]
            if not bucket:
                return None
            try:
                self._call("info", bucket)
                return None
            except FileNotFoundError:
                pass
        return CheckpointNotFound(
            f"the bucket {bucket!r} of {url} does not exist: check the URL and the endpoint "
            "(storage_options), or create the bucket first", path=url,
        )

    # ------------------------------------------------------------------ names
    def join(self, parent: str, name: str) -> str:
        return f"{parent}/{name}"

    # ------------------------------------------------------------------ list and read
    def list(self, path: str) -> list[Item] | None:
        p = self._path(path).rstrip("/")
        with self._errors(path, "listing"):
            self.fs.invalidate_cache(p)
            try:
                found = self._call("ls", p, detail=True)
            except (FileNotFoundError, NotADirectoryError):
                missing = self._missing_bucket(path)
                if missing is not None:
                    raise missing from None
                return None
        out = []
        for info in found:
            full = str(info["name"]).rstrip("/")
            name = full.rsplit("/", 1)[-1]
            if not name or full == p:
                continue
            kind = "dir" if info.get("type") == "directory" else "file"
            out.append(Item(name, kind, int(info.get("size") or 0)))
        return out or None

    def size(self, path: str) -> int | None:
        p = self._path(path)
        with self._errors(path, "looking up"):
            self.fs.invalidate_cache(p)
            try:
                info = self._call("info", p)
            except FileNotFoundError:
                return None
        return None if info.get("type") == "directory" else int(info["size"])

    def read(self, path: str, limit: int) -> bytes | None:
        with self._errors(path, "reading"):
            try:
                return self._call("cat_file", self._path(path), start=0, end=limit)
            except FileNotFoundError:
                return None

    def read_manifest(self, ckpt: str) -> dict[str, Any]:
        raw = self.read(self.join(ckpt, MANIFEST), max_manifest_bytes() + 1)
        if raw is None:
            missing = self._missing_bucket(ckpt)
            if missing is not None:
                raise missing
            raise CheckpointNotFound(
                f"no committed checkpoint at {ckpt} (no {MANIFEST}; an interrupted save never "
                "writes one). Use `safeckpt ls` on its parent to see what is there.", path=ckpt,
            )
        return parse_manifest(raw, ckpt)

    def open(self, path: str, size: int, ckpt: str, likely: Sequence[tuple[int, int]] = ()) -> RemoteFile:
        return RemoteFile(self, path, size, ckpt, likely)

    def fetch(self, path: str, starts: list[int], ends: list[int]) -> list[bytes]:
        """Bytes [starts[i], ends[i]) of one object, the ranges fetched concurrently."""
        p = self._path(path)
        with self._errors(path, "reading"):
            if len(starts) == 1:
                return [self._call("cat_file", p, start=starts[0], end=ends[0])]
            return self._call("cat_ranges", [p] * len(starts), starts, ends, on_error="raise")

    def hash(self, path: str, progress: Callable[[int], None] | None = None,
             spans: Sequence[tuple[int, int]] = ()) -> FileDigest:
        size = self.size(path)
        if size is None:
            raise FileNotFoundError(path)
        return stream_hash(self, path, size, progress, spans=spans)

    # ------------------------------------------------------------------ write
    def write(self, path: str, items: Sequence[tuple[str, Any]], metadata: dict[str, str], index: Any = None) -> WrittenFile:
        """One streamed upload (the filesystem's buffered file); abandoned on any error."""
        with self._errors(path, "uploading"):
            f = self.fs.open(self._path(path), "wb")
            try:
                written = stream_safetensors(items, metadata, f.write, index=index)
            except BaseException:
                _abandon(f)
                raise
            f.close()  # completes the upload; raises if it failed
        return written

    def put(self, path: str, data: bytes, *, exclusive: bool = False) -> None:
        """One PUT of ``data``. ``exclusive``: FileExistsError if the object exists, atomically
        where the filesystem has conditional writes (fsspec ``mode="create"``), else by a check
        just before the write."""
        p = self._path(path)
        with self._errors(path, "writing"):
            if exclusive and self.conditional_writes(path):
                self._create(path, data)
            else:
                if exclusive and self.size(path) is not None:
                    raise FileExistsError(path)
                self._call("pipe_file", p, data)
            self.fs.invalidate_cache(p)

    def conditional_writes(self, path: str) -> bool:
        """Whether an exclusive write to ``path`` is one atomic conditional PUT."""
        return _can_create(self.fs)

    def _create(self, path: str, data: bytes) -> None:
        """One conditional PUT (``pipe_file(mode="create")``); FileExistsError if the object
        exists, whether the filesystem says so or only answers 412 Precondition Failed."""
        p = self._path(path)
        try:
            self._call("pipe_file", p, data, mode="create")
        except FileExistsError:
            raise
        except OSError as exc:
            if _precondition_failed(exc):
                raise FileExistsError(path) from exc
            raise
        finally:
            self.fs.invalidate_cache(p)

    # ------------------------------------------------------------------ delete
    def delete(self, path: str) -> None:
        p = self._path(path)
        with self._errors(path, "deleting"):
            try:
                self._call("rm_file", p)
            except FileNotFoundError:
                pass
            self.fs.invalidate_cache(p)

    def delete_many(self, paths: Sequence[str]) -> None:
        """Delete objects (absent is fine), ``DELETE_THREADS`` at a time; the first error is
        raised once every delete has ended."""
        paths = list(paths)
        if len(paths) <= 1:
            for path in paths:
                self.delete(path)
            return
        with concurrent.futures.ThreadPoolExecutor(min(DELETE_THREADS, len(paths))) as pool:
            futures = [pool.submit(self.delete, path) for path in paths]
        for fut in futures:
            fut.result()

    def delete_tree(self, path: str) -> None:
        """The manifest first (the prefix stops being a checkpoint at once), then the rest."""
        items = self.list(path) or []
        names = [i.name for i in items if i.kind == "file"]
        if MANIFEST in names:
            self.delete(self.join(path, MANIFEST))
        self.delete_many([self.join(path, n) for n in sorted(names) if n != MANIFEST])

    # ------------------------------------------------------------------ publish
    def stage(self, final: str, token: str) -> str:
        return final  # objects go straight to their final, token-named keys

    def data_name(self, rank: int, token: str) -> str:
        return token_name(rank, token)

    def sees(self, staging: str) -> bool:
        return True  # nothing was created; the commit checks that every object arrived

    def publish(self, staging: str, final: str, manifest: bytes, *, replace: bool) -> None:
        self.put(self.join(final, MANIFEST), manifest, exclusive=not replace)

    # ------------------------------------------------------------------ lease primitives
    def create(self, path: str, data: bytes) -> None:
        self.put(path, data, exclusive=True)

    def touch(self, path: str, data: bytes) -> None:
        self.put(path, data)  # objects have no utime: the record carries the heartbeat time

    def age(self, path: str, record: dict[str, Any]) -> float:
        return time.time() - float(record.get("beat", record.get("started", 0.0)))

    def take_over(self, path: str) -> None:
        self.delete(path)


def _from_storage(exc: BaseException) -> bool:
    """An error of the storage (OS, network, the storage client), not of our own code."""
    if isinstance(exc, OSError):  # also ConnectionError, PermissionError, TimeoutError
        return True
    return (type(exc).__module__ or "").split(".", 1)[0] not in ("builtins", "safeckpt", "torch", "numpy")


def _can_create(fs: Any) -> bool:
    """Whether ``fs.pipe_file`` takes ``mode="create"`` (fsspec >= 2025.2; atomic on backends
    with conditional writes, such as recent s3fs and gcsfs)."""
    try:
        return "mode" in inspect.signature(fs.pipe_file).parameters
    except (TypeError, ValueError):
        return False


def _precondition_failed(exc: BaseException) -> bool:
    """An answer 412 Precondition Failed (or S3's 409 ConditionalRequestConflict: another
    conditional write of the key is in flight) to a conditional write. s3fs makes it
    FileExistsError only when the error names its condition, which AWS does and SeaweedFS
    does not."""
    for e in (exc, exc.__cause__, exc.__context__):
        response = getattr(e, "response", None)
        if isinstance(response, dict):
            code = (response.get("Error") or {}).get("Code")
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            return code in ("PreconditionFailed", "ConditionalRequestConflict") or status == 412
    return False


def _abandon(f: Any) -> None:
    """Drop an unfinished upload without completing it (best effort; leftovers are swept)."""
    try:
        f.discard()  # s3fs: aborts the multipart upload
    except Exception:  # noqa: BLE001
        pass
    try:
        from fsspec.spec import AbstractBufferedFile

        if isinstance(f, AbstractBufferedFile):
            f.closed = True  # close() would upload what is buffered
            return
    except ImportError:  # pragma: no cover
        pass
    try:
        f.close()
    except Exception:  # noqa: BLE001
        pass
