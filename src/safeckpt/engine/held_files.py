"""Files a restore holds in memory: verified copies a node fetched but could not keep on its
disk (ENOSPC on a full RAM disk or NVMe), served to this process's load of the step from an
anonymous memory file (``memfd``), so a full local disk never turns a restorable step into an
older one. Linux only (``os.memfd_create``); elsewhere nothing is held and the restore falls
back as before (root's copy of the step, else an older step).

The registry is per process and short-lived: a restore holds files for one load and releases
them when the load returns (:func:`release`).

A node of one rank also receives the files it fetches into buffers it keeps (:class:`Received`):
the load reads them from there (:class:`BufferFile`: hashed in place, copied into the state,
every chunk checked as from a file) and the node writes them to its disk after the load, off
the restore's critical path."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any

import torch
import xxhash

from ..errors import CorruptCheckpoint
from ..format.shardfile import MappedFile, check_chunk, is_empty

_HELD: dict[str, Any] = {}  # normalized local path -> the verified bytes (a buffer)
_LOCK = threading.Lock()


def available() -> bool:
    return hasattr(os, "memfd_create")


def hold(path: str, data: Any) -> bool:
    """Serve ``path`` from ``data`` (verified bytes) to this process's reads through the tier's
    storage until :func:`release`; False (nothing held) where memory files do not exist (a
    :class:`Received` or a manifest's bytes need none)."""
    if not available() and not isinstance(data, (Received, bytes)):
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


class Received:
    """A buffer of ``size`` bytes for a receive to fill (``tensor``, plain memory: a memory
    file's pages cost twice as much to fault in), read by the load through :class:`BufferFile`
    and written to the node's disk after it. :meth:`close` drops it."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._data: torch.Tensor | None = torch.empty(size, dtype=torch.uint8)

    @property
    def tensor(self) -> torch.Tensor:
        assert self._data is not None, "closed"
        return self._data

    def view(self) -> memoryview:
        return memoryview(self.tensor.numpy())

    def close(self) -> None:
        self._data = None


def receive_buffer(size: int) -> Received | None:
    """A :class:`Received` of ``size`` bytes (None for an empty file: nothing to receive)."""
    return Received(size) if size > 0 else None


class BufferFile:
    """A data file served from a :class:`Received` (bytes verified whole on arrival), with the
    reader's interface of a local file (``safeckpt.format.shardfile.MappedFile``): reads are
    copies out of the buffer, hashing runs over it in place (no file, no mapping, no page
    faults); every chunk is still checked against the file's index as the load reads it."""

    def __init__(self, path: str, got: Received, size: int) -> None:
        if got.size != size:
            raise CorruptCheckpoint(f"data file {path} held in memory has {got.size} bytes, the manifest says {size}",
                                    path=os.path.dirname(path))
        self.path = path
        self.ckpt = os.path.dirname(path)
        self.size = size
        self._buf: memoryview | None = got.view()

    def _view(self) -> memoryview:
        assert self._buf is not None, "closed"
        return self._buf

    def read_into(self, start: int, dst: memoryview) -> None:
        dst = dst.cast("B") if dst.format != "B" else dst
        if start + len(dst) > self.size:
            raise CorruptCheckpoint(f"{self.path} ended at byte {self.size} while reading", path=self.ckpt)
        dst[:] = self._view()[start:start + len(dst)]

    def preadv(self, bufs: list[Any], at: int) -> int:
        done = 0
        for b in bufs:
            mv = memoryview(b).cast("B")
            n = max(0, min(len(mv), self.size - at - done))
            mv[:n] = self._view()[at + done:at + done + n]
            done += n
            if n < len(mv):
                break
        return done

    def read(self, start: int, end: int) -> bytes:
        return bytes(self._view()[start:end]) if end > start else b""

    def read_hash_into(self, start: int, dst: memoryview) -> str:
        self.read_into(start, dst)
        return xxhash.xxh3_64_hexdigest(self._view()[start:start + len(dst)])

    def hash_runs(self, spans: Sequence[tuple[int, int]]) -> list[str]:
        whole = self._view()
        return [xxhash.xxh3_64_hexdigest(whole[s:e]) for s, e in spans]

    def hash_range_local(self, start: int, end: int, window: int) -> str:
        return xxhash.xxh3_64_hexdigest(self._view()[start:end])

    def tensor(self, start: int, end: int, dtype: torch.dtype, shape: Sequence[int], expect_hash: str | None
               ) -> torch.Tensor:
        if is_empty(shape, start, end):
            return torch.empty(tuple(shape), dtype=dtype)
        view = self._view()[start:end]
        check_chunk(view, expect_hash, f"{self.path} bytes {start}-{end}", self.ckpt)
        # a copy: the buffer is released when the load returns, a tensor may outlive it
        return torch.frombuffer(bytearray(view), dtype=torch.uint8).view(dtype).reshape(tuple(shape))

    def close(self) -> None:
        self._buf = None


def open_held(path: str, data: Any, size: int) -> MappedFile:
    """A MappedFile over a fresh memory file holding ``data`` (the reader's usual file: preadv
    into place, hashing, mappings), checked to have ``size`` bytes; over ``data``'s own memory
    file when it is a :class:`Received`."""
    if isinstance(data, Received):
        return BufferFile(path, data, size)  # type: ignore[return-value]  # MappedFile's interface
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
