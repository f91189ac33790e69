"""Files a restore holds in memory: verified copies a node fetched but could not keep on its
disk (ENOSPC on a full RAM disk or NVMe), served to this process's load of the step from an
anonymous memory file (``memfd``), so a full local disk never turns a restorable step into an
older one. Linux only (``os.memfd_create``); elsewhere nothing is held and the restore falls
back as before (root's copy of the step, else an older step).

The registry is per process and short-lived: a restore holds files for one load and releases
them when the load returns (:func:`release`)."""

from __future__ import annotations

import os
import threading
from typing import Any

from ..errors import CorruptCheckpoint
from ..format.shardfile import MappedFile

_HELD: dict[str, Any] = {}  # normalized local path -> the verified bytes (a buffer)
_LOCK = threading.Lock()


def available() -> bool:
    return hasattr(os, "memfd_create")


def hold(path: str, data: Any) -> bool:
    """Serve ``path`` from ``data`` (verified bytes) to this process's reads through the tier's
    storage until :func:`release`; False (nothing held) where memory files do not exist."""
    if not available():
        return False
    with _LOCK:
        _HELD[os.path.normpath(path)] = data
    return True


def held(path: str) -> Any:
    """The bytes held for ``path``, or None."""
    with _LOCK:
        return _HELD.get(os.path.normpath(path))


def release(prefix: str) -> None:
    """Drop every file held under the directory ``prefix``."""
    base = os.path.normpath(prefix) + os.sep
    with _LOCK:
        for key in [k for k in _HELD if k.startswith(base)]:
            del _HELD[key]


def open_held(path: str, data: Any, size: int) -> MappedFile:
    """A MappedFile over a fresh memory file holding ``data`` (the reader's usual file: preadv
    into place, hashing, mappings), checked to have ``size`` bytes."""
    view = memoryview(data).cast("B")
    if len(view) != size:
        raise CorruptCheckpoint(f"data file {path} held in memory has {len(view)} bytes, the manifest says {size}",
                                path=os.path.dirname(path))
    fd = os.memfd_create(os.path.basename(path)[:200], getattr(os, "MFD_CLOEXEC", 0))
    try:
        done = 0
        while done < size:
            done += os.write(fd, view[done:])
        return MappedFile(path, size, fd=fd)
    except BaseException:
        os.close(fd)
        raise
