"""PEFT/LoRA under Trainer with safeckpt: checkpoints the size of stock's, base verified.

One process, tiny Llama from a config (no downloads). Stock Trainer saves only the adapter of a
PeftModel; safeckpt saves the trainable tensors and fingerprints of the frozen base.
"""

from __future__ import annotations

import os

import pytest

# First: skips this module without transformers or accelerate, sets the offline environment.
from tests.integrations.hf_testing import (
    fresh_accelerate_state,  # noqa: F401 - autouse fixture
    reset_accelerate_state,
    tiny,
    training_args,
)

pytest.importorskip("peft")

import torch  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402

import safeckpt  # noqa: E402
from safeckpt.integrations.hf import with_safeckpt  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def _lora(seed: int = 0):  # noqa: ANN202
    from peft import LoraConfig, get_peft_model

    base = tiny.model(seed=seed, dropout=0.0)
    return get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))


def _args(out: str, steps: int) -> TrainingArguments:
    return training_args(out, max_steps=steps, logging_steps=1, seed=0)


def _bytes(d: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(d) for f in fs)


def test_lora_checkpoint_is_stock_size_resumes_and_refuses_another_base(tmp_path) -> None:
    stock = Trainer(model=_lora(), args=_args(str(tmp_path / "stock"), 2),
                    train_dataset=tiny.TokenData(8, 1))
    stock.train()
    reset_accelerate_state()
    ours = with_safeckpt(Trainer)(model=_lora(), args=_args(str(tmp_path / "ours"), 2),
                                  train_dataset=tiny.TokenData(8, 1))
    ours.train()
    stock_size = _bytes(str(tmp_path / "stock" / "checkpoint-2"))
    ours_dir = os.path.realpath(str(tmp_path / "ours" / "checkpoint-2"))
    ours_size = _bytes(ours_dir)
    full = sum(p.numel() * p.element_size() for p in ours.model.parameters())
    trainable = sum(p.numel() * p.element_size() for p in ours.model.parameters() if p.requires_grad)
    assert trainable * 10 < full  # the test means something: the base dominates
    assert ours_size <= 1.1 * stock_size, (ours_size, stock_size)
    keys = safeckpt.read_state_dict(ours_dir)
    model_keys = [k for k in keys if k.startswith("model/")]
    assert any("lora_A" in k for k in model_keys) and not any("embed_tokens" in k for k in model_keys)
    assert any("embed_tokens" in k for k in keys if k.startswith("_safeckpt_frozen/"))

    reset_accelerate_state()  # resume onto the same base: continues to step 4
    again = with_safeckpt(Trainer)(model=_lora(), args=_args(str(tmp_path / "ours"), 4),
                                   train_dataset=tiny.TokenData(8, 1))
    again.train(resume_from_checkpoint=True)
    assert again.state.global_step == 4

    reset_accelerate_state()  # another base model (seed 1): refused, naming a frozen tensor
    other = with_safeckpt(Trainer)(model=_lora(seed=1), args=_args(str(tmp_path / "ours"), 6),
                                   train_dataset=tiny.TokenData(8, 1))
    with pytest.raises(safeckpt.IncompatibleCheckpoint, match=r"frozen tensor '.*base_model.*' differs"):
        other.train(resume_from_checkpoint=True)
    assert torch.isfinite(next(other.model.parameters())).all()
