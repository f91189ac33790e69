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

import ctypes
import ctypes.util
import json
import math
import mmap
import os
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import xxhash

from ..errors import CheckpointError, CorruptCheckpoint
from .fileindex import INDEX_NAME, header_digest
from .manifest import DTYPE_TO_ST, dtype_code, open_regular, retry_io, unavailable

PIECE = 64 << 20  # bytes hashed and written per system call
WRITEBACK_WINDOW = 64 << 20  # bytes handed to the disk at a time (see _EarlyWriteback)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a CPU tensor (copies only if on another device or strided).

    Saves call this once per tensor, so the common case (a plain contiguous CPU tensor) is one
    ``numpy()`` with no checks in front: numpy itself refuses what has no plain byte view (a
    GPU tensor, autograd, conjugate or negative bits: RuntimeError/TypeError) and memoryview
    refuses strided layouts, and those go the slow way. The five checks this replaces cost
    more than ``numpy()`` (4,000 tensors: 8.2 -> 4 ms)."""
    as_int = _NUMPY_LACKS.get(t.dtype)
    try:
        return memoryview((t if as_int is None else t.view(as_int)).numpy()).cast("B")
    except (RuntimeError, TypeError):
        pass
    t = _plain(t)
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview((t if as_int is None else t.view(as_int)).numpy()).cast("B")


def _plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous CPU tensor without autograd, conjugate or negative bits."""
    if t.requires_grad:
        t = t.detach()
    if not t.is_cpu:
        t = t.cpu()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    return t.contiguous()


def _numpy_lacks() -> dict[torch.dtype, torch.dtype]:
    """Storable dtypes numpy has no type for (bfloat16, float8), each mapped to the integer
    dtype of the same size: their bytes are reached through a view as that."""
    same_size = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    lacks = {}
    for dtype in DTYPE_TO_ST:
        try:
            torch.zeros(1, dtype=dtype).numpy()
        except TypeError:
            lacks[dtype] = same_size[torch.empty((), dtype=dtype).element_size()]
    return lacks


_NUMPY_LACKS = _numpy_lacks()


@dataclass(frozen=True)
class WrittenFile:
    """What a writer reports: per chunk in file order, its name, byte span and checksum, as
    parallel sequences (``names`` and ``spans`` are shared by every save of one layout and
    must not be changed), and the file's ``header``, which fixes all names and spans: two
    files with equal headers have their chunks in the same places."""

    size: int
    xxh3_128: str
    header: bytes
    names: Sequence[str]
    spans: Sequence[tuple[int, int]]
    digests: Sequence[str]
    data_start: int = 0  # where the data section starts (after the header)
    index: tuple[int, int, str] | None = None  # the file index's (start, end, xxh3-64), format 3


def _write_all(fd: int, bufs: list[memoryview]) -> None:
    """Write every buffer, in order, with as few ``writev`` calls as the kernel allows (it may
    write less than asked, and takes at most IOV_MAX buffers). The one place data files are
    written: fault-injection tests replace it to tear or stall a write."""
    bufs = list(bufs)
    i = 0  # bufs[:i] are written (an index, not slicing: 1,024 slices of 1,024 entries each)
    while i < len(bufs):
        n = os.writev(fd, bufs[i : i + IOV_MAX])
        while i < len(bufs) and n >= len(bufs[i]):  # skip what was written, keep a partial tail
            n -= len(bufs[i])
            i += 1
        if n:
            bufs[i] = bufs[i][n:]


IOV_MAX = 1024  # os.writev and os.preadv refuse more buffers (EINVAL)


class _BatchedWriter:
    """Gathers small pieces and hands them to the kernel together (one ``writev`` per up to
    IOV_MAX pieces or a writeback kick's worth of bytes, see _EarlyWriteback), so a state of
    thousands of small tensors costs a few system calls instead of one per tensor. The header
    goes out on its own first. ``flushed(pos)`` is told how far the file is written."""

    def __init__(self, fd: int, flushed: Callable[[int], None]) -> None:
        self.fd = fd
        self.flushed = flushed
        self.pending: list[memoryview] = []
        self.pending_bytes = 0
        self.pos = 0
        self.batch = min(PIECE, _kick_bytes())

    def write(self, data: memoryview) -> None:
        self.pending.append(data)
        self.pending_bytes += len(data)
        if self.pos == 0 or len(self.pending) >= IOV_MAX or self.pending_bytes >= self.batch:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            _write_all(self.fd, self.pending)
            self.pos += self.pending_bytes
        self.pending, self.pending_bytes = [], 0
        self.flushed(self.pos)


def _kick_bytes() -> int:
    """Bytes written between two starts of writeback (an eighth of a window: 8 MiB)."""
    return max(1, WRITEBACK_WINDOW // 8)


_SFR_WAIT_BEFORE, _SFR_WRITE, _SFR_WAIT_AFTER = 1, 2, 4
_sync_file_range: object = None  # resolved on first use; False where unavailable


def _get_sync_file_range() -> object:
    global _sync_file_range
    if _sync_file_range is None:
        try:
            fn = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).sync_file_range
            fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
            fn.restype = ctypes.c_int
            _sync_file_range = fn
        except (OSError, AttributeError, TypeError):
            _sync_file_range = False
    return _sync_file_range


class _EarlyWriteback:
    """Hand each written window of the file to the disk at once, and wait for the one before.

    Without this, a large write fills the page cache and the final fsync then flushes it all,
    so copying and disk I/O never overlap (and dirty-page throttling makes it erratic). With it,
    the disk writes window k while window k+1 is hashed and copied, and the final fsync has
    little left to do; written windows are dropped from the page cache, so a checkpoint does
    not evict the training job's cached data. On the 2-core dev VM, safeckpt.save of 1 GiB went
    from a median of 3.3 s to 1.1 s (7 interleaved runs; bench/bench_save.py has the full
    comparison). Linux only; a no-op elsewhere. It is only a hint: the fsync at the end is what
    makes the file durable and reports I/O errors.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.sfr = _get_sync_file_range()
        self.kick = _kick_bytes()
        self.kicked = 0  # writeback started for [0, kicked)
        self.started = 0  # start of the window being written
        self.done = 0  # writeback waited for (and pages dropped) for [0, done)

    def advance(self, pos: int) -> None:
        """Bytes [0, pos) of the file have been written."""
        if not self.sfr or pos - self.kicked < self.kick:
            return
        # Start writeback every eighth of a window, not once per window: the disk is then busy
        # while the rest is hashed and copied, also in files smaller than a window (4,000 x
        # 16 KiB: the final fsync had all 62 MiB left to write).
        self.sfr(self.fd, self.kicked, pos - self.kicked, _SFR_WRITE)  # type: ignore[operator]
        self.kicked = pos
        if pos - self.started < WRITEBACK_WINDOW:
            return
        if self.started > self.done:  # a window is complete: wait for the one before it
            n = self.started - self.done
            self.sfr(self.fd, self.done, n, _SFR_WAIT_BEFORE | _SFR_WRITE | _SFR_WAIT_AFTER)  # type: ignore[operator]
            _drop_cache(self.fd, self.done, n)
            self.done = self.started
        self.started = pos

    def finish(self) -> None:
        """After the fsync: drop the rest of the file from the page cache."""
        if self.sfr:
            _drop_cache(self.fd, self.done, 0)


def _drop_cache(fd: int, start: int, length: int) -> None:
    try:
        os.posix_fadvise(fd, start, length, os.POSIX_FADV_DONTNEED)
    except (AttributeError, OSError):
        pass


def stream_safetensors(
    items: Sequence[tuple[str, torch.Tensor]],
    metadata: dict[str, str],
    write: Callable[[memoryview], None],
    written_upto: Callable[[int], None] | None = None,
    index: Callable[[Sequence[str], Sequence[tuple[int, int]]], Any] | None = None,
) -> WrittenFile:
    """Emit ``items`` as one safetensors stream through ``write``, hashing while writing.

    The one layout both the local writer and the object-store writer use: tensors in order of
    descending element size (every tensor aligned), header padded to 8 bytes.
    ``written_upto(pos)`` is told after each piece how many bytes have been written.
    ``index(names, spans)`` (format 3): given the chunks' names and data-relative spans in file
    order, an IndexTail (see ``safeckpt.format.fileindex``) written as the file's last tensor once every
    chunk's checksum is known.
    """
    items = list(items)
    tail = None
    if index is not None:
        order = _header(items, metadata)
        tail = index(order.names, [(s - len(order.header), e - len(order.header)) for s, e in order.spans])
    layout = _header(items, metadata, tail.size if tail is not None else -1)
    file_hash = xxhash.xxh3_128(layout.header)
    write(memoryview(layout.header))
    digests: list[str] = []
    one_shot = xxhash.xxh3_64_hexdigest
    for i, (start, end) in zip(layout.order, layout.spans, strict=True):
        data = tensor_bytes(items[i][1])
        if len(data) != end - start:
            raise CheckpointError(f"tensor {items[i][0]!r} changed size while it was being saved; "
                                  "nothing was published. Do not resize tensors during a save.")
        if len(data) <= PIECE:  # one piece: the one-shot hash is cheaper for small tensors
            file_hash.update(data)
            write(data)
            digests.append(one_shot(data))
            if written_upto is not None:
                written_upto(end)
        else:
            digests.append(_stream_pieces(data, start, file_hash, write, written_upto))
    size = layout.spans[-1][1] if layout.spans else len(layout.header)
    index_rec = None
    if tail is not None:
        data = tail.render(digests)
        file_hash.update(data)
        write(memoryview(data))
        index_rec = (size, size + len(data), one_shot(data))
        size += len(data)
        if written_upto is not None:
            written_upto(size)
    return WrittenFile(size, file_hash.hexdigest(), layout.header, layout.names, layout.spans, digests,
                       len(layout.header), index_rec)


def _stream_pieces(data: memoryview, pos: int, file_hash: Any, write: Callable[[memoryview], None],
                   written_upto: Callable[[int], None] | None) -> str:
    """Write one large tensor's bytes (starting at file offset ``pos``) PIECE by PIECE; its xxh3-64."""
    chunk_hash = xxhash.xxh3_64()
    for off in range(0, len(data), PIECE):
        piece = data[off : off + PIECE]
        chunk_hash.update(piece)
        file_hash.update(piece)
        write(piece)
        if written_upto is not None:
            written_upto(pos + off + len(piece))
    return chunk_hash.hexdigest()


class _Layout(NamedTuple):
    """A data file's layout: write order (indices into the items), header bytes, and each
    chunk's name and (start, end) in the file, in write order."""

    order: list[int]
    header: bytes
    names: list[str]
    spans: list[tuple[int, int]]


def _header(items: list[tuple[str, torch.Tensor]], metadata: dict[str, str], tail: int = -1) -> _Layout:
    """The file layout of ``items``, cached by names, dtypes and shapes: a training loop writes
    the same layout every time, and for 4,000 tensors building and encoding the header took
    7 ms of the save; the key takes under 1 ms."""
    key = (tuple([(name, t.dtype, t.shape) for name, t in items]), tuple(metadata.items()), tail)
    hit = _HEADERS.get(key)
    if hit is None:
        hit = _HEADERS[key] = _build_header(items, metadata, tail)
        while len(_HEADERS) > 4:
            _HEADERS.pop(next(iter(_HEADERS)), None)
    return hit


def _build_header(items: list[tuple[str, torch.Tensor]], metadata: dict[str, str], tail: int = -1) -> _Layout:
    """``tail`` >= 0: a U8 tensor of that many bytes, the file index, follows the chunks."""
    order = sorted(range(len(items)), key=lambda i: -items[i][1].element_size())
    header: dict[str, object] = {"__metadata__": metadata}
    offsets = []
    offset = 0
    for i in order:
        name, t = items[i]
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": dtype_code(t.dtype), "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offsets.append((offset, offset + nbytes))
        offset += nbytes
    if tail >= 0:
        header[INDEX_NAME] = {"dtype": "U8", "shape": [tail], "data_offsets": [offset, offset + tail]}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    prefix = struct.pack("<Q", len(raw)) + raw
    base = len(prefix)
    return _Layout(order, prefix, [items[i][0] for i in order], [(base + s, base + e) for s, e in offsets])


_HEADERS: dict[tuple, _Layout] = {}  # layout key -> layout, newest last


def write_file(path: str, items: Sequence[tuple[str, torch.Tensor]], metadata: dict[str, str],
               index: Any = None) -> WrittenFile:
    """Write ``items`` (name, tensor) as a safetensors file at ``path`` (must not exist), fsynced."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        writeback = _EarlyWriteback(fd)
        out = _BatchedWriter(fd, writeback.advance)
        written = stream_safetensors(items, metadata, out.write, index=index)
        out.flush()
        os.fsync(fd)
        writeback.finish()
    finally:
        os.close(fd)
    return written


def hash_file(path: str, block: int = 8 << 20, progress: Callable[[int], None] | None = None) -> tuple[int, str]:
    """(size, xxh3-128) of a file, streamed; ``progress(n)`` after each block of n bytes."""
    h = xxhash.xxh3_128()
    size = 0
    with os.fdopen(open_regular(path, os.path.dirname(path)), "rb", buffering=0) as f:
        buf = bytearray(block)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
            size += n
            if progress is not None:
                progress(n)
    return size, h.hexdigest()


MAX_HEADER = 100 << 20  # safetensors' own limit on the header size


def header_problems(read: Callable[[int, int], bytes], size: int, chunks: Sequence[dict]) -> list[str]:
    """What is wrong with a data file's safetensors header, given the manifest's ``chunks`` of
    that file (each with start, end, dtype, sizes): the header must parse, describe tensors
    that tile the data exactly, and hold every non-empty chunk at its byte range with its dtype
    and shape (so the file stays readable by any safetensors reader). Where the file's index
    records the checksum of the header's tensor entries (a chunk's ``header``, see
    ``safeckpt.format.fileindex``), the names, byte ranges and shapes must match it too: a
    renamed tensor or two same-shaped tensors' offsets swapped change what other readers load
    (``from_pretrained`` of a named file) while every chunk checksum still holds."""
    if size < 8:
        return [f"{size} bytes, too short for a safetensors header"]
    (hlen,) = struct.unpack("<Q", read(0, 8))
    if hlen > min(MAX_HEADER, size - 8):
        return [f"safetensors header length {hlen} does not fit the {size}-byte file"]
    try:
        header = json.loads(read(8, 8 + hlen))
        if not isinstance(header, dict):
            raise ValueError("not an object")
        entries = {}
        named = []  # (name, start, end relative to the data, shape) of every tensor but the index
        for name, rec in header.items():
            if name == "__metadata__":
                continue
            lo, hi = rec["data_offsets"]
            entries[(8 + hlen + int(lo), 8 + hlen + int(hi))] = (rec["dtype"], list(rec["shape"]))
            if name != INDEX_NAME:
                named.append((name, lo, hi, rec["shape"]))
        want = next((c["header"] for c in chunks if c.get("header") is not None), None)
        digest = header_digest(named) if want is not None else None
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        return [f"unreadable safetensors header ({type(exc).__name__}: {exc})"]
    problems = []
    covered = sorted(entries)
    pos = 8 + hlen
    for lo, hi in covered:
        if lo != pos and hi > lo:
            problems.append(f"safetensors header: tensors do not tile the data at byte {pos}")
            break
        pos = max(pos, hi)
    if pos != size and not problems:
        problems.append(f"safetensors header covers the data up to byte {pos}, the file has {size}")
    for c in chunks:
        if c["end"] <= c["start"]:
            continue
        got = entries.get((c["start"], c["end"]))
        if got != (c["dtype"], list(c["sizes"])):
            problems.append(
                f"safetensors header does not hold tensor {c['key']!r} at bytes "
                f"{c['start']}-{c['end']} as {c['dtype']}{list(c['sizes'])} (it has {got})"
            )
            break
    if digest != want:
        problems.append("safetensors header does not match its index (a tensor's name, shape or byte "
                        "range was changed): other safetensors readers would load the wrong tensors")
    return problems


def is_empty(shape: Sequence[int], start: int, end: int) -> bool:
    """A chunk with no elements (or no bytes): nothing to read or verify."""
    return math.prod(shape) == 0 or end == start


def check_chunk(data: bytes | memoryview, expect_hash: str | None, where: str, ckpt: str) -> None:
    """Raise CorruptCheckpoint unless ``data`` has the xxh3-64 ``expect_hash`` (None: unchecked)."""
    if expect_hash is not None and xxhash.xxh3_64_hexdigest(data) != expect_hash:
        raise CorruptCheckpoint(
            f"checksum mismatch in {where}: the data is corrupt. "
            "Load an older checkpoint (CheckpointManager.restore falls back automatically).",
            path=ckpt,
        )


RELEASE_BYTES = 64 << 20  # hashed bytes kept mapped (resident) at most, per reading thread


def _unmap(mm: mmap.mmap, start: int, end: int) -> None:
    """Drop the page mappings of bytes [start, end) of ``mm`` (a read-only file mapping: the
    pages stay in the page cache and are mapped again on the next access)."""
    lo, hi = start - start % mmap.PAGESIZE, min(end, len(mm))
    if hi > lo:  # nothing to drop for empty chunks (madvise refuses a start at the very end)
        mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


class MappedFile:
    """One local data file, checked against its recorded size.

    Whole chunks are read with ``preadv`` straight into the destination tensor (no mapping, no
    intermediate copy, no page faults on the file); hashing reads through a small per-thread
    buffer. Parts of chunks (resharding) are copied out of a read-only mapping made on demand.
    """

    def __init__(self, path: str, expected_size: int, fd: int | None = None) -> None:
        """``fd``: an open descriptor of the file's bytes to read instead of opening ``path``
        (owned from now on: a memory file holding a verified copy, see local_tier.held_file)."""
        self.path = path
        self.ckpt = os.path.dirname(path)
        self.fd = open_regular(path, self.ckpt) if fd is None else fd
        try:
            size = os.fstat(self.fd).st_size
            if size != expected_size:
                raise CorruptCheckpoint(
                    f"data file {path} has {size} bytes, the manifest says {expected_size} "
                    "(truncated or replaced)", path=self.ckpt,
                )
        except BaseException:
            os.close(self.fd)
            raise
        self.size = size
        self._mapping: mmap.mmap | None = None
        self._hash_map: mmap.mmap | None | bool = None  # read-only; False: mmap refused
        self._map_lock = threading.Lock()  # reading threads map the file on first use

    @property
    def _mm(self) -> mmap.mmap | None:
        if self._mapping is None and self.size:
            try:  # (a mapping holds a descriptor of its own: EMFILE can come here too)
                self._mapping = retry_io(lambda: mmap.mmap(self.fd, self.size, access=mmap.ACCESS_COPY),
                                         f"cannot map {self.path}")
            except OSError as exc:
                raise unavailable(f"cannot map {self.path}", exc) from exc
        return self._mapping

    def tensor(self, start: int, end: int, dtype: torch.dtype, shape: Sequence[int], expect_hash: str | None) -> torch.Tensor:
        """The bytes [start, end) as a tensor (aliasing the mapping); verified if a hash is given."""
        if is_empty(shape, start, end):
            return torch.empty(tuple(shape), dtype=dtype)
        assert self._mm is not None
        view = memoryview(self._mm)[start:end]
        check_chunk(view, expect_hash, f"{self.path} bytes {start}-{end}", os.path.dirname(self.path))
        return torch.frombuffer(view, dtype=torch.uint8).view(dtype).reshape(tuple(shape))

    def read(self, start: int, end: int) -> bytes:
        """A copy of bytes [start, end) (for small reads such as the header)."""
        if end <= start:
            return b""
        buf = bytearray(end - start)
        self.read_into(start, memoryview(buf))
        return bytes(buf)

    def read_into(self, start: int, dst: memoryview) -> None:
        """Fill ``dst`` with the file's bytes from ``start`` (``preadv``, looping on short reads)."""
        done = 0
        while done < len(dst):
            n = self.preadv([dst[done:]], start + done)
            if n <= 0:
                raise CorruptCheckpoint(
                    f"{self.path} ended at byte {start + done} while reading (it was truncated "
                    "or replaced while loading)", path=self.ckpt,
                )
            done += n

    def preadv(self, bufs: list[Any], at: int) -> int:
        """``os.preadv`` of this file, tried again while it fails with a transient error (EIO,
        ESTALE, ...), then StorageUnavailable; any other OS error too is StorageUnavailable
        (damage shows as a short read or a checksum mismatch, never as an OS error)."""
        try:
            return retry_io(lambda: os.preadv(self.fd, bufs, at), f"cannot read {self.path}")
        except OSError as exc:
            raise unavailable(f"cannot read {self.path}", exc) from exc

    def read_hash_into(self, start: int, dst: memoryview) -> str:
        """Fill ``dst`` from ``start`` like :meth:`read_into` and return the xxh3-64 of what
        was read, hashing each HASH_BUFFER piece right after reading it (still in the CPU
        cache): one pass over the bytes, for destinations nobody else sees yet."""
        h = xxhash.xxh3_64()
        for off in range(0, len(dst), HASH_BUFFER):
            piece = dst[off:off + HASH_BUFFER]
            self.read_into(start + off, piece)
            h.update(piece)
        return h.hexdigest()

    def _hashable(self) -> mmap.mmap | None:
        """A read-only shared mapping of the file for hashing in place, or None where the file
        cannot be mapped (some FUSE mounts). xxh3 over page-cache pages through a mapping skips
        the copy into a buffer that preadv makes: 512 MiB hashed at 30 GB/s per thread on the
        development VM instead of 14 (cold files: the same speed as preadv)."""
        if self._hash_map is None:
            with self._map_lock:
                if self._hash_map is None:
                    try:
                        self._hash_map = mmap.mmap(self.fd, self.size, access=mmap.ACCESS_READ) if self.size else False
                    except (OSError, ValueError):
                        self._hash_map = False
        return self._hash_map or None

    def _hash_mapped(self, mm: mmap.mmap, spans: Sequence[tuple[int, int]], step: int,
                     keep: int) -> list[str]:
        """xxh3-64 of each [start, end) of ``spans`` through ``mm``, ``step`` bytes per call.
        Hashed pages are unmapped again every ``keep`` bytes and at the end (they stay in the
        page cache): the process's resident memory grows by at most that much per reading
        thread, not by the file (unmapping every 4 MiB step instead cost 8% of a warm load)."""
        digests = []
        with memoryview(mm) as whole:
            for start, end in spans:
                if end - start <= step:
                    digests.append(xxhash.xxh3_64_hexdigest(whole[start:end]))
                    continue
                h = xxhash.xxh3_64()
                released = start
                for off in range(start, end, step):
                    h.update(whole[off:min(off + step, end)])
                    if off + step - released >= keep:
                        _unmap(mm, released, off + step)
                        released = off + step
                digests.append(h.hexdigest())
        _unmap(mm, spans[0][0], max(end for _, end in spans))
        return digests

    def hash_runs(self, spans: Sequence[tuple[int, int]]) -> list[str]:
        """xxh3-64 of each of the back-to-back byte ranges ``spans`` (small chunks, together at
        most HASH_BUFFER bytes): hashed in place, or from one read of them all into a buffer."""
        mm = self._hashable()
        if mm is not None:
            return self._hash_mapped(mm, spans, HASH_BUFFER, RELEASE_BYTES)
        first = spans[0][0]
        buf = _BOUNCE.take()
        try:
            self.read_into(first, buf[:spans[-1][1] - first])
            return [xxhash.xxh3_64_hexdigest(buf[s - first:e - first]) for s, e in spans]
        finally:
            _BOUNCE.give(buf)

    def hash_range_local(self, start: int, end: int, window: int) -> str:
        """xxh3-64 of bytes [start, end), hashed in place, or (unmappable) read through a
        per-thread buffer of at most ``window`` bytes; either way the bytes end up in the page
        cache for the copy that follows."""
        step = min(window, HASH_BUFFER)
        mm = self._hashable()
        if mm is not None:
            return self._hash_mapped(mm, [(start, end)], step, min(window, RELEASE_BYTES))[0]
        h = xxhash.xxh3_64()
        buf = _BOUNCE.take()
        try:
            for off in range(start, end, step):
                n = min(step, end - off)
                self.read_into(off, buf[:n])
                h.update(buf[:n])
        finally:
            _BOUNCE.give(buf)
        return h.hexdigest()

    def close(self) -> None:
        if self._hash_map:
            self._hash_map.close()  # type: ignore[union-attr]  # views into it never outlive a call
            self._hash_map = False
        if self._mapping is not None:
            try:
                self._mapping.close()
            except BufferError:  # a tensor still aliases the mapping; the GC will release it
                pass
            self._mapping = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


# Bytes read per call while hashing: small enough that the hash reads them back from the CPU
# cache (4 MiB: 15 GB/s for preadv + xxh3 from the page cache here; 16 MiB: 6 GB/s).
HASH_BUFFER = 4 << 20


class _BufferPool:
    """A few HASH_BUFFER-sized buffers shared by the reading threads of every load, so a
    load does not allocate (and page-fault in) fresh buffers each time."""

    def __init__(self, keep: int = 4) -> None:
        self.keep = keep
        self.free: list[memoryview] = []
        self.lock = threading.Lock()

    def take(self) -> memoryview:
        with self.lock:
            if self.free:
                return self.free.pop()
        return memoryview(bytearray(HASH_BUFFER))

    def give(self, buf: memoryview) -> None:
        with self.lock:
            if len(self.free) < self.keep:
                self.free.append(buf)


_BOUNCE = _BufferPool()
