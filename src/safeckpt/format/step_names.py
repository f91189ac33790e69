"""The training step in a checkpoint directory name, for the names frameworks give them.

One pure function, no I/O: :func:`step_from_name`. The names recognised, each in its canonical
form only (the step written without leading zeros, except safeckpt's own padded form), so that
a name reads as one step and never as another:

====================================  =====================================  ==========
name                                  written by                             step
====================================  =====================================  ==========
``step-0000000100``                   safeckpt's CheckpointManager           100
``step-100``                          torchtitan, and safeckpt.dcp users     100
``checkpoint-100``                    Hugging Face Trainer                   100
``checkpoint_100``                    Accelerate                             100
``global_step100``                    DeepSpeed                              100
``epoch=2-step=100`` (``.ckpt``,      Lightning's ModelCheckpoint            100
``-v1``, ``-v1.ckpt``)
====================================  =====================================  ==========

Anything else (``last.ckpt``, ``step-07``, ``checkpoint-1e3``, a hidden staging directory
``.step-100.safeckpt-staging-...``) has no step: None.
"""

from __future__ import annotations

import re

__all__ = ["step_from_name"]

_NUM = r"(0|[1-9][0-9]*)"  # canonical: no leading zeros
_PATTERNS = (
    re.compile(r"step-([0-9]{10})"),  # safeckpt's default, zero-padded to 10 digits
    re.compile(rf"step-{_NUM}"),
    re.compile(rf"checkpoint-{_NUM}"),
    re.compile(rf"checkpoint_{_NUM}"),
    re.compile(rf"global_step{_NUM}"),
    # Lightning: "epoch={epoch}-step={step}", ModelCheckpoint's "-vN" for a name taken, ".ckpt"
    re.compile(rf"epoch={_NUM}-step={_NUM}(?:-v[1-9][0-9]*)?(?:\.ckpt)?"),
)
MAX_STEP = (1 << 63) - 1  # what JSON readers and torch's int64 hold


def step_from_name(name: str) -> int | None:
    """The step in checkpoint directory name ``name`` (its last path component, not a path),
    or None when it is not one of the names above."""
    if not isinstance(name, str) or len(name) > 255:
        return None
    for pattern in _PATTERNS:
        m = pattern.fullmatch(name)  # fullmatch: "step-5\n" is not a name
        if m is not None:
            step = int(m.group(m.lastindex or 1))
            return step if step <= MAX_STEP else None
    return None
