"""Shared set-up of the one-process Hugging Face integration tests (Trainer / Accelerate, CPU).

Import it before transformers, torch or accelerate: importing it skips the test module when
transformers or accelerate is missing (before either is imported), puts ``scripts/`` on
``sys.path`` for ``hf_tiny`` and sets the offline environment. A test module imports
``fresh_accelerate_state`` into its namespace for the autouse fixture to apply; it is not in a
conftest.py so that the Lightning and DeepSpeed tests beside them never import accelerate.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts"))
import hf_tiny as tiny  # noqa: E402

for _k, _v in tiny.OFFLINE_ENV.items():
    os.environ.setdefault(_k, _v)

if TYPE_CHECKING:
    from transformers import TrainingArguments

__all__ = ["flip_data_byte", "fresh_accelerate_state", "reset_accelerate_state", "tiny", "training_args"]


def reset_accelerate_state() -> None:
    """Drop Accelerate's process-wide singletons, so the next Accelerator or Trainer starts fresh."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture(autouse=True)
def fresh_accelerate_state() -> Iterator[None]:
    """Accelerate keeps process-wide singletons; leave none behind for other tests."""
    yield
    reset_accelerate_state()


def training_args(out: str, **kw: Any) -> TrainingArguments:
    """Trainer arguments for a short CPU run saving every 2 steps, with no reporting, progress
    bars or loader workers; ``kw`` adds to or overrides them."""
    from transformers import TrainingArguments

    base = dict(output_dir=out, per_device_train_batch_size=2, save_steps=2, save_strategy="steps",
                report_to="none", use_cpu=True, disable_tqdm=True, dataloader_num_workers=0)
    base.update(kw)
    return TrainingArguments(**base)


def flip_data_byte(ckpt: str) -> None:
    """Same-size damage: flip the middle byte of the checkpoint's first data file (inside a
    tensor's bytes, not in the entries a resume reads first)."""
    data = sorted(f for f in os.listdir(ckpt) if f.endswith(".safetensors"))
    path = os.path.join(ckpt, data[0])
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(size // 2)
        b = f.read(1)
        f.seek(size // 2)
        f.write(bytes([b[0] ^ 0xFF]))
