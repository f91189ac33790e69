"""Tensors <-> one safetensors file: streamed writes with checksums, mmap'd reads.

The writer emits a standard safetensors file (header, then tensor bytes packed in order of
descending element size so every tensor is aligned) straight from each tensor's memory: no
second copy of the state is built. Each chunk's bytes are hashed (xxh3-64) and the whole file
(xxh3-128) while being written, so the commit never needs a second read. The file is fsynced
before the writer returns.

The reader maps the file (copy-on-write, so tensors can wrap it without warnings) and hands
out byte ranges recorded in the manifest; it never unpickles and never parses more than it needs.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import xxhash

from ._manifest import dtype_code
from .errors import CorruptCheckpoint

PIECE = 64 << 20  # bytes hashed and written per system call


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a CPU tensor (copies only if on another device or strided)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.resolve_conj().resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


@dataclass(frozen=True)
class WrittenChunk:
    name: str
    start: int
    end: int
    xxh3_64: str


@dataclass(frozen=True)
class WrittenFile:
    size: int
    xxh3_128: str
    chunks: tuple[WrittenChunk, ...]


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        n = os.write(fd, data)
        data = data[n:]


def write_file(path: str, items: Sequence[tuple[str, torch.Tensor]], metadata: dict[str, str]) -> WrittenFile:
    """Write ``items`` (name, tensor) as a safetensors file at ``path`` (must not exist), fsynced."""
    order = sorted(items, key=lambda it: -it[1].element_size())
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, t in order:
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": dtype_code(t.dtype), "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    prefix = struct.pack("<Q", len(raw)) + raw
    base = len(prefix)

    file_hash = xxhash.xxh3_128()
    chunks: list[WrittenChunk] = []
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        file_hash.update(prefix)
        _write_all(fd, memoryview(prefix))
        pos = base
        for name, t in order:
            data = tensor_bytes(t)
            chunk_hash = xxhash.xxh3_64()
            for off in range(0, len(data), PIECE):
                piece = data[off : off + PIECE]
                chunk_hash.update(piece)
                file_hash.update(piece)
                _write_all(fd, piece)
            chunks.append(WrittenChunk(name, pos, pos + len(data), chunk_hash.hexdigest()))
            pos += len(data)
        os.fsync(fd)
    finally:
        os.close(fd)
    return WrittenFile(size=pos, xxh3_128=file_hash.hexdigest(), chunks=tuple(chunks))


def hash_file(path: str, block: int = 8 << 20) -> tuple[int, str]:
    """(size, xxh3-128) of a file, streamed."""
    h = xxhash.xxh3_128()
    size = 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(block)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
            size += n
    return size, h.hexdigest()


class MappedFile:
    """A read-only view of one data file, checked against its recorded size."""

    def __init__(self, path: str, expected_size: int) -> None:
        self.path = path
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise CorruptCheckpoint(f"data file {path} is missing", path=os.path.dirname(path)) from None
        try:
            size = os.fstat(fd).st_size
            if size != expected_size:
                raise CorruptCheckpoint(
                    f"data file {path} has {size} bytes, the manifest says {expected_size} "
                    "(truncated or replaced)", path=os.path.dirname(path),
                )
            self._mm = mmap.mmap(fd, size, access=mmap.ACCESS_COPY) if size else None
        finally:
            os.close(fd)

    def tensor(self, start: int, end: int, dtype: torch.dtype, shape: Sequence[int], expect_hash: str | None) -> torch.Tensor:
        """The bytes [start, end) as a tensor (aliasing the mapping); verified if a hash is given."""
        numel = 1
        for s in shape:
            numel *= s
        if numel == 0 or end == start:
            return torch.empty(tuple(shape), dtype=dtype)
        assert self._mm is not None
        view = memoryview(self._mm)[start:end]
        if expect_hash is not None and xxhash.xxh3_64_hexdigest(view) != expect_hash:
            raise CorruptCheckpoint(
                f"checksum mismatch in {self.path} bytes {start}-{end}: the file is corrupt. "
                "Load an older checkpoint (CheckpointManager.restore falls back automatically).",
                path=os.path.dirname(self.path),
            )
        return torch.frombuffer(view, dtype=torch.uint8).view(dtype).reshape(tuple(shape))

    def close(self) -> None:
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # a tensor still aliases the mapping; the GC will release it
                pass
