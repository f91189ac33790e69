"""``s3://`` (and S3-compatible stores such as MinIO or Ceph): the fsspec backend plus what S3
does differently from a generic object store.

- **Parallel multipart uploads.** A rank's data file is uploaded in parts of ``PART`` bytes
  (more for very large files: S3 allows 10 000 parts), up to ``MAX_IN_FLIGHT`` of them at
  once, while the next part is filled (s3fs' own buffered file sends one part at a time).
  A file smaller than two parts is one PUT, as ``pipe_file`` does. Every request is bounded by the I/O timeout. On
  any error the multipart upload is aborted, so no parts are left behind.
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
from collections.abc import Sequence
from typing import Any

from ..format.shardfile import WrittenFile, stream_safetensors
from .base import Upload
from .fsspec_store import FsspecStorage

PART = 50 << 20  # bytes per part, as s3fs' pipe_file (S3's minimum is 5 MiB but for the last);
# a file smaller than two parts is one PUT (as pipe_file does)
MAX_PARTS = 9000  # below S3's limit of 10 000 parts per upload
MAX_IN_FLIGHT = 8  # parts uploading at once per file (memory: this many parts per rank)
ABORT_WAIT = 2.0  # seconds an abort after a failed upload may take (else the sweep does it)


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
        hint = sum(t.numel() * t.element_size() for _, t in items)
        part = hint + (1 << 20) if hint < 2 * PART else max(PART, -(-hint // MAX_PARTS))
        upload = MultipartWriter(self, path, part=part)
        try:
            written = stream_safetensors(items, metadata, upload.write, index=index)
            upload.finish()
        except BaseException:
            upload.abort()
            raise
        self.fs.invalidate_cache(self._path(path))
        return written

    def uploads(self, prefix: str) -> list[Upload]:
        bucket, key, _ = self.fs.split_path(self._path(prefix))
        key = key.rstrip("/") + "/" if key else ""
        out: list[Upload] = []
        marker: dict[str, str] = {}
        while True:
            page = self._s3_now(prefix, "listing unfinished uploads under", "list_multipart_uploads",
                                Bucket=bucket, Prefix=key, **marker)
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

    def __init__(self, store: S3Storage, url: str, part: int = PART) -> None:
        self.store = store
        self.url = url
        self.bucket, self.key, _ = store.fs.split_path(store._path(url))
        self.part = part
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
        if self.upload_id is None:  # smaller than one part: one PUT
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
