"""How a checkpoint location is spelled: a local path or an object-store URL.

A string rule, no I/O: the format names files relative to a location, the storage layer picks
a backend by it.
"""

from __future__ import annotations

import os

LOCAL_SCHEME = "file://"


def is_remote(path: str | os.PathLike[str]) -> bool:
    """True for an fsspec URL other than ``file://`` (``s3://bucket/prefix``, ``gs://...``)."""
    p = os.fspath(path)
    return isinstance(p, str) and "://" in p and not p.startswith(LOCAL_SCHEME)
