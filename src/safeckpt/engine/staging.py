"""Copy an async save's tensors aside into host buffers, blocking the training loop only for
the copy itself.

CPU tensors: one batched copy (``torch._foreach_copy_``: for thousands of small tensors it
costs a fraction of a ``copy_`` per tensor). CUDA tensors: device-to-host copies into pinned
buffers, enqueued on a side stream per device that first waits for the current stream (so the
copies see what the training step computed). The current stream then waits for the copies on
the GPU, so the next step cannot overwrite a parameter before it was copied, and the host does
not wait at all: the background writer waits for the returned events before reading the
buffers. ``record_stream`` keeps the caching allocator from handing a source's memory to
another tensor before its copy ran.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .prefault import populate

_SIDE_STREAMS: dict[Any, Any] = {}  # device -> the stream the copies of that device run on


@dataclass
class PendingCopies:
    """Device-to-host copies still running; :meth:`wait` before reading the host buffers."""

    events: list[Any] = field(default_factory=list)

    def wait(self) -> None:
        for event in self.events:
            event.synchronize()
        self.events = []


def copy_aside(bufs: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> PendingCopies:
    """Copy every ``srcs[i]`` into the host tensor ``bufs[i]`` (same shape and dtype).
    CPU copies are done when this returns; CUDA copies when the result's ``wait`` returns."""
    if not torch.cuda.is_initialized():  # no tensor can be on a GPU: skip sorting them
        if bufs:
            _copy_batched(list(bufs), list(srcs))
        return PendingCopies()
    host_dsts, host_srcs = [], []
    by_device: dict[Any, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for b, s in zip(bufs, srcs, strict=True):  # one pass, is_cuda (44 ns; device.type: 280 ns)
        if s.is_cuda:
            by_device.setdefault(s.device, []).append((b, s))
        else:
            host_dsts.append(b)
            host_srcs.append(s)
    if host_dsts:
        _copy_batched(host_dsts, host_srcs)
    pending = PendingCopies()
    for device, pairs in by_device.items():
        pending.events.append(_copy_from_device(device, pairs))
    return pending


def _copy_batched(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    try:
        torch._foreach_copy_(dsts, srcs)
    except (RuntimeError, TypeError, AttributeError):  # an older torch, or an unusual tensor
        for d, s in zip(dsts, srcs, strict=True):
            d.copy_(s)


def _copy_from_device(device: Any, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """Enqueue the copies of one device on its side stream; return the event that marks them done."""
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)
    producer = torch.cuda.current_stream(device)
    stream.wait_stream(producer)
    with torch.cuda.stream(stream):
        for buf, src in pairs:
            buf.copy_(src, non_blocking=True)
            src.record_stream(stream)
    done = torch.cuda.Event()
    done.record(stream)
    producer.wait_event(done)
    return done


class SnapshotPool:
    """Reusable staging buffers for async saves (pinned when CUDA is present): allocated for
    the first save of a layout, reused as they are by every later save of the same layout."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.items: list[tuple[str, torch.Tensor]] = []
        self.bufs: list[torch.Tensor] = []
        self.by_name: dict[str, torch.Tensor] = {}

    def staged(self, key: tuple, items: list[tuple[str, torch.Tensor]]
               ) -> tuple[list[tuple[str, torch.Tensor]], list[torch.Tensor]]:
        """The write items with a buffer in place of each tensor, and the buffers. The same
        lists for every save of the same plan (building them cost ~0.5 ms for 4,000 tensors)."""
        if key == self.key and len(self.bufs) == len(items):
            return self.items, self.bufs
        bufs = []
        for name, src in items:
            buf = self.by_name.get(name)
            if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
                pinned = torch.cuda.is_available()  # page-locked: its pages exist already
                buf = torch.empty(src.shape, dtype=src.dtype, pin_memory=pinned)
                if not pinned:
                    populate(buf)  # new pages faulted in with one call, not one per 4 KiB of the copy
            bufs.append(buf)
        self.key, self.bufs = key, bufs
        self.items = [(name, buf) for (name, _), buf in zip(items, bufs, strict=True)]
        self.by_name = dict(self.items)
        return self.items, bufs
