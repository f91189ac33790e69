"""Issue 19 round 2: Accelerate and Trainer bugs found by the frameworks' own checkpoint tests.

One process each (no process group); the distributed paths are in test_hf_trainer_accelerate.py.
Each test here failed before its fix.
"""

from __future__ import annotations

import gc

import pytest

# First: skips this module without transformers or accelerate, sets the offline environment.
from tests.integrations.hf_testing import (
    fresh_accelerate_state,  # noqa: F401 - autouse fixture
    reset_accelerate_state,
)

# isort: split
import torch

import safeckpt

pytestmark = pytest.mark.timeout(180)


def _acc(project: str, **kw: object):  # noqa: ANN202
    from accelerate.utils import ProjectConfiguration

    from safeckpt.integrations.accelerate import SafeckptAccelerator

    return SafeckptAccelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=project, automatic_checkpoint_naming=True, total_limit=2), **kw)


# --------------------------------------------------------------------------- Accelerate
def test_stateful_dataloader_position_is_saved_and_restored(tmp_path) -> None:
    pytest.importorskip("torchdata")
    from accelerate.utils import DataLoaderConfiguration

    def run():  # noqa: ANN202
        acc = _acc(str(tmp_path), dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
        dl = torch.utils.data.DataLoader(list(range(40)), batch_size=4, shuffle=False)
        model = torch.nn.Linear(2, 2)
        model, dl = acc.prepare(model, dl)
        return acc, dl

    acc, dl = run()
    it = iter(dl)
    seen = [next(it).tolist() for _ in range(3)]
    acc.save_state()
    rest = [b.tolist() for b in it]
    acc.safeckpt_close()
    del acc, dl, it
    reset_accelerate_state()
    acc, dl = run()
    try:
        acc.load_state()
        assert [b.tolist() for b in dl] == rest and len(seen) == 3
    finally:
        acc.safeckpt_close()


def test_second_accelerator_after_del_takes_the_lease(tmp_path) -> None:
    acc = _acc(str(tmp_path))
    model = acc.prepare(torch.nn.Linear(2, 2))
    acc.save_state()
    del acc, model
    gc.collect()
    acc = _acc(str(tmp_path))  # same project_dir, same process: the old lease is gone
    acc.prepare(torch.nn.Linear(2, 2))
    try:
        acc.load_state()
        assert acc.save_state().endswith("1")
    finally:
        acc.safeckpt_close()


def test_collected_manager_and_lease_release_the_root(tmp_path) -> None:
    from safeckpt.coord.lease import LOCK_NAME, writer_lease

    mgr = safeckpt.CheckpointManager(tmp_path / "m", preemption_signals=())
    mgr.save(1, {"x": torch.ones(2)})
    assert (tmp_path / "m" / LOCK_NAME).exists()
    del mgr
    gc.collect()
    assert not (tmp_path / "m" / LOCK_NAME).exists()
    again = safeckpt.CheckpointManager(tmp_path / "m", preemption_signals=())
    again.save(2, {"x": torch.ones(2)})
    again.close()

    lock = writer_lease(str(tmp_path))
    lock.acquire()
    assert (tmp_path / LOCK_NAME).exists()
    del lock
    gc.collect()
    assert not (tmp_path / LOCK_NAME).exists()


def test_collected_manager_restores_signal_handlers(tmp_path) -> None:
    import signal

    before = signal.getsignal(signal.SIGUSR1)
    mgr = safeckpt.CheckpointManager(tmp_path)
    assert signal.getsignal(signal.SIGUSR1) is not before
    del mgr
    gc.collect()
    assert signal.getsignal(signal.SIGUSR1) is before
