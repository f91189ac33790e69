"""Local and shared filesystems: a save is a hidden directory published by one rename.

Files go into ``.<name>.safeckpt-staging-<token>`` next to the target, are fsynced, and the
coordinator writes ``manifest.json`` (temp file, fsync, rename), fsyncs the directory and
publishes it with ``renameat2(RENAME_NOREPLACE)`` (a plain rename silently replaces an empty
directory); ``overwrite`` swaps old and new with ``RENAME_EXCHANGE``, so the old checkpoint is
never removed before the new one is visible. Where renameat2 is unavailable, plain renames with
the old checkpoint moved aside first (never deleted before the new one is in place). Deleting a
directory renames it aside to a hidden trash name first, so nothing looks committed half-way.
Data files are read through mmap and opened only as regular files, never through a symlink.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import shutil
import stat
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import CheckpointNotFound
from ..format import manifest as _manifest
from ..format.manifest import (
    MANIFEST,
    TRASH_MARK,
    is_staging_name,
    open_regular,
    rank_file,
    staging_name,
)
from ..format.shardfile import MappedFile, write_file
from .base import Item, Storage
from .digest import FileDigest, StreamDigest

RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
_AT_FDCWD = -100

_libc: Any = None


def _renameat2(src: str, dst: str, flags: int) -> bool:
    """Call renameat2; False if the platform or filesystem does not support it."""
    global _libc
    if _libc is None:
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
            fn = lib.renameat2
            fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
            fn.restype = ctypes.c_int
            _libc = fn
        except (OSError, AttributeError, TypeError):
            _libc = False
    if _libc is False:
        return False
    rc = _libc(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), dst)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:  # some filesystems refuse fsync on directories
        if exc.errno not in (errno.EINVAL, errno.EBADF, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def _write_fd(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.fsync(fd)


def write_bytes_atomic(path: str, data: bytes) -> None:
    """Write ``data`` to a sibling temp file, fsync, rename over ``path``, fsync the directory."""
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        _write_fd(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


def is_committed(path: str) -> bool:
    """A published checkpoint: a non-staging directory holding a manifest."""
    name = os.path.basename(os.path.normpath(path))
    return not is_staging_name(name) and os.path.isfile(os.path.join(path, MANIFEST))


def rename_publish(staging: str, final: str, *, replace: bool) -> None:
    """Atomically make ``staging`` visible as ``final``; with ``replace``, swap out the old one."""
    parent = os.path.dirname(os.path.normpath(final))
    fsync_dir(staging)
    if replace and os.path.exists(final):
        if _renameat2(staging, final, RENAME_EXCHANGE):
            # ``staging`` now holds the old checkpoint.
            fsync_dir(parent)
            remove_tree(staging)
            return
        aside = os.path.join(parent, f".{os.path.basename(final)}{TRASH_MARK}{uuid.uuid4().hex[:12]}")
        os.rename(final, aside)
        os.rename(staging, final)
        fsync_dir(parent)
        remove_tree(aside)
        return
    if not _renameat2(staging, final, RENAME_NOREPLACE):
        if os.path.lexists(final):
            raise FileExistsError(errno.EEXIST, "destination exists", final)
        os.rename(staging, final)
    fsync_dir(parent)


def remove_tree(path: str) -> None:
    """Delete a directory so it never looks committed half-way: rename aside, then delete."""
    parent, name = os.path.split(os.path.normpath(path))
    if not name.startswith(".") or TRASH_MARK not in name:
        aside = os.path.join(parent, f".{name.lstrip('.')}{TRASH_MARK}{uuid.uuid4().hex[:12]}")
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            return
        path = aside
    shutil.rmtree(path, ignore_errors=True)


def open_local_manifest(ckpt_dir: str) -> dict[str, Any]:
    """The validated manifest of a local checkpoint directory, or CheckpointNotFound (absent,
    a staging leftover, no manifest) / CorruptCheckpoint."""
    name = os.path.basename(os.path.normpath(ckpt_dir))
    if not os.path.isdir(ckpt_dir):
        raise CheckpointNotFound(f"no checkpoint at {ckpt_dir}: the directory does not exist", path=ckpt_dir)
    if is_staging_name(name) or not os.path.isfile(os.path.join(ckpt_dir, MANIFEST)):
        raise CheckpointNotFound(
            f"{ckpt_dir} is not a committed safeckpt checkpoint (no {MANIFEST}; an interrupted "
            "save never publishes one). Use `safeckpt ls` on its parent to see what is there.",
            path=ckpt_dir,
        )
    return _manifest.read_manifest(ckpt_dir)  # looked up at call time (tests wrap it)


HASH_BLOCK = 8 << 20  # bytes read per call when hashing a whole file


def digest_file(path: str, spans: Sequence[tuple[int, int]] = (), progress: Callable[[int], None] | None = None,
                block: int = HASH_BLOCK) -> FileDigest:
    """:meth:`Storage.hash` of a local file: read once in ``block``-byte pieces (into one
    buffer, so memory stays flat however large the file; never through a symlink or from a
    FIFO), each piece hashed into the file's digest and its spans' while in the CPU cache."""
    d = StreamDigest(spans)
    with os.fdopen(open_regular(path, os.path.dirname(path)), "rb", buffering=0) as f:
        # no bigger than the file: a small file (a framework's JSON) must not cost 8 MiB of new pages
        buf = bytearray(max(1, min(block, os.fstat(f.fileno()).st_size)))
        view = memoryview(buf)
        while n := f.readinto(buf):
            d.update(view[:n])
            if progress is not None:
                progress(n)
    return d.result()


class PosixStorage(Storage):
    """A local or shared (NFS, Lustre, GPFS...) filesystem. See the module docstring."""

    renames = True

    def join(self, parent: str, name: str) -> str:
        return os.path.join(parent, name)

    # ------------------------------------------------------------------ list and read
    def list(self, path: str) -> list[Item] | None:
        try:
            names = os.listdir(path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        out = []
        for name in names:
            try:
                st = os.lstat(os.path.join(path, name))
            except FileNotFoundError:
                out.append(Item(name, "gone"))
                continue
            kind = "dir" if stat.S_ISDIR(st.st_mode) else "file"
            out.append(Item(name, kind, st.st_size if kind == "file" else 0))
        return out

    def size(self, path: str) -> int | None:
        try:
            st = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        return st.st_size if stat.S_ISREG(st.st_mode) else None

    def read(self, path: str, limit: int) -> bytes | None:
        try:
            with open(path, "rb") as f:
                return f.read(limit)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None

    def read_manifest(self, ckpt: str) -> dict[str, Any]:
        return open_local_manifest(ckpt)

    def open(self, path: str, size: int, ckpt: str, likely: Sequence[tuple[int, int]] = ()) -> MappedFile:
        return MappedFile(path, size)

    def hash(self, path: str, progress: Callable[[int], None] | None = None,
             spans: Sequence[tuple[int, int]] = ()) -> FileDigest:
        return digest_file(path, spans, progress)

    # ------------------------------------------------------------------ write
    def write(self, path: str, items: Sequence[tuple[str, Any]], metadata: dict[str, str], index: Any = None) -> Any:
        return write_file(path, items, metadata, index)

    def put(self, path: str, data: bytes, *, exclusive: bool = False) -> None:
        if exclusive:
            self.create(path, data)
        else:
            write_bytes_atomic(path, data)

    # ------------------------------------------------------------------ delete
    def delete(self, path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def delete_tree(self, path: str) -> None:
        remove_tree(path)

    # ------------------------------------------------------------------ publish
    def stage(self, final: str, token: str) -> str:
        parent, name = os.path.split(os.path.normpath(final))
        os.makedirs(parent, exist_ok=True)
        staging = os.path.join(parent, staging_name(name, token))
        os.mkdir(staging)
        fsync_dir(parent)
        return staging

    def data_name(self, rank: int, token: str) -> str:
        return rank_file(rank)

    def sees(self, staging: str) -> bool:
        return os.path.isdir(staging)

    def publish(self, staging: str, final: str, manifest: bytes, *, replace: bool) -> None:
        write_bytes_atomic(os.path.join(staging, MANIFEST), manifest)
        rename_publish(staging, final, replace=replace)

    # ------------------------------------------------------------------ lease primitives
    def create(self, path: str, data: bytes) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _write_fd(fd, data)
        finally:
            os.close(fd)

    def touch(self, path: str, data: bytes) -> None:
        os.utime(path)  # the record stays as written; its mtime is the heartbeat

    def age(self, path: str, record: dict[str, Any]) -> float:
        return time.time() - os.path.getmtime(path)

    def take_over(self, path: str) -> None:
        aside = f"{path}.stale-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(path, aside)  # only one contender wins the rename
            os.unlink(aside)
        except FileNotFoundError:
            pass
