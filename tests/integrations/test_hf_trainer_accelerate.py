"""Hugging Face Trainer, TRL SFTTrainer and Accelerate with safeckpt, on real torchrun jobs.

Three launches of ``scripts/hf_run.py`` (2 ranks, gloo, CPU, a tiny Llama from a config, no
downloads), each under a hard timeout; the jobs of a launch share one import of transformers:

1. ``first``: Trainer (DDP) straight to step 12 (reference: saves every 4 steps, eval, retention,
   best model, export); the same job again with a real SIGTERM to rank 1 during step 5; TRL
   SFTTrainer on an FSDP2-sharded model straight to step 6; Accelerate straight to step 12 and
   again with a SIGTERM to rank 1 during step 6.
2. ``crash``: SFTTrainer resumed from the reference's step 3; then the preempted Trainer job
   resumed, with rank 1 SIGKILLed while writing its file of the step-8 checkpoint.
3. ``final``: the Trainer job resumed again (it must pick step 5), and the Accelerate job
   resumed with ``load_state()``.

Then every resumed run must equal its reference bit for bit: per-step losses, model, optimizer,
scheduler and RNG of every rank.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("trl")

import torch  # noqa: E402

import safeckpt  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "scripts", "hf_run.py")
sys.path.insert(0, os.path.join(HERE, "scripts"))
import hf_tiny as tiny  # noqa: E402

LAUNCH_TIMEOUT = 240  # seconds per torchrun launch (each takes ~15-35 s on 2 busy cores)


@dataclass
class Runs:
    base: str
    logs: dict[str, tuple[int, str]]
    after_crash: dict[str, Any]

    def result(self, job: str) -> dict[str, Any]:
        path = os.path.join(self.base, f"{job}.result.json")
        assert os.path.exists(path), f"{job} left no result:\n{self._tails()}"
        with open(path) as f:
            r = json.load(f)
        assert r["ok"], f"{job} failed: {r.get('type')}: {r.get('msg')}\n{self._tails()}"
        return r["value"]

    def rank(self, job: str, r: int) -> dict[str, Any]:
        with open(os.path.join(self.base, f"{job}.rank{r}.json")) as f:
            return json.load(f)

    def path(self, *parts: str) -> str:
        return os.path.join(self.base, *parts)

    def _tails(self) -> str:
        return "\n".join(f"--- {p} (rc {rc}) ---\n{out[-4000:]}" for p, (rc, out) in self.logs.items())


def _launch(phase: str, base: str) -> tuple[int, str]:
    from tests.helpers.dist_harness import free_port

    clean = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    env = {**clean, **tiny.OFFLINE_ENV, "SAFECKPT_TIMEOUT": "60",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(HERE)),
                                          os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), SCRIPT, phase, base]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=LAUNCH_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"torchrun phase {phase!r} hung (> {LAUNCH_TIMEOUT}s):\n{out[-6000:]}")
    return proc.returncode, out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    base = str(tmp_path_factory.mktemp("hf"))
    logs: dict[str, tuple[int, str]] = {}
    logs["first"] = _launch("first", base)
    logs["crash"] = _launch("crash", base)
    resumed = os.path.join(base, "resumed")
    if not os.path.isdir(resumed):  # a launch failed before its first save: show why
        pytest.fail("no checkpoint root after the first launches:\n" + "\n".join(
            f"--- {p} (rc {rc}) ---\n{out[-4000:]}" for p, (rc, out) in logs.items()))
    after_crash = {
        "listing": sorted(os.listdir(resumed)),
        "committed": [i.step for i in safeckpt.CheckpointManager(resumed, preemption_signals=()).list()],
        "verify5": safeckpt.verify(os.path.join(resumed, "checkpoint-5")).ok,
    }
    logs["final"] = _launch("final", base)
    return Runs(base, logs, after_crash)


# ----------------------------------------------------------------------------- helpers
def losses(path: str) -> dict[int, float]:
    out: dict[int, float] = {}
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            out.setdefault(rec["step"], rec["loss"])
            assert out[rec["step"]] == rec["loss"], f"step {rec['step']} logged twice, differently"
    return out


def assert_same_checkpoint(a: str, b: str, ignore: tuple[str, ...] = ()) -> int:
    """Every tensor and value of two checkpoints equal, bit for bit (except ``ignore`` prefixes);
    returns the number of tensors compared."""
    sa, sb = safeckpt.read_state_dict(a), safeckpt.read_state_dict(b)
    keys = {k for k in sa if not k.startswith(ignore)}
    assert keys == {k for k in sb if not k.startswith(ignore)}
    n = 0
    for k in sorted(keys):
        if isinstance(sa[k], torch.Tensor):
            assert torch.equal(sa[k], sb[k]), f"{k} differs between {a} and {b}"
            n += 1
        else:
            assert sa[k] == sb[k], f"{k}: {sa[k]!r} != {sb[k]!r}"
    return n


def assert_same_rng(dir_a: str, dir_b: str, tag: str) -> None:
    from safetensors.torch import load_file

    for r in (0, 1):
        name = f"rng-{tag}-rank{r}.safetensors"
        ta, tb = load_file(os.path.join(dir_a, name)), load_file(os.path.join(dir_b, name))
        assert torch.equal(ta["torch"], tb["torch"]), f"rank {r}'s RNG differs after training"


def committed(root: str) -> list[int]:
    return [i.step for i in safeckpt.CheckpointManager(root, preemption_signals=()).list()]


def logits_of_export(export: str, ref_file: str) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    ref = load_file(ref_file)
    model = AutoModelForCausalLM.from_pretrained(export)
    model.eval()
    with torch.no_grad():
        got = model(input_ids=ref["input_ids"]).logits
    assert torch.equal(got, ref["logits"]), (got - ref["logits"]).abs().max()


# ----------------------------------------------------------------------------- Trainer (DDP)
@pytest.mark.timeout(3 * LAUNCH_TIMEOUT + 60)
def test_trainer_sigterm_on_one_rank_saves_same_step_everywhere(runs: Runs) -> None:
    pre = runs.result("ddp_preempt")
    assert pre["preempted"] and pre["global_step"] == 5
    for r in (0, 1):  # both ranks stopped at step 5 having agreed to save it
        assert runs.rank("ddp_preempt", r) == {**runs.rank("ddp_preempt", r), "ok": True,
                                               "global_step": 5, "preempted": True}
    # the preempted run committed step 5 (listed after the next launch; retention since then
    # follows Trainer's rule, which does not keep it forever)
    assert runs.after_crash["committed"] == [4, 5]


@pytest.mark.timeout(3 * LAUNCH_TIMEOUT + 60)
def test_trainer_resume_is_bit_exact(runs: Runs) -> None:
    straight, final = runs.result("ddp_straight"), runs.result("ddp_final")
    assert straight["global_step"] == final["global_step"] == 12
    ref = losses(runs.path("straight", "losses.jsonl"))
    got = losses(runs.path("resumed", "losses.jsonl"))  # steps 1-5, 6-8 (crashed run), 6-12
    assert sorted(ref) == list(range(1, 13)) and got == ref
    n = assert_same_checkpoint(runs.path("straight", "checkpoint-12"),
                               runs.path("resumed", "checkpoint-12"),
                               ignore=("trainer_state/log_history", "trainer_state/best_model_checkpoint"))
    assert n > 60  # model, AdamW exp_avg/exp_avg_sq/step, RNG tensors
    sd = safeckpt.read_state_dict(runs.path("resumed", "checkpoint-12"))
    assert {"model", "optimizer", "scheduler", "rng", "trainer_state", "sampler"} <= {k.split("/")[0] for k in sd}
    assert sd["trainer_state/global_step"] == 12 and sd["sampler/seedable/initial_seed"] == 7
    assert_same_rng(runs.path("straight"), runs.path("resumed"), "ddp")
    # the file a Trainer subclass wrote into checkpoint-N after super() (like TRL's GRPO) was
    # committed with step 5 and handed back to it on resume
    assert final["side_counter"] == 5 * 7
    assert sd["side_files/side_state.json"] == '{"counter": 84}'
    # checkpoint-N are the commits themselves (Trainer's names), holding the subclass's file and
    # Trainer's trainer_state.json as files of the checkpoint (verify checks them)
    names = [d for d in os.listdir(runs.path("resumed")) if d.startswith("checkpoint-")]
    assert names and all(os.path.isdir(runs.path("resumed", d)) and not os.path.islink(runs.path("resumed", d))
                         for d in names)
    with open(runs.path("resumed", "checkpoint-12", "side_state.json")) as f:
        assert f.read() == '{"counter": 84}'
    with open(runs.path("resumed", "checkpoint-12", "trainer_state.json")) as f:
        ts = json.load(f)
    assert ts["global_step"] == 12 and ts["log_history"] and ts["log_history"][-1]["step"] == 12
    assert safeckpt.verify(runs.path("resumed", "checkpoint-12")).ok
    from transformers.trainer_utils import get_last_checkpoint

    assert get_last_checkpoint(runs.path("resumed")) == runs.path("resumed", "checkpoint-12")


@pytest.mark.timeout(3 * LAUNCH_TIMEOUT + 60)
def test_trainer_sigkill_during_save_leaves_previous_checkpoint(runs: Runs) -> None:
    marker = runs.path("resumed", "killed-in-save")
    assert os.path.exists(marker), "rank 1 was not killed inside the step-8 save"
    with open(marker) as f:
        assert ".safeckpt-staging-" in f.read()  # it died writing into the staging directory
    rc, out = runs.logs["crash"]
    assert rc != 0 and "SIGKILL" in out
    assert runs.result("sft_resume")["global_step"] == 6  # the job before it in that launch
    ac = runs.after_crash
    assert "checkpoint-8" not in ac["listing"] and ac["committed"] == [4, 5] and ac["verify5"]
    crash = json.load(open(runs.path("ddp_crash.result.json")))
    assert not crash["ok"] and crash["type"] == "RankFailure" and "rank(s) 1" in crash["msg"]
    # resume=True then picked step 5, the newest committed one (and finished bit-exact, above)
    assert runs.result("ddp_final")["start_step"] == 5
    assert [runs.rank("ddp_final", r)["start_step"] for r in (0, 1)] == [5, 5]


@pytest.mark.timeout(3 * LAUNCH_TIMEOUT + 60)
def test_trainer_retention_and_best_model(runs: Runs) -> None:
    straight = runs.result("ddp_straight")
    evals = {e["step"]: e["eval_loss"] for e in straight["log_history"] if "eval_loss" in e}
    assert sorted(evals) == [4, 8, 12]
    best = max(evals, key=lambda s: (evals[s], s))  # metric "loss", greater_is_better=True
    assert best != 12, "the test needs a best checkpoint that is not the newest"
    root = runs.path("straight")
    # As Trainer's rotate_checkpoints: save_total_limit=2 keeps the newest and the best (step 8
    # or 4 was deleted); best_model_checkpoint is Trainer's name, the commit itself.
    assert committed(root) == sorted({best, 12})
    assert straight["best_model_checkpoint"] == os.path.join(root, f"checkpoint-{best}")
    assert os.path.realpath(straight["best_model_checkpoint"]) == os.path.join(root, f"checkpoint-{best}")
    # load_best_model_at_end loaded the best checkpoint's weights
    from safetensors.torch import load_file

    final = load_file(runs.path("straight", "final_model.safetensors"))
    best_sd = safeckpt.read_state_dict(straight["best_model_checkpoint"])
    assert all(torch.equal(final[k], best_sd[f"model/{k}"]) for k in final)
    # Trainer's rule does not protect the checkpoint a run resumed from (5): newest + best
    assert committed(runs.path("resumed")) == sorted({best, 12})


@pytest.mark.timeout(3 * LAUNCH_TIMEOUT + 60)
def test_trainer_async_saves_train_on_and_resume_bit_exact(runs: Runs) -> None:
    """with_safeckpt(..., async_save=True): the same checkpoints, retention, best model and
    bit-exact resume as the synchronous reference, while training went on before each commit."""
    straight, preempt = runs.result("ddp_straight"), runs.result("ddp_async_preempt")
    final = runs.result("ddp_async_final")
    # synchronous: every checkpoint committed before Trainer's on_save; async: step 4's not yet
    # (its writer was slowed by 2 s), and the preemption save of step 5 committed by train()'s end
    assert straight["at_save"] == [[4, True], [8, True], [12, True]]
    assert preempt["at_save"][0] == [4, False] and preempt["preempted"] and preempt["global_step"] == 5
    assert final["start_step"] == 5 and final["global_step"] == 12
    assert [s for s, _ in final["at_save"]] == [8, 12]
    ref = losses(runs.path("straight", "losses.jsonl"))
    assert losses(runs.path("async_resumed", "losses.jsonl")) == ref
    assert assert_same_checkpoint(runs.path("straight", "checkpoint-12"),
                                  runs.path("async_resumed", "checkpoint-12"),
                                  ignore=("trainer_state/log_history", "trainer_state/best_model_checkpoint")) > 60
    assert_same_rng(runs.path("straight"), runs.path("async_resumed"), "ddp")
    root = runs.path("async_resumed")
    assert committed(root) == committed(runs.path("straight"))  # same retention: newest + best
    assert final["best_model_checkpoint"] == os.path.join(root, os.path.basename(straight["best_model_checkpoint"]))
    from safetensors.torch import load_file

    got, want = (load_file(runs.path(n, "final_model.safetensors")) for n in ("async_resumed", "straight"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)  # the best, loaded


@pytest.mark.timeout(3 * LAUNCH_TIMEOUT + 60)
def test_trainer_export_loads_with_from_pretrained(runs: Runs) -> None:
    for name in ("straight", "resumed"):
        export = runs.path(name, "export")
        assert {"config.json", "model.safetensors"} <= set(os.listdir(export))
        logits_of_export(export, runs.path(name, "logits.safetensors"))


# ----------------------------------------------------------------------------- TRL + FSDP2
@pytest.mark.timeout(3 * LAUNCH_TIMEOUT + 60)
def test_sft_fsdp2_shards_saved_unGathered_and_resume_bit_exact(runs: Runs) -> None:
    straight, resumed = runs.result("sft_straight"), runs.result("sft_resume")
    assert straight["global_step"] == resumed["global_step"] == 6
    assert len(straight["sharded"]) >= 19  # parameters are DTensors (FSDP2)
    ckpt = runs.path("sft_straight", "checkpoint-6")
    from safeckpt.engine.reader import open_manifest

    man = open_manifest(ckpt)  # format 3's chunk records (in per-file indexes), format 2's shape
    model_keys = [k for k in man["tensors"] if k.startswith("model/")]
    assert model_keys and all(man["tensors"][k]["scope"] == "sharded" for k in model_keys)
    w = man["tensors"]["model/model.layers.0.mlp.up_proj.weight"]
    assert sorted(c["file"] for c in w["chunks"]) == ["rank-00000.safetensors", "rank-00001.safetensors"]
    assert_same_checkpoint(ckpt, runs.path("sft_resumed", "checkpoint-6"),
                           ignore=("trainer_state/log_history",))
    ref, got = losses(runs.path("sft_straight", "losses.jsonl")), losses(runs.path("sft_resumed", "losses.jsonl"))
    assert sorted(got) == [4, 5, 6] and all(got[s] == ref[s] for s in got)
    assert_same_rng(runs.path("sft_straight"), runs.path("sft_resumed"), "sft")
    assert os.path.exists(runs.path("sft_resumed", "README.md"))  # SFTTrainer's model card
    # field report 5: ranks passing different directories to save_model get RankMismatch, on
    # every rank, and nothing is written (instead of a rank-0 FileNotFoundError on a shard)
    for r in (0, 1):
        msg = runs.rank("sft_straight", r)["mismatch"]
        assert msg and "path=" in msg and "nothing was written" in msg, msg
    leftovers = [n for n in os.listdir(runs.path("sft_straight")) if "export-" in n]
    assert leftovers == [], leftovers
    for name in ("sft_straight", "sft_resumed"):  # exported without gathering, from_pretrained
        logits_of_export(runs.path(name, "export"), runs.path(name, "logits.safetensors"))


# ----------------------------------------------------------------------------- Accelerate
@pytest.mark.timeout(3 * LAUNCH_TIMEOUT + 60)
def test_accelerate_sigterm_resume_is_bit_exact(runs: Runs) -> None:
    straight, pre, final = (runs.result(j) for j in ("acc_straight", "acc_preempt", "acc_final"))
    assert pre["preempted"] and pre["final_step"] == 6
    assert [runs.rank("acc_preempt", r)["final_step"] for r in (0, 1)] == [6, 6]
    assert final["loaded_iteration"] == 2  # load_state() restored the save iteration (#1601)
    ref = dict(map(tuple, straight["losses"]))
    got = dict(map(tuple, pre["losses"] + final["losses"]))
    assert sorted(got) == list(range(1, 13)) and got == ref
    a = runs.path("acc_straight", "checkpoints", "checkpoint_2")   # step 12
    b = runs.path("acc_resumed", "checkpoints", "checkpoint_3")     # step 12
    assert_same_checkpoint(a, b, ignore=("accelerator/iteration",))
    sd = safeckpt.read_state_dict(b)
    assert sd["custom_0/step"] == 12 and sd["dataloader_0/sampler/initial_seed"] == 11
    assert_same_rng(runs.path("acc_straight"), runs.path("acc_resumed"), "acc")
    # total_limit=2, applied after each commit; the restored checkpoint is kept by that run
    assert committed(runs.path("acc_straight", "checkpoints")) == [1, 2]
    assert committed(runs.path("acc_resumed", "checkpoints")) == [1, 2, 3]
    for r in (0, 1):  # a registered object that is not tensors/JSON: refused on every rank
        msg = runs.rank("acc_final", r)["refused"]
        assert msg.startswith("CheckpointError") and "Opaque" in msg and "no pickle" in msg


def test_import_safeckpt_imports_no_framework() -> None:
    code = ("import safeckpt, sys; bad = [m for m in ('transformers', 'accelerate', 'trl', "
            "'datasets') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
