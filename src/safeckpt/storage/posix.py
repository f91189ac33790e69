"""Local and shared filesystems: a save is a hidden directory published by one rename.

Files go into ``.<name>.safeckpt-staging-<token>`` next to the target, are fsynced, and the
coordinator writes ``manifest.json`` (temp file, fsync, rename), fsyncs the directory and
publishes it with ``renameat2(RENAME_NOREPLACE)`` (a plain rename silently replaces an empty
directory); ``overwrite`` swaps old and new with ``RENAME_EXCHANGE``, so the old checkpoint is
never removed before the new one is visible.

Where renameat2's flags are refused (NFS, CephFS and FUSE filesystems answer EINVAL) an
overwrite takes two renames: the committed checkpoint moves to ``.<name>.safeckpt-replaced-<hex>``
(``REPLACED_MARK``), then the staging directory to ``<name>``; only then is the replaced one
deleted (renamed to a trash name first). A process killed between the two renames leaves the
old checkpoint complete under its replaced name: the catalog reports it as the step's committed
checkpoint (restore loads it from there) and the coordinator's next sweep (``catalog.recover``),
or the next save to that path (``commit.begin``), renames it back; no sweep deletes it while
the name it replaced is free. Deleting a directory renames it aside to a hidden trash name
first, so nothing looks committed half-way.

Files named by a manifest are never reached through a symlink, in any component of the name:
sizes and checksums (``size``, ``hash``) walk from the checkpoint directory one component at a
time (``O_NOFOLLOW | O_DIRECTORY``) and ``lstat`` the last one; data files (names without a
directory) are opened only as regular files, with ``O_NOFOLLOW``, and read through mmap.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import re
import shutil
import stat
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import CheckpointError, CheckpointNotFound, CorruptCheckpoint
from ..format import manifest as _manifest
from ..format.manifest import (
    MANIFEST,
    TRASH_MARK,
    is_staging_name,
    open_regular,
    rank_file,
    retry_io,
    staging_name,
    unavailable,
)
from ..format.shardfile import MappedFile, write_file
from .base import Item, Storage
from .digest import FileDigest, StreamDigest

RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
_AT_FDCWD = -100

# A committed checkpoint set aside by an overwrite that had no atomic swap (see the module
# docstring): ``.<final name>.safeckpt-replaced-<12 hex>``. Neither a staging nor a trash name,
# so no earlier safeckpt version takes it for a leftover (they leave it alone as foreign).
REPLACED_MARK = ".safeckpt-replaced-"
_REPLACED_RE = re.compile(r"^\.(.+)" + re.escape(REPLACED_MARK) + r"[0-9a-f]{12}$")

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


def replaced_name(final_name: str) -> str:
    """A fresh name for the committed checkpoint ``final_name`` while an overwrite replaces it."""
    return f".{final_name}{REPLACED_MARK}{uuid.uuid4().hex[:12]}"


def replaced_final(name: str) -> str | None:
    """The checkpoint name a replaced directory ``name`` was set aside from, or None."""
    m = _REPLACED_RE.match(name)
    return m.group(1) if m else None


def rename_publish(staging: str, final: str, *, replace: bool) -> None:
    """Atomically make ``staging`` visible as ``final``; with ``replace``, swap out the old one.

    Without an atomic swap (renameat2's flags refused) the old checkpoint is renamed to a
    replaced name first and deleted only once the new one is in place; every point of the
    sequence leaves one of the two committed and found by the catalog (see the module
    docstring). The steps are module functions (``_rename``, ``fsync_dir``, ``remove_tree``)
    so that tests can kill the process at each of them."""
    parent = os.path.dirname(os.path.normpath(final))
    fsync_dir(staging)
    if replace and os.path.lexists(final):
        if _renameat2(staging, final, RENAME_EXCHANGE):
            # ``staging`` now holds the old checkpoint.
            fsync_dir(parent)
            remove_tree(staging)
            return
        aside = os.path.join(parent, replaced_name(os.path.basename(final)))
        _rename(final, aside)  # from here until the next rename, the step lives at ``aside``
        _rename(staging, final)
        fsync_dir(parent)
        remove_tree(aside)  # renamed to a trash name first: never partial under a replaced name
        return
    if not _renameat2(staging, final, RENAME_NOREPLACE):
        if os.path.lexists(final):
            raise FileExistsError(errno.EEXIST, "destination exists", final)
        _rename(staging, final)
    fsync_dir(parent)


def _rename(src: str, dst: str) -> None:
    os.rename(src, dst)


def replaced_of(final: str) -> list[str]:
    """The replaced directories of the checkpoint directory ``final`` (full paths), newest
    checkpoint first (by the ``created_at`` of their manifests; unreadable ones last)."""
    parent, name = os.path.split(os.path.normpath(final))
    try:
        names = os.listdir(parent)
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for n in names:
        if replaced_final(n) == name:
            path = os.path.join(parent, n)
            try:
                created = float(open_local_manifest(path).get("created_at") or 0.0)
            except (CheckpointError, OSError, TypeError, ValueError):
                created = float("-inf")
            found.append((created, n, path))
    return [p for _, _, p in sorted(found, reverse=True)]


def recover_replaced(final: str) -> bool:
    """Undo an overwrite of ``final`` that was killed between its two renames: if nothing is at
    ``final`` and the checkpoint it replaced is set aside (complete: a readable manifest), rename
    it back. Returns True if it did. For the process that owns the root's writes (the
    coordinator holding the writer lease, or the save to this very path): a reader must not
    rename anything (a live overwrite may be between its renames)."""
    if os.path.lexists(final):
        return False
    for aside in replaced_of(final):
        try:
            open_local_manifest(aside)
        except (CheckpointError, OSError):
            continue  # never partial by construction; whatever it is, not a checkpoint to restore
        try:
            _rename(aside, final)
        except FileNotFoundError:
            continue
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                return False  # something took the name meanwhile: the aside is a leftover now
            raise
        fsync_dir(os.path.dirname(os.path.normpath(final)))
        return True
    return False


def remove_tree(path: str) -> None:
    """Delete a directory so it never looks committed half-way: rename aside, then delete."""
    parent, name = os.path.split(os.path.normpath(path))
    if not name.startswith(".") or TRASH_MARK not in name:
        aside = os.path.join(parent, f".{name.lstrip('.')}{TRASH_MARK}{uuid.uuid4().hex[:12]}")
        try:
            _rename(path, aside)
        except FileNotFoundError:
            return
        path = aside
    rmtree_quiet(path)


def rmtree_quiet(path: str) -> None:
    """``shutil.rmtree(path, ignore_errors=True)`` that really never raises. On FUSE and NFS-like
    mounts (bindfs measured, Python 3.11) rmtree raises a nameless FileNotFoundError from its
    ``fstat`` of a subdirectory that another process removed meanwhile, outside its error
    handling: two ranks of a node clearing the same step failed a save on every rank. A race
    leaves part of the tree: the next pass removes it (what three passes leave stays, as with
    ``ignore_errors``)."""
    for _ in range(3):
        try:
            shutil.rmtree(path, ignore_errors=True)
        except OSError:
            continue
        return


def open_local_manifest(ckpt_dir: str) -> dict[str, Any]:
    """The validated manifest of a local checkpoint directory, or CheckpointNotFound (absent,
    a staging leftover, no manifest) / CorruptCheckpoint."""
    name = os.path.basename(os.path.normpath(ckpt_dir))
    if not os.path.isdir(ckpt_dir):
        aside = replaced_of(ckpt_dir) if not os.path.lexists(ckpt_dir) else []
        if aside:
            raise CheckpointNotFound(
                f"no checkpoint at {ckpt_dir}: an overwrite of it was interrupted (or is under way) "
                f"between its two renames; the replaced checkpoint is intact at {aside[0]}. Load it from "
                "there; the next save to this path, or its CheckpointManager's next save, puts it back",
                path=ckpt_dir)
        raise CheckpointNotFound(f"no checkpoint at {ckpt_dir}: the directory does not exist", path=ckpt_dir)
    if is_staging_name(name) or not os.path.isfile(os.path.join(ckpt_dir, MANIFEST)):
        raise CheckpointNotFound(
            f"{ckpt_dir} is not a committed safeckpt checkpoint (no {MANIFEST}; an interrupted "
            "save never publishes one). Use `safeckpt ls` on its parent to see what is there.",
            path=ckpt_dir,
        )
    return _manifest.read_manifest(ckpt_dir)  # looked up at call time (tests wrap it)


# ----------------------------------------------------------------- names inside a checkpoint

_O_PATH = getattr(os, "O_PATH", 0)  # Linux: a handle to walk through, no read permission needed
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_ANCHORS: dict[str, str] = {}  # directory -> the checkpoint directory it lies in (found ones only)
_ANCHORS_MAX = 4096


def checkpoint_dir_of(path: str) -> str | None:
    """The checkpoint directory ``path`` lies in: the shallowest proper ancestor that is a
    save's staging or replaced directory (by its name) or holds a ``manifest.json``; None if
    there is none. Found top-down, so a directory below the checkpoint (a ``written`` name's,
    possibly a symlink to somewhere else that holds a manifest too) is never taken for it.
    Symlinks above it (a root reached through a link) are the user's business and followed."""
    parent = os.path.dirname(os.path.abspath(path))
    hit = _ANCHORS.get(parent)
    if hit is not None:
        return hit
    cur = os.sep
    found = None
    for part in parent.split(os.sep):
        if not part:
            continue
        cur = os.path.join(cur, part)
        if is_staging_name(part) or replaced_final(part) or os.path.lexists(os.path.join(cur, MANIFEST)):
            found = cur
            break
    if found is not None:
        if len(_ANCHORS) >= _ANCHORS_MAX:
            _ANCHORS.pop(next(iter(_ANCHORS)))
        _ANCHORS[parent] = found
    return found


def _relative_parts(path: str) -> tuple[str, list[str]] | None:
    """(checkpoint directory, the components of ``path`` below it) or None outside one."""
    anchor = checkpoint_dir_of(path)
    if anchor is None:
        return None
    rel = os.path.relpath(os.path.abspath(path), anchor)
    return anchor, rel.split(os.sep)


class _Linked(Exception):
    """A component of a name below the checkpoint directory is a symlink or not a directory."""

    def __init__(self, where: str, link: bool) -> None:
        super().__init__(where)
        self.where, self.link = where, link


def _open_parent(anchor: str, parts: list[str], path: str) -> int:
    """A handle on the directory holding the last of ``parts`` (relative to ``anchor``), reached
    one component at a time without following a symlink. FileNotFoundError if one is missing;
    _Linked if one is a symlink or not a directory; an error that can pass is tried again, then
    StorageUnavailable (see ``format.manifest.retry_io``)."""
    fd = retry_io(lambda: os.open(anchor, (_O_PATH or os.O_RDONLY) | os.O_DIRECTORY | _O_CLOEXEC),
                  f"cannot open {anchor}")
    walked = anchor
    try:
        for part in parts[:-1]:
            walked = os.path.join(walked, part)
            try:
                nfd = retry_io(lambda p=part, d=fd: os.open(
                    p, (_O_PATH or os.O_RDONLY) | os.O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC, dir_fd=d),
                    f"cannot open {path}")
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise _Linked(walked, os.path.islink(walked)) from None
                raise
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


def lstat_beneath(path: str) -> os.stat_result | None:
    """``os.lstat(path)`` where no component of ``path`` below its checkpoint directory is
    followed if it is a symlink; None if one is (or if anything is missing)."""
    where = _relative_parts(path)
    if where is None or len(where[1]) == 1:  # a file directly in the checkpoint: nothing to walk
        try:
            return os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            return None
    anchor, parts = where
    try:
        fd = _open_parent(anchor, parts, path)
    except (FileNotFoundError, NotADirectoryError, _Linked):
        return None
    try:
        return os.stat(parts[-1], dir_fd=fd, follow_symlinks=False)
    except (FileNotFoundError, NotADirectoryError):
        return None
    finally:
        os.close(fd)


def open_beneath(path: str) -> int:
    """Open a file named by a manifest for reading (as ``open_regular``: only a regular file,
    never blocking on a FIFO; damage is CorruptCheckpoint, an error that can pass
    StorageUnavailable), following no symlink in any component of its name below the
    checkpoint directory."""
    where = _relative_parts(path)
    if where is None or len(where[1]) == 1:
        return open_regular(path, where[0] if where else os.path.dirname(path))
    anchor, parts = where
    try:
        fd = _open_parent(anchor, parts, path)
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{path} is missing", path=anchor) from None
    except _Linked as exc:
        what = "a symlink; refusing to follow it" if exc.link else "not a directory"
        raise CorruptCheckpoint(f"{path}: {exc.where} is {what}", path=anchor) from None
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM):
            raise CheckpointError(f"cannot read {path}: permission denied (run as a user who can "
                                  "read the checkpoint, or fix its permissions)") from exc
        raise unavailable(f"cannot open {path}", exc) from exc
    try:  # the last name opened inside its (link-free) parent, checked as any data file is
        return open_regular(path, anchor, dir_fd=fd, name=parts[-1])
    finally:
        os.close(fd)


HASH_BLOCK = 8 << 20  # bytes read per call when hashing a whole file


def digest_file(path: str, spans: Sequence[tuple[int, int]] = (), progress: Callable[[int], None] | None = None,
                block: int = HASH_BLOCK) -> FileDigest:
    """:meth:`Storage.hash` of a local file: read once in ``block``-byte pieces (into one
    buffer, so memory stays flat however large the file; never through a symlink in any
    component of its name below the checkpoint directory, never from a FIFO), each piece
    hashed into the file's digest and its spans' while in the CPU cache."""
    fd = open_beneath(path)
    try:
        return digest_fd(fd, spans, progress, block)
    finally:
        os.close(fd)


def digest_fd(fd: int, spans: Sequence[tuple[int, int]] = (), progress: Callable[[int], None] | None = None,
              block: int = HASH_BLOCK) -> FileDigest:
    """:func:`digest_file` of an open descriptor, from the file's first byte to its end (read
    with ``pread``: the descriptor's offset is not used), for a caller that must know which
    file it hashed (``fstat`` of the same descriptor)."""
    d = StreamDigest(spans)
    # no bigger than the file: a small file (a framework's JSON) must not cost 8 MiB of new pages
    buf = bytearray(max(1, min(block, os.fstat(fd).st_size)))
    view = memoryview(buf)
    while n := os.preadv(fd, [buf], d.pos):
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
        # Inside a checkpoint no component is followed if it is a symlink (a ``written`` name
        # ``d/hostname`` with ``d -> /etc`` has no size); elsewhere (a save's target) as stat.
        if checkpoint_dir_of(path) is not None:
            st = lstat_beneath(path)
        else:
            try:
                st = os.stat(path)
            except (FileNotFoundError, NotADirectoryError):
                return None
        return st.st_size if st is not None and stat.S_ISREG(st.st_mode) else None

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

    def put_back(self, final: str) -> bool:
        return recover_replaced(final)

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
