"""dcp.save / dcp.load through safeckpt.dcp vs DCP's own FileSystemWriter / FileSystemReader.

Same run, same state, interleaved repetitions (median reported), for world sizes 1 and 2
(gloo on 127.0.0.1) and two states of --size-mib in total:

- replicated: a dict of plain tensors, identical on every rank (DCP deduplicates them, so each
  is written once);
- fsdp2: an nn.Sequential of Linear layers sharded with ``fully_shard`` over all ranks.

Each repetition runs both (save then load) back to back, the order alternating from one
repetition to the next (safeckpt first in even ones), so neither always runs on a machine the
other just warmed or loaded; the ratio reported is the median of the per-repetition ratios (and
the medians of the times are shown too). The development VM is shared and noisy: compare
ratios within one run, not times across runs.

Saves go to a fresh directory under --dir each time (removed after the load that follows).
Before each load the checkpoint's files are dropped from the page cache (fsync, then
POSIX_FADV_DONTNEED), so both loads read from the disk: safeckpt's writer drops what it wrote
from the page cache by design (a checkpoint does not evict the training job's data) while
FileSystemWriter's files stay cached, and comparing a cold load with a warm one would say
nothing. (On a VM the "disk" may itself be cached by the host.) Times are the slowest rank's,
between two barriers.

    python bench/bench_dcp.py --size-mib 512 --worlds 1,2 --reps 3 --dir /tmp/bench-dcp
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import sys
import time
from datetime import timedelta


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _state(kind: str, size_mib: int, world: int):
    import torch
    from torch import nn

    torch.manual_seed(0)
    n_layers = 8
    if kind == "replicated":
        per = (size_mib << 20) // 4 // n_layers
        return {"model": {f"t{i}": torch.randn(per) for i in range(n_layers)}}, None
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    width = int(((size_mib << 20) // 4 // n_layers) ** 0.5)
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(n_layers)])
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    msd, _ = get_state_dict(model, [])
    return {"model": msd}, model


def _evict(path: str) -> None:
    """Drop a checkpoint's files from the page cache (after an fsync, so the kernel can)."""
    for name in os.listdir(path):
        fd = os.open(os.path.join(path, name), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _timed_writer(cls: type, phases: dict[str, list[float]]) -> type:
    """``cls`` with each DCP hook timed into ``phases`` (--phases: where a save's time goes)."""

    def timed(name: str):
        hook = getattr(cls, name)

        def run(self, *a, **kw):
            t0 = time.perf_counter()
            try:
                return hook(self, *a, **kw)
            finally:
                phases.setdefault(f"{name}", []).append(time.perf_counter() - t0)
        return run

    hooks = ("prepare_local_plan", "prepare_global_plan", "write_data", "finish")
    return type(f"Timed{cls.__name__}", (cls,), {h: timed(h) for h in hooks})


def _worker(rank: int, world: int, port: int, args: dict, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import safeckpt.dcp

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=600))
    results: dict[str, list[float]] = {}
    phases: dict[str, list[float]] = {}
    writer_cls = _timed_writer(safeckpt.dcp.StorageWriter, phases) if args["phases"] else safeckpt.dcp.StorageWriter
    try:
        for kind in args["kinds"]:
            state, _model = _state(kind, args["size_mib"], world)
            for rep in range(args["reps"]):
                order = ("safeckpt", "filesystem") if rep % 2 == 0 else ("filesystem", "safeckpt")
                for impl in order:
                    path = os.path.join(args["dir"], f"w{world}-{kind}-{impl}-{rep}")
                    writer = (writer_cls(path) if impl == "safeckpt"
                              else dcp.FileSystemWriter(path))
                    reader = (safeckpt.dcp.StorageReader(path) if impl == "safeckpt"
                              else dcp.FileSystemReader(path))
                    dist.barrier()
                    t0 = time.perf_counter()
                    dcp.save(state, storage_writer=writer)
                    dist.barrier()
                    t1 = time.perf_counter()
                    if rank == 0:
                        _evict(path)  # both loads read from disk (see the module docstring)
                    dist.barrier()
                    t1 = time.perf_counter()
                    dcp.load(state, storage_reader=reader)
                    dist.barrier()
                    t2 = time.perf_counter()
                    results.setdefault(f"{kind} {impl} save", []).append(t1 - t0)
                    results.setdefault(f"{kind} {impl} load", []).append(t2 - t1)
                    if rank == 0:
                        shutil.rmtree(path, ignore_errors=True)
                    dist.barrier()
            del state, _model
            for name, times in phases.items():
                results[f"{kind} safeckpt phase {name}"] = times
            phases.clear()
        queue.put((rank, results))
    finally:
        dist.destroy_process_group()


def run_world(world: int, args: dict) -> dict[str, list[float]]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    got = dict(queue.get(timeout=args["timeout"]) for _ in procs)
    for p in procs:
        p.join(60)
    return got[0]  # times are between barriers: every rank measures the slowest one


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--worlds", default="1,2")
    ap.add_argument("--kinds", default="replicated,fsdp2")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/bench-dcp")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", help="also write the results as JSON here")
    ap.add_argument("--phases", action="store_true",
                    help="also time each hook of safeckpt's writer (rank 0's median per save)")
    a = ap.parse_args(argv)
    os.makedirs(a.dir, exist_ok=True)
    args = {"size_mib": a.size_mib, "reps": a.reps, "dir": a.dir, "kinds": a.kinds.split(","),
            "timeout": a.timeout, "phases": a.phases}
    table = {}
    print(f"{a.size_mib} MiB, median of {a.reps} interleaved repetitions, seconds (ratio: median of the "
          "per-repetition FileSystem time / safeckpt time; >1: safeckpt faster)")
    for world in (int(w) for w in a.worlds.split(",")):
        res = run_world(world, args)
        for kind in args["kinds"]:
            for op in ("save", "load"):
                mine, fs = res[f"{kind} safeckpt {op}"], res[f"{kind} filesystem {op}"]
                ours, theirs = statistics.median(mine), statistics.median(fs)
                ratio = statistics.median(f / m for m, f in zip(mine, fs, strict=True))
                table[f"world {world} {kind} {op}"] = {"safeckpt": ours, "filesystem": theirs, "ratio": ratio,
                                                       "safeckpt_runs": mine, "filesystem_runs": fs}
                print(f"world {world}  {kind:10s} {op}:  safeckpt {ours:7.3f}  FileSystem {theirs:7.3f}  "
                      f"ratio {ratio:5.2f}  (per run: {' '.join(f'{f / m:.2f}' for m, f in zip(mine, fs, strict=True))})",
                      flush=True)
            timed = {k.rsplit(" ", 1)[1]: v for k, v in res.items() if k.startswith(f"{kind} safeckpt phase ")}
            if timed:
                table[f"world {world} {kind} phases"] = timed
                print(f"world {world}  {kind:10s} safeckpt save phases (rank 0, median s): "
                      + "  ".join(f"{k} {statistics.median(v):.3f}" for k, v in timed.items()), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"size_mib": a.size_mib, "reps": a.reps, "results": table}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
