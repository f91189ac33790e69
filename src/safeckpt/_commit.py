"""Make a checkpoint directory appear atomically, or not at all (single process; no collectives).

The coordinator writes the manifest into the staging directory, fsyncs it, then publishes the
directory with one rename and fsyncs the parent. ``renameat2(RENAME_NOREPLACE)`` makes "publish
only if nothing is there" atomic (a plain rename silently replaces an empty directory); for
``overwrite=True``, ``RENAME_EXCHANGE`` swaps old and new in one step, so the old checkpoint is
never removed before the new one is visible. Where renameat2 is unavailable we fall back to
plain renames with the old checkpoint moved aside first (never deleted before the new one is in
place).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import shutil
import uuid
from typing import Any

from ._manifest import MANIFEST, STAGING_MARK, TRASH_MARK, is_staging_name

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


def write_bytes_atomic(path: str, data: bytes) -> None:
    """Write ``data`` to a sibling temp file, fsync, rename over ``path``, fsync the directory."""
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


def is_committed(path: str) -> bool:
    """A published checkpoint: a non-staging directory holding a manifest."""
    name = os.path.basename(os.path.normpath(path))
    return not is_staging_name(name) and os.path.isfile(os.path.join(path, MANIFEST))


def new_staging_dir(final: str) -> str:
    parent, name = os.path.split(os.path.normpath(final))
    staging = os.path.join(parent, f".{name}{STAGING_MARK}{uuid.uuid4().hex[:12]}")
    os.mkdir(staging)
    fsync_dir(parent)
    return staging


def publish(staging: str, final: str, *, replace: bool) -> None:
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
