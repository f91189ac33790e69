"""Issue 22 (6): ``with_safeckpt(Trainer)`` with a DeepSpeed config, ZeRO-2 and ZeRO-3 on CPU, 2 ranks.

The whole ``checkpoint-N`` (DeepSpeed's engine files, Trainer's ``trainer_state.json``, every
rank's RNG) is one safeckpt commit. A run whose rank 1 is SIGKILLed while DeepSpeed writes its
optimizer partition of step 6 leaves no ``checkpoint-6`` at all (neither safeckpt's resume nor
transformers' ``get_last_checkpoint`` can pick a partial one); resuming then continues bit for bit
as the uninterrupted run did (every step's loss and gradient norm equal). Under ZeRO-3 the newest
checkpoint's engine file is also damaged first: the resume falls back one checkpoint, still
bit-exact.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("deepspeed")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "scripts"))
import hf_tiny as tiny  # noqa: E402

from tests.helpers import dist_harness  # noqa: E402

pytestmark = pytest.mark.timeout(900)

ENV = {**tiny.OFFLINE_ENV, "DS_ACCELERATOR": "cpu"}
STEPS = 8


def _lock_cleanup() -> None:
    """A stale JIT lock from a killed DeepSpeed build hangs every later start."""
    lock = os.path.expanduser("~/.cache/torch_extensions/py311_cpu/deepspeed_shm_comm/lock")
    if os.path.exists(lock):
        os.remove(lock)


def arm_kill(tag: str = "") -> None:
    """This rank: the next optimizer partition DeepSpeed writes (to a path containing ``tag``)
    is cut in half, then the process is SIGKILLed."""
    import torch

    real = torch.save

    def save(obj, f, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        if isinstance(f, str) and tag in f and "optim_states" in f:
            real(obj, f, *a, **kw)
            with open(f, "r+b") as fh:
                fh.truncate(os.path.getsize(f) // 2)
            os.kill(os.getpid(), signal.SIGKILL)
        return real(obj, f, *a, **kw)

    torch.save = save


def _job(rank: int, world: int, out: str, stage: int, resume: bool, kill_at: int | None,
         install: bool = False, steps: int = STEPS) -> dict:
    from transformers import Trainer, TrainingArguments

    from safeckpt.integrations.hf import with_safeckpt

    if install:  # the engine's own files pickle-free (safeckpt's DeepSpeed checkpoint engine)
        from safeckpt.integrations.deepspeed import install_on_initialize

        install_on_initialize()

    if kill_at is not None and rank == 1:  # in the middle of its optimizer partition of step kill_at
        arm_kill(f"global_step{kill_at}")
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
          "zero_optimization": {"stage": stage}, "zero_force_ds_cpu_optimizer": False}
    args = TrainingArguments(
        output_dir=out, max_steps=steps, per_device_train_batch_size=2, save_steps=2,
        save_strategy="steps", report_to="none", use_cpu=True, logging_steps=1, disable_tqdm=True,
        dataloader_num_workers=0, seed=3, deepspeed=ds, ddp_backend="gloo", learning_rate=3e-3,
        save_total_limit=None)
    trainer = with_safeckpt(Trainer)(model=tiny.model(), args=args, train_dataset=tiny.TokenData(64, 1))
    trainer.train(resume_from_checkpoint=True if resume else None)
    return {"history": [(h["step"], h["loss"], h["grad_norm"]) for h in trainer.state.log_history
                        if "loss" in h]}


def _flip(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(os.path.getsize(path) // 2)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.mark.parametrize("stage", [2, 3])
def test_kill_inside_a_save_then_resume_bit_exact(tmp_path, stage) -> None:
    from transformers.trainer_utils import get_last_checkpoint

    import safeckpt

    _lock_cleanup()
    full = str(tmp_path / "full")
    out = dist_harness.run(_job, 2, full, stage, False, None, timeout=400, env=ENV, pg_timeout=120)
    assert all(o.ok for o in out), [o.message for o in out]
    reference = {s: (loss, g) for s, loss, g in out[0].value["history"]}
    assert sorted(reference) == list(range(1, STEPS + 1))
    last = os.path.join(full, f"checkpoint-{STEPS}")
    names = sorted(os.listdir(last))
    assert "trainer_state.json" in names and "latest" in names and f"global_step{STEPS}" in names
    assert safeckpt.verify(last, deep=True).ok
    with open(os.path.join(last, "manifest.json")) as f:
        man = json.load(f)
    on_disk = {os.path.relpath(os.path.join(d, n), last) for d, _, ns in os.walk(last) for n in ns}
    # every file of the checkpoint is listed (DeepSpeed's with their checksums)
    listed = {*man["files"], *man["extra"], *man["written"], "manifest.json"}
    assert on_disk == listed, on_disk ^ listed
    assert any(n.startswith(f"global_step{STEPS}/") and "optim_states" in n for n in man["written"])

    run = str(tmp_path / "run")
    out = dist_harness.run(_job, 2, run, stage, False, 6, timeout=400, env=ENV, pg_timeout=120)
    assert out[1].exitcode == -signal.SIGKILL, out[1]
    assert not out[0].ok, out[0]
    visible = sorted(n for n in os.listdir(run) if not n.startswith("."))
    assert visible == ["checkpoint-2", "checkpoint-4"], visible  # nothing of step 6
    assert os.path.basename(get_last_checkpoint(run)) == "checkpoint-4"
    resume_from = 4
    if stage == 3:  # damage the newest engine file: the resume falls back to checkpoint-2
        step_dir = os.path.join(run, "checkpoint-4", "global_step4")
        _flip(os.path.join(step_dir, sorted(n for n in os.listdir(step_dir) if "optim" in n)[-1]))
        resume_from = 2

    out = dist_harness.run(_job, 2, run, stage, True, None, timeout=400, env=ENV, pg_timeout=120)
    assert all(o.ok for o in out), [o.message for o in out]
    resumed = {s: (loss, g) for s, loss, g in out[0].value["history"]}
    assert sorted(resumed) == list(range(1, STEPS + 1))
    for s in range(resume_from + 1, STEPS + 1):  # bit for bit: floats compared exactly
        assert resumed[s] == reference[s], (s, resumed[s], reference[s])
    shutil.rmtree(full, ignore_errors=True)


def test_pickle_free_engine_files_with_install_on_initialize(tmp_path) -> None:
    """With safeckpt's DeepSpeed checkpoint engine installed, the engine's files inside the
    commit are safeckpt's own (a nested atomic tag); resuming from checkpoint-4 of a 6-step run
    (a copy without checkpoint-6) gives its steps 5 and 6 bit for bit."""
    _lock_cleanup()
    full, run = str(tmp_path / "full"), str(tmp_path / "run")
    out = dist_harness.run(_job, 2, full, 2, False, None, True, 6, timeout=400, env=ENV, pg_timeout=120)
    assert all(o.ok for o in out), [o.message for o in out]
    reference = {s: (loss, g) for s, loss, g in out[0].value["history"]}
    shutil.copytree(full, run)  # resume from its checkpoint-4 (same schedule as the full run)
    shutil.rmtree(os.path.join(run, "checkpoint-6"))
    with open(os.path.join(run, "checkpoint-4", "manifest.json")) as f:
        written = json.load(f)["written"]
    assert "global_step4/mp_rank_00_model_states.pt/manifest.json" in written  # not a pickle
    assert not any(n.endswith(".pt") for n in written)
    out = dist_harness.run(_job, 2, run, 2, True, None, True, 6, timeout=400, env=ENV, pg_timeout=120)
    assert all(o.ok for o in out), [o.message for o in out]
    resumed = {s: (loss, g) for s, loss, g in out[0].value["history"]}
    for s in (5, 6):
        assert resumed[s] == reference[s], (s, resumed[s], reference[s])
