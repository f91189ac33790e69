"""Outcomes of a peer project's own tests run under pytest with ``--junitxml``: shared by the
optional-integration tests that run another project's test suite against safeckpt
(``peer_deepspeed/run.py``, ``test_lightning_peer.py``, ``test_hf_accelerate_peer.py``)."""

from __future__ import annotations

import os
import socket
import xml.etree.ElementTree as ET

_PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def reachable(host: str = "github.com", port: int = 443, timeout: float = 5.0) -> bool:
    """Whether a peer project's sources can be fetched from ``host``: a TCP connect within
    ``timeout`` (through a proxy, assumed yes). Where the network drops packets to it (CI has
    only the package registries), a git fetch would wait out its whole timeout instead."""
    if any(os.environ.get(v) for v in _PROXY_VARS):
        return True
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


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
