"""Count the bytes a storage reads: wraps a Storage instance's ``hash`` and ``open`` (the
data files it opens), or on a remote store every ranged GET (``fetch``). Used by
tests/test_verify_pass.py and bench/bench_verify.py to show a deep verify reads the data once."""

from __future__ import annotations

from typing import Any


class _Counted:
    """A data file opened by the store, counting the bytes read or hashed through it."""

    def __init__(self, f: Any, tally: list[int]) -> None:
        self._f, self._tally = f, tally

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._f, name)
        if name in ("read", "hash_range", "hash_range_local"):
            def counted(start: int, end: int, *a: Any) -> Any:
                self._tally[0] += end - start
                return attr(start, end, *a)
            return counted
        if name == "hash_runs":
            def runs(spans: Any) -> Any:
                self._tally[0] += sum(e - s for s, e in spans)
                return attr(spans)
            return runs
        if name == "read_into":
            def into(start: int, buf: Any) -> Any:
                self._tally[0] += len(buf)
                return attr(start, buf)
            return into
        return attr


def counting(store: Any) -> list[int]:
    """Wrap ``store``'s open and hash (and fetch, remote) to count the bytes they read."""
    tally = [0]
    open_, hash_ = store.open, store.hash
    store.open = lambda *a, **k: _Counted(open_(*a, **k), tally)

    def hashed(path: str, *a: Any, **k: Any) -> Any:
        out = hash_(path, *a, **k)
        tally[0] += out[0]
        return out

    store.hash = hashed
    if hasattr(store, "fetch"):  # remote: every GET, whoever asks (hash and open alike)
        store.open, store.hash = open_, hash_
        fetch = store.fetch

        def fetched(path: str, starts: list[int], ends: list[int]) -> Any:
            tally[0] += sum(e - s for s, e in zip(starts, ends))
            return fetch(path, starts, ends)

        store.fetch = fetched
    return tally
