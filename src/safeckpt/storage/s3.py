"""``s3://`` (and S3-compatible stores such as MinIO or Ceph): the fsspec backend plus what S3
does differently from a generic object store.

- **Parallel multipart uploads.** A rank's data file is uploaded in parts of ``PART`` bytes
  (more for very large files: S3 allows 10 000 parts), up to ``MAX_IN_FLIGHT`` of them at
  once, while the next part is filled (s3fs' own buffered file sends one part at a time).
  A file smaller than two parts is one PUT, as ``pipe_file`` does. The part size comes from
  the file's real size, read from its safetensors header (the first bytes written): the
  header and the chunk index of a file of many tiny tensors can be most of it, and a part
  sized from the tensors' bytes alone was under S3's 5 MiB minimum. Every request is bounded
  by the I/O timeout. On any error the multipart upload is aborted, so no parts are left behind.
- **Conditional writes.** The first exclusive write to an endpoint (the writer lease, or the
  manifest of a save without ``overwrite``) is sent twice: a server that accepts the second
  ignores ``If-None-Match`` (``rclone serve s3``, old MinIO). It is then told once, with a
  warning, and exclusive writes fall back to an existence check just before the PUT.
- **Bulk deletes.** ``delete_many`` removes up to 1,000 objects per ``DeleteObjects``
  request, a few requests at once (retention and the sweep delete whole checkpoints).
- **Unfinished uploads.** A writer killed mid-upload leaves a multipart upload that is no
  object (``ls`` does not show it) but whose parts are stored and billed until aborted.
  :meth:`S3Storage.uploads` lists them under a prefix and :meth:`S3Storage.abort` drops them;
  the catalog reports those of safeckpt's data files as leftovers, so the manager's sweep and
  ``safeckpt gc`` abort them.

s3fs is used for its configured client (credentials, endpoint, retries); nothing here
imports botocore directly.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import warnings
from collections.abc import Sequence
from typing import Any

from ..errors import SafeckptWarning
from ..format.shardfile import WrittenFile, stream_safetensors
from .base import StorageError, Upload
from .fsspec_store import FsspecStorage, _can_create

PART = 50 << 20  # bytes per part, as s3fs' pipe_file (S3's minimum is 5 MiB but for the last);
# a file smaller than two parts is one PUT (as pipe_file does)
MAX_PARTS = 9000  # below S3's limit of 10 000 parts per upload
MIN_PART = 5 << 20  # S3's minimum size of every part but the last
MAX_IN_FLIGHT = 8  # parts uploading at once per file (memory: this many parts per rank)
ABORT_WAIT = 2.0  # seconds an abort after a failed upload may take (else the sweep does it)
DELETE_BATCH = 1000  # keys per DeleteObjects request (S3's limit)
DELETES_IN_FLIGHT = 4  # DeleteObjects requests at once

# (endpoint, bucket) -> whether the server honours If-None-Match (learnt at the first exclusive
# write in this process; see S3Storage.put)
_CONDITIONAL: dict[tuple[Any, str], bool] = {}
_CONDITIONAL_LOCK = threading.Lock()


class S3Storage(FsspecStorage):
    """An S3 (or S3-compatible) bucket through s3fs."""

    def _s3(self, method: str, *, bound: float | None = None, **kwargs: Any) -> concurrent.futures.Future:
        """Start one S3 request on s3fs' event loop, bounded by the I/O timeout (or ``bound``)."""
        coro = asyncio.wait_for(self.fs._call_s3(method, **kwargs), bound or self.io_timeout)
        return asyncio.run_coroutine_threadsafe(coro, self.fs.loop)

    def _s3_now(self, url: str, doing: str, method: str, **kwargs: Any) -> Any:
        with self._errors(url, doing):
            return self._s3(method, **kwargs).result()

    def write(self, path: str, items: Sequence[tuple[str, Any]], metadata: dict[str, str], index: Any = None) -> WrittenFile:
        # The part size is set at the first write, from the file's real size (its header says).
        upload = MultipartWriter(self, path, part=None)
        try:
            written = stream_safetensors(items, metadata, upload.write, index=index)
            upload.finish()
        except BaseException:
            upload.abort()
            raise
        self.fs.invalidate_cache(self._path(path))
        return written

    # ------------------------------------------------------------------ conditional writes
    def conditional_writes(self, path: str) -> bool:
        """Whether an exclusive PUT to ``path``'s bucket is atomic (If-None-Match honoured).
        Unknown until the first exclusive write, which :meth:`put` turns into the probe."""
        if not _can_create(self.fs):
            return False
        return _CONDITIONAL.get(self._endpoint(path), True)

    def _endpoint(self, path: str) -> tuple[Any, str]:
        ep = getattr(self.fs, "endpoint_url", None) or (getattr(self.fs, "client_kwargs", None) or {}).get(
            "endpoint_url")
        return (ep, self.fs.split_path(self._path(path))[0])

    def put(self, path: str, data: bytes, *, exclusive: bool = False) -> None:
        """As :meth:`FsspecStorage.put`. The first exclusive write to an endpoint also learns
        whether the server honours If-None-Match: once created, the same bytes are PUT again
        with it; a server that accepts that second PUT ignores the condition (it rewrote the
        same bytes: nothing changed). From then on exclusive writes there check for the object
        just before the PUT, and a warning says once what that weakens."""
        key = self._endpoint(path)
        if not exclusive or not _can_create(self.fs) or key in _CONDITIONAL:
            super().put(path, data, exclusive=exclusive)
            return
        super().put(path, data, exclusive=True)  # FileExistsError: honoured or not, not learnt
        try:
            with self._errors(path, "writing"):
                self._create(path, data)
        except FileExistsError:
            honoured = True
        else:
            honoured = False
        with _CONDITIONAL_LOCK:
            first = key not in _CONDITIONAL
            _CONDITIONAL[key] = honoured
        if first and not honoured:
            warnings.warn(
                f"the S3 endpoint {key[0] or 'of AWS'} (bucket {key[1]!r}) ignores conditional "
                "writes (If-None-Match): exclusive writes fall back to an existence check just "
                "before the PUT, so two jobs taking the writer lease of a root in the same "
                "instant can both believe they hold it, and a save without overwrite raced by "
                "another writer is replaced by the later one instead of raising CheckpointExists. "
                "Use a store with conditional writes (AWS S3, SeaweedFS, recent MinIO) for those "
                "guarantees; see docs/how-to/object-stores.md.", SafeckptWarning, stacklevel=3)

    # ------------------------------------------------------------------ delete
    def delete_many(self, paths: Sequence[str]) -> None:
        """Delete objects (absent is fine) with DeleteObjects: up to ``DELETE_BATCH`` keys per
        request, ``DELETES_IN_FLIGHT`` requests at once; StorageError names what the store
        refused to delete."""
        by_bucket: dict[str, list[str]] = {}
        for path in paths:
            bucket, key, _ = self.fs.split_path(self._path(path))
            by_bucket.setdefault(bucket, []).append(key)
            self.fs.invalidate_cache(self._path(path))
        batches = [(b, keys[i : i + DELETE_BATCH]) for b, keys in by_bucket.items()
                   for i in range(0, len(keys), DELETE_BATCH)]
        if not batches:
            return
        where = paths[0]
        refused: list[str] = []
        for i in range(0, len(batches), DELETES_IN_FLIGHT):
            futs = [(b, self._s3("delete_objects", Bucket=b, Delete={
                "Objects": [{"Key": k} for k in keys], "Quiet": True}))
                for b, keys in batches[i : i + DELETES_IN_FLIGHT]]
            for bucket, fut in futs:
                with self._errors(where, "deleting"):
                    out = fut.result()
                refused += [f"{bucket}/{e.get('Key')}: {e.get('Code')} {e.get('Message', '')}".strip()
                            for e in out.get("Errors", []) if e.get("Code") != "NoSuchKey"]
        if refused:
            raise StorageError(f"deleting under {where}: the storage refused to delete {len(refused)} "
                               f"object(s): {'; '.join(refused[:5])}")
        for bucket, keys in by_bucket.items():  # folders these deletes left empty
            for folder in sorted({k.rsplit("/", 1)[0] for k in keys if "/" in k}):
                self._drop_empty_folder(bucket, folder)

    def _drop_empty_folder(self, bucket: str, folder: str) -> None:
        """Delete the marker of ``folder`` if nothing is left in it. Filer-backed servers
        (SeaweedFS) keep a folder once its last object is deleted, and a scan would see an
        empty ``step-N`` prefix; on AWS there is no such marker (deleting it is a no-op)."""
        url = f"{self.scheme}://{bucket}/{folder}"
        if self.list(url) is None:
            try:
                self._s3_now(url, "deleting", "delete_object", Bucket=bucket, Key=folder + "/")
            except (FileNotFoundError, StorageError):
                pass  # best effort: an empty prefix is no checkpoint

    def uploads(self, prefix: str) -> list[Upload]:
        bucket, key, _ = self.fs.split_path(self._path(prefix))
        key = key.rstrip("/") + "/" if key else ""
        out: list[Upload] = []
        marker: dict[str, str] = {}
        while True:
            try:
                page = self._s3_now(prefix, "listing unfinished uploads under", "list_multipart_uploads",
                                    Bucket=bucket, Prefix=key, **marker)
            except FileNotFoundError as exc:
                if _error_code(exc) == "NoSuchUpload":  # rclone's answer when there are none
                    return out
                raise
            for u in page.get("Uploads", []):
                url = f"{self.scheme}://{bucket}/{u['Key']}"
                try:
                    nbytes = self._parts_size(url, bucket, u["Key"], u["UploadId"])
                except FileNotFoundError:
                    continue  # completed or aborted since the listing
                out.append(Upload(url, u["UploadId"], nbytes))
            if not page.get("IsTruncated"):
                return out
            marker = {"KeyMarker": page["NextKeyMarker"], "UploadIdMarker": page["NextUploadIdMarker"]}

    def _parts_size(self, url: str, bucket: str, key: str, upload_id: str) -> int:
        total, marker = 0, {}
        while True:
            page = self._s3_now(url, "listing the parts of", "list_parts", Bucket=bucket, Key=key,
                                UploadId=upload_id, **marker)
            total += sum(int(p.get("Size", 0)) for p in page.get("Parts", []))
            if not page.get("IsTruncated"):
                return total
            marker = {"PartNumberMarker": page["NextPartNumberMarker"]}

    def abort(self, upload: Upload) -> None:
        bucket, key, _ = self.fs.split_path(self._path(upload.path))
        try:
            self._s3_now(upload.path, "aborting the unfinished upload of", "abort_multipart_upload",
                         Bucket=bucket, Key=key, UploadId=upload.upload_id)
        except FileNotFoundError:
            pass  # already aborted or completed


class MultipartWriter:
    """A ``write(bytes)`` sink that uploads full parts concurrently (see module docstring)."""

    def __init__(self, store: S3Storage, url: str, part: int | None = PART) -> None:
        self.store = store
        self.url = url
        self.bucket, self.key, _ = store.fs.split_path(store._path(url))
        self.part = part  # None: from the file's size, read from the header at the first write
        self.views: list[memoryview] = []  # the part being filled: views of the caller's bytes
        self.fill = 0
        self.upload_id: str | None = None
        self.pending: list[tuple[int, concurrent.futures.Future]] = []
        self.done: list[dict[str, Any]] = []

    def _result(self, fut: concurrent.futures.Future) -> Any:
        with self.store._errors(self.url, "uploading"):
            return fut.result()

    def _call(self, method: str, **kwargs: Any) -> Any:
        return self._result(self.store._s3(method, Bucket=self.bucket, Key=self.key, **kwargs))

    def write(self, data: memoryview) -> None:
        """Take ``data`` (valid only during this call): full parts are copied out, once, into
        the ``bytes`` body of their request (botocore sends ``bytes`` faster than a bytearray)."""
        view = memoryview(data).cast("B")
        if self.part is None:
            self.part = part_size(file_size(view))
        while view:
            n = min(self.part - self.fill, len(view))
            self.views.append(view[:n])
            self.fill += n
            view = view[n:]
            if self.fill == self.part:
                self._send(self._take())

    def _take(self) -> bytes:
        body = b"".join(self.views)
        self.views, self.fill = [], 0
        return body

    def _send(self, body: bytes) -> None:
        if self.upload_id is None:
            self.upload_id = self._call("create_multipart_upload")["UploadId"]
        while len(self.pending) >= MAX_IN_FLIGHT:
            self._wait_oldest()
        number = len(self.done) + len(self.pending) + 1
        self.pending.append((number, self.upload_part(number, body)))

    def upload_part(self, number: int, body: bytes) -> concurrent.futures.Future:
        """Start uploading part ``number`` (a hook for tests that kill a writer mid-upload)."""
        return self.store._s3("upload_part", Bucket=self.bucket, Key=self.key, UploadId=self.upload_id,
                              PartNumber=number, Body=body)

    def _wait_oldest(self) -> None:
        number, fut = self.pending.pop(0)
        self.done.append({"PartNumber": number, "ETag": self._result(fut)["ETag"]})

    def finish(self) -> None:
        """Upload what is left and complete the upload: only now does the object exist."""
        rest = self._take()
        if self.upload_id is None:  # at most one part: one PUT
            self._call("put_object", Body=rest)
            return
        if rest:
            self._send(rest)
        while self.pending:
            self._wait_oldest()
        self._call("complete_multipart_upload", UploadId=self.upload_id, MultipartUpload={"Parts": self.done})

    def abort(self) -> None:
        """Cancel what is in flight and abort the upload (best effort: leftovers are swept)."""
        for _, fut in self.pending:
            fut.cancel()
        self.pending = []
        if self.upload_id is not None:
            try:  # briefly: the other ranks are waiting for this one's error
                self._result(self.store._s3("abort_multipart_upload", bound=ABORT_WAIT, Bucket=self.bucket,
                                            Key=self.key, UploadId=self.upload_id))
            except Exception:  # noqa: BLE001
                pass


def file_size(first: memoryview) -> int | None:
    """The size of the safetensors file whose first write is ``first`` (the whole header, as
    ``stream_safetensors`` writes it): the header plus the end of its last tensor (chunks are
    laid out in order, the chunk index last); None if ``first`` is not a whole header."""
    if len(first) < 8:
        return None
    n = int.from_bytes(first[:8], "little")
    if len(first) < 8 + n:
        return None
    raw = bytes(first[8 : 8 + n])
    at = raw.rfind(b'"data_offsets":[')  # the last tensor's (a name before it is escaped)
    if at < 0:
        return 8 + n
    try:
        end = int(raw[at + 16 :].split(b"]", 1)[0].split(b",")[1])
    except (IndexError, ValueError):
        return None
    return 8 + n + end


def part_size(size: int | None) -> int:
    """Bytes per part for a file of ``size`` bytes: all of it (one PUT) below two parts, else
    ``PART`` or more (at most ``MAX_PARTS`` parts); never under S3's minimum. Unknown size:
    ``PART``."""
    if size is None:
        return max(PART, MIN_PART)
    if size < 2 * PART:
        return max(size + 1, MIN_PART)  # one part: finish() sends one PUT
    return max(PART, MIN_PART, -(-size // MAX_PARTS))


def _error_code(exc: BaseException) -> str | None:
    """The S3 error code behind an exception s3fs translated (its cause), if any."""
    for e in (exc, exc.__cause__, exc.__context__):
        response = getattr(e, "response", None)
        if isinstance(response, dict):
            return (response.get("Error") or {}).get("Code")
    return None
