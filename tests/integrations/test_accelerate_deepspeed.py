"""Issue 22 (6): ``SafeckptAccelerator`` with a DeepSpeed config, ZeRO-2 and ZeRO-3 on CPU, 2 ranks.

Every ``checkpoint_N`` (the engine's own files under Accelerate's tag ``pytorch_model``, the
RNG of every rank, a registered object, the sampler) is one safeckpt commit. Rank 1 is SIGKILLed
while DeepSpeed writes its optimizer partition in the save after step 6: no ``checkpoint_2`` of
any kind is left, and ``load_state()`` resumes from ``checkpoint_1`` (step 4) with steps 5 and 6
(loss and gradient norm, floats compared exactly) equal to those the killed run computed before
its save. Under ZeRO-3 an engine file of ``checkpoint_1`` is damaged first: ``load_state()``
passes over it to ``checkpoint_0`` (step 2), still bit-exact. The resumed ZeRO-2 run saves
``checkpoint_2`` again and ``save_state(dir)`` writes a plain directory: every file in them is
listed in the manifest. With ``install_on_initialize()`` the engine's files in the commit are
safeckpt's own (no pickle) and a resume from ``checkpoint_1`` is bit-exact too.
"""

from __future__ import annotations

import json
import os
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
from tests.integrations.test_hf_trainer_deepspeed import _flip, _lock_cleanup, arm_kill  # noqa: E402

pytestmark = pytest.mark.timeout(300)

ENV = {**tiny.OFFLINE_ENV, "DS_ACCELERATOR": "cpu", "ACCELERATE_USE_DEEPSPEED": "true"}
STEPS, SAVE_EVERY = 6, 2


class Progress:
    """Registered for checkpointing (JSON only): the loop's position."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, sd: dict) -> None:
        self.step = int(sd["step"])


def _train(rank: int, out: str, stage: int, resume: bool, kill: bool, saves: tuple[int, ...],
           install: bool = False) -> dict:
    import torch
    from accelerate import DataLoaderConfiguration
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DeepSpeedPlugin, ProjectConfiguration
    from torch.utils.data import DataLoader

    from safeckpt.integrations.accelerate import SafeckptAccelerator

    if install:  # the engine's own files pickle-free (safeckpt's DeepSpeed checkpoint engine)
        from safeckpt.integrations.deepspeed import install_on_initialize

        install_on_initialize()
    AcceleratorState._reset_state()  # a new Accelerator per run in this process
    GradientState._reset_state()
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
          "zero_optimization": {"stage": stage}, "zero_force_ds_cpu_optimizer": False}
    acc = SafeckptAccelerator(
        deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds),
        project_config=ProjectConfiguration(project_dir=out, automatic_checkpoint_naming=True),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=11))
    model = tiny.model(seed=3)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)  # the engine's to save
    dl = DataLoader(tiny.TokenData(32, 5), batch_size=2, shuffle=True,
                    generator=torch.Generator().manual_seed(0))
    progress = Progress()
    acc.register_for_checkpointing(progress)
    model, opt, dl, sched = acc.prepare(model, opt, dl, sched)
    if resume:
        acc.load_state()
    history, error = {}, None
    model.train()
    batches = acc.skip_first_batches(dl, progress.step) if progress.step else dl
    for batch in batches:
        loss = model(**batch).loss
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        progress.step += 1
        history[progress.step] = (acc.reduce(loss.detach(), "mean").item(), float(model.get_global_grad_norm()))
        if progress.step in saves:
            if kill and progress.step == STEPS and rank == 1:
                arm_kill()  # its next optimizer partition
            try:
                acc.save_state()
            except Exception as exc:  # noqa: BLE001 - rank 0 of the killed save: reported
                error = type(exc).__name__
                break
        if progress.step == STEPS:
            break
    manual = None
    if resume and saves:  # without automatic naming: save_state(dir), then load_state(dir)
        acc.project_configuration.automatic_checkpoint_naming = False
        manual = acc.save_state(os.path.join(out, "manual"))
        acc.load_state(manual)
    acc.safeckpt_close()
    return {"history": history, "error": error, "start": STEPS - len(history), "manual": manual}


def _job(rank: int, world: int, runs: list[tuple]) -> list[dict]:
    return [_train(rank, *run) for run in runs]


def test_kill_inside_a_save_then_resume_bit_exact(tmp_path) -> None:
    import safeckpt

    _lock_cleanup()
    every = tuple(range(SAVE_EVERY, STEPS + 1, SAVE_EVERY))
    reference = {}
    for stage in (2, 3):  # each killed run is the reference: its steps ran before the kill
        out = dist_harness.run(_job, 2, [(str(tmp_path / f"z{stage}"), stage, False, True, every)],
                               timeout=240, env=ENV, pg_timeout=60)
        assert out[1].exitcode == -signal.SIGKILL, out[1]
        assert out[0].ok and out[0].value[0]["error"] == "RankFailure", out[0]  # the save failed there too
        reference[stage] = out[0].value[0]["history"]
        assert sorted(reference[stage]) == list(range(1, STEPS + 1))
        ckpts = tmp_path / f"z{stage}" / "checkpoints"
        visible = sorted(n for n in os.listdir(ckpts) if not n.startswith("."))
        assert visible == ["checkpoint_0", "checkpoint_1"], visible  # nothing of the killed save
    # ZeRO-3: damage an engine file of the newest checkpoint; load_state falls back past it
    engine_dir = tmp_path / "z3" / "checkpoints" / "checkpoint_1" / "pytorch_model"
    _flip(str(engine_dir / sorted(n for n in os.listdir(engine_dir) if "optim" in n)[-1]))

    pf = str(tmp_path / "pf")  # last (install_on_initialize holds for the rest of the process)
    runs = [(str(tmp_path / "z2"), 2, True, False, (STEPS,)), (str(tmp_path / "z3"), 3, True, False, ()),
            (pf, 2, False, False, (2, 4), True), (pf, 2, True, False, (), True)]
    out = dist_harness.run(_job, 2, runs, timeout=240, env=ENV, pg_timeout=60)
    assert all(o.ok for o in out), [o.message for o in out]
    reference["pf"] = out[0].value[2]["history"]
    for stage, result, start in zip((2, 3, "pf"), out[0].value[:2] + out[0].value[3:], (4, 2, 4), strict=True):
        assert result["error"] is None and result["start"] == start, (stage, result)
        for s in range(start + 1, STEPS + 1):  # bit for bit: floats compared exactly
            assert result["history"][s] == reference[stage][s], (stage, s, result["history"][s], reference[stage][s])
    # with install_on_initialize the engine's files in the commit are safeckpt's own, not pickles
    written = json.loads((tmp_path / "pf" / "checkpoints" / "checkpoint_1" / "manifest.json").read_text())["written"]
    assert "pytorch_model/mp_rank_00_model_states.pt/manifest.json" in written
    assert not any(n.endswith(".pt") for n in written)
    # saved by the resumed run: checkpoint_2 again, and a plain directory without automatic naming
    assert out[0].value[0]["manual"] == str(tmp_path / "z2" / "manual")
    for last in (tmp_path / "z2" / "checkpoints" / "checkpoint_2", tmp_path / "z2" / "manual"):
        assert safeckpt.verify(str(last), deep=True).ok
        man = json.loads((last / "manifest.json").read_text())
        on_disk = {os.path.relpath(os.path.join(d, n), last) for d, _, ns in os.walk(last) for n in ns}
        assert on_disk == {*man["files"], *man.get("extra", {}), *man["written"], "manifest.json"}
        assert "latest" in man["written"]
        assert any(n.startswith("pytorch_model/") and "optim_states" in n for n in man["written"])
        assert "model_0" not in man["objects"] and "optimizer_0" not in man["objects"]  # the engine's
