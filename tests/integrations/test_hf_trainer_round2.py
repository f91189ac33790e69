"""Issue 19: Trainer with safeckpt gives Trainer's answers (one process, tiny Llama, CPU).

Best model, rotation, callbacks and checkpoint names are compared with the stock Trainer run on
the same arguments; resume falls back past a checkpoint damaged anywhere.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings

import pytest

# First: skips this module without transformers or accelerate, sets the offline environment.
from tests.integrations.hf_testing import (
    flip_data_byte,
    fresh_accelerate_state,  # noqa: F401 - autouse fixture
    reset_accelerate_state,
    tiny,
    training_args,
)

# isort: split
import torch
from transformers import Trainer, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

import safeckpt
from safeckpt.integrations.hf import with_safeckpt

pytestmark = pytest.mark.timeout(300)


def _args(out: str, **kw: object) -> TrainingArguments:
    return training_args(out, **{"max_steps": 8, "logging_steps": 1, "seed": 0, **kw})


def _scripted(scores: list[float]):  # noqa: ANN202
    """compute_metrics returning the next score of a script (ties on purpose)."""
    calls = iter(scores)

    def compute(_pred: object) -> dict[str, float]:
        return {"score": next(calls)}
    return compute


def _run(cls: type, out: str, scores: list[float], **kw: object) -> Trainer:
    reset_accelerate_state()
    trainer = cls(model=tiny.model(dropout=0.0), args=_args(out, **kw),
                  train_dataset=tiny.TokenData(16, 1), eval_dataset=tiny.TokenData(2, 2),
                  compute_metrics=_scripted(scores),
                  preprocess_logits_for_metrics=lambda logits, labels: logits[..., :1])
    trainer.train()
    return trainer


def _kept(out: str) -> list[str]:
    return sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")
                  and os.path.isdir(os.path.join(out, n)))


SCENARIOS = {
    # ties: Trainer keeps the first best (strictly better only)
    "ties_limit2": dict(eval_strategy="steps", eval_steps=2, save_total_limit=2,
                        metric_for_best_model="score", greater_is_better=True),
    # eval every 3 steps, save every 2: a best at an unsaved step names no new checkpoint
    "eval3_save2": dict(eval_strategy="steps", eval_steps=3, save_total_limit=2,
                        metric_for_best_model="score", greater_is_better=False),
    # eval each epoch (4 steps per epoch), save every 2 steps
    "epoch_eval_step_save": dict(eval_strategy="epoch", save_total_limit=2, num_train_epochs=2,
                                 max_steps=-1, metric_for_best_model="score", greater_is_better=True),
    # limit 1 with load_best_model_at_end: only the best remains at the end
    "limit1_load_best": dict(eval_strategy="steps", eval_steps=2, save_total_limit=1,
                             metric_for_best_model="score", greater_is_better=True,
                             load_best_model_at_end=True),
}
SCORES = [1.0, 1.0, 0.5, 1.0, 0.2, 0.2]


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_best_model_and_rotation_match_stock_trainer(tmp_path, name) -> None:
    kw = SCENARIOS[name]
    stock = _run(Trainer, str(tmp_path / "stock"), list(SCORES), **kw)
    ours = _run(with_safeckpt(Trainer), str(tmp_path / "ours"), list(SCORES), **kw)
    assert stock.state.best_global_step == ours.state.best_global_step
    assert stock.state.best_metric == ours.state.best_metric
    s_best, o_best = stock.state.best_model_checkpoint, ours.state.best_model_checkpoint
    assert (s_best is None) == (o_best is None)
    if s_best is not None:
        assert os.path.basename(s_best) == os.path.basename(o_best)
        assert os.path.realpath(o_best).startswith(str(tmp_path / "ours"))
    assert _kept(str(tmp_path / "stock")) == _kept(str(tmp_path / "ours"))
    if kw.get("load_best_model_at_end"):
        for a, b in zip(stock.model.state_dict().values(), ours.model.state_dict().values(), strict=True):
            assert torch.equal(a, b)


def test_no_private_callback_is_visible(tmp_path) -> None:
    stock = Trainer(model=tiny.model(), args=_args(str(tmp_path / "s")))
    ours = with_safeckpt(Trainer)(model=tiny.model(), args=_args(str(tmp_path / "o")))
    assert [type(c) for c in ours.callback_handler.callbacks] == \
        [type(c) for c in stock.callback_handler.callbacks]


def _flip_model_byte(ckpt: str) -> None:
    """Same-size damage in a model tensor's bytes (not in the entries a resume reads first)."""
    rec = safeckpt.read_state_dict(ckpt)  # noqa: F841 - the checkpoint reads before damage
    flip_data_byte(ckpt)


def test_resume_falls_back_past_damage_anywhere_and_names_match_trainer(tmp_path) -> None:
    out = str(tmp_path / "run")
    cls = with_safeckpt(Trainer)
    t = cls(model=tiny.model(), args=_args(out, max_steps=4), train_dataset=tiny.TokenData(16, 1))
    t.train()
    last = get_last_checkpoint(out)  # what HF example scripts call to auto-resume
    assert last is not None and os.path.basename(last) == "checkpoint-4"
    assert os.path.isdir(last) and not os.path.islink(last)  # the commit itself, Trainer's name
    with open(os.path.join(last, "trainer_state.json")) as f:  # Trainer's file, inside the commit
        assert json.load(f)["global_step"] == 4
    assert safeckpt.verify(last, deep=True).ok
    _flip_model_byte(os.path.realpath(last))
    assert not safeckpt.verify(last, deep=True).ok

    # the same resume taken directly from checkpoint-2 (a copy), for comparison
    direct = str(tmp_path / "direct")
    shutil.copytree(out, direct)
    reset_accelerate_state()
    d = cls(model=tiny.model(), args=_args(direct, max_steps=6), train_dataset=tiny.TokenData(16, 1))
    d.train(resume_from_checkpoint=os.path.join(direct, "checkpoint-2"))

    reset_accelerate_state()
    t = cls(model=tiny.model(), args=_args(out, max_steps=6), train_dataset=tiny.TokenData(16, 1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.train(resume_from_checkpoint=True)
    assert any("step 4" in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert t.state.global_step == 6
    # resumed from step 2: its log history holds steps 1-2 from the checkpoint, then 3-6
    assert [h["step"] for h in t.state.log_history if "loss" in h] == [1, 2, 3, 4, 5, 6]
    # The fallback ran Trainer's loop again after the damaged checkpoint's load failed: it left
    # no trace (same losses, bit for bit, and the same weights as the direct resume).
    assert [h["loss"] for h in t.state.log_history if "loss" in h] == \
        [h["loss"] for h in d.state.log_history if "loss" in h]
    for a, b in zip(t.model.state_dict().values(), d.model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert os.path.basename(get_last_checkpoint(out)) == "checkpoint-6"

    reset_accelerate_state()
    t = cls(model=tiny.model(), args=_args(out, max_steps=8), train_dataset=tiny.TokenData(16, 1))
    t.train(resume_from_checkpoint=get_last_checkpoint(out))  # a checkpoint-N path resumes
    assert t.state.global_step == 8
