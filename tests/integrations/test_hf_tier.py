"""``with_safeckpt(Trainer, local_dir=..., durable_every=2, replicas=1)`` on a real 2-rank job
(torchrun, gloo on 127.0.0.1, CPU, hard timeout; each rank its own simulated node).

A run that fails at the start of step 6 has committed only the durable steps 2 and 4 under
``output_dir`` (step 5 is on the nodes only, not drained after the failure); a new trainer with
``resume_from_checkpoint=True`` restores step 5 from the nodes and ends bit-exact with an
uninterrupted run (step 6's loss, every rank's model, optimizer and RNG). The durable steps are
Hugging Face model directories (``from_pretrained``) and pass ``safeckpt verify``.
"""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch  # noqa: E402

import safeckpt  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "scripts", "hf_tier.py")
sys.path.insert(0, os.path.join(HERE, "scripts"))
import hf_tiny as tiny  # noqa: E402

from tests.helpers.hf_layout import run_two_ranks  # noqa: E402

LAUNCH_TIMEOUT = 300


@pytest.mark.timeout(LAUNCH_TIMEOUT + 120)
def test_trainer_resumes_a_local_only_step_and_durable_steps_are_model_directories(tmp_path) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out = str(tmp_path / "out")
    r = run_two_ranks(SCRIPT, out, env=tiny.OFFLINE_ENV, timeout=LAUNCH_TIMEOUT)

    straight, crashed, resumed = r["straight"], r["crashed"], r["resumed"]
    assert straight["global_step"] == 6 and crashed["crashed"] and sorted(crashed["losses"], key=int)[-1] == "5"
    # Only the durable steps were under output_dir when the run failed; step 5 was on the nodes only.
    assert r["before"] == ["checkpoint-2", "checkpoint-4"], r["before"]
    for node in ("node0", "node1"):
        (tag,) = os.listdir(os.path.join(out, "nodes", node))
        assert "step-0000000005" in os.listdir(os.path.join(out, "nodes", node, tag))
    # The resume restored step 5 (it trained step 6 only) and ends bit-exact with the straight run.
    assert resumed["global_step"] == 6 and resumed["losses"] == {"6": straight["losses"]["6"]}
    for rank in (0, 1):
        a = load_file(os.path.join(out, "straight", f"state-rank{rank}.safetensors"))
        b = load_file(os.path.join(out, "crashed", f"state-rank{rank}.safetensors"))
        assert a.keys() == b.keys() and any(k.startswith("optim/") for k in a)
        assert [k for k in a if not torch.equal(a[k], b[k])] == []

    # Durable steps are Hugging Face model directories, committed and verified.
    final = load_file(os.path.join(out, "straight", "state-rank0.safetensors"))
    for run in ("straight", "crashed"):
        root = os.path.join(out, run)
        assert sorted(n for n in os.listdir(root) if n.startswith("checkpoint-")) == [
            "checkpoint-2", "checkpoint-4", "checkpoint-6"]
        for step in (2, 4, 6):
            ckpt = os.path.join(root, f"checkpoint-{step}")
            assert {"model.safetensors", "config.json", "trainer_state.json"} <= set(os.listdir(ckpt))
            assert safeckpt.verify(ckpt).ok
        sd = AutoModelForCausalLM.from_pretrained(os.path.join(root, "checkpoint-6")).state_dict()
        weights = {k[len("model/"):]: v for k, v in final.items() if k.startswith("model/")}
        assert all(torch.equal(sd[k], weights[k]) for k in weights if k in sd) and "lm_head.weight" in sd
