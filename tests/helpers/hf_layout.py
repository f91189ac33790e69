"""Checks of a Hugging Face model directory: safetensors headers read without loading tensors,
and a checkpoint's shards compared with the ones ``save_pretrained`` wrote."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_two_ranks(script: str, out: str, *args: str, env: dict[str, str], timeout: float) -> dict:
    """Run ``script out *args`` under torchrun with 2 ranks (its own process group, killed past
    ``timeout``: a hang fails the test) and return the ``result.json`` it writes into ``out``."""
    from tests.helpers.dist_harness import free_port

    clean = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    env = {**clean, **env, "SAFECKPT_TIMEOUT": "60",
           "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), script, out, *args]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"torchrun job hung (> {timeout}s):\n{log[-6000:]}")
    assert proc.returncode == 0 and os.path.exists(os.path.join(out, "result.json")), log[-6000:]
    with open(os.path.join(out, "result.json")) as f:
        return json.load(f)


def header(path: str) -> dict:
    """The JSON header of a safetensors file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def tensors(path: str) -> dict[str, tuple[str, list[int]]]:
    """name -> (dtype, shape) of every tensor in a safetensors file."""
    return {k: (v["dtype"], v["shape"]) for k, v in header(path).items() if k != "__metadata__"}


def assert_same_shards(ckpt: str, ref: str) -> list[str]:
    """``ckpt`` holds the shards ``ref`` (a save_pretrained directory) holds, each with the same
    tensors, and the same weight map; returns the shard names."""
    shards = sorted(n for n in os.listdir(ref) if n.endswith(".safetensors"))
    assert sorted(n for n in os.listdir(ckpt) if n.startswith("model-")) == shards
    for n in shards:
        assert tensors(os.path.join(ckpt, n)) == tensors(os.path.join(ref, n)), n
    with open(os.path.join(ckpt, "model.safetensors.index.json")) as a, \
            open(os.path.join(ref, "model.safetensors.index.json")) as b:
        assert json.load(a)["weight_map"] == json.load(b)["weight_map"]
    return shards
