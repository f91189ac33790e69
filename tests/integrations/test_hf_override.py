"""Issue 19 (req. 2): a model's own ``load_state_dict`` is honoured where Trainer calls it
(``model.load_state_dict(state_dict, False)`` on resume and at ``load_best_model_at_end``), with
safeckpt's checks kept: checksums of what the override gets, missing/unexpected keys refused.
One process, tiny Llama, CPU."""

from __future__ import annotations

import os

import pytest

# First: skips this module without transformers or accelerate, sets the offline environment.
from tests.integrations.hf_testing import (
    flip_data_byte,
    reset_accelerate_state,
    tiny,
    training_args,
)

# isort: split
import torch
from transformers import LlamaForCausalLM, Trainer

import safeckpt
from safeckpt.errors import CorruptCheckpoint, IncompatibleCheckpoint
from safeckpt.integrations.hf import with_safeckpt

pytestmark = pytest.mark.timeout(300)


class Resizing(LlamaForCausalLM):
    """A Llama with a persistent ``memory`` buffer whose length changes during training; its
    ``load_state_dict`` resizes the buffer to the saved one (what Trainer honours)."""

    calls = 0
    after: dict = {}

    def __init__(self, config, slots: int = 2) -> None:
        super().__init__(config)
        self.register_buffer("memory", torch.zeros(slots))

    def grow(self, step: int) -> None:
        self.memory = torch.arange(step + 2, dtype=torch.float32) * 0.5

    def load_state_dict(self, state_dict, strict=True, assign=False):  # noqa: ANN001, ANN201
        type(self).calls += 1
        self.memory = torch.empty_like(state_dict["memory"])
        result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        type(self).after = {k: v.detach().clone() for k, v in self.state_dict().items()}
        return result


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():  # noqa: ANN202
    reset_accelerate_state()
    yield
    reset_accelerate_state()


def _model() -> Resizing:
    torch.manual_seed(0)
    return Resizing(tiny.config(dropout=0.0))


def _trainer(out: str, model: Resizing, max_steps: int, eval_dataset: object = None, **kw: object):
    from transformers import TrainerCallback

    class Grow(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **_):  # noqa: ANN001, ANN201
            model.grow(state.global_step)

    args = training_args(out, max_steps=max_steps, seed=0, **kw)
    return with_safeckpt(Trainer)(model=model, args=args, train_dataset=tiny.TokenData(16, 1),
                                  eval_dataset=eval_dataset, callbacks=[Grow()])


def test_resume_calls_the_models_own_load_state_dict_with_verified_weights(tmp_path) -> None:
    out = str(tmp_path / "run")
    _trainer(out, _model(), 4).train()
    ckpt = os.path.join(out, "checkpoint-4")
    saved = safeckpt.read_state_dict(ckpt, nested=True)["model"]
    assert saved["memory"].shape == (6,)  # grown to step 4's size

    # A fresh model (memory of 2 slots): the in-place load would refuse the shape; the
    # override resizes, as with stock Trainer.
    model = _model()
    Resizing.calls = 0
    t = _trainer(out, model, 4)
    t.train(resume_from_checkpoint=ckpt)
    assert Resizing.calls == 1
    now = Resizing.after  # the model right after the override loaded it
    assert set(now) == set(saved)
    assert [k for k in saved if not torch.equal(now[k], saved[k])] == []

    # Training goes on from the resumed state.
    model = _model()
    t = _trainer(out, model, 6)
    t.train(resume_from_checkpoint=True)
    assert t.state.global_step == 6 and model.memory.shape == (8,)

    # safeckpt's verification is kept: damaged bytes are refused before the override runs.
    flip_data_byte(ckpt)
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    Resizing.calls = 0
    with pytest.raises(CorruptCheckpoint):
        _trainer(out, model, 6).train(resume_from_checkpoint=ckpt)
    assert Resizing.calls == 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_override_reporting_missing_keys_is_refused_and_best_model_uses_the_override(tmp_path) -> None:
    out = str(tmp_path / "run")
    model = _model()
    t = _trainer(out, model, 4, eval_strategy="steps", eval_steps=2, load_best_model_at_end=True,
                 metric_for_best_model="loss", greater_is_better=False, per_device_eval_batch_size=2,
                 eval_dataset=tiny.TokenData(2, 2))
    Resizing.calls = 0
    t.train()
    best = t.state.best_model_checkpoint
    assert Resizing.calls == 1 and best  # load_best_model_at_end went through the override
    saved = safeckpt.read_state_dict(best, nested=True)["model"]
    assert [k for k, v in model.state_dict().items() if not torch.equal(v, saved[k])] == []
    assert [k for k, v in Resizing.after.items() if not torch.equal(v, saved[k])] == []

    class Dropping(Resizing):
        def load_state_dict(self, state_dict, strict=True, assign=False):  # noqa: ANN001, ANN201
            sd = {k: v for k, v in state_dict.items() if k != "lm_head.weight"}
            return super().load_state_dict(sd, strict=strict, assign=assign)

    torch.manual_seed(0)
    dropping = Dropping(tiny.config(dropout=0.0))
    with pytest.raises(IncompatibleCheckpoint, match="lm_head.weight"):
        _trainer(out, dropping, 6).train(resume_from_checkpoint=os.path.join(out, "checkpoint-4"))
