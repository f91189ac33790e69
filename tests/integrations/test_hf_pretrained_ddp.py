"""Issue 30 on a real 2-rank DDP Trainer job (torchrun, gloo on 127.0.0.1, CPU, hard timeout).

With ``max_shard_size`` small enough for several shards, ``checkpoint-N`` holds
``model-0000k-of-0000n.safetensors`` and ``model.safetensors.index.json`` exactly as
``save_pretrained`` writes them, the shards written by both ranks (each rank its share, once),
and ``AutoModelForCausalLM.from_pretrained(checkpoint-N)`` is the trained model.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch  # noqa: E402

import safeckpt  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "scripts", "hf_pretrained_ddp.py")
sys.path.insert(0, os.path.join(HERE, "scripts"))
import hf_tiny as tiny  # noqa: E402

from tests.helpers.hf_layout import assert_same_shards, run_two_ranks, tensors  # noqa: E402

LAUNCH_TIMEOUT = 240


@pytest.mark.timeout(LAUNCH_TIMEOUT + 120)
def test_ddp_checkpoint_is_a_sharded_model_directory_written_by_both_ranks(tmp_path) -> None:
    out = str(tmp_path / "out")
    run_two_ranks(SCRIPT, out, env=tiny.OFFLINE_ENV, timeout=LAUNCH_TIMEOUT)

    from transformers import AutoModelForCausalLM

    ckpt = os.path.join(out, "checkpoint-4")
    ref = os.path.join(out, "ref")
    shards = assert_same_shards(ckpt, ref)
    assert len(shards) >= 3, shards  # several shards, so both ranks can take some

    man = json.load(open(os.path.join(ckpt, "manifest.json")))
    assert man["world_size"] == 2
    writers = {man["files"][n]["writer"] for n in shards}
    assert writers == {0, 1}, writers  # each rank wrote its share of the shards
    for n in ("rank-00000.safetensors", "rank-00001.safetensors"):  # and no model bytes besides
        assert not any(k.startswith("model/") for k in tensors(os.path.join(ckpt, n)))
    assert safeckpt.verify(ckpt).ok

    loaded = AutoModelForCausalLM.from_pretrained(ckpt)
    want = AutoModelForCausalLM.from_pretrained(ref)
    sd = want.state_dict()
    assert all(torch.equal(loaded.state_dict()[k], sd[k]) for k in sd)
    before = AutoModelForCausalLM.from_pretrained(os.path.join(out, "checkpoint-2"))
    assert not all(torch.equal(before.state_dict()[k], sd[k]) for k in sd)  # it trained in between
