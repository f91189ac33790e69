"""Share checksum verification among the ranks of one machine, without exchanging anything.

A load verifies every chunk before copying it into place (a failed load changes nothing).
When several ranks on one machine load the same replicated bytes, each of them hashing all of
them multiplies the CPU cost of that pass by the number of ranks, and they share one page
cache: a chunk one rank verified is, byte for byte, the pages the others copy from.

So the ranks of one machine (torchrun's LOCAL_RANK / LOCAL_WORLD_SIZE) split the replicated
chunks they copy whole by a rule each computes alone (:func:`split_shared`: largest first to the
least-loaded local rank), and report with their check (no extra round) their page-cache id and
a digest of the list. The coordinator confirms that every machine's ranks were all there, on
one page cache, with the same list (:func:`shares_complete`); if not, the ranks verify what
they left to the others in one more round before anything is applied. A failure anywhere fails
the check on every rank, before anything is copied. Object stores and ranks without LOCAL_*
verify everything they read themselves.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

_BOOT_ID = "/proc/sys/kernel/random/boot_id"


def page_cache_id(directory: str) -> str | None:
    """Identifies the page cache through which this process reads ``directory``'s files: two
    processes with the same id read the same cached pages. None when that cannot be told."""
    try:
        with open(_BOOT_ID) as f:
            boot = f.read().strip()
        st = os.stat(directory)
    except OSError:
        return None
    return f"{boot}:{st.st_dev}:{st.st_ino}" if boot else None


def local_position() -> tuple[int, int] | None:
    """(local rank, ranks on this machine) as torchrun sets them (LOCAL_RANK,
    LOCAL_WORLD_SIZE), or None when not known."""
    try:
        local, size = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        return None
    return (local, size) if 0 <= local < size else None


def split_shared(shared: Sequence[tuple[Any, int]], local_rank: int, local_world: int) -> tuple[list[Any], list[Any]]:
    """(mine, the others') of the ``shared`` (chunk, bytes) every rank of the machine needs:
    largest first to the least-loaded local rank. Every rank computes the same split from the
    same list without exchanging anything; the coordinator checks afterwards that the list
    and the machine's ranks were what each rank assumed (:func:`shares_complete`)."""
    load = [0] * local_world
    mine, others = [], []
    for chunk, size in sorted(shared, key=lambda cs: (-cs[1], cs[0])):
        r = min(range(local_world), key=lambda i: (load[i], i))
        load[r] += size
        (mine if r == local_rank else others).append(chunk)
    return mine, others


def shared_digest(shared: Sequence[tuple[Any, int]]) -> str:
    import hashlib
    import json

    return hashlib.sha256(json.dumps(sorted(shared)).encode()).hexdigest()[:32]


def shares_complete(shares: Sequence[dict[str, Any] | None]) -> bool:
    """Coordinator: whether every machine's split covered its shared chunks: each group of
    ranks that reported one page cache is local ranks 0..L-1 of L, all with the same list.
    False: the ranks that left chunks to others verify them themselves (one more round)."""
    groups: dict[Any, list[dict[str, Any]]] = {}
    for share in shares:
        if share is not None and share.get("local"):
            groups.setdefault(share["cache"], []).append(share)
    for group in groups.values():
        size = group[0]["local"][1]
        if (len(group) != size or sorted(s["local"][0] for s in group) != list(range(size))
                or any(s["local"][1] != size or s["shared"] != group[0]["shared"] for s in group)):
            return False
    return True
