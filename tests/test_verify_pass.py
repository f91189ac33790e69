"""A deep verify reads every data byte once: the whole-file xxh3-128 and every chunk's xxh3-64
come from one streamed pass (``Storage.hash`` with the chunks' spans), so a remote deep verify
downloads each object once, not twice, and still names each corrupt chunk."""

from __future__ import annotations

import json
import os
import random

import fsspec
import pytest
import torch
import xxhash

import safeckpt
from safeckpt.engine.offline import verify_on
from safeckpt.engine.reader import open_manifest
from safeckpt.format.manifest import CHECKSUM_FIELD, MANIFEST, encode_manifest
from safeckpt.storage.base import resolve, storage_for
from safeckpt.storage.digest import StreamDigest
from tests.helpers.manifest_checks import as_format2
from tests.helpers.read_counter import counting


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "big": torch.randn(1 << 23, generator=g),  # 32 MiB: far more than a remote read-ahead
        "mid": torch.randn(300_000, generator=g),  # not a multiple of any block size
        **{f"small.{i}": torch.randn(64 + i, generator=g) for i in range(40)},
        "empty": torch.empty(0),
    }


@pytest.fixture(params=["format3", "format2"])
def ckpt(request, tmp_path) -> str:
    path = str(tmp_path / "ck")
    safeckpt.save(path, _state())
    if request.param == "format2":
        as_format2(path)
    return path


def _chunks(ckpt: str) -> list[tuple[str, dict]]:
    man = open_manifest(ckpt)
    return [(key, c) for key, rec in man["tensors"].items() for c in rec["chunks"] if c["end"] > c["start"]]


def _resign(ckpt: str, edit) -> None:
    """Rewrite the manifest with ``edit`` applied and its checksum recomputed (a forged one)."""
    path = os.path.join(ckpt, MANIFEST)
    with open(path) as f:
        man = json.load(f)
    edit(man)
    with open(path, "wb") as f:
        f.write(encode_manifest({k: v for k, v in man.items() if k != CHECKSUM_FIELD}))


def test_stream_digest_equals_hashing_each_range_on_its_own():
    rng = random.Random(3)
    for _ in range(2000):
        data = rng.randbytes(rng.randrange(0, 400))
        spans = [(s, s + rng.randrange(0, 60)) for s in (rng.randrange(0, len(data) + 4) for _ in range(rng.randrange(8)))]
        d = StreamDigest(spans)
        pos = 0
        while pos < len(data):
            step = rng.randrange(0, 70)
            d.update(data[pos:pos + step])
            pos += step
        got = d.result()
        assert got.size == len(data) and got.xxh3_128 == xxhash.xxh3_128_hexdigest(data)
        for (s, e), digest in zip(spans, got.spans, strict=True):
            assert digest == (xxhash.xxh3_64_hexdigest(data[s:e]) if e <= len(data) else None), (s, e)
    with pytest.raises(ValueError):
        StreamDigest([(5, 4)])


def test_local_deep_verify_reads_each_data_byte_once(ckpt):
    store = storage_for(ckpt)
    read = counting(store)
    told = []
    report = verify_on(store, resolve(ckpt), deep=True, progress=told.append)
    assert report.ok, report.problems
    files = open_manifest(ckpt)["files"]
    extra = sum(_header_bytes(ckpt, n) for n in files)
    extra += sum(rec["index"][1] - rec["index"][0] for rec in files.values() if "index" in rec)
    # the data hashed once, plus the headers (and format 3's indexes) read by the checks
    assert report.nbytes <= read[0] <= report.nbytes + extra, (read[0], report.nbytes, extra)
    assert sum(told) == report.nbytes


def _header_bytes(ckpt: str, name: str) -> int:
    with open(os.path.join(ckpt, name), "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def test_remote_deep_verify_downloads_each_object_once(ckpt):
    url = "memory://safeckpt-verify-pass/ck"
    fs = fsspec.filesystem("memory")
    if fs.exists("/safeckpt-verify-pass"):
        fs.rm("/safeckpt-verify-pass", recursive=True)
    fs.put(ckpt, "/safeckpt-verify-pass/ck", recursive=True)
    store = storage_for(url)
    fetched = counting(store)
    report = verify_on(store, resolve(url), deep=True)
    assert report.ok, report.problems
    # every object's bytes fetched once (whole-file and chunk digests from one stream), plus
    # what the structural checks read: the header with its read-ahead (4 MiB) and the index
    assert report.nbytes <= fetched[0] <= report.nbytes + (5 << 20), (fetched[0], report.nbytes)
    fs.rm("/safeckpt-verify-pass", recursive=True)


def _flip(ckpt: str, at: int) -> str:
    (name,) = open_manifest(ckpt)["files"]
    path = os.path.join(ckpt, name)
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x10]))
    return name


def test_a_flipped_byte_names_the_file_and_the_chunk(ckpt):
    key, c = next((k, c) for k, c in _chunks(ckpt) if k == "mid")
    name = _flip(ckpt, (c["start"] + c["end"]) // 2)
    report = safeckpt.verify(ckpt)
    assert not report.ok
    assert report.problems == [
        f"{name}: checksum mismatch (corrupt data)",
        f"{name}: checksum mismatch in bytes {c['start']}-{c['end']} (tensor 'mid'): the data is corrupt",
    ]
    assert safeckpt.verify(ckpt, deep=False).ok  # structure and sizes only


def test_a_chunk_under_a_recomputed_file_checksum_is_named(ckpt):
    """A tool rewrote the file's xxh3-128 over damaged chunk bytes: the chunk's own xxh3-64
    still catches it, from the same single pass."""
    chunks = _chunks(ckpt)
    (key, c), (key2, c2) = [kc for kc in chunks if kc[0] in ("big", "small.7")]
    name = _flip(ckpt, c["end"] - 1)
    _flip(ckpt, c2["start"])
    digest = xxhash.xxh3_128_hexdigest(open(os.path.join(ckpt, name), "rb").read())
    _resign(ckpt, lambda man: man["files"][name].update(xxh3_128=digest))
    report = safeckpt.verify(ckpt)
    assert not report.ok
    assert sorted(report.problems) == sorted(
        f"{name}: checksum mismatch in bytes {x['start']}-{x['end']} (tensor {k!r}): the data is corrupt"
        for k, x in ((key, c), (key2, c2))
    )
    with pytest.raises(safeckpt.CorruptCheckpoint, match="checksum mismatch"):
        safeckpt.read_state_dict(ckpt)


def test_many_corrupt_chunks_are_summarised(tmp_path):
    ckpt = str(tmp_path / "ck")
    safeckpt.save(ckpt, {f"t{i}": torch.full((16,), float(i)) for i in range(30)})
    chunks = _chunks(ckpt)
    for _, c in chunks:
        name = _flip(ckpt, c["start"])
    report = safeckpt.verify(ckpt)
    assert report.problems[0] == f"{name}: checksum mismatch (corrupt data)"
    named = [p for p in report.problems if "(tensor " in p]
    assert len(named) == 10 and report.problems[-1] == f"{name}: {len(chunks) - 10} more corrupt chunks"


def test_truncated_and_grown_files_are_refused_before_hashing(ckpt):
    (name,) = open_manifest(ckpt)["files"]
    path = os.path.join(ckpt, name)
    raw = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(raw[:-3])
    report = safeckpt.verify(ckpt)
    assert not report.ok and "manifest says" in report.problems[0]
    with open(path, "wb") as f:
        f.write(raw + b"\0")
    report = safeckpt.verify(ckpt)
    assert not report.ok and "manifest says" in report.problems[0]
