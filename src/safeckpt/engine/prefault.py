"""Fault in the pages of a load's destination tensors on a helper thread, ahead of the copy.

Tensors allocated just before a load (``torch.empty``, a model built on the CPU) have no pages
yet: the copy pass then takes one page fault per 4 KiB, and on the development VM that cost
~0.2 s per 512 MiB, as much as reading the bytes from disk. ``MADV_POPULATE_WRITE`` (Linux
5.14+) makes the kernel fault the pages in without touching their contents (a page that exists
keeps its bytes; a new one reads as zeros, as it would anyway), so it changes nothing the
caller can observe and can run while the load is still verifying checksums: the faults overlap
the verification pass instead of following it. It stops when the copy starts (the two would
fault the same pages and contend), and skips tensors whose pages are resident already (probed
with ``mincore`` at their first, middle and last page). Anywhere the calls are missing or
refused, this does nothing: it is only a head start.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys
import threading
from collections.abc import Iterable

import torch

from ..format.tree import is_dtensor, local_of

MADV_POPULATE_WRITE = 23  # linux/mman.h
MIN_BYTES = 16 << 20  # below this the thread costs more than the faults
MIN_TENSOR = 256 << 10  # smaller tensors come from the allocator's heap, whose pages are
# reused and resident: skipping them keeps a state of 4,000 small tensors from paying ~8 ms
# of probes for nothing
PIECE = 8 << 20  # bytes per call: stop() waits for at most one call (a few ms)

_libc: object = None  # (madvise, mincore), resolved on first use; False where unavailable


def _get_libc() -> object:
    global _libc
    if _libc is None:
        _libc = False
        if sys.platform.startswith("linux"):
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
                madvise, mincore = libc.madvise, libc.mincore
                madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
                madvise.restype = mincore.restype = ctypes.c_int
                _libc = (madvise, mincore)
            except (OSError, AttributeError, TypeError):
                pass
    return _libc


def _resident(mincore: object, start: int, end: int) -> bool:
    """Whether the first, middle and last page of [start, end) are in memory (a tensor that
    was written to, e.g. initialised, has all its pages)."""
    page = mmap.PAGESIZE
    vec = ctypes.create_string_buffer(1)
    for at in (start, start + ((end - start) // 2 // page) * page, end - page):
        if mincore(at, page, vec) != 0 or not vec.raw[0] & 1:  # type: ignore[operator]
            return False
    return True


def page_ranges(tensors: Iterable[torch.Tensor]) -> list[tuple[int, int]]:
    """The page-aligned [start, end) address ranges of the bytes of the CPU tensors of at least
    MIN_TENSOR bytes (a DTensor's local shard), merged."""
    page = mmap.PAGESIZE
    spans = []
    for t in tensors:
        if is_dtensor(t):
            t = local_of(t)
        if t.nbytes < MIN_TENSOR or t.device.type != "cpu":
            continue
        start = t.data_ptr()
        end = start + t.numel() * t.element_size() if t.is_contiguous() else _storage_end(t)
        spans.append((start - start % page, -(-end // page) * page))
    spans.sort()
    merged: list[tuple[int, int]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _storage_end(t: torch.Tensor) -> int:
    """The end address of the bytes a strided tensor can reach."""
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return t.data_ptr() + (last + 1) * t.element_size()


class Prefault:
    """Starts faulting in ``tensors``' untouched pages at once; :meth:`stop` ends it."""

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        self.thread: threading.Thread | None = None
        self.stopping = False
        libc = _get_libc()
        if not libc:
            return
        madvise, mincore = libc  # type: ignore[misc]
        ranges = [(s, e) for s, e in page_ranges(tensors) if not _resident(mincore, s, e)]
        if sum(end - start for start, end in ranges) < MIN_BYTES:
            return
        self.thread = threading.Thread(target=self._run, args=(madvise, ranges), name="safeckpt-prefault",
                                       daemon=True)
        self.thread.start()

    def _run(self, madvise: object, ranges: list[tuple[int, int]]) -> None:
        for start, end in ranges:
            for at in range(start, end, PIECE):
                if self.stopping:
                    return
                if madvise(at, min(PIECE, end - at), MADV_POPULATE_WRITE) != 0:  # type: ignore[operator]
                    return  # unsupported (EINVAL before Linux 5.14) or refused: nothing lost

    def stop(self) -> None:
        """Stop and wait for the thread. Call it before the copy starts, and before the load
        returns or raises: the caller's tensors (and so their memory) outlive the thread."""
        if self.thread is not None:
            self.stopping = True
            self.thread.join()
            self.thread = None


def populate(t: torch.Tensor) -> None:
    """Fault in the pages of a fresh CPU tensor of at least MIN_TENSOR bytes now, in one call,
    before reading into it: a read into pages that do not exist yet takes one fault per 4 KiB
    inside the copy. Nothing is observable either way (see the module docstring)."""
    libc = _get_libc()
    if not libc or t.nbytes < MIN_TENSOR or t.device.type != "cpu":
        return
    madvise = libc[0]  # type: ignore[index]
    page = mmap.PAGESIZE
    start = -(-t.data_ptr() // page) * page  # whole pages inside the tensor only
    end = (t.data_ptr() + t.nbytes) // page * page
    if end > start:
        madvise(start, end - start, MADV_POPULATE_WRITE)  # type: ignore[operator]
