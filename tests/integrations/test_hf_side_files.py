"""Files a Trainer subclass writes into ``checkpoint-N`` during a save (TRL's pattern), review of
issue 30: they are written into a hidden scratch directory under the root while the subclass
runs (``args.output_dir`` points there), never into a visible ``checkpoint-N`` before the
commit, and committed with the checkpoint.

(a) A SIGKILL while the subclass writes (a real one, in a child process) leaves no visible
``checkpoint-4``: ``get_last_checkpoint`` finds ``checkpoint-2``, a resume from it (by that path
or ``True``) passes step 4, and the next save's sweep removes the hidden leftover.
(b) A step saved again over a committed ``checkpoint-N`` (after a fallback) holds the file the
subclass wrote in that save.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

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
from transformers import LlamaForCausalLM, Trainer
from transformers.trainer_utils import get_last_checkpoint

import safeckpt
from safeckpt.integrations.hf import with_safeckpt

pytestmark = pytest.mark.timeout(300)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class SideTrainer(Trainer):
    """Writes my_state.json into output_dir/checkpoint-N before super() and after.json after,
    as TRL's trainers do; KILL_AT: SIGKILL itself between the two at that step."""

    KILL_AT: int | None = None
    tag = "first"

    def _save_checkpoint(self, model, trial):  # type: ignore[no-untyped-def]
        # TRL names its model card after the output directory, and writes it there
        self.seen_name = os.path.basename(self.args.output_dir)
        with open(os.path.join(self.args.output_dir, "README.md"), "w") as f:
            f.write(f"card {self.state.global_step}")
        d = os.path.join(self.args.output_dir, f"checkpoint-{self.state.global_step}")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "my_state.json"), "w") as f:
            json.dump({"step": self.state.global_step, "tag": self.tag}, f)
        if self.state.global_step == self.KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)
        super()._save_checkpoint(model, trial)
        with open(os.path.join(d, "after.json"), "w") as f:
            json.dump({"step": self.state.global_step}, f)


def _trainer(out: str, steps: int, **kw: object) -> Trainer:
    torch.manual_seed(0)
    return with_safeckpt(SideTrainer)(model=LlamaForCausalLM(tiny.config(0.0)),
                                      args=training_args(out, max_steps=steps, seed=0),
                                      train_dataset=tiny.TokenData(16, 1), **kw)


def _visible(out: str) -> list[str]:
    return sorted(n for n in os.listdir(out) if not n.startswith("."))


CHILD = textwrap.dedent("""
    import sys
    sys.path.insert(0, {repo!r})
    from tests.integrations import test_hf_side_files as t
    t.SideTrainer.KILL_AT = 4
    t._trainer({out!r}, 6).train()
""")


def test_a_kill_while_the_subclass_writes_leaves_no_checkpoint_n(tmp_path) -> None:
    out = str(tmp_path / "out")
    proc = subprocess.run([sys.executable, "-c", CHILD.format(repo=REPO, out=out)], cwd=REPO,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    # Killed with my_state.json written for step 4: only checkpoint-2 is visible.
    assert _visible(out) == ["README.md", "checkpoint-2"], os.listdir(out)
    hidden = [n for n in os.listdir(out) if n.startswith(".checkpoint-4")]
    assert len(hidden) == 1 and os.path.isfile(os.path.join(out, hidden[0], "out", "checkpoint-4", "my_state.json"))
    last = get_last_checkpoint(out)
    assert last == os.path.join(out, "checkpoint-2")

    # Resume by that path (the transformers examples' pattern): passes step 4 and commits it.
    trainer = _trainer(out, 6)
    trainer.tag = "resumed"
    trainer.train(resume_from_checkpoint=last)
    assert trainer.state.global_step == 6
    assert _visible(out) == ["README.md", "checkpoint-2", "checkpoint-4", "checkpoint-6"], os.listdir(out)
    assert not [n for n in os.listdir(out) if n.startswith(".checkpoint-")], os.listdir(out)  # swept
    for step in (4, 6):
        ck = os.path.join(out, f"checkpoint-{step}")
        with open(os.path.join(ck, "my_state.json")) as f:
            assert json.load(f) == {"step": step, "tag": "resumed"}
        with open(os.path.join(ck, "after.json")) as f:
            assert json.load(f) == {"step": step}
        assert safeckpt.verify(ck).ok

    # And resume_from_checkpoint=True from the killed state does the same (a second kill first).
    out2 = str(tmp_path / "out2")
    proc = subprocess.run([sys.executable, "-c", CHILD.format(repo=REPO, out=out2)], cwd=REPO,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    reset_accelerate_state()
    again = _trainer(out2, 6)
    again.train(resume_from_checkpoint=True)
    assert again.state.global_step == 6
    assert _visible(out2) == ["README.md", "checkpoint-2", "checkpoint-4", "checkpoint-6"], os.listdir(out2)


def test_a_step_saved_again_keeps_the_subclass_files_of_that_save(tmp_path) -> None:
    out = str(tmp_path / "out")
    _trainer(out, 4).train()
    ck4 = os.path.join(out, "checkpoint-4")
    with open(os.path.join(ck4, "my_state.json")) as f:
        assert json.load(f) == {"step": 4, "tag": "first"}
    flip_data_byte(ck4)  # the resume falls back to checkpoint-2 and saves step 4 again over it

    reset_accelerate_state()
    trainer = _trainer(out, 6)
    trainer.tag = "second"
    with pytest.warns(UserWarning, match="corrupt"):
        trainer.train(resume_from_checkpoint=True)
    assert trainer.state.global_step == 6
    for step in (4, 6):
        ck = os.path.join(out, f"checkpoint-{step}")
        assert safeckpt.verify(ck).ok
        with open(os.path.join(ck, "my_state.json")) as f:
            assert json.load(f) == {"step": step, "tag": "second"}
        with open(os.path.join(ck, "after.json")) as f:
            assert json.load(f) == {"step": step}
    assert trainer.args.output_dir == out and trainer.seen_name == "out"
    with open(os.path.join(out, "README.md")) as f:  # written into output_dir during the save
        assert f.read() == "card 6"
    assert not [n for n in os.listdir(out) if n.startswith(".checkpoint-")], os.listdir(out)
