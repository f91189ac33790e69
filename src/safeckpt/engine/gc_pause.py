"""Cyclic garbage collection paused while the training loop waits on a save or a load."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """No cyclic garbage collection while the training loop waits on us. A save of thousands
    of tensors allocates tens of thousands of small objects, which triggers collections whose
    cost grows with the whole heap of the training process (the profile of an async save of
    4,000 tensors showed most of its time in collections landing in our allocations). The
    objects are freed by reference counting anyway; GC resumes right after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
