"""Checks of a Hugging Face model directory: safetensors headers read without loading tensors,
and a checkpoint's shards compared with the ones ``save_pretrained`` wrote."""

from __future__ import annotations

import json
import os
import struct


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
