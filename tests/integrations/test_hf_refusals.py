"""Trainer / Accelerate integration: what is refused, and how (one process, no process group).

The distributed behaviour is tested with real torchrun jobs in test_hf_trainer_accelerate.py;
these are the error paths, which must fail before training starts or before anything is
written, with a message that says what to do.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

# First: skips this module without transformers or accelerate, sets the offline environment.
from tests.integrations.hf_testing import (
    fresh_accelerate_state,  # noqa: F401 - autouse fixture
    tiny,
    training_args,
)

# isort: split
import torch
from transformers import Trainer, TrainingArguments

import safeckpt
from safeckpt.integrations.hf import SafeckptTrainerMixin, with_safeckpt

pytestmark = pytest.mark.timeout(120)


def _args(out: str, **kw: object) -> TrainingArguments:
    return training_args(out, **{"max_steps": 2, "logging_steps": 1, **kw})


def _trainer(out: str, model: object = None, async_save: bool = False, **kw: object) -> Trainer:
    return with_safeckpt(Trainer, async_save=async_save)(model=model or tiny.model(), args=_args(out, **kw),
                                                         train_dataset=tiny.TokenData(8, 1))


def test_with_safeckpt_places_the_mixin_directly_above_trainer() -> None:
    from trl import SFTTrainer

    for cls in (Trainer, SFTTrainer):
        mro = with_safeckpt(cls).__mro__
        assert mro.index(Trainer) == mro.index(SafeckptTrainerMixin) + 1
        assert cls in mro
    with pytest.raises(TypeError, match="Trainer subclass"):
        with_safeckpt(dict)  # type: ignore[arg-type]


def test_resume_true_without_checkpoint_is_an_error(tmp_path) -> None:
    with pytest.raises(safeckpt.CheckpointNotFound, match="holds no committed safeckpt checkpoint"):
        _trainer(str(tmp_path)).train(resume_from_checkpoint=True)


def test_trainer_format_checkpoint_is_not_resumed(tmp_path) -> None:
    plain = Trainer(model=tiny.model(), args=_args(str(tmp_path / "hf")),
                    train_dataset=tiny.TokenData(8, 1))
    plain.train()
    hf_ckpt = tmp_path / "hf" / "checkpoint-2"
    assert (hf_ckpt / "trainer_state.json").exists()
    with pytest.raises(safeckpt.CheckpointNotFound, match="Trainer-format checkpoints"):
        _trainer(str(tmp_path / "new")).train(resume_from_checkpoint=str(hf_ckpt))


def test_save_only_model_checkpoint_cannot_resume(tmp_path) -> None:
    t = _trainer(str(tmp_path), save_only_model=True)
    t.train()
    sd = safeckpt.read_state_dict(str(tmp_path / "checkpoint-2"))
    assert not any(k.startswith(("optimizer/", "rng/")) for k in sd) and "trainer_state/global_step" in sd
    with pytest.raises(safeckpt.IncompatibleCheckpoint, match="save_only_model=True"):
        _trainer(str(tmp_path), max_steps=4).train(resume_from_checkpoint=True)


def test_a_missing_piece_is_an_error_not_a_skip(tmp_path) -> None:
    _trainer(str(tmp_path)).train()
    other = tiny.model()
    other.model.layers = other.model.layers[:1]  # a model without the second layer's weights
    t = _trainer(str(tmp_path), model=other, max_steps=4)
    before = {k: v.detach().clone() for k, v in other.state_dict().items()}
    with pytest.raises(safeckpt.IncompatibleCheckpoint, match="cannot resume from") as err:
        t.train(resume_from_checkpoint=True)
    assert "layers.1" in str(err.value)
    # refused before anything was copied: not even the layers that fit were loaded
    assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())
    # the same through load_entries (load_best_model_at_end's load of the model entry alone)
    from safeckpt.integrations._hf import common as _hf_common

    ckpt = safeckpt.CheckpointManager(str(tmp_path), preemption_signals=()).latest().path
    with pytest.raises(safeckpt.IncompatibleCheckpoint, match="(?s)load_best_model_at_end: .*layers.1"):
        _hf_common.load_entries(ckpt, {"model": other}, timeout=30, where="load_best_model_at_end")
    assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())


def test_per_rank_sigterm_handler_of_trainer_is_refused(tmp_path) -> None:
    with pytest.raises(safeckpt.CheckpointError, match="enable_jit_checkpoint"):
        _trainer(str(tmp_path), enable_jit_checkpoint=True)


def test_deepspeed_under_trainer_with_save_only_model_is_refused(tmp_path, monkeypatch) -> None:
    # DeepSpeed under Trainer is supported (test_hf_trainer_deepspeed.py); save_only_model is
    # not: the model is inside the engine's checkpoint with the optimizer.
    pytest.importorskip("deepspeed")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    # TrainingArguments sets ACCELERATE_USE_DEEPSPEED=true in os.environ; setenv (unlike a
    # delenv of an absent variable) makes monkeypatch remove it again after the test, so it
    # cannot leak into the torchrun jobs of later tests.
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "false")
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
          "zero_optimization": {"stage": 1}}
    with pytest.raises(safeckpt.CheckpointError, match="save_only_model=True with DeepSpeed"):
        _trainer(str(tmp_path), deepspeed=ds, save_only_model=True)
    with pytest.raises(safeckpt.CheckpointError, match="async saves with DeepSpeed"):
        _trainer(str(tmp_path), deepspeed=ds, async_save=True)


# ----------------------------------------------------------------------------- Accelerate
def _accelerator(tmp_path, automatic: bool = True):  # noqa: ANN202
    from accelerate.utils import ProjectConfiguration

    from safeckpt.integrations.accelerate import SafeckptAccelerator

    acc = SafeckptAccelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=str(tmp_path), automatic_checkpoint_naming=automatic, total_limit=2))
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return acc, *acc.prepare(model, opt)


def test_accelerate_refusals_and_plain_directory(tmp_path) -> None:
    acc, model, opt = _accelerator(tmp_path / "a")
    try:
        with pytest.raises(safeckpt.CheckpointNotFound):
            acc.load_state()  # nothing saved yet
        first = acc.save_state()
        assert first.endswith("checkpoint_0") and acc.project_configuration.iteration == 1
        # save hooks write into a private directory whose plain files are committed with the
        # checkpoint (verify covers them); load hooks get the checkpoint directory
        def save_hook(models, weights, out):
            with open(os.path.join(out, "data.json"), "w") as f:
                f.write(json.dumps({"n": len(models)}))

        seen = []
        handle = acc.register_save_state_pre_hook(save_hook)
        load_handle = acc.register_load_state_pre_hook(
            lambda models, d: seen.append(open(os.path.join(d, "data.json")).read()))
        second = acc.save_state()
        assert second.endswith("checkpoint_1") and safeckpt.verify(second).ok
        acc.load_state(second)
        assert seen == ['{"n": 1}']
        with open(os.path.join(second, "data.json"), "w") as f:
            f.write('{"n": 2}')  # the hook's file is checked like the rest
        assert not safeckpt.verify(second).ok
        handle.remove()
        load_handle.remove()
        handle = acc.register_save_state_pre_hook(lambda models, weights, out: os.mkdir(os.path.join(out, "sub")))
        with pytest.raises(safeckpt.CheckpointError, match="not a plain file"):
            acc.save_state()
        handle.remove()
        shutil.rmtree(second)
        acc.project_configuration.iteration = 0  # would overwrite checkpoint 0
        with pytest.raises(safeckpt.CheckpointExists, match="call load_state"):
            acc.save_state()
        with torch.no_grad():
            model.weight.zero_()
        acc.load_state()
        assert model.weight.abs().sum() > 0 and acc.project_configuration.iteration == 1
    finally:
        acc.safeckpt_close()

    acc, model, opt = _accelerator(tmp_path / "b", automatic=False)
    with pytest.raises(safeckpt.CheckpointError, match="no output_dir"):
        acc.save_state()
    with pytest.raises(safeckpt.CheckpointError, match="automatic_checkpoint_naming"):
        acc.preempted  # noqa: B018
    path = acc.save_state(str(tmp_path / "b" / "ckpt"))
    again = acc.save_state(str(tmp_path / "b" / "ckpt"))  # replaced atomically
    assert path == again and safeckpt.verify(path).ok
    (tmp_path / "b" / "other").mkdir()
    (tmp_path / "b" / "other" / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(safeckpt.CheckpointExists):
        acc.save_state(str(tmp_path / "b" / "other"))


def test_async_save_failure_in_the_background_stops_training(tmp_path, monkeypatch) -> None:
    """with_safeckpt(..., async_save=True): a save that fails after training went on is not
    lost silently: the next save raises it, and nothing partial is committed."""
    import errno

    real_fsync = os.fsync

    def full_disk(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".safetensors"):
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", full_disk)
    out = str(tmp_path / "out")
    trainer = _trainer(out, async_save=True, save_steps=1, max_steps=3)
    with pytest.raises(safeckpt.CheckpointError, match="No space left on device"):
        trainer.train()
    assert trainer.state.global_step == 2  # step 1's save failed in the background; step 2's raised it
    assert safeckpt.CheckpointManager(out, preemption_signals=()).list() == []
    assert not [n for n in os.listdir(out) if n.startswith("checkpoint-")]
