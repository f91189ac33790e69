"""Ranged GETs answered with the whole object (a server that ignores the Range header: 200
instead of 206): ``stream_hash`` (deep verify of a remote object) hashes the object's bytes,
not the concatenated answers, and a body of any other wrong length is a clear
CorruptCheckpoint, never hashed."""

from __future__ import annotations

import os

import pytest
import xxhash

from safeckpt.errors import CorruptCheckpoint
from safeckpt.storage.ranged import stream_hash

pytestmark = pytest.mark.timeout(60)

BODY = os.urandom(10_000)
SPANS = [(0, 8), (100, 4_000), (3_999, 10_000), (9_000, 9_000)]


class Store:
    """``fetch`` as a storage has it, from a server that honours ranges or sends ``answer``."""

    def __init__(self, answer: bytes | None = None) -> None:
        self.answer = answer
        self.calls = 0

    def fetch(self, path: str, starts: list[int], ends: list[int]) -> list[bytes]:
        self.calls += 1
        return [BODY[s:e] if self.answer is None else self.answer for s, e in zip(starts, ends)]


def _hash(store: Store, reported: list[int]):
    return stream_hash(store, "http://host/ck/rank-00000.safetensors", len(BODY), reported.append,
                       window=1_000, spans=SPANS)


def test_whole_object_answers_are_hashed_once_as_the_object():
    honest, seen = [], []
    expect = _hash(Store(), honest)
    assert expect.xxh3_128 == xxhash.xxh3_128_hexdigest(BODY)
    assert expect.spans[1] == xxhash.xxh3_64_hexdigest(BODY[100:4_000])
    ignoring = Store(answer=BODY)
    assert _hash(ignoring, seen) == expect
    assert ignoring.calls == 1 and sum(seen) == sum(honest) == len(BODY)  # one download, not ten


@pytest.mark.parametrize("answer", [BODY[:500], BODY + b"x", BODY[:1_001]], ids=["short", "longer", "part+1"])
def test_an_answer_of_another_length_is_a_clear_error(answer):
    with pytest.raises(CorruptCheckpoint, match=r"read from .* bytes 0-1000 \(got \d+ bytes\).*ranged GETs"):
        _hash(Store(answer=answer), [])
