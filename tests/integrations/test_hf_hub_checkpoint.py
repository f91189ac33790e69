"""``push_to_hub=True`` with ``hub_strategy="checkpoint"`` / ``"all_checkpoints"`` / ``"every_save"``
under ``with_safeckpt(Trainer)``, offline: the Hub client Trainer calls (``transformers.trainer.hf_api``)
is replaced by one that copies each uploaded folder into a local "repository" at once, so the test
sees exactly what would be pushed: the committed ``checkpoint-N`` as ``last-checkpoint`` (a
safeckpt checkpoint that verifies and a model directory ``from_pretrained`` reads) and the
model's files at the top, as stock Trainer pushes them. Async saves with a pushing strategy are
refused (Trainer pushes right after the save, before an async commit).
"""

from __future__ import annotations

import os
import shutil
from concurrent.futures import Future
from types import SimpleNamespace

import pytest

# First: skips this module without transformers or accelerate, sets the offline environment.
from tests.integrations.hf_testing import (
    fresh_accelerate_state,  # noqa: F401 - autouse fixture
    tiny,
    training_args,
)

# isort: split
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM, Trainer

import safeckpt
from safeckpt import CheckpointError
from safeckpt.integrations.hf import with_safeckpt

pytestmark = pytest.mark.timeout(300)


class FakeHub:
    """``hf_api()`` for Trainer: ``create_repo`` and ``upload_folder`` (copied now, a done Future)."""

    def __init__(self, repo: str) -> None:
        self.repo = repo
        self.uploads: list[tuple[str, str]] = []  # (path_in_repo, files uploaded)
        self.beside: list[str] = []  # safeckpt's hidden names in each uploaded folder, as found

    def create_repo(self, name: str, **kw: object) -> SimpleNamespace:
        return SimpleNamespace(repo_id=f"user/{os.path.basename(name)}")

    def upload_folder(self, *, folder_path: str, path_in_repo: str | None = None,
                      ignore_patterns: list[str] | str | None = None, **kw: object) -> Future:
        # What the real client uploads: every file under the folder (recursively) that its
        # filter keeps, with the patterns Trainer passes and huggingface_hub's defaults.
        from huggingface_hub.utils import filter_repo_objects
        from huggingface_hub.utils._paths import DEFAULT_IGNORE_PATTERNS

        pats = [ignore_patterns] if isinstance(ignore_patterns, str) else list(ignore_patterns or ())
        rel = sorted(os.path.relpath(os.path.join(d, f), folder_path).replace(os.sep, "/")
                     for d, _, fs in os.walk(folder_path) for f in fs)
        kept = list(filter_repo_objects(rel, ignore_patterns=pats + DEFAULT_IGNORE_PATTERNS))
        self.beside += [n for n in rel if ".safeckpt" in n]
        dest = os.path.join(self.repo, path_in_repo or "")
        if path_in_repo:  # upload_folder replaces nothing else, but a stale file would hide a bug here
            shutil.rmtree(dest, ignore_errors=True)
        os.makedirs(dest, exist_ok=True)
        for n in kept:
            os.makedirs(os.path.dirname(os.path.join(dest, n)), exist_ok=True)
            shutil.copy(os.path.join(folder_path, n), os.path.join(dest, n))
        self.uploads.append((path_in_repo or "", ",".join(kept)))
        done: Future = Future()
        done.set_result(SimpleNamespace(oid="0"))
        return done


@pytest.fixture
def hub(tmp_path, monkeypatch) -> FakeHub:
    import transformers.trainer as tr

    fake = FakeHub(str(tmp_path / "hub"))
    monkeypatch.setattr(tr, "hf_api", lambda *a, **k: fake)
    return fake


def _model() -> LlamaForCausalLM:
    cfg = tiny.config(0.0)
    cfg.tie_word_embeddings = False
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def test_hub_strategy_checkpoint_pushes_the_committed_checkpoint(tmp_path, hub) -> None:
    out = str(tmp_path / "out")
    args = training_args(out, max_steps=4, push_to_hub=True, hub_strategy="checkpoint", hub_token="x")
    trainer = with_safeckpt(Trainer)(model=_model(), args=args, train_dataset=tiny.TokenData(16, 1))
    trainer.train()
    # Every save pushed: the model files at the top and checkpoint-N as last-checkpoint.
    assert [u[0] for u in hub.uploads] == ["", "last-checkpoint", "", "last-checkpoint"], hub.uploads
    last = os.path.join(hub.repo, "last-checkpoint")
    assert sorted(os.listdir(last)) == sorted(os.listdir(os.path.join(out, "checkpoint-4")))
    assert {"manifest.json", "model.safetensors", "config.json", "trainer_state.json"} <= set(os.listdir(last))
    assert safeckpt.verify(last).ok  # the pushed folder is a whole, verifiable checkpoint
    got = AutoModelForCausalLM.from_pretrained(last).state_dict()
    top = AutoModelForCausalLM.from_pretrained(hub.repo).state_dict()  # the model files at the top
    want = trainer.model.state_dict()
    assert all(torch.equal(got[k], want[k]) and torch.equal(top[k], want[k]) for k in want)
    assert not any(n.startswith("checkpoint-") for n in os.listdir(hub.repo))
    # The files Trainer copied into output_dir to push leave safeckpt's checkpoints alone.
    assert [i.step for i in safeckpt.CheckpointManager(out, dirname="checkpoint-{step}").list()] == [2, 4]
    _none_of_ours(hub)


def _none_of_ours(hub: FakeHub) -> None:
    """No upload holds safeckpt's own hidden files (the lease names the host)."""
    pushed = [n for _, names in hub.uploads for n in names.split(",")]
    assert pushed and not [n for n in pushed if ".safeckpt" in n], hub.uploads
    for d, _, fs in os.walk(hub.repo):
        assert not [f for f in fs if ".safeckpt" in f] and ".safeckpt" not in d, (d, fs)


def test_every_save_and_push_to_hub_leave_out_the_lease_and_hidden_directories(tmp_path, hub) -> None:
    from transformers import TrainerCallback

    out = str(tmp_path / "out")

    class Leftover(TrainerCallback):  # what a killed save leaves: a hidden staging directory
        def on_save(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
            d = os.path.join(out, f".checkpoint-9.safeckpt-staging-{state.global_step:04x}", "sub")
            os.makedirs(d, exist_ok=True)
            open(os.path.join(d, "rank-00000.safetensors"), "wb").close()

    args = training_args(out, max_steps=4, push_to_hub=True, hub_strategy="every_save", hub_token="x")
    trainer = with_safeckpt(Trainer)(model=_model(), args=args, train_dataset=tiny.TokenData(16, 1),
                                     callbacks=[Leftover()])
    trainer.train()
    trainer.push_to_hub()  # Trainer's own push at the end
    assert len(hub.uploads) == 3, hub.uploads
    # the folders held them (the lease while training, a leftover at the end); none went up
    assert ".safeckpt.lock" in hub.beside and any("safeckpt-staging" in n for n in hub.beside), hub.beside
    assert "model.safetensors" in hub.uploads[-1][1].split(","), hub.uploads
    _none_of_ours(hub)


def test_hub_strategy_all_checkpoints_pushes_each_under_its_name(tmp_path, hub) -> None:
    out = str(tmp_path / "out")
    args = training_args(out, max_steps=4, push_to_hub=True, hub_strategy="all_checkpoints", hub_token="x")
    with_safeckpt(Trainer)(model=_model(), args=args, train_dataset=tiny.TokenData(16, 1)).train()
    assert [u[0] for u in hub.uploads] == ["", "checkpoint-2", "", "checkpoint-4"], hub.uploads
    for step in (2, 4):
        assert safeckpt.verify(os.path.join(hub.repo, f"checkpoint-{step}")).ok
    _none_of_ours(hub)


def test_hub_strategy_with_async_saves_is_refused(tmp_path, hub) -> None:
    args = training_args(str(tmp_path / "out"), max_steps=2, push_to_hub=True, hub_strategy="checkpoint",
                         hub_token="x")
    with pytest.raises(CheckpointError, match="async saves"):
        with_safeckpt(Trainer, async_save=True)(model=_model(), args=args, train_dataset=tiny.TokenData(8, 1))
