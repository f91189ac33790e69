"""Who writes which bytes: a deterministic plan every rank computes identically.

Replicated tensors (the same on every rank, e.g. under DDP) are written once in total. Large
tensors are cut into row ranges so that each rank writes about 1/N of the bytes; pieces are
assigned largest first to the least-loaded rank. The plan depends only on the agreed layout,
so ranks need not exchange it.

Only as many ranks as the bytes need (``ceil(total / target)``, at least MIN_PIECE each) take
part: the small replicated state of a sharded job (FSDP2's optimizer ``step`` scalars) lands in
a few files instead of one per rank, so a rank that loads it opens a few files' indexes, not
thousands (see ``_format3``).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from typing import NamedTuple

MIN_PIECE = 4 << 20


class Piece(NamedTuple):  # a tuple: cheap to create by the thousand
    key: str
    row_start: int  # along dim 0; (0, rows) for the whole tensor
    rows: int
    nbytes: int
    rank: int = -1


def plan_replicated(specs: Sequence[tuple[str, Sequence[int], int]], world_size: int) -> list[Piece]:
    """Assign replicated tensors ``(key, shape, element_size)`` to writer ranks."""
    sizes = [(key, list(shape), math.prod(shape) * es) for key, shape, es in specs]
    total = sum(n for _, _, n in sizes)
    target = max(math.ceil(total / max(world_size, 1)), MIN_PIECE)
    pieces: list[Piece] = []
    for key, shape, nbytes in sizes:
        rows = shape[0] if shape else 1
        if shape and rows > 1 and nbytes > target:
            row_bytes = nbytes // rows
            per = max(1, target // max(row_bytes, 1))
            for start in range(0, rows, per):
                n = min(per, rows - start)
                pieces.append(Piece(key, start, n, n * row_bytes))
        else:
            pieces.append(Piece(key, 0, rows, nbytes))
    pieces.sort(key=lambda p: (-p.nbytes, p.key, p.row_start))
    writers = max(1, min(world_size, math.ceil(total / target)))
    loads = [(0, r) for r in range(writers)]
    heapq.heapify(loads)
    out = []
    for p in pieces:
        load, rank = heapq.heappop(loads)
        out.append(Piece(p.key, p.row_start, p.rows, p.nbytes, rank))
        heapq.heappush(loads, (load + p.nbytes, rank))
    return out
