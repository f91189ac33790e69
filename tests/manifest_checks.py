"""Checks on written manifests shared by the format and distributed tests."""

from __future__ import annotations

import json
import os

from safeckpt._manifest import CHECKSUM_FIELD, encode_manifest


def assert_canonical(ckpt_dir: str) -> dict:
    """The manifest's bytes are exactly the canonical encoding of what they parse to (the save
    path assembles them from cached pieces; a reader re-encodes a reformatted manifest to check
    it, so any difference would make a re-indented manifest fail its checksum). Returns it."""
    with open(os.path.join(ckpt_dir, "manifest.json"), "rb") as f:
        raw = f.read()
    man = json.loads(raw)
    body = {k: v for k, v in man.items() if k != CHECKSUM_FIELD}
    assert raw == encode_manifest(body), f"{ckpt_dir}: manifest bytes are not the canonical encoding"
    return man
