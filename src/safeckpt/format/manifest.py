"""What a checkpoint is on disk, and nothing else.

A checkpoint is a directory::

    <name>/
      manifest.json            written last, inside the staging directory, before publication
      rank-00000.safetensors   tensors written by rank 0 (chunks of replicated tensors, its
      rank-00001.safetensors   shards of sharded ones, its per-rank state), one file per rank

``manifest.json`` (JSON, never pickle) records the format version, step, world size, creation
time, library and torch versions, user metadata and metrics, every object's JSON tree, and for
each tensor its dtype, global shape, scope and chunks (file, byte range, global offsets, sizes,
xxh3-64 checksum); for each file its size and xxh3-128 checksum. Files are plain safetensors
and open with any safetensors reader.

The manifest carries its own checksum (``manifest_xxh3_128``, xxh3-128 of its canonical JSON
without that field, keys in their order), so an edit of any value is detected. Every field is validated before use
(:mod:`safeckpt.format.validate`): names (no absolute paths, no ``..``, no separators), dtypes,
shapes, chunk boxes that tile each tensor exactly, byte ranges inside their files, trees.
Files are opened without following symlinks and only if they are regular files.
On object stores (fsspec URLs) data files also carry a per-save token,
``rank-00000.<token>.safetensors`` (see ``safeckpt.storage.commit``); readers use the names the
manifest lists, whatever they are.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import xxhash

from ..errors import CheckpointError, CheckpointNotFound, CorruptCheckpoint, StorageUnavailable
from .locations import is_remote
from .validate import check_manifest, check_manifest_v3, is_written_name

FORMAT = "safeckpt"
FORMAT_VERSION = 3  # 2: manifest checksum (CHECKSUM_FIELD), escaped tensor keys; 3: chunks in per-file indexes
READABLE_VERSIONS = (2, 3)
MANIFEST = "manifest.json"
CHECKSUM_FIELD = "manifest_xxh3_128"
MAX_MANIFEST_ENV = "SAFECKPT_MAX_MANIFEST_BYTES"
DEFAULT_MAX_MANIFEST = 64 << 20
STAGING_MARK = ".safeckpt-staging-"
TRASH_MARK = ".safeckpt-trash-"

_SAFE_FILE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")

DTYPE_TO_ST: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
}
for _name, _code in (
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e5m2", "F8_E5M2"),
    ("uint16", "U16"),
    ("uint32", "U32"),
    ("uint64", "U64"),
):
    if hasattr(torch, _name):
        DTYPE_TO_ST[getattr(torch, _name)] = _code
ST_TO_DTYPE = {v: k for k, v in DTYPE_TO_ST.items()}


def dtype_code(dtype: torch.dtype) -> str:
    try:
        return DTYPE_TO_ST[dtype]
    except KeyError:
        raise TypeError(f"dtype {dtype} cannot be stored in safetensors") from None


def torch_dtype(code: str) -> torch.dtype:
    try:
        return ST_TO_DTYPE[code]
    except (KeyError, TypeError):
        raise CorruptCheckpoint(f"unknown dtype {code!r:.40} in manifest") from None


_ELEMENT_SIZE = {code: dtype.itemsize for dtype, code in DTYPE_TO_ST.items()}


def dtype_size(code: str) -> int:
    """Bytes per element of a safetensors dtype code (CorruptCheckpoint if unknown)."""
    size = _ELEMENT_SIZE.get(code) if isinstance(code, str) else None
    return size if size is not None else torch_dtype(code).itemsize


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def staging_name(final_name: str, token: str) -> str:
    return f".{final_name}{STAGING_MARK}{token}"


def is_staging_name(name: str) -> bool:
    return name.startswith(".") and (STAGING_MARK in name or TRASH_MARK in name)


# The one hidden name a manifest may list (in ``extra``): DCP's own metadata file, committed by
# safeckpt.dcp for tools that recognise a DCP checkpoint by it (never read by safeckpt).
DCP_DOT_METADATA = ".metadata"


def safe_file_path(ckpt_dir: str, name: Any) -> str:
    """Resolve a file named by a manifest, refusing anything that could leave ``ckpt_dir``."""
    if name != DCP_DOT_METADATA and (not isinstance(name, str) or not _SAFE_FILE.match(name) or ".." in name):
        raise CorruptCheckpoint(
            f"manifest names an unsafe file {name!r:.200} (absolute path, '..' or separator); "
            "refusing to read it", path=ckpt_dir,
        )
    if is_remote(ckpt_dir):
        return f"{ckpt_dir}/{name}"  # an object key: no links to follow
    return os.path.join(ckpt_dir, name)


def written_file_path(ckpt_dir: str, name: Any) -> str:
    """Resolve a file the manifest lists in ``written`` or ``extra`` (a relative path such as
    ``global_step8/x.pt``), refusing anything that could leave ``ckpt_dir``
    (see ``validate.is_written_name``)."""
    if name != DCP_DOT_METADATA and not is_written_name(name):
        raise CorruptCheckpoint(f"manifest names an unsafe file {name!r:.200}; refusing to read it",
                                path=ckpt_dir)
    if is_remote(ckpt_dir):
        return f"{ckpt_dir}/{name}"
    return os.path.join(ckpt_dir, *name.split("/"))


# OS errors that say nothing about a checkpoint's bytes and may pass: out of descriptors
# (EMFILE, ENFILE), an I/O or network filesystem hiccup (EIO, ESTALE, ETIMEDOUT, ...). A read
# failing so is tried again a few times, then raised as StorageUnavailable (every rank, no
# fallback to an older checkpoint): only evidence of damage is CorruptCheckpoint.
TRANSIENT_ERRNOS = frozenset(getattr(errno, name) for name in (
    "EMFILE", "ENFILE", "EIO", "ESTALE", "EINTR", "EAGAIN", "ENOMEM", "EBUSY", "ETIMEDOUT", "ENOBUFS",
    "ENOLCK", "ECONNRESET", "ECONNABORTED", "EHOSTUNREACH", "ENETDOWN", "ENETUNREACH", "EREMOTEIO",
    "ENOLINK", "ECOMM", "EDEADLK") if hasattr(errno, name))
# Errors of opening a file that are evidence about the checkpoint itself: it is not there, or
# is not what a checkpoint's file is (a symlink, a path through a non-directory).
DAMAGE_ERRNOS = frozenset((errno.ENOENT, errno.ELOOP, errno.ENOTDIR))
IO_TRIES = 4  # tries of an operation failing with a transient error
IO_BACKOFF = 0.05  # seconds before the second try, doubled for each next one (0.35 s in all)

_T = TypeVar("_T")


def unavailable(what: str, exc: OSError, tries: int = 1) -> StorageUnavailable:
    """The error for an OS error that is not evidence of damage (``what`` failed)."""
    again = f" (tried {tries} times)" if tries > 1 else ""
    hint = ("raise the open-file limit (ulimit -n) or load with fewer ranks per machine"
            if exc.errno in (errno.EMFILE, errno.ENFILE) else "check the storage and retry")
    return StorageUnavailable(
        f"{what}: {exc.strerror or exc}{again}. This says nothing about the checkpoint, which may "
        f"be intact: {hint}.", errno=exc.errno,
    )


def retry_io(call: Callable[[], _T], what: str, *, tries: int = IO_TRIES, backoff: float = IO_BACKOFF) -> _T:
    """``call()``, tried again after a short, growing pause while it fails with a transient OS
    error (:data:`TRANSIENT_ERRNOS`), at most ``tries`` times; then StorageUnavailable. Any
    other OSError propagates unchanged for the caller to classify."""
    for attempt in range(1, tries + 1):
        try:
            return call()
        except OSError as exc:
            if exc.errno not in TRANSIENT_ERRNOS:
                raise
            if attempt == tries:
                raise unavailable(what, exc, tries) from exc
            time.sleep(backoff * (1 << (attempt - 1)))
    raise AssertionError("unreachable")  # pragma: no cover


def pread_all(fd: int, n: int, at: int = 0) -> bytes:
    """Up to ``n`` bytes of ``fd`` from offset ``at`` (fewer only at the end of the file)."""
    parts, got = [], 0
    while got < n:
        piece = os.pread(fd, n - got, at + got)
        if not piece:
            break
        parts.append(piece)
        got += len(piece)
    return b"".join(parts)


def open_regular(path: str, ckpt_dir: str, *, dir_fd: int | None = None, name: str | None = None) -> int:
    """Open a file inside a checkpoint for reading: never through a symlink, never blocking on
    a FIFO or device, only a regular file. Returns the fd. A missing file, a symlink or
    anything but a regular file is CorruptCheckpoint; a permission problem CheckpointError; an
    error that can pass (out of descriptors, I/O error, stale handle) is tried again a few
    times and then StorageUnavailable: never taken for damage. ``dir_fd``/``name``: open
    ``name`` inside that directory (``path`` then only names it in messages)."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        if dir_fd is None:
            fd = retry_io(lambda: os.open(path, flags), f"cannot open {path}")
        else:
            fd = retry_io(lambda: os.open(name or os.path.basename(path), flags, dir_fd=dir_fd), f"cannot open {path}")
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{path} is missing", path=ckpt_dir) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP or (dir_fd is None and os.path.islink(path)):
            raise CorruptCheckpoint(f"{path} is a symlink; refusing to follow it", path=ckpt_dir) from None
        if exc.errno in (errno.EACCES, errno.EPERM):
            # Not damage: the checkpoint may be fine, so no fallback to an older one.
            raise CheckpointError(
                f"cannot read {path}: permission denied (run as a user who can read the "
                "checkpoint, or fix its permissions)"
            ) from exc
        if exc.errno in DAMAGE_ERRNOS:
            raise CorruptCheckpoint(f"cannot open {path}: {exc.strerror}", path=ckpt_dir) from exc
        raise unavailable(f"cannot open {path}", exc) from exc
    try:
        mode = retry_io(lambda: os.fstat(fd).st_mode, f"cannot stat {path}")
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file (FIFO, device or socket)"
        raise CorruptCheckpoint(f"{path} is {kind}; refusing to read it", path=ckpt_dir)
    return fd


def max_manifest_bytes() -> int:
    """Largest manifest.json read (bounded memory for a damaged or hostile one)."""
    return int(os.environ.get(MAX_MANIFEST_ENV, DEFAULT_MAX_MANIFEST))


def read_manifest(ckpt_dir: str) -> dict[str, Any]:
    """Read and fully validate ``manifest.json``; raise CorruptCheckpoint if unusable."""
    path = os.path.join(ckpt_dir, MANIFEST)
    if not os.path.lexists(path):
        # Deleted (e.g. by retention) after the caller saw it: a safeckpt error, not a raw OSError.
        raise CheckpointNotFound(f"no checkpoint at {ckpt_dir} (it was deleted)", path=ckpt_dir)
    try:
        fd = open_regular(path, ckpt_dir)
    except CorruptCheckpoint:
        if not os.path.lexists(path):
            raise CheckpointNotFound(f"no checkpoint at {ckpt_dir} (it was deleted)", path=ckpt_dir) from None
        raise
    return parse_manifest(read_manifest_fd(fd, path, ckpt_dir), ckpt_dir)


def read_manifest_fd(fd: int, path: str, ckpt_dir: str) -> bytes:
    """The bytes of the manifest open as ``fd`` (closed here), refused past
    ``max_manifest_bytes()`` before any is read; transient errors retried (``retry_io``)."""
    try:
        size = os.fstat(fd).st_size
        check_manifest_size(size, path, ckpt_dir)
        return retry_io(lambda: pread_all(fd, size + 1), f"cannot read {path}")
    finally:
        os.close(fd)


def check_manifest_size(size: int, where: str, ckpt_dir: str) -> None:
    limit = max_manifest_bytes()
    if size > limit:
        raise CorruptCheckpoint(
            f"{where} has {size} bytes, more than the {limit} a manifest may have "
            f"(set ${MAX_MANIFEST_ENV} to raise the limit if this checkpoint is genuine)",
            path=ckpt_dir,
        )


def _canonical(man: dict[str, Any]) -> str:
    """The manifest without its checksum field as compact ASCII JSON, keys in their order (dict
    order is content: a state dict's key order comes back as it was saved)."""
    body = {k: v for k, v in man.items() if k != CHECKSUM_FIELD}
    return json.dumps(body, separators=(",", ":"), ensure_ascii=True, allow_nan=True)


def manifest_digest(man: dict[str, Any]) -> str:
    """xxh3-128 of the canonical JSON of a manifest without its own checksum field."""
    return xxhash.xxh3_128_hexdigest(_canonical(man).encode())


def encode_manifest(man: dict[str, Any]) -> bytes:
    """The bytes of ``manifest.json``: the manifest in canonical form plus a checksum over it,
    so an edit of any value (or of the order of keys) is detected; whitespace does not matter.

    ``man`` must hold only what JSON round-trips (dicts with string keys, lists, str, int,
    float, bool, None): the save path builds it so. A reader parses the file and checks the
    digest of the canonical form of what it parsed."""
    return seal_manifest(_canonical(man))


def seal_manifest(canon: str) -> bytes:
    """The bytes of ``manifest.json`` for the canonical JSON ``canon`` of a manifest without its
    checksum field: ``canon`` with the checksum over it appended as the last field."""
    body = canon.encode()
    raw = body[:-1] + f',"{CHECKSUM_FIELD}":"{xxhash.xxh3_128_hexdigest(body)}"}}'.encode()
    if len(raw) > max_manifest_bytes():
        raise CheckpointError(
            f"the manifest of this checkpoint would have {len(raw)} bytes, more than readers "
            f"accept ({max_manifest_bytes()}); set ${MAX_MANIFEST_ENV} higher on every "
            "machine that saves or reads it, or store fewer, larger tensors."
        )
    return raw


def parse_manifest(raw: bytes, ckpt_dir: str) -> dict[str, Any]:
    """Parse, checksum-verify and fully validate the bytes of ``manifest.json``."""
    path = f"{ckpt_dir}/{MANIFEST}" if is_remote(ckpt_dir) else os.path.join(ckpt_dir, MANIFEST)
    check_manifest_size(len(raw), path, ckpt_dir)
    signed = signed_as_written(raw)
    if not signed and len(raw) > REFORMATTED_MAX:
        # Not byte-for-byte as written, and too large to parse just to compare content:
        # refuse before building (possibly hundreds of MB of) Python objects from it.
        raise CorruptCheckpoint(f"{path}: {_EDITED}", path=ckpt_dir)
    try:
        man = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:  # ValueError: also Python's int-string limit
        raise CorruptCheckpoint(f"{path} is not valid JSON ({str(exc)[:200]})", path=ckpt_dir) from None
    except RecursionError:
        raise CorruptCheckpoint(f"{path} is nested too deeply", path=ckpt_dir) from None
    validate_manifest(man, ckpt_dir, checksum_checked=signed)
    return man


REFORMATTED_MAX = 4 << 20  # a manifest that is not as written is parsed only up to this size
_EDITED = ("the manifest's checksum does not match its content: it was edited or damaged "
           "after the checkpoint was written")
_SIGNATURE = f',"{CHECKSUM_FIELD}":"'.encode()


def signed_as_written(raw: bytes) -> bool:
    """True if ``raw`` is byte-for-byte what :func:`encode_manifest` wrote: the canonical body
    followed by its checksum field. Checked on the bytes, before any parsing."""
    tail = raw.rstrip()
    cut = tail.rfind(_SIGNATURE)
    if cut < 0 or not tail.endswith(b'"}'):
        return False
    digest = tail[cut + len(_SIGNATURE) : -2]
    return len(digest) == 32 and xxhash.xxh3_128_hexdigest(tail[:cut] + b"}") == digest.decode("ascii", "replace")


def validate_manifest(man: Any, ckpt_dir: str, *, checksum_checked: bool = False) -> None:
    """Header (format, version, checksum) then every field (:mod:`safeckpt.format.validate`)."""
    where = f"{ckpt_dir}/{MANIFEST}" if is_remote(ckpt_dir) else os.path.join(ckpt_dir, MANIFEST)

    def bad(msg: str) -> CorruptCheckpoint:
        return CorruptCheckpoint(f"{where}: {msg}", path=ckpt_dir)

    if not isinstance(man, dict) or man.get("format") != FORMAT:
        raise bad("not a safeckpt manifest")
    version = man.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise bad(f"invalid format version {version!r:.40}")
    if version > FORMAT_VERSION:
        raise bad(
            f"format version {version!r} is newer than this safeckpt understands "
            f"({FORMAT_VERSION}); upgrade safeckpt"
        )
    if version not in READABLE_VERSIONS:
        raise bad(
            f"format version {version} (written by safeckpt 0.1) has no manifest checksum, so "
            "edits cannot be detected; this safeckpt reads versions 2 and 3 only. Load it with "
            "safeckpt 0.1 and save it again."
        )
    digest = man.get(CHECKSUM_FIELD)
    if not checksum_checked and (not isinstance(digest, str) or digest != manifest_digest(man)):
        raise bad(_EDITED)
    if version == 3:
        check_manifest_v3(man, where, ckpt_dir, file_ok=lambda n: safe_file_path(ckpt_dir, n), dtype_size=dtype_size)
    else:
        check_manifest(man, where, ckpt_dir, file_ok=lambda n: safe_file_path(ckpt_dir, n), dtype_size=dtype_size)


@dataclass(frozen=True)
class CheckpointInfo:
    """What a committed checkpoint is: returned by save/load and listed by the manager."""

    path: str
    step: int | None
    world_size: int
    created_at: str
    metrics: dict[str, Any] = field(default_factory=dict)
    nbytes: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)
    skipped: tuple[str, ...] = ()

    @classmethod
    def from_manifest(cls, path: str, man: dict[str, Any], skipped: tuple[str, ...] = ()) -> CheckpointInfo:
        return cls(
            path=path,
            step=man.get("step"),
            world_size=int(man.get("world_size", 1)),
            created_at=str(man.get("created_at", "")),
            metrics=dict(man.get("metrics") or {}),
            nbytes=sum(int(f["size"]) for f in man["files"].values()),
            metadata=dict(man.get("metadata") or {}),
            skipped=skipped,
        )
