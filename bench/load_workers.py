"""What each rank runs for bench_load.py: timed loads and tiny saves inside a gloo group.

One spawn per world size runs a list of jobs (a spawn costs seconds here). Every timed region
is bracketed by barriers; each rank times only its own call, and the parent takes the maximum
over ranks per run. The first round of every job is a warm-up that is not timed; after it each
method's result is checked against the saved values (or, for the raw read, against the
manifest's chunk checksums), so a broken load can never be what is measured.
"""

from __future__ import annotations

import gc
import os
import resource
import shutil
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import xxhash
from bench_save import drop_cache, files_under
from load_states import (
    check,
    fingerprint,
    fresh_like,
    fsdp2_model,
    local_nbytes,
    meta_like,
    random_state,
    release_memory,
    shapes_for_bytes,
    zero_,
)

import safeckpt

PIECE = 16 << 20  # raw reference: 16 MiB preadv calls

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed")


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


# --------------------------------------------------------------------------- raw reference
def needed_chunks(ckpt: str, targets: dict[str, torch.Tensor]) -> list[tuple[str, int, int, str]]:
    """(file path, start, end, xxh3_64) of every stored chunk that overlaps this rank's targets."""
    import json

    with open(os.path.join(ckpt, "manifest.json")) as f:
        tensors = json.load(f)["tensors"]
    out = []
    for key, t in targets.items():
        if key not in tensors:
            raise KeyError(f"{key!r} not in {ckpt}/manifest.json (the raw reference needs flat keys)")
        if hasattr(t, "__create_chunk_list__"):
            box = t.__create_chunk_list__()[0]
            lo, size = list(box.offsets), list(box.sizes)
        else:
            lo, size = [0] * t.dim(), list(t.shape)
        if 0 in size:
            continue
        for c in tensors[key]["chunks"]:
            o, s = c["offsets"], c["sizes"]
            if all(max(a, b) < min(a + n, b + m) for a, n, b, m in zip(o, s, lo, size)):
                out.append((os.path.join(ckpt, c["file"]), int(c["start"]), int(c["end"]), c["xxh3_64"]))
    return sorted(out)


def coalesce(chunks: list[tuple[str, int, int, str]]) -> list[tuple[str, int, int]]:
    ranges: list[tuple[str, int, int]] = []
    for path, start, end, _ in chunks:
        if ranges and ranges[-1][0] == path and ranges[-1][2] == start:
            ranges[-1] = (path, ranges[-1][1], end)
        elif end > start:
            ranges.append((path, start, end))
    return ranges


def raw_read(ranges: list[tuple[str, int, int]], buf: memoryview) -> int:
    """Read the byte ranges back to back into ``buf`` with 16 MiB ``os.preadv`` calls."""
    pos = 0
    for path, start, end in ranges:
        fd = os.open(path, os.O_RDONLY)
        try:
            off = start
            while off < end:
                got = os.preadv(fd, [buf[pos: pos + min(PIECE, end - off)]], off)
                if got <= 0:
                    raise OSError(f"short read of {path} at {off}")
                pos += got
                off += got
        finally:
            os.close(fd)
    return pos


def check_raw(chunks: list[tuple[str, int, int, str]], buf: memoryview) -> None:
    pos = 0
    for path, start, end, digest in chunks:
        if xxhash.xxh3_64_hexdigest(buf[pos: pos + end - start]) != digest:
            raise AssertionError(f"raw read: bytes {start}-{end} of {path} do not match the manifest checksum")
        pos += end - start


def read_through(paths: list[str]) -> None:
    """Read whole files once (untimed), so a warm load finds them in the page cache."""
    scratch = memoryview(bytearray(PIECE))
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            off = 0
            while (got := os.preadv(fd, [scratch], off)) > 0:
                off += got
        finally:
            os.close(fd)


# --------------------------------------------------------------------------- load job
def _build(kind: str, size: int, world: int, rank: int, seed: int) -> tuple[dict, Any, str]:
    shapes, desc = shapes_for_bytes(size)
    if kind == "replicated":
        return random_state(shapes, seed), None, desc
    model = fsdp2_model(shapes, world, rank, seed)
    return dict(model.state_dict()), model, desc


def load_job(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Save one state with safeckpt and DCP, then time loads of it, methods interleaved.

    Methods: ``raw`` (16 MiB preadv of this rank's bytes into an existing buffer),
    ``safeckpt-fresh``/``-reused`` (``safeckpt.load`` into newly allocated / existing targets),
    ``safeckpt-reused-nocheck`` (``verify_checksums=False``), ``dcp-fresh``/``-reused``.
    ``cfg["cache"]``: ``cold`` drops the files from the page cache before every call,
    ``warm`` reads them through first. Replicated targets and the raw buffer exist only
    around their own call (written once before it, outside the clock, when they stand for
    existing memory), so a rank holds one copy of the state at a time.
    """
    import torch.distributed.checkpoint as dcp

    root = cfg["dir"]
    ck, dc = os.path.join(root, "safeckpt"), os.path.join(root, "dcp")
    methods: list[str] = cfg["methods"]
    tag = f"[world {world}, {cfg['kind']} {cfg['size'] >> 20} MiB, {cfg['cache']}]"
    t_setup = time.perf_counter()
    if rank == 0:
        os.makedirs(root, exist_ok=True)
    barrier()
    state, model, desc = _build(cfg["kind"], cfg["size"], world, rank, cfg.get("seed", 0))
    safeckpt.save(ck, state)
    if any(m.startswith("dcp") for m in methods):
        dcp.save(state, checkpoint_id=dc)
    want = fingerprint(state)
    n_tensors, global_bytes = len(state), sum(t.numel() * t.element_size() for t in state.values())
    # FSDP2: load into the model's own sharded parameters, as a resume does; replicated: the
    # originals are dropped and targets are allocated per call from a template
    template = state if model is not None else meta_like(state)
    del state
    release_memory()
    chunks = needed_chunks(ck, template)
    ranges = coalesce(chunks)
    raw_bytes = sum(e - s for _, s, e in ranges)
    files = files_under(ck) + (files_under(dc) if os.path.isdir(dc) else [])
    _log(rank, f"{tag} {n_tensors} tensors built and saved in {time.perf_counter() - t_setup:.1f} s")

    def targets(method: str) -> Any:
        if method == "raw":
            return memoryview(torch.zeros(raw_bytes, dtype=torch.uint8).numpy()).cast("B")
        if "fresh" in method:
            return fresh_like(template)
        if model is not None:
            zero_(template)
            return template
        return fresh_like(template, touch=True)

    def call(method: str, dst: Any) -> None:
        if method == "raw":
            if raw_read(ranges, dst) != raw_bytes:
                raise AssertionError("raw read: fewer bytes than the manifest lists")
        elif method.startswith("safeckpt"):
            safeckpt.load(ck, dst, verify_checksums=not method.endswith("nocheck"))
        else:
            dcp.load(dst, checkpoint_id=dc)

    times: dict[str, list[float]] = {m: [] for m in methods}
    faults: dict[str, float] = {}
    for rnd in range(cfg["reps"] + 1):  # round 0: untimed warm-up, results checked
        order = methods[rnd % len(methods):] + methods[: rnd % len(methods)]
        for method in order:
            dst = targets(method)
            gc.collect()
            barrier()
            if rank == 0:
                if cfg["cache"] == "cold":
                    for p in (ck, dc):
                        if os.path.exists(p):
                            drop_cache(p)
                else:
                    read_through(files)
            barrier()
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            call(method, dst)
            dt = time.perf_counter() - t0
            f1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            barrier()
            if rnd == 0:
                if method == "raw":
                    check_raw(chunks, dst)
                else:
                    check(dst, want, f"{method} on rank {rank}")
                faults[method] = (f1 - f0) * 4096 / max(1, raw_bytes)
            else:
                times[method].append(dt)
            del dst
            release_memory()
        if rnd:
            _log(rank, f"{tag} run {rnd}/{cfg['reps']} (rank 0): "
                 + ", ".join(f"{m} {times[m][-1]:.3f}s" for m in methods))
    barrier()
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    return {"job": "load", "cfg": {k: v for k, v in cfg.items() if k != "dir"}, "desc": desc,
            "n_tensors": n_tensors, "global_bytes": global_bytes, "local_bytes": local_nbytes(template),
            "raw_bytes": raw_bytes, "times": times, "faults": faults}


def _log(rank: int, msg: str) -> None:
    if rank == 0:
        print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- tiny save job
def tiny_state() -> dict[str, Any]:
    return {"x": torch.arange(256, dtype=torch.float32), "step": 7}


def tiny_job(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Time ``safeckpt.save`` of ``{"x": 1 KiB tensor, "step": int}``: agreement + write + commit."""
    root = cfg["dir"]
    if rank == 0:
        os.makedirs(root, exist_ok=True)
    barrier()
    state = tiny_state()
    times = []
    for rnd in range(cfg["reps"] + 1):  # round 0: warm-up, result checked
        p = os.path.join(root, f"tiny-{rnd}")
        barrier()
        t0 = time.perf_counter()
        safeckpt.save(p, state)
        dt = time.perf_counter() - t0
        barrier()
        if rnd == 0:
            back = {"x": torch.zeros(256), "step": 0}
            safeckpt.load(p, back)
            if not torch.equal(back["x"], state["x"]) or back["step"] != 7:
                raise AssertionError(f"tiny save on rank {rank}: loaded values differ from the saved ones")
        else:
            times.append(dt)
        barrier()
        if rank == 0:
            shutil.rmtree(p)
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    return {"job": "tiny", "times": times}


JOBS: dict[str, Callable[[int, int, dict[str, Any]], dict[str, Any]]] = {"load": load_job, "tiny": tiny_job}


def run_jobs(rank: int, world: int, jobs: list[dict[str, Any]], threads: int) -> list[dict[str, Any]]:
    """Entry point of every spawned rank (tests/dist_harness.run calls it in a gloo group)."""
    torch.set_num_threads(threads)
    out = []
    for cfg in jobs:
        out.append(JOBS[cfg["job"]](rank, world, cfg))
        release_memory()
    return out


