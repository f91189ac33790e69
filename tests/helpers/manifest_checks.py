"""Checks on written manifests shared by the format and distributed tests."""

from __future__ import annotations

import json
import os

from safeckpt.engine.reader import open_manifest
from safeckpt.format.manifest import CHECKSUM_FIELD, encode_manifest


def assert_canonical(ckpt_dir: str) -> dict:
    """The manifest's bytes are exactly the canonical encoding of what they parse to (the save
    path assembles them from cached pieces; a reader re-encodes a reformatted manifest to check
    it, so any difference would make a re-indented manifest fail its checksum). Returns it (a
    format-3 manifest as its format-2 view: chunks from the files' indexes, all checked)."""
    with open(os.path.join(ckpt_dir, "manifest.json"), "rb") as f:
        raw = f.read()
    man = json.loads(raw)
    body = {k: v for k, v in man.items() if k != CHECKSUM_FIELD}
    assert raw == encode_manifest(body), f"{ckpt_dir}: manifest bytes are not the canonical encoding"
    if man.get("format_version") == 3:  # chunks live in the files' indexes: the format-2 view
        return open_manifest(ckpt_dir)
    return man


def as_format2(ckpt_dir: str) -> dict:
    """Rewrite a format-3 checkpoint's manifest as format 2 (every chunk listed in it, as
    safeckpt 0.1 wrote), for the tests of format-2 validation; returns the new manifest. The
    data files stay as they are (their index tensor is one more safetensors tensor)."""
    path = os.path.join(ckpt_dir, "manifest.json")
    with open(path, "rb") as f:
        man = json.loads(f.read())
    if man.get("format_version") != 3:
        return man
    view = open_manifest(ckpt_dir)
    old = {k: v for k, v in view.items() if k not in (CHECKSUM_FIELD, "meshes", "rank_trees")}
    old["format_version"] = 2
    old["files"] = {n: {k: v for k, v in rec.items() if k not in ("index", "data")} for n, rec in view["files"].items()}
    old["tensors"] = {k: {f: v for f, v in rec.items() if f not in ("pieces", "sharding", "boxes")}
                      for k, rec in view["tensors"].items()}
    order = ("format", "format_version", "step", "world_size", "created_at", "created_unix", "safeckpt_version",
             "torch_version", "metadata", "metrics", "files", "objects", "tensors")
    old = {k: old[k] for k in order if k in old}
    raw = encode_manifest(old)
    with open(path, "wb") as f:
        f.write(raw)
    return json.loads(raw)
