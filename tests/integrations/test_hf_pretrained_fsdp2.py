"""Issue 30 item 3 on a real 2-rank FSDP2 Trainer job (torchrun, gloo on 127.0.0.1, CPU, hard timeout).

A tiny Llama sharded by transformers at load time (``DistributedConfig(fsdp_size=2)``, i.e.
``fully_shard``) trains under ``with_safeckpt(Trainer, pretrained=True, max_shard_size=...)``:
``checkpoint-N`` holds the model gathered once, as ``save_pretrained`` lays it out (shards written
by both ranks, nothing of the model in safeckpt's rank files, the optimizer still DTensor shards);
``from_pretrained(checkpoint-N)`` gives the trained model's full tensors; a resume from
``checkpoint-3`` in new trainers is bit-exact at step 6 (losses, every rank's shards and RNG);
``safeckpt verify`` (the console script) passes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch  # noqa: E402

import safeckpt  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "scripts", "hf_pretrained_fsdp2.py")
sys.path.insert(0, os.path.join(HERE, "scripts"))
import hf_tiny as tiny  # noqa: E402

from tests.helpers.hf_layout import assert_same_shards, run_two_ranks, tensors  # noqa: E402

LAUNCH_TIMEOUT = 300
SHARD = "40KB"  # as the script's


def _launch(out: str, *args: str) -> dict:
    return run_two_ranks(SCRIPT, out, *args, env=tiny.OFFLINE_ENV, timeout=LAUNCH_TIMEOUT)


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> tuple[str, dict]:
    out = str(tmp_path_factory.mktemp("fsdp2"))
    return out, _launch(out)


def _load(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path)


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.timeout(LAUNCH_TIMEOUT + 120)
def test_fsdp2_checkpoint_is_save_pretrained_layout_written_by_both_ranks(job, tmp_path) -> None:
    out, result = job
    straight = result["straight"]
    assert straight["global_step"] == 6
    assert len(straight["sharded"]) >= 19  # every parameter is a DTensor: the model trained sharded

    from transformers import LlamaForCausalLM

    ckpt = os.path.join(out, "straight", "checkpoint-6")
    full = _load(os.path.join(out, "straight", "full.safetensors"))
    # The reference: stock save_pretrained of the same (full) weights, with the same shard size.
    ref_model = LlamaForCausalLM.from_pretrained(os.path.join(out, "tiny-llama"))
    ref_model.load_state_dict(full)
    ref = str(tmp_path / "ref")
    ref_model.save_pretrained(ref, max_shard_size=SHARD)
    shards = assert_same_shards(ckpt, ref)
    assert len(shards) >= 3, shards
    assert {"config.json", "generation_config.json", "trainer_state.json"} <= set(os.listdir(ckpt))
    assert not {"optimizer.pt", "scheduler.pt", "training_args.bin", "pytorch_model.bin"} & set(os.listdir(ckpt))

    man = json.load(open(os.path.join(ckpt, "manifest.json")))
    assert man["world_size"] == 2
    assert {man["files"][n]["writer"] for n in shards} == {0, 1}  # the shards are spread over the ranks
    for n in ("rank-00000.safetensors", "rank-00001.safetensors"):  # the model's bytes once, in the shards
        assert not any(k.startswith("model/") for k in tensors(os.path.join(ckpt, n)))
    from safeckpt.engine.reader import open_manifest

    recs = open_manifest(ckpt)["tensors"]
    model_keys = [k for k in recs if k.startswith("model/")]
    assert len(model_keys) == len(full) and all(recs[k]["scope"] == "replicated" for k in model_keys)
    opt = [k for k in recs if k.startswith("optimizer/state/")]
    assert opt and any(recs[k]["scope"] == "sharded" for k in opt)  # the optimizer stays DTensor shards

    # from_pretrained(checkpoint-N) is the trained model's full tensors, bit for bit
    loaded = LlamaForCausalLM.from_pretrained(ckpt).state_dict()
    assert _equal({k: loaded[k] for k in full}, full)
    early = LlamaForCausalLM.from_pretrained(os.path.join(out, "straight", "checkpoint-3")).state_dict()
    assert not all(torch.equal(early[k], full[k]) for k in full)  # it trained in between

    exe = os.path.join(os.path.dirname(sys.executable), "safeckpt")
    for c in (ckpt, os.path.join(out, "straight", "checkpoint-3"), os.path.join(out, "resumed", "checkpoint-6")):
        assert safeckpt.verify(c).ok
        proc = subprocess.run([exe, "verify", c], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and proc.stdout.startswith("OK"), proc.stdout + proc.stderr


@pytest.mark.timeout(LAUNCH_TIMEOUT + 120)
def test_fsdp2_resume_from_model_directory_is_bit_exact(job) -> None:
    out, result = job
    straight, resumed = result["straight"], result["resumed"]
    assert resumed["global_step"] == 6
    assert sorted(resumed["losses"], key=int) == ["4", "5", "6"]
    assert all(resumed["losses"][s] == straight["losses"][s] for s in resumed["losses"])
    a, b = (os.path.join(out, n) for n in ("straight", "resumed"))
    assert _equal(_load(os.path.join(a, "full.safetensors")), _load(os.path.join(b, "full.safetensors")))
    for r in (0, 1):  # each rank's own shards and its RNG
        assert _equal(_load(os.path.join(a, f"shards-rank{r}.safetensors")),
                      _load(os.path.join(b, f"shards-rank{r}.safetensors")))
        assert _equal(_load(os.path.join(a, f"rng-rank{r}.safetensors")),
                      _load(os.path.join(b, f"rng-rank{r}.safetensors")))
    # the resumed run's own checkpoint is the same model directory (optimizer state included)
    ra, rb = safeckpt.read_state_dict(os.path.join(a, "checkpoint-6")), safeckpt.read_state_dict(
        os.path.join(b, "checkpoint-6"))
    skip = ("trainer_state/", "rng/")
    keys = [k for k in ra if not k.startswith(skip)]
    assert keys and [k for k in rb if not k.startswith(skip)] == keys
    for k in keys:
        va, vb = ra[k], rb[k]
        assert (torch.equal(va, vb) if isinstance(va, torch.Tensor) else va == vb), k


@pytest.mark.timeout(LAUNCH_TIMEOUT + 120)
def test_fsdp2_tied_weights_are_gathered_and_written_once(tmp_path) -> None:
    # A tied Llama (lm_head.weight is the embedding): state_dict() gives a DTensor per name, but
    # the save gathers the parameter once and the checkpoint holds what save_pretrained writes
    # for the same model unsharded: the embedding alone, lm_head.weight left out.
    from transformers import LlamaForCausalLM

    out = str(tmp_path / "tied")
    result = _launch(out, "tied")
    straight, resumed = result["straight"], result["resumed"]
    # one parameter under two names (named_parameters lists it once), sharded
    assert "model.embed_tokens.weight" in straight["sharded"] and "lm_head.weight" not in straight["sharded"]
    assert straight["gathered"] == 2 * straight["distinct"]  # 2 saves, each parameter gathered once
    assert resumed["gathered"] == resumed["distinct"]  # one save (step 6) after resuming at 3

    ckpt = os.path.join(out, "straight", "checkpoint-6")
    full = _load(os.path.join(out, "straight", "full.safetensors"))
    assert torch.equal(full["lm_head.weight"], full["model.embed_tokens.weight"])
    ref_model = LlamaForCausalLM.from_pretrained(os.path.join(out, "tiny-llama"))
    assert ref_model.lm_head.weight is ref_model.model.embed_tokens.weight
    ref_model.load_state_dict(full)
    ref = str(tmp_path / "ref")
    ref_model.save_pretrained(ref, max_shard_size=SHARD)
    shards = assert_same_shards(ckpt, ref)
    assert not any("lm_head.weight" in tensors(os.path.join(ckpt, n)) for n in shards)
    for n in ("rank-00000.safetensors", "rank-00001.safetensors"):  # no second (sharded) copy
        assert not any(k.startswith("model/") for k in tensors(os.path.join(ckpt, n)))
    from safeckpt.engine.reader import open_manifest

    recs = open_manifest(ckpt)["tensors"]
    assert recs["model/lm_head.weight"].get("alias_of") == "model/model.embed_tokens.weight" or \
        recs["model/model.embed_tokens.weight"].get("alias_of") == "model/lm_head.weight"
    loaded = LlamaForCausalLM.from_pretrained(ckpt)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    assert _equal({k: v for k, v in loaded.state_dict().items()}, full)
    assert safeckpt.verify(ckpt).ok

    # the resume reads each rank's shard of the tied parameter out of that file: bit-exact
    assert resumed["global_step"] == 6
    assert all(resumed["losses"][s] == straight["losses"][s] for s in resumed["losses"])
    assert _equal(full, _load(os.path.join(out, "resumed", "full.safetensors")))
    for r in (0, 1):
        assert _equal(_load(os.path.join(out, "straight", f"shards-rank{r}.safetensors")),
                      _load(os.path.join(out, "resumed", f"shards-rank{r}.safetensors")))
