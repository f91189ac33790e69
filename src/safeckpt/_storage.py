"""Where a checkpoint lives: a local (or shared-filesystem) path, or an fsspec URL.

Only this decides which of the two implementations a path takes. Local paths (and
``file://`` URLs) go through the POSIX code (staging directory, fsync, ``renameat2`` publish,
mmap reads); any other ``scheme://`` URL goes through :mod:`safeckpt._remote` (objects written
in place under per-save names, ``manifest.json`` written last as the commit point, range reads).
This module imports nothing heavy, so the local path never imports fsspec.
"""

from __future__ import annotations

import os

LOCAL_SCHEME = "file://"


def is_remote(path: str | os.PathLike[str]) -> bool:
    """True for an fsspec URL other than ``file://`` (``s3://bucket/prefix``, ``gs://...``)."""
    p = os.fspath(path)
    return isinstance(p, str) and "://" in p and not p.startswith(LOCAL_SCHEME)


def resolve(path: str | os.PathLike[str]) -> str:
    """The canonical form of a checkpoint path: an absolute local path, or the URL without a
    trailing slash. Every rank computes the same string from the same argument."""
    p = os.fspath(path)
    if not isinstance(p, str):
        p = os.fsdecode(p)
    if is_remote(p):
        scheme, _, rest = p.partition("://")
        rest = rest.rstrip("/")
        if not rest:
            raise ValueError(f"{p!r} names no bucket or prefix")
        return f"{scheme}://{rest}"
    return os.path.abspath(p.removeprefix(LOCAL_SCHEME))


def join(parent: str, name: str) -> str:
    """``parent/name`` for a resolved local path or URL."""
    return f"{parent}/{name}" if is_remote(parent) else os.path.join(parent, name)


def basename(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1] if is_remote(path) else os.path.basename(os.path.normpath(path))
