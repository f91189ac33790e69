"""Read tensors of one committed checkpoint into place: box arithmetic over chunks.

Every stored tensor is a set of chunks, each a box (global offsets, sizes) of the global tensor:
row ranges of a replicated tensor, shards of a DTensor, or one per-rank copy. A target is also
a box (the whole tensor, or this rank's shard of a DTensor). Reading copies every chunk/target
intersection, touching only the overlapping bytes (mmap), so resharding to another world size
costs only what the new shard needs. Chunks read whole are verified against their checksum.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from functools import partial
from typing import Any

import torch
import xxhash

from ..errors import CorruptCheckpoint, StorageUnavailable
from ..format.manifest import dtype_size, safe_file_path, torch_dtype
from ..format.shardfile import HASH_BUFFER, IOV_MAX, header_problems
from ..format.sharding import local_box
from ..format.tree import is_dtensor, local_of
from ..format.v3 import FORMAT_V3, Layout
from ..storage.base import Storage, storage_for
from .prefault import populate

Box = list[list[int]]  # [offsets, sizes]
READ_THREADS = 4  # at most this many reads and hashes in flight at once on local files
# Chunks of a local file up to SMALL_CHUNK bytes that lie back to back are read in runs of up
# to HASH_BUFFER bytes and IOV_MAX chunks: one preadv (and one task) per run, not per chunk (a
# state of 4,000 x 16 KiB spent most of its load in per-chunk futures and calls).
SMALL_CHUNK = min(1 << 20, HASH_BUFFER)
_PLAIN = (torch.Tensor, torch.nn.Parameter)
# Local data files a reader keeps open at once (a DDP load of a 1,000-rank checkpoint reads
# every rank's file): the least recently used idle one is closed beyond that. Each open file
# may hold three descriptors (its own and those of two mappings), so the cap is also kept
# under a quarter of the descriptors the process has left (see max_open_files).
MAX_OPEN_FILES = 64


_POOLS: dict[tuple[int, int], ThreadPoolExecutor] = {}  # (pid, threads) -> reader threads
_POOLS_LOCK = threading.Lock()


def _pool(threads: int) -> ThreadPoolExecutor:
    """Reader threads kept for the process's later loads: starting them cost a small load
    ~6 ms. Keyed by pid too, as a forked child (a data loader worker) has the object but none
    of its threads."""
    key = (os.getpid(), threads)
    with _POOLS_LOCK:
        pool = _POOLS.get(key)
        if pool is None:
            pool = _POOLS[key] = ThreadPoolExecutor(threads, thread_name_prefix="safeckpt-read")
        return pool


def read_threads(ranks_on_machine: int = 1) -> int:
    """Reader threads per rank: two per CPU core this rank may use, shared with the other
    ranks reading on the same machine, between 1 and READ_THREADS. (4 ranks x 4 threads on a
    2-core VM made FSDP2 loads slower than 1 thread each.)"""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(READ_THREADS, 2 * cpus // max(1, ranks_on_machine)))


def max_open_files() -> int:
    """How many local data files one reader keeps open: MAX_OPEN_FILES, or fewer under a low
    open-file limit (a quarter of the descriptors still free), at least 2."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):  # not POSIX
        return MAX_OPEN_FILES
    if soft == resource.RLIM_INFINITY or soft <= 0:
        return MAX_OPEN_FILES
    try:
        used = len(os.listdir("/proc/self/fd"))
    except OSError:  # no /proc: assume a busy process
        used = min(soft // 2, 256)
    return max(2, min(MAX_OPEN_FILES, (soft - used) // 4))


def host_addressable(t: torch.Tensor) -> bool:
    """Whether file bytes can be read straight into ``t``'s memory (a CPU tensor)."""
    return t.is_cpu


def host_buffer_for(t: torch.Tensor) -> torch.Tensor:
    """A host tensor like ``t`` to read a chunk for a device tensor into: pinned for CUDA (the
    copy to the device is then a DMA; torch caches pinned blocks, so loads reuse them)."""
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=t.device.type == "cuda")


def _overlaps(box: Box, c: dict[str, Any]) -> bool:
    """Whether chunk ``c`` holds any part of ``box`` (a 0-dim box overlaps its one chunk)."""
    return not box[0] or _intersect(box, [c["offsets"], c["sizes"]]) is not None


def _whole(box: Box, shape: list[int]) -> bool:
    """Whether ``box`` is all of a tensor of ``shape``."""
    return box[1] == shape and not any(box[0])


def _runs(items: list[Any]) -> list[list[Any]]:
    """``items`` (tuples whose first element is a chunk of one file) cut into runs of chunks
    that lie back to back in the file, each of at most HASH_BUFFER bytes and IOV_MAX chunks."""
    items = sorted(items, key=lambda item: item[0]["start"])
    runs: list[list[Any]] = []
    run: list[Any] = []
    first = end = 0
    for item in items:
        c = item[0]
        if not run or c["start"] != end or c["end"] - first > HASH_BUFFER or len(run) >= IOV_MAX:
            run = [item]
            runs.append(run)
            first = c["start"]
        else:
            run.append(item)
        end = c["end"]
    return runs


def _writable(t: torch.Tensor) -> Any:
    """The bytes of a contiguous CPU tensor as a writable buffer (a ctypes array over its
    memory: ~0.5 us, where a numpy view costs ~2.5 us; the caller keeps ``t`` alive)."""
    return (ctypes.c_char * t.nbytes).from_address(t.data_ptr())


def _read_vectored(f: Any, start: int, bufs: list[Any], total: int) -> None:
    """Fill ``bufs``, which lie back to back in local file ``f`` from ``start`` (``total`` bytes
    together), with one preadv; after a short read, the rest buffer by buffer (read_into
    raises CorruptCheckpoint at the end of the file). A file without an fd: all by read_into."""
    got = f.preadv(bufs, start) if hasattr(f, "preadv") else 0
    if got == total:
        return
    pos = 0
    for buf in bufs:
        view = memoryview(buf)  # of single bytes
        have = min(max(got - pos, 0), len(view))
        if have < len(view):
            f.read_into(start + pos + have, view[have:])
        pos += len(view)


def _intersect(a: Box, b: Box) -> tuple[list[int], list[int]] | None:
    lo, hi = [], []
    for ao, asz, bo, bsz in zip(a[0], a[1], b[0], b[1], strict=True):
        start, stop = max(ao, bo), min(ao + asz, bo + bsz)
        if stop <= start:
            return None
        lo.append(start)
        hi.append(stop)
    return lo, hi


class TensorReader:
    """Serves tensors of the checkpoint at ``ckpt_dir`` described by ``manifest``."""

    def __init__(self, ckpt_dir: str, manifest: dict[str, Any], *, rank: int = 0, verify: bool = True,
                 store: Storage | None = None) -> None:
        self.dir = ckpt_dir
        self.store = store or storage_for(ckpt_dir)
        self.man = manifest
        self.rank = rank
        self.verify = verify
        # Open files (MappedFile, or ranged.RemoteFile for a URL), least recently used first;
        # at most max_open local ones are kept open (idle ones beyond that are closed), users
        # counts the reads in flight in each, which keep it open (see _using).
        self._files: OrderedDict[str, Any] = OrderedDict()
        self._users: dict[str, int] = {}
        self._headers_ok: set[str] = set()  # files whose header was checked (once, not per open)
        self._open_lock = threading.Lock()
        self._local: bool | None = None  # whether the files are local (read_into), known once one is open
        self.max_open = max_open_files()
        self._verified: set[tuple[str, int, int]] = set()  # chunks whose checksum matched
        # Chunks another rank of this machine verifies (see safeckpt.coord.verify_split): read into fresh
        # tensors without hashing; trust_idents or check_idents settles them before any use.
        self._deferred: set[tuple[str, int, int]] = set()
        self._tied = {r["alias_of"] for r in manifest["tensors"].values() if "alias_of" in r}
        self._made: dict[str, torch.Tensor] = {}  # tied tensors already built by new()
        self.nbytes_read = 0  # bytes copied out of the files (overlaps only), for tests and stats
        self.threads = read_threads()  # a load sets it once it knows the ranks on this machine
        self._by_file: dict[str, list[dict[str, Any]]] | None = None

    @contextlib.contextmanager
    def _using(self, name: str) -> Iterator[Any]:
        """File ``name``, open (opened now if it is not) and kept open until the block ends."""
        with self._open_lock:
            f = self._files.get(name)
            if f is None:
                self._evict(self.max_open - 1)  # room for it first: at most max_open at any time
                f = self._files[name] = self._open(name)
            else:
                self._files.move_to_end(name)
            self._users[name] = self._users.get(name, 0) + 1
        try:
            yield f
        finally:
            with self._open_lock:
                self._users[name] -= 1

    def _open(self, name: str) -> Any:
        """Open file ``name`` and check its header (the first time); the caller holds the lock.
        Out of descriptors even so (other code in the process holds them), every idle file is
        closed and the open tried once more."""
        size = int(self.man["files"][name]["size"])
        likely = self._likely(name) if self.verify and not self.store.renames else ()
        try:
            f = open_data_file(self.dir, name, size, self.store, likely)
        except StorageUnavailable as exc:
            if exc.errno not in (errno.EMFILE, errno.ENFILE) or not self._evict(0):
                raise
            f = open_data_file(self.dir, name, size, self.store, likely)
        if name not in self._headers_ok:
            problems = header_problems(f.read, size, self._chunks_in(name))
            if problems:
                f.close()
                raise CorruptCheckpoint(f"{name}: {problems[0]}", path=self.dir)
            self._headers_ok.add(name)
        if self._local is None:
            self._local = hasattr(f, "read_into")
        return f

    def _evict(self, keep: int) -> int:
        """Close idle local files, least recently used first, until at most ``keep`` local
        files are open (files in use stay open); the caller holds the lock. How many closed."""
        local = [n for n, f in self._files.items() if getattr(f, "fd", None) is not None]
        closed = 0
        for name in local:
            if len(local) - closed <= keep:
                break
            if self._users.get(name, 0) == 0:
                self._files.pop(name).close()
                closed += 1
        return closed

    def _is_local(self, name: str) -> bool:
        """Whether the checkpoint's files are local files (``read_into``); ``name``: a file to
        open to find out, if none is open yet."""
        if self._local is None:
            with self._using(name):
                pass
        return bool(self._local)

    def open_files(self) -> int:
        """How many data files this reader holds open now (for tests and stats)."""
        with self._open_lock:
            return len(self._files)

    def _likely(self, name: str) -> list[tuple[int, int]]:
        """Byte ranges of file ``name`` this rank will most likely read (an object store fetches
        them together): replicated chunks, its own per-rank chunks, and the shards in a file
        that this rank number wrote."""
        writer = self.man["files"][name].get("rank")
        out = []
        for rec in self.man["tensors"].values():
            scope = rec.get("scope")
            for c in rec.get("chunks", ()):
                if c["file"] == name and (scope == "replicated" or (scope == "per_rank" and c.get("rank") == self.rank)
                                          or (scope == "sharded" and writer == self.rank)):
                    out.append((c["start"], c["end"]))
        return out

    def _chunks_in(self, name: str) -> list[dict[str, Any]]:
        """The manifest's chunks stored in file ``name`` (with their dtype), for the header check
        (grouped by file in one pass over the manifest, not one pass per file opened)."""
        if self._by_file is None:
            self._by_file = {}
            for key, rec in self.man["tensors"].items():
                for c in rec.get("chunks", ()):
                    self._by_file.setdefault(c["file"], []).append({**c, "dtype": rec["dtype"], "key": key})
        return self._by_file.get(name, [])

    def record(self, key: str) -> dict[str, Any]:
        """The manifest record of ``key`` (for an alias, the record of the tensor it shares)."""
        try:
            rec = self.man["tensors"][key]
            return self.man["tensors"][rec["alias_of"]] if "alias_of" in rec else rec
        except KeyError:
            raise CorruptCheckpoint(f"manifest tree refers to tensor {key!r} that it does not describe", path=self.dir) from None

    def fill(self, key: str, dst: torch.Tensor, *, owned: bool = False, box: Box | None = None) -> None:
        """Copy the stored tensor ``key`` into ``dst`` (a tensor or DTensor) in place.

        A DTensor gets only its local shard, read from the chunks that overlap it. ``owned``:
        ``dst`` is a fresh tensor nobody else sees yet (see :meth:`fill_box`). ``box``: its
        :func:`local_box`, if the caller has it already.
        """
        local = local_of(dst) if is_dtensor(dst) else dst
        self.fill_box(key, local, box or local_box(dst), owned=owned)

    def _chunks(self, key: str, rec: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """The chunks of ``key`` (whose :meth:`record` is ``rec``, if the caller has it) this
        rank may read (its own copy of per-rank state)."""
        rec = rec or self.record(key)
        chunks = rec["chunks"]
        if rec.get("scope") == "per_rank":
            chunks = [c for c in chunks if c.get("rank") == self.rank]
            if not chunks:
                raise CorruptCheckpoint(f"no per-rank copy of {key!r} for rank {self.rank}", path=self.dir)
        return chunks

    def _needed(self, targets: list[tuple[str, Box]]) -> dict[tuple[str, int, int], tuple[str, dict[str, Any]]]:
        """The chunks (by (file, start, end)) that reading ``targets`` touches and that are not
        verified yet, each with a key it belongs to."""
        todo: dict[tuple[str, int, int], tuple[str, dict[str, Any]]] = {}
        verified = self._verified
        for key, box in targets:
            rec = self.record(key)
            whole = _whole(box, rec["shape"])  # then every non-empty chunk overlaps
            for c in self._chunks(key, rec):
                ident = (c["file"], c["start"], c["end"])
                if ident in todo or ident in verified or c["end"] <= c["start"]:
                    continue
                if whole or _overlaps(box, c):
                    todo[ident] = (key, c)
        return todo

    def needed(self, targets: list[tuple[str, Box]]) -> list[tuple[str, int, int]]:
        """The chunks (file, start, end) :meth:`check_many` would verify for ``targets``."""
        return list(self._needed(targets)) if self.verify else []

    def check_many(self, targets: list[tuple[str, Box]]) -> None:
        """Verify (once, in parallel) the checksum of every chunk that the (key, box) targets
        overlap, reading each such chunk whole, except the :meth:`defer`-ed ones. Loads call
        this for everything they will copy in place before copying anything, so a damaged
        checkpoint fails before the caller's state is touched."""
        if not self.verify:
            return
        todo = self._needed(targets)
        self._check([kc for ident, kc in todo.items() if ident not in self._deferred])

    def defer(self, idents: Sequence[tuple[str, int, int]]) -> None:
        """Leave the chunks ``idents`` to another rank of this machine (see ``safeckpt.coord.verify_split``):
        :meth:`check_many` skips them and reads into fresh tensors do not hash them, until
        :meth:`trust_idents` (every rank's check succeeded) or :meth:`check_idents`."""
        self._deferred.update(idents)

    def check_idents(self, idents: Sequence[tuple[str, int, int]]) -> None:
        """Verify the chunks ``idents`` (file, start, end) of this reader's view."""
        if not self.verify or not idents:
            return
        want = set(idents)
        self._deferred.difference_update(want)
        found = {}
        for key, rec in self.man["tensors"].items():
            for c in rec.get("chunks", ()):
                ident = (c["file"], c["start"], c["end"])
                if ident in want and ident not in found:
                    found[ident] = (key, c)
        self._check([kc for ident, kc in found.items() if ident not in self._verified])

    def _check(self, todo: list[tuple[str, dict[str, Any]]]) -> None:
        tasks: list[Any] = []
        small: dict[str, list[tuple[dict[str, Any], str]]] = {}
        for key, c in todo:
            if c["end"] - c["start"] <= SMALL_CHUNK and self._is_local(c["file"]):
                small.setdefault(c["file"], []).append((c, key))
            else:
                tasks.append(partial(self._verify_chunk, key, c))
        for items in small.values():
            tasks += [partial(self._verify_run, run) for run in _runs(items)]
        self._parallel(tasks, {c["file"] for _, c in todo})

    def _verify_run(self, run: list[tuple[dict[str, Any], str]]) -> None:
        """Verify chunks that lie back to back in one local file, hashed together (one read,
        or in place)."""
        with self._using(run[0][0]["file"]) as f:
            digests = f.hash_runs([(c["start"], c["end"]) for c, _ in run])
        for (c, key), digest in zip(run, digests, strict=True):
            self._compare(key, c, digest)

    def trust_idents(self, idents: Sequence[tuple[str, int, int]]) -> None:
        """Count chunks (file, start, end) as verified: another rank reading the same page
        cache verified them in a check phase that succeeded on every rank."""
        self._verified.update(idents)
        self._deferred.difference_update(idents)

    def fill_many(self, targets: list[tuple[str, torch.Tensor]], *, owned: bool = False,
                  boxes: dict[str, Box] | None = None) -> None:
        """:meth:`fill` for many (key, destination) pairs, in parallel (largest first, so the
        threads finish together). ``boxes``: the destinations' local boxes by key, if known.
        Small whole chunks lying back to back in a file are read in runs (:meth:`_fill_run`)."""
        boxes = boxes or {}
        jobs = []
        small: dict[str, list[tuple[dict[str, Any], str, torch.Tensor]]] = {}
        for k, t in targets:
            box = boxes.get(k) or local_box(t)
            c = self._small_whole(k, t, box)
            if c is None:
                jobs.append((k, t, box))
            else:
                small.setdefault(c["file"], []).append((c, k, t))
        files = {c["file"] for k, _, box in jobs for c in self._chunks(k) if _overlaps(box, c)} | set(small)
        jobs.sort(key=lambda job: -job[1].numel() * job[1].element_size())
        tasks: list[Any] = [partial(self.fill, k, t, owned=owned, box=box) for k, t, box in jobs]
        for items in small.values():
            tasks += [partial(self._fill_run, run, owned) for run in _runs(items)]
        self._parallel(tasks, files)

    def _small_whole(self, key: str, t: torch.Tensor, box: Box) -> dict[str, Any] | None:
        """The chunk to read ``t`` from with :meth:`_fill_run`, or None for :meth:`fill_box`:
        ``t`` is a plain contiguous CPU tensor wanted whole, stored as one small non-empty
        chunk of a local file with exactly its bytes."""
        rec = self.record(key)
        chunks = self._chunks(key, rec)
        if len(chunks) != 1:
            return None
        c = chunks[0]
        n = c["end"] - c["start"]
        shape = rec["shape"]
        if not 0 < n <= SMALL_CHUNK or c["sizes"] != shape or box[1] != shape or any(c["offsets"]) or any(box[0]):
            return None
        if (type(t) not in _PLAIN or not host_addressable(t) or t.layout is not torch.strided
                or not t.is_contiguous() or t.is_conj() or t.is_neg() or t.nbytes != n):
            return None
        return c if self._is_local(c["file"]) else None

    def _fill_run(self, run: list[tuple[dict[str, Any], str, torch.Tensor]], owned: bool) -> None:
        """:meth:`fill_box` for whole small chunks that lie back to back in one local file, with
        one preadv straight into all their destinations. As there, every chunk is verified
        before its bytes are read into a destination; with ``owned`` (fresh tensors the caller
        drops if this raises) a chunk not verified yet is hashed in the destination instead."""
        verified, deferred = self._verified, self._deferred
        idents = [(c["file"], c["start"], c["end"]) for c, _, _ in run]
        fresh = [owned and self.verify and i not in verified and i not in deferred for i in idents]
        for (c, key, _), unseen, ident in zip(run, fresh, idents, strict=True):
            if not unseen and not (owned and ident in deferred):
                self._verify_chunk(key, c)
        bufs = [_writable(t) for _, _, t in run]
        first = run[0][0]["start"]
        total = run[-1][0]["end"] - first
        with self._using(run[0][0]["file"]) as f:
            _read_vectored(f, first, bufs, total)
        for (c, key, _), buf, unseen in zip(run, bufs, fresh, strict=True):
            if unseen:
                self._compare(key, c, xxhash.xxh3_64_hexdigest(buf))
        self.nbytes_read += total

    def new_many(self, keys: list[str]) -> dict[str, torch.Tensor]:
        """:meth:`new` for many keys (read in parallel; tied keys share one tensor)."""
        out: dict[str, torch.Tensor] = {}
        fills = []
        for key in dict.fromkeys(keys):
            canonical = self.man["tensors"].get(key, {}).get("alias_of", key)
            if canonical in self._made:
                out[key] = self._made[canonical]
                continue
            rec = self.record(key)
            t = torch.empty(tuple(rec["shape"]), dtype=torch_dtype(rec["dtype"]))
            if canonical in self._tied:
                self._made[canonical] = t
            out[key] = t
            fills.append((key, t))
        self.fill_many(fills, owned=True)
        return out

    def _parallel(self, tasks: list[Any], files: set[str]) -> None:
        """Run I/O-bound tasks (reads and hashes release the GIL) on a few threads when every
        file is local (the threads open files as they need them, at most max_open idle at once)."""
        local = all(self._is_local(name) for name in sorted(files)[:1])
        if len(tasks) < 2 or not local or self.threads < 2:
            for task in tasks:
                task()
            return
        pool = _pool(self.threads)
        futures = [pool.submit(task) for task in tasks]
        try:
            for future in futures:
                future.result()
        finally:  # a task raised: let the others end before the caller drops their tensors
            wait(futures)

    def _verify_chunk(self, key: str, c: dict[str, Any], window: int = 64 << 20) -> None:
        start, end = c["start"], c["end"]
        ident = (c["file"], start, end)
        if not self.verify or end <= start or ident in self._verified:
            return
        with self._using(c["file"]) as f:
            if hasattr(f, "hash_range"):  # a remote file: ranged reads
                digest = f.hash_range(start, end, window)
            else:
                digest = f.hash_range_local(start, end, window)
        self._compare(key, c, digest)

    def _compare(self, key: str, c: dict[str, Any], digest: str) -> None:
        """Record chunk ``c`` as verified if ``digest`` is its checksum, else raise."""
        if digest != c.get("xxh3_64"):
            raise CorruptCheckpoint(
                f"checksum mismatch in {c['file']} bytes {c['start']}-{c['end']} (tensor {key!r}): "
                "the data is corrupt. Load an older checkpoint (CheckpointManager.restore falls "
                "back automatically).", path=self.dir,
            )
        self._verified.add((c["file"], c["start"], c["end"]))

    def fill_box(self, key: str, local: torch.Tensor, box: Box, *, owned: bool = False) -> None:
        """Copy the region ``box`` ([global offsets, sizes]) of the stored tensor ``key`` into
        the plain tensor ``local`` (of shape ``box[1]``), touching only overlapping bytes.

        Every chunk is verified (whole) before anything is copied out of it; a load verifies
        all of them in its check phase, so here that is a lookup. With ``owned`` (``local`` is
        a fresh tensor the caller drops if this raises), a chunk read whole into it is verified
        in the same pass instead: hashed piece by piece right after each read, so the bytes
        cross memory once."""
        rec = self.record(key)
        dtype = torch_dtype(rec["dtype"])
        chunks = self._chunks(key)
        covered = 0
        with torch.no_grad():
            for c in chunks:
                cbox = [c["offsets"], c["sizes"]]
                if len(cbox[0]) != len(box[0]):
                    raise CorruptCheckpoint(f"chunk of {key!r} has the wrong rank", path=self.dir)
                inter = _intersect(box, cbox) if box[0] else ([], [])
                if inter is None:
                    continue
                lo, hi = inter
                whole = lo == list(cbox[0]) and [h - o for h, o in zip(hi, cbox[0], strict=True)] == list(cbox[1])
                with self._using(c["file"]) as f:
                    covered += self._copy_chunk(f, key, c, local, box, lo, hi, whole, dtype, owned)
        if covered < local.numel():
            raise CorruptCheckpoint(
                f"tensor {key!r}: the checkpoint's chunks cover {covered} of {local.numel()} "
                "elements needed here", path=self.dir,
            )

    def _copy_chunk(self, f: Any, key: str, c: dict[str, Any], local: torch.Tensor, box: Box, lo: list[int],
                    hi: list[int], whole: bool, dtype: torch.dtype, owned: bool) -> int:
        """:meth:`fill_box`'s copy of the part [lo, hi) of chunk ``c`` (of the open file ``f``)
        into ``local``; how many elements it copied."""
        cbox = [c["offsets"], c["sizes"]]
        src_at = cbox[0]
        if whole and hasattr(f, "read_into"):
            dst = local[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, box[0], strict=True))]
            if dst.is_contiguous() and dst.numel():
                # Straight from the file into the destination: no mapping, no copy
                # (a GPU tensor: into a pinned host buffer, then one device copy).
                host = dst if host_addressable(dst) else host_buffer_for(dst)
                into = memoryview(host.view(-1).view(torch.uint8).numpy())
                ident = (c["file"], c["start"], c["end"])
                if owned and host is dst:  # new pages: faulted in with one call, not one per 4 KiB
                    populate(dst)
                if owned and ident in self._deferred:  # another rank hashes it
                    f.read_into(c["start"], into)
                elif owned and self.verify and ident not in self._verified:
                    self._compare(key, c, f.read_hash_into(c["start"], into))
                else:
                    self._verify_chunk(key, c)
                    f.read_into(c["start"], into)
                if host is not dst:
                    dst.copy_(host)
                self.nbytes_read += c["end"] - c["start"]
                return dst.numel()
        self._verify_chunk(key, c)
        if whole or not hasattr(f, "rows"):
            src = f.tensor(c["start"], c["end"], dtype, c["sizes"], None)
        else:  # a remote file: fetch only the overlapping rows (dim 0) of the chunk
            r0 = lo[0] - cbox[0][0]
            src = f.rows(c["start"], c["end"], dtype, c["sizes"], r0, hi[0] - cbox[0][0])
            src_at = [lo[0], *cbox[0][1:]]
        src_idx = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, src_at, strict=True))
        dst_idx = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, box[0], strict=True))
        local[dst_idx].copy_(src[src_idx])
        n = 1
        for a, b in zip(lo, hi, strict=True):
            n *= b - a
        self.nbytes_read += n * src.element_size()
        return n

    def verify_chunks(self, key: str, window: int = 64 << 20) -> None:
        """Check every chunk of ``key`` against its checksum, ``window`` bytes at a time
        (memory stays bounded for any chunk size). Streaming readers that cut chunks into
        pieces call this first."""
        for c in self.record(key)["chunks"]:
            self._verify_chunk(key, c, window)

    def release(self) -> None:
        """Drop the pages of the mapped files from this process's memory (they stay in the page
        cache and are read again on demand). Streaming readers call this between pieces."""
        for f in self._files.values():
            mm = getattr(f, "_mapping", None)
            if mm is not None and hasattr(mmap, "MADV_DONTNEED"):
                try:
                    mm.madvise(mmap.MADV_DONTNEED)
                except OSError:  # pragma: no cover - best effort
                    pass

    def new(self, key: str) -> torch.Tensor:
        """The stored tensor ``key`` as a fresh CPU tensor (full, unsharded). Tensors stored
        once for several keys (tied weights) come back as one tensor, still tied."""
        return self.new_many([key])[key]

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


def open_data_file(ckpt_dir: str, name: str, size: int, store: Storage | None = None,
                   likely: Sequence[tuple[int, int]] = ()) -> Any:
    """A data file of a checkpoint, checked for its size: a MappedFile (local, mmap), or a
    RemoteFile (object store, ranged reads; ``likely`` ranges are fetched together)."""
    store = store or storage_for(ckpt_dir)
    return store.open(safe_file_path(ckpt_dir, name), size, ckpt_dir, likely)


def open_manifest(ckpt_dir: str, store: Storage | None = None, *, full: bool = True) -> dict[str, Any]:
    """Read a committed checkpoint's manifest or raise CheckpointNotFound / CorruptCheckpoint.

    A format-3 manifest comes in format 2's shape, with every file's index read and checked
    (``full``), or as stored (``full=False``: see ``safeckpt.format.v3.Layout`` for reading parts)."""
    store = store or storage_for(ckpt_dir)
    man = store.read_manifest(ckpt_dir)
    if full and man.get("format_version") == FORMAT_V3:
        return Layout(man, ckpt_dir, store, dtype_size).view()
    return man
