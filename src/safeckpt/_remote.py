"""Checkpoints on object stores (any fsspec URL other than ``file://``): no renames, no mmap.

Layout: the same as a local checkpoint, as objects under a prefix, except that data files carry
a per-save token, so a save never overwrites an object another checkpoint refers to::

    s3://bucket/run/step-0000000040/manifest.json
    s3://bucket/run/step-0000000040/rank-00000.3f9c0a1b2c4d.safetensors
    s3://bucket/run/step-0000000040/rank-00001.3f9c0a1b2c4d.safetensors

Commit (the object-store form of stage/write/commit in :mod:`safeckpt._save`):

- stage  (coordinator) check the target, draw the token. Nothing is created.
- write  (all ranks)   stream this rank's file straight to its final name (one upload, hashed
                       while written); a failed upload is abandoned, never completed.
- commit (coordinator) check every rank's object exists with the reported size, then PUT
                       ``manifest.json`` in one request: that PUT is the commit point. A prefix
                       is a checkpoint only while it holds a valid manifest, and only the objects
                       the manifest names belong to it. With ``overwrite`` the old manifest is
                       replaced by the new one (the old checkpoint stays readable until then) and
                       only afterwards are the objects it named deleted.

Objects with a token name that no manifest names are leftovers of interrupted saves: invisible
to readers, removed by the coordinator when a save fails, by the manager's sweep at its next
save and by ``safeckpt gc``. Retention deletes the manifest first (the checkpoint stops being
committed at once), then its objects.

Reads are ranged GETs: a chunk read whole is verified against its checksum; a partial read
(resharding) fetches only the rows it needs. The writer lease is best effort (see RemoteLock).

fsspec is imported on first use only; it is the ``remote`` extra.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from ._catalog import Entry, parse_step
from ._lock import DEFAULT_LEASE, LOCK_NAME, holder_is_live, locked_error
from ._manifest import FORMAT, MANIFEST, CheckpointInfo, encode_manifest, parse_manifest
from ._save import _SaveJob
from ._shardfile import WrittenFile, check_chunk, is_empty, stream_safetensors
from .errors import (
    CheckpointError,
    CheckpointExists,
    CheckpointLocked,
    CheckpointNotFound,
    CorruptCheckpoint,
)

INSTALL_HINT = (
    "pip install 'safeckpt[remote]' (fsspec), plus the package for your storage "
    "(s3fs for s3://, gcsfs for gs://, adlfs for az://)"
)
TOKEN_FILE = re.compile(r"^rank-(\d{5})\.([0-9a-f]{12})\.safetensors$")
READAHEAD = 4 << 20  # a small read fetches this much from its start and serves later reads from it
KEEP_VERIFIED = 512 << 20  # per object: verified chunks kept in memory for the copy that follows
PART = 16 << 20  # larger reads are split into parts fetched concurrently (on async filesystems)


# --------------------------------------------------------------------------- locations


@dataclass(frozen=True)
class Loc:
    """One object or prefix: the URL users see, and the filesystem + path fsspec uses."""

    url: str
    fs: Any
    path: str

    def child(self, name: str) -> Loc:
        return Loc(f"{self.url}/{name}", self.fs, f"{self.path.rstrip('/')}/{name}")

    @property
    def parent_url(self) -> str:
        return self.url.rsplit("/", 1)[0]


def locate(url: str) -> Loc:
    """The filesystem for ``url`` (cached by fsspec); clear errors when it is not installed."""
    try:
        import fsspec
    except ImportError:
        raise CheckpointError(
            f"{url} is a remote URL, which needs fsspec: {INSTALL_HINT}"
        ) from None
    try:
        fs, path = fsspec.core.url_to_fs(url)
    except ImportError as exc:
        raise CheckpointError(
            f"cannot open {url}: the filesystem package for this scheme is missing ({exc}); "
            f"{INSTALL_HINT}"
        ) from None
    except ValueError as exc:
        raise CheckpointError(f"cannot open {url}: {exc}") from None
    return Loc(url, fs, path)


def _name(info: dict[str, Any]) -> str:
    return str(info["name"]).rstrip("/").rsplit("/", 1)[-1]


def _listing(loc: Loc) -> list[dict[str, Any]]:
    """Fresh (uncached) listing of a prefix; [] when it holds nothing."""
    loc.fs.invalidate_cache(loc.path)
    try:
        out = loc.fs.ls(loc.path, detail=True)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [i for i in out if _name(i) and str(i["name"]).rstrip("/") != loc.path.rstrip("/")]


def _files(loc: Loc) -> dict[str, int]:
    """Objects directly under a prefix: name -> size."""
    return {_name(i): int(i.get("size") or 0) for i in _listing(loc) if i.get("type") != "directory"}


def size_of(loc: Loc) -> int | None:
    """Size of an object, or None when it does not exist (never a cached answer)."""
    loc.fs.invalidate_cache(loc.path)
    try:
        info = loc.fs.info(loc.path)
    except FileNotFoundError:
        return None
    if info.get("type") == "directory":
        return None
    return int(info["size"])


def exists(url: str) -> bool:
    return size_of(locate(url)) is not None


def _cat(loc: Loc) -> bytes | None:
    try:
        return loc.fs.cat_file(loc.path)
    except FileNotFoundError:
        return None


def _put(loc: Loc, data: bytes, *, exclusive: bool = False) -> None:
    """One PUT of ``data``. ``exclusive``: fail with FileExistsError if the object exists,
    atomically where the filesystem supports conditional writes (fsspec ``mode="create"``),
    else by a check just before the write."""
    if exclusive:
        if _can_create(loc.fs):
            loc.fs.pipe_file(loc.path, data, mode="create")
            return
        if size_of(loc) is not None:
            raise FileExistsError(loc.url)
    loc.fs.pipe_file(loc.path, data)


def _can_create(fs: Any) -> bool:
    """Whether ``fs.pipe_file`` takes ``mode="create"`` (fsspec >= 2025.2; atomic on backends
    with conditional writes, such as recent s3fs and gcsfs)."""
    try:
        return "mode" in inspect.signature(fs.pipe_file).parameters
    except (TypeError, ValueError):
        return False


def _rm(loc: Loc) -> None:
    try:
        loc.fs.rm_file(loc.path)
    except FileNotFoundError:
        pass


# --------------------------------------------------------------------------- manifests


def read_manifest(ckpt_url: str) -> dict[str, Any]:
    """The validated manifest of the checkpoint at ``ckpt_url`` (CheckpointNotFound if none)."""
    raw = _cat(locate(ckpt_url).child(MANIFEST))
    if raw is None:
        raise CheckpointNotFound(
            f"no committed checkpoint at {ckpt_url} (no {MANIFEST}; an interrupted save never "
            "writes one). Use `safeckpt ls` on its parent to see what is there.", path=ckpt_url,
        )
    return parse_manifest(raw, ckpt_url)


open_manifest = read_manifest


# --------------------------------------------------------------------------- writing


def write_object(loc: Loc, items: Sequence[tuple[str, torch.Tensor]], metadata: dict[str, str]) -> WrittenFile:
    """Stream ``items`` as one safetensors object at ``loc``, hashing while writing (the same
    bytes as a local file). The object exists only once the upload completed; on any error the
    upload is abandoned."""
    f = loc.fs.open(loc.path, "wb")
    try:
        written = stream_safetensors(items, metadata, f.write)
    except BaseException:
        _abandon(f)
        raise
    f.close()  # completes the upload; raises if it failed
    return written


def _abandon(f: Any) -> None:
    """Drop an unfinished upload without completing it (best effort; leftovers are swept)."""
    try:
        f.discard()
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


def data_name(rank: int, token: str) -> str:
    return f"rank-{rank:05d}.{token}.safetensors"


class RemoteSaveJob(_SaveJob):
    """A :class:`_SaveJob` whose stage/write/commit target an object store (see module doc).
    The value shared after "stage" is the save's token instead of a staging directory."""

    def _stage(self) -> str | None:
        if not self.coord.is_coordinator:
            return None
        ckpt = locate(self.target)
        present = _files(ckpt)
        if MANIFEST in present:
            if not self.overwrite:
                raise CheckpointExists(
                    f"{self.target} already exists. Pass overwrite=True to replace it atomically, "
                    "or save under a new name (CheckpointManager names steps for you)."
                )
        else:
            foreign = sorted(n for n in present if not TOKEN_FILE.match(n))
            if foreign:
                raise CheckpointExists(
                    f"{self.target} holds objects that are not a safeckpt checkpoint "
                    f"({', '.join(foreign[:5])}); refusing to write there even with "
                    "overwrite=True. Choose another path."
                )
        return uuid.uuid4().hex[:12]

    def _write(self, token: str) -> dict[str, Any]:
        fname = data_name(self.coord.rank, token)
        written = write_object(locate(self.target).child(fname), self.items, {"format": FORMAT})
        return self._report(fname, written, [dict(r) for r in self.records])

    def _commit(self, token: str, written: list[dict[str, Any]]) -> dict[str, Any] | None:
        if not self.coord.is_coordinator:
            return None
        ckpt = locate(self.target)
        files: dict[str, Any] = {}
        for r, w in enumerate(written):
            actual = size_of(ckpt.child(w["file"]))
            if actual is None:
                raise CheckpointError(
                    f"rank {r} wrote {w['file']} but the coordinator (rank 0) cannot see it under "
                    f"{self.target}: every rank must write to the same store and bucket."
                )
            if actual != w["size"]:
                raise CheckpointError(
                    f"rank {r}'s object {w['file']} has {actual} bytes in the store but rank {r} "
                    f"wrote {w['size']}: the upload was lost or replaced."
                )
            files[w["file"]] = {"size": w["size"], "xxh3_128": w["xxh3_128"], "rank": r}
        manifest = self._build_manifest(files, written)
        old = _referenced(ckpt) if self.overwrite else set()
        data = encode_manifest(manifest)
        try:
            _put(ckpt.child(MANIFEST), data, exclusive=not self.overwrite)  # the commit point
        except FileExistsError:
            raise CheckpointExists(
                f"{self.target} appeared while saving (another job writing the same path?); "
                "nothing was replaced."
            ) from None
        # Committed. The replaced checkpoint's objects are garbage now; a failure to delete
        # them leaves leftovers for the next sweep, never an error.
        for name in sorted(old - set(files)):
            try:
                _rm(ckpt.child(name))
            except Exception:  # noqa: BLE001
                pass
        return self._committed_info(manifest, files)

    def _discard(self, token: str) -> None:
        """After a failed save: delete this save's objects, unless its manifest landed."""
        ckpt = locate(self.target)
        try:
            if any(token in n for n in _referenced(ckpt)):
                return  # committed after all (e.g. a timeout after the PUT succeeded)
        except CheckpointError:
            pass
        for name in _files(ckpt):
            m = TOKEN_FILE.match(name)
            if m and m.group(2) == token:
                _rm(ckpt.child(name))


def _referenced(ckpt: Loc) -> set[str]:
    """Objects the current manifest at ``ckpt`` names (empty if there is none or it is unreadable)."""
    raw = _cat(ckpt.child(MANIFEST))
    if raw is None:
        return set()
    try:
        man = json.loads(raw)
        return {str(n) for n in man.get("files", {})}
    except (ValueError, AttributeError):
        return set()


# --------------------------------------------------------------------------- reading


class RemoteFile:
    """A data object read by byte ranges, checked against its recorded size (the remote
    counterpart of _shardfile.MappedFile)."""

    def __init__(self, url: str, expected_size: int) -> None:
        self.loc = locate(url)
        self.path = url
        size = size_of(self.loc)
        if size is None:
            raise CorruptCheckpoint(f"data file {url} is missing", path=self.loc.parent_url)
        if size != expected_size:
            raise CorruptCheckpoint(
                f"data file {url} has {size} bytes, the manifest says {expected_size} "
                "(truncated or replaced)", path=self.loc.parent_url,
            )
        self.size = size
        self._window: tuple[int, bytes] | None = None
        self._kept: dict[tuple[int, int], bytes] = {}  # verified chunks, read again by the load
        self._kept_bytes = 0

    def read(self, start: int, end: int) -> bytes:
        """Bytes [start, end) of the object."""
        n = end - start
        if n <= 0:
            return b""
        for (lo, hi), buf in self._kept.items():
            if lo <= start and end <= hi:
                return buf[start - lo : end - lo]
        if self._window is not None:
            lo, buf = self._window
            if lo <= start and end <= lo + len(buf):
                return buf[start - lo : end - lo]
        if n < READAHEAD:
            buf = self._fetch(start, min(self.size, start + READAHEAD))
            self._window = (start, buf)
            data = buf[:n]
        else:
            data = self._fetch(start, end)
        if len(data) != n:
            raise CorruptCheckpoint(
                f"short read from {self.path} bytes {start}-{end} (got {len(data)}): the object "
                "changed or was deleted while reading", path=self.loc.parent_url,
            )
        return data

    def _fetch(self, start: int, end: int) -> bytes:
        fs, path = self.loc.fs, self.loc.path
        try:
            if end - start <= 2 * PART:
                return fs.cat_file(path, start=start, end=end)
            starts = list(range(start, end, PART))
            ends = [min(s + PART, end) for s in starts]
            parts = fs.cat_ranges([path] * len(starts), starts, ends, on_error="raise")
            return b"".join(parts)
        except FileNotFoundError:
            raise CorruptCheckpoint(
                f"data file {self.path} vanished while reading (deleted by retention or an "
                "overwrite?)", path=self.loc.parent_url,
            ) from None

    def tensor(self, start: int, end: int, dtype: torch.dtype, shape: Sequence[int], expect_hash: str | None) -> torch.Tensor:
        """The bytes [start, end) as a (fresh) tensor; verified if a hash is given."""
        if is_empty(shape, start, end):
            return torch.empty(tuple(shape), dtype=dtype)
        data = self.read(start, end)
        check_chunk(data, expect_hash, f"{self.path} bytes {start}-{end}", self.loc.parent_url)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(tuple(shape))

    def rows(self, start: int, end: int, dtype: torch.dtype, shape: Sequence[int], r0: int, r1: int) -> torch.Tensor:
        """Rows [r0, r1) (along dim 0) of the chunk stored at [start, end) with ``shape``,
        fetching only their bytes (a chunk read in part is not verified, as for local files)."""
        numel = 1
        for s in shape:
            numel *= s
        itemsize = torch.empty((), dtype=dtype).element_size()
        if numel * itemsize != end - start or not shape or not 0 <= r0 < r1 <= shape[0]:
            raise CorruptCheckpoint(
                f"a chunk in {self.path} has a size that does not match its shape",
                path=self.loc.parent_url,
            )
        row = (end - start) // shape[0]
        data = self.read(start + r0 * row, start + r1 * row)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape((r1 - r0, *shape[1:]))

    def hash_range(self, start: int, end: int, window: int) -> str:
        """xxh3-64 of bytes [start, end), read ``window`` bytes at a time. A range that fits
        the budget is kept, so the load that verified it does not fetch it a second time."""
        if self._kept_bytes + end - start <= KEEP_VERIFIED:
            data = self._fetch(start, end)
            self._kept[(start, end)] = data
            self._kept_bytes += len(data)
            return xxhash.xxh3_64_hexdigest(data)
        h = xxhash.xxh3_64()
        for off in range(start, end, window):
            h.update(self._fetch(off, min(off + window, end)))
        return h.hexdigest()

    def close(self) -> None:
        self._window = None
        self._kept.clear()
        self._kept_bytes = 0


def hash_file(url: str, block: int = 64 << 20, progress: Callable[[int], None] | None = None) -> tuple[int, str]:
    """(size, xxh3-128) of an object, streamed by ranges."""
    loc = locate(url)
    size = size_of(loc)
    if size is None:
        raise FileNotFoundError(url)
    h = xxhash.xxh3_128()
    f = RemoteFile.__new__(RemoteFile)  # reuse the ranged fetch without the size check
    f.loc, f.path, f.size, f._window = loc, url, size, None
    for off in range(0, size, block):
        end = min(off + block, size)
        h.update(f._fetch(off, end))
        if progress is not None:
            progress(end - off)
    return size, h.hexdigest()


# --------------------------------------------------------------------------- catalog


def scan(root: str, *, leftovers: bool = True) -> list[Entry]:
    """What is under ``root`` (the object-store form of _catalog.scan).

    ``step-*`` prefixes with a valid manifest are committed; with an unreadable one, corrupt;
    without one, leftovers ("staging") when they hold only this library's token-named objects,
    else "incomplete" (left alone). With ``leftovers``, token-named objects that no manifest
    names, under any prefix, are reported too (as "staging" entries listing them in ``files``).
    """
    base = locate(root)
    out: list[Entry] = []
    for child in sorted(_listing(base), key=_name):
        if child.get("type") != "directory":
            continue
        name = _name(child)
        step = parse_step(name)
        if step is None and not leftovers:
            continue
        ckpt = base.child(name)
        raw = _cat(ckpt.child(MANIFEST))
        if raw is None:
            present = _files(ckpt)
            ours = tuple(sorted(n for n in present if TOKEN_FILE.match(n)))
            if ours:
                out.append(Entry(name, ckpt.url, "staging", step, files=ours))
            elif present and step is not None:
                out.append(Entry(name, ckpt.url, "incomplete", step, problem=f"no {MANIFEST}"))
            continue
        man: dict[str, Any] | None = None
        if step is not None:
            try:
                man = parse_manifest(raw, ckpt.url)
            except (CheckpointError, OSError) as exc:
                out.append(Entry(name, ckpt.url, "corrupt", step, problem=str(exc)))
                continue
            out.append(Entry(name, ckpt.url, "committed", step, CheckpointInfo.from_manifest(ckpt.url, man)))
        if leftovers:
            try:
                named = set((man or json.loads(raw))["files"])
            except (ValueError, KeyError, TypeError):
                continue  # cannot tell which objects belong to it: leave them alone
            stray = tuple(sorted(n for n in _files(ckpt) if TOKEN_FILE.match(n) and n not in named))
            if stray:
                out.append(Entry(name, ckpt.url, "staging", step, files=stray))
    out.sort(key=lambda e: (e.step if e.step is not None else -1, e.name))
    return out


def unmanaged(root: str, known: set[str]) -> list[Entry]:
    """Checkpoints under ``root`` with names the manager does not use (for `safeckpt ls`)."""
    base = locate(root)
    found = []
    for child in sorted(_listing(base), key=_name):
        name = _name(child)
        if child.get("type") != "directory" or name in known or name.startswith("."):
            continue
        ckpt = base.child(name)
        raw = _cat(ckpt.child(MANIFEST))
        if raw is None:
            continue
        try:
            man = parse_manifest(raw, ckpt.url)
        except (CheckpointError, OSError) as exc:
            found.append(Entry(name, ckpt.url, "corrupt", None, problem=str(exc)))
            continue
        info = CheckpointInfo.from_manifest(ckpt.url, man)
        found.append(Entry(name, ckpt.url, "committed", info.step, info))
    return found


def remove(entry: Entry) -> None:
    """Delete what ``entry`` stands for: the listed leftover objects, or a whole committed
    checkpoint (manifest first, so it stops being a checkpoint at once, then its objects)."""
    ckpt = locate(entry.path)
    if entry.files:
        for name in entry.files:
            _rm(ckpt.child(name))
        return
    named = _referenced(ckpt)
    _rm(ckpt.child(MANIFEST))
    for name in sorted(_files(ckpt)):
        if name in named or TOKEN_FILE.match(name):
            _rm(ckpt.child(name))


def entry_nbytes(entry: Entry) -> int:
    """Bytes an entry occupies (its listed objects, or everything under its prefix)."""
    present = _files(locate(entry.path))
    if entry.files:
        return sum(present.get(n, 0) for n in entry.files)
    return sum(present.values())


# --------------------------------------------------------------------------- writer lease


def read_lock(root: str) -> dict[str, Any] | None:
    raw = _cat(locate(root).child(LOCK_NAME))
    if raw is None:
        return None
    try:
        data = json.loads(raw)
        data["age"] = time.time() - float(data.get("beat", data.get("started", 0.0)))
        return data
    except (ValueError, TypeError, AttributeError):
        return None


def break_lock(root: str) -> None:
    _rm(locate(root).child(LOCK_NAME))


class RemoteLock:
    """The writer lease on a remote root: the same record and rules as _lock.RootLock, kept in
    ``ROOT/.safeckpt.lock``, with the heartbeat written into the record (objects have no
    utime). Best effort: an object store has no O_EXCL. The lease is created with a
    conditional write where the filesystem supports one (fsspec ``mode="create"``), else after
    an existence check; either way the holder reads the record back before trusting it, and
    each heartbeat and each save re-checks that it is still the holder."""

    SETTLE = 0.2  # seconds between writing the record and reading it back

    def __init__(self, root: str, run_id: str | None = None, lease: float = DEFAULT_LEASE) -> None:
        from ._lock import default_run_id

        self.root = root
        self.path = f"{root}/{LOCK_NAME}"
        self.run_id = run_id or default_run_id()
        self.lease = lease
        self.nonce = uuid.uuid4().hex
        self.held = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = time.time()

    def _loc(self) -> Loc:
        return locate(self.root).child(LOCK_NAME)

    def _record(self) -> bytes:
        return json.dumps({
            "run_id": self.run_id, "host": socket.gethostname(), "pid": os.getpid(),
            "started": self._started, "beat": time.time(), "lease": self.lease, "nonce": self.nonce,
        }).encode()

    def _mine(self) -> bool | None:
        """True if the record names us, False if someone else, None if there is none."""
        holder = read_lock(self.root)
        if holder is None:
            return None
        return holder.get("nonce") == self.nonce

    def acquire(self) -> None:
        if self.held:
            self.refresh()
            return
        for _ in range(5):
            holder = read_lock(self.root)
            if holder is not None:
                same_job = holder.get("run_id") == self.run_id and "TORCHELASTIC_RUN_ID" in os.environ
                if holder.get("nonce") != self.nonce and holder_is_live(holder, self.lease) and not same_job:
                    raise locked_error(self.root, holder, self.lease)
                _rm(self._loc())  # stale: take it over
            self._started = time.time()
            try:
                _put(self._loc(), self._record(), exclusive=True)
            except FileExistsError:
                time.sleep(0.05)
                continue
            time.sleep(self.SETTLE)
            if self._mine():
                self.held = True
                self._start_heartbeat()
                return
        raise CheckpointLocked(f"could not take the writer lease on {self.root} (contention)")

    def refresh(self) -> None:
        if not self.held:
            return
        mine = self._mine()
        if mine:
            _put(self._loc(), self._record())
            return
        self.held = False  # lost it (expired and taken over, or broken): take it again or raise
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        self.acquire()

    def _start_heartbeat(self) -> None:
        self._stop = threading.Event()
        stop = self._stop

        def beat() -> None:
            while not stop.wait(self.lease / 4):
                try:
                    if self._mine():
                        _put(self._loc(), self._record())
                except Exception:  # noqa: BLE001 - best effort; the next save re-checks
                    pass

        self._thread = threading.Thread(target=beat, name="safeckpt-lease", daemon=True)
        self._thread.start()

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)  # a heartbeat mid-write must not recreate the record
            self._thread = None
        if self.held:
            try:
                if self._mine():
                    _rm(self._loc())
            except Exception:  # noqa: BLE001
                pass
            self.held = False
