"""Share checksum verification among the ranks of one machine.

A load verifies every chunk before copying it into place (a failed load changes nothing).
When several ranks on one machine load the same replicated bytes, each of them hashing all of
them multiplies the CPU cost of that pass by the number of ranks, and they share one page
cache: a chunk one rank verified is, byte for byte, the pages the others copy from. So ranks
that read the checkpoint through the same page cache (same kernel boot, same directory inode)
split the chunks they need between them, each verifying a share, largest chunks first to
the least-loaded rank that needs the chunk. A failure anywhere fails the collective check
phase on every rank, before anything is copied. Ranks on other machines, and object stores,
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


def split_verification(plans: Sequence[dict[str, Any]], sizes: Sequence[int]) -> list[set[int]]:
    """Which chunks each rank verifies. ``plans[r]``: rank r's ``{"cache": page_cache_id or
    None, "need": [chunk indices]}``; ``sizes[i]``: bytes of chunk i. Every chunk a rank needs
    is verified by one rank of its page-cache group that also needs it; the result is the same
    on every rank (it depends only on the gathered plans)."""
    assigned: list[set[int]] = [set() for _ in plans]
    groups: dict[Any, list[int]] = {}
    for rank, plan in enumerate(plans):
        key = plan["cache"] if plan["cache"] is not None else ("alone", rank)
        groups.setdefault(key, []).append(rank)
    for ranks in groups.values():
        needers: dict[int, list[int]] = {}
        for rank in ranks:
            for i in plans[rank]["need"]:
                needers.setdefault(i, []).append(rank)
        load = dict.fromkeys(ranks, 0)
        for i in sorted(needers, key=lambda i: (-sizes[i], i)):
            rank = min(needers[i], key=lambda r: (load[r], r))
            assigned[rank].add(i)
            load[rank] += sizes[i]
    return assigned
