"""Outcomes of a peer project's own tests run under pytest with ``--junitxml``: shared by the
optional-integration tests that run another project's test suite against safeckpt
(``peer_deepspeed/run.py``, ``test_lightning_peer.py``, ``test_hf_accelerate_peer.py``)."""

from __future__ import annotations

import os
import xml.etree.ElementTree as ET


def outcomes(junit: str) -> dict[str, tuple[str, str]]:
    """``{classname::name: (passed|failed|skipped, message + text)}``; a test whose teardown
    errors counts as failed. Empty when the file is missing (the run died before writing it)."""
    out: dict[str, tuple[str, str]] = {}
    if not os.path.exists(junit):
        return out
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        status, text = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                status = "skipped" if tag == "skipped" else "failed"
                text = f"{node.get('message') or ''}\n{node.text or ''}"
                if status == "failed":
                    break
        if out.get(name, ("passed",))[0] != "failed":
            out[name] = (status, text)
    return out
