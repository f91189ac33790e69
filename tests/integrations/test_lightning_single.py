"""Lightning integration in one process (no process group): SafeckptIO keeps Lightning's dict
exactly, ModelCheckpoint top-k/save_last work on safeckpt directories, load_from_checkpoint,
and the errors a user meets (non-JSON hyper-parameters, a non-Lightning checkpoint)."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("lightning")

import torch  # noqa: E402

import safeckpt  # noqa: E402
from tests.helpers import dist_harness  # noqa: E402


def _same(a, b, where="") -> list[str]:
    """Exact equality (types included; tensors bit for bit; dict order aside)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        ok = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype \
            and a.shape == b.shape and torch.equal(a, b)
        return [] if ok else [where]
    if isinstance(a, dict) and isinstance(b, dict):  # OrderedDict comes back as dict
        if set(a) != set(b):
            return [f"{where}: keys {sorted(map(str, a))} != {sorted(map(str, b))}"]
        return [d for k in a for d in _same(a[k], b[k], f"{where}/{k}")]
    if type(a) is not type(b):
        return [f"{where}: {type(a).__name__} != {type(b).__name__}"]
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: length {len(a)} != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _same(x, y, f"{where}/{i}")]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def _trainer(root, epochs, **kw):
    from safeckpt.integrations.lightning import SafeckptIO
    from tests.integrations import lightning_app as app

    return app.trainer(str(root), "auto", epochs, 1, plugins=[SafeckptIO()], **kw)


@pytest.mark.timeout(120)
def test_safeckpt_io_round_trips_lightning_dict_and_resumes(tmp_path):
    from safeckpt.integrations import lightning as sl
    from tests.integrations import lightning_app as app

    app.scramble(0)
    model = app.Net()
    trainer = _trainer(tmp_path, 3)
    trainer.fit(model)
    ckpts = tmp_path / "ckpts"
    cb = trainer.checkpoint_callback
    # Top-k rotation removed the dropped directories; every survivor is a committed checkpoint.
    assert sorted(os.listdir(ckpts)) == sorted([os.path.basename(p) for p in cb.best_k_models] + ["last.ckpt"])
    assert all((ckpts / n / "manifest.json").is_file() for n in os.listdir(ckpts))
    assert dist_harness.leftovers(ckpts) == []

    # The dict Lightning builds now, written and read back: identical, including the
    # path-keyed best_k_models, tuples (AdamW betas), int-keyed optimizer state, loops.
    expected = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
    trainer.save_checkpoint(tmp_path / "now.ckpt")
    assert _same(expected, sl.SafeckptIO().load_checkpoint(tmp_path / "now.ckpt")) == []
    assert safeckpt.verify(tmp_path / "now.ckpt").step == trainer.global_step

    # Resume through Lightning's own path: weights, optimizer, scheduler, loops, callbacks.
    app.scramble(0)
    resumed = app.Net()
    trainer2 = _trainer(tmp_path, 4)
    trainer2.fit(resumed, ckpt_path=str(tmp_path / "now.ckpt"))
    assert trainer2.global_step == 4 * trainer.num_training_batches and trainer2.current_epoch == 4
    # ModelCheckpoint's top-k came back (a fresh callback would hold only the newest entry).
    kept = trainer2.checkpoint_callback.best_k_models
    assert len(kept) == 2 and set(kept) & set(cb.best_k_models), (kept, cb.best_k_models)

    # load_from_checkpoint-style: hyper-parameters from the checkpoint, weights exact.
    loaded = sl.load_from_checkpoint(app.Net, tmp_path / "now.ckpt")
    assert loaded.hparams == model.hparams
    assert _same(loaded.state_dict(), model.state_dict()) == []
    # kwargs override saved hyper-parameters, as in Lightning (strict loading then fails loudly).
    with pytest.raises(RuntimeError, match="size mismatch"):
        sl.load_from_checkpoint(app.Net, tmp_path / "now.ckpt", hidden=8)


class _Opaque:
    """A value no checkpoint can hold without pickle."""


@pytest.mark.timeout(120)
def test_non_json_hyperparameters_fail_before_writing(tmp_path):
    from tests.integrations import lightning_app as app

    class WithOpaque(app.Net):
        def __init__(self, handle: object = None) -> None:
            super().__init__()
            self.save_hyperparameters()

    trainer = _trainer(tmp_path, 1)
    with pytest.raises(safeckpt.CheckpointError, match="_Opaque at .*hyper_parameters/handle"):
        trainer.fit(WithOpaque(handle=_Opaque()))  # SafeckptIO: ModelCheckpoint's first save
    assert list(tmp_path.rglob("*.ckpt")) == [] and dist_harness.leftovers(tmp_path) == []  # nothing written


def test_read_checkpoint_refuses_a_non_lightning_checkpoint(tmp_path):
    from safeckpt.integrations import lightning as sl

    safeckpt.save(tmp_path / "plain", {"w": torch.ones(2)})
    with pytest.raises(safeckpt.IncompatibleCheckpoint, match="not a Lightning one"):
        sl.read_checkpoint(tmp_path / "plain")
    with pytest.raises(safeckpt.CheckpointNotFound):
        sl.read_checkpoint(tmp_path / "absent.ckpt")


def test_remove_checkpoint_handles_directories_links_and_files(tmp_path):
    from safeckpt.integrations import lightning as sl

    io = sl.SafeckptIO()
    safeckpt.save(tmp_path / "a.ckpt", {"w": torch.ones(2)})
    os.symlink("a.ckpt", tmp_path / "last.ckpt")  # what save_last="link" makes
    (tmp_path / "old.ckpt").write_bytes(b"torch.save file")
    io.remove_checkpoint(tmp_path / "last.ckpt")
    assert (tmp_path / "a.ckpt" / "manifest.json").is_file()  # the link only
    io.remove_checkpoint(tmp_path / "a.ckpt")
    io.remove_checkpoint(tmp_path / "old.ckpt")
    io.remove_checkpoint(tmp_path / "never-existed.ckpt")
    assert os.listdir(tmp_path) == []


def test_import_safeckpt_does_not_import_lightning():
    import subprocess
    import sys

    code = ("import sys, safeckpt, safeckpt.integrations; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout
