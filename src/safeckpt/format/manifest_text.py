"""The manifest's canonical JSON, written from pieces rendered separately.

A save renders the head, the objects and the ``tensors`` object (the last cached per plan: in
format 3 it holds no checksums, so it is the same text every save of a layout) and joins them.
The result is byte for byte what :func:`safeckpt.format.manifest.encode_manifest` makes of the same
manifest as a dict (the same key order, separators and escaping: every piece is rendered by
``json.dumps`` with the canonical settings), so readers cannot tell the difference; the tests
check that every written manifest is the canonical encoding of what it parses to.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from .manifest import seal_manifest


def dumps(value: Any) -> str:
    """``value`` as canonical manifest JSON (the settings of ``safeckpt.format.manifest._canonical``)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=True, allow_nan=True)


def encode(head: Mapping[str, Any], objects: Mapping[str, Any], tensors_json: str) -> bytes:
    """The bytes of ``manifest.json``: ``head`` (every top-level field but objects and tensors,
    in order, at least one) followed by ``objects`` and ``tensors``, sealed with the manifest
    checksum. The objects are rendered every time: they hold the state's plain values, and a
    cache compared by ``==`` would take ``1`` for ``True`` or ``1.0``."""
    body = dumps(dict(head))
    return seal_manifest(f'{body[:-1]},"objects":{dumps(objects)},"tensors":{tensors_json}}}')
