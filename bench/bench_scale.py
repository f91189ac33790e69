"""How safeckpt's coordination scales with the world size, next to DCP, on one machine.

Run with ``make bench-scale`` (``--worlds 8,16,32,64,128 --reps 5``). Not part of ``make test``.

Ranks are forked from one parent that has imported torch and safeckpt (a fork server: the
children share its pages, so 128 ranks fit in memory), join a gloo process group on
127.0.0.1, and build a tiny state of ~1,000 tensors in one of two layouts:

- ``ddp``:  1,000 replicated tensors (64 floats each), as a DDP job's model + optimizer;
- ``fsdp``: 1,000 DTensors sharded along dim 0 over all ranks (``Shard(0)``, as FSDP2),
            built with ``DTensor.from_local`` (no communication), plus per-rank RNG state.

For each world size and layout: one warm-up call of each (the checkpoint group is created by
the first), then ``--reps`` timed rounds of safeckpt.save, safeckpt.load, dcp.save and
dcp.load (FileSystemWriter/Reader) into a fresh directory under ``--root`` (tmpfs by
default: the disk is not what is measured). Each call starts after a barrier on the default
group; its time is the slowest rank's. safeckpt's collectives count themselves
(``safeckpt.coord.dist.STATS``: rounds, bytes sent and received); DCP's are counted by wrapping the
torch.distributed calls it makes (rounds; bytes as the pickled size of the objects sent).

Output: a Markdown table on stdout and ``bench/results/scale.md``, medians of the reps.
"""

from __future__ import annotations

import argparse
import os
import pickle
import shutil
import socket
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp  # imported here, before the fork: ranks share it
import torch.multiprocessing as mp

import safeckpt
from safeckpt.coord import dist as _dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests.*
from tests.helpers.proc_sockets import open_sockets  # noqa: E402

N_TENSORS = 1000
ROWS = 64  # rows of each FSDP tensor (sharded over the ranks); DDP tensors have 64 elements


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _state(layout: str, rank: int, world: int) -> dict[str, Any]:
    if layout == "ddp":
        g = torch.Generator().manual_seed(0)
        return {"model": {f"layers.{i}.weight": torch.randn(64, generator=g) for i in range(N_TENSORS)},
                "step": 7}
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    rows = max(ROWS, world)
    per = -(-rows // world)
    lo, hi = min(rank * per, rows), min((rank + 1) * per, rows)
    g = torch.Generator().manual_seed(rank)
    model = {f"layers.{i}.weight": DTensor.from_local(torch.randn(hi - lo, 4, generator=g), mesh, [Shard(0)],
                                                      shape=torch.Size([rows, 4]), stride=(4, 1), run_check=False)
             for i in range(N_TENSORS)}
    return {"model": model, "rng": safeckpt.RNGState()}


class _DcpCounter:
    """Counts the torch.distributed calls DCP makes (its _DistWrapper) and the pickled bytes."""

    NAMES = ("gather_object", "scatter_object_list", "broadcast_object_list", "all_gather_object",
             "all_reduce", "barrier", "reduce_scatter", "all_gather")

    def __init__(self) -> None:
        self.rounds = 0
        self.sent = 0
        self._orig: dict[str, Any] = {}

    def __enter__(self) -> _DcpCounter:
        import torch.distributed.checkpoint.utils as dcp_utils

        target = dcp_utils.dist
        for name in self.NAMES:
            fn = getattr(target, name, None)
            if fn is None:
                continue
            self._orig[name] = fn

            def wrapped(*args: Any, _fn: Any = fn, _name: str = name, **kwargs: Any) -> Any:
                self.rounds += 1
                if _name.endswith("_object") or _name.endswith("_object_list"):
                    try:
                        self.sent += len(pickle.dumps(args[0] if _name == "gather_object" else args[-1]
                                                      if _name == "all_gather_object" else args[0]))
                    except Exception:  # noqa: BLE001 - an estimate only
                        pass
                return _fn(*args, **kwargs)

            setattr(target, name, wrapped)
        return self

    def __exit__(self, *exc: Any) -> None:
        import torch.distributed.checkpoint.utils as dcp_utils

        for name, fn in self._orig.items():
            setattr(dcp_utils.dist, name, fn)


def _timed(call: Any) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    call()
    return time.perf_counter() - t0


def _rank_main(rank: int, world: int, port: int, layout: str, root: str, reps: int, dcp_reps: int,
               queue: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        state = _state(layout, rank, world)
        out: dict[str, list[Any]] = {k: [] for k in ("save", "load", "dcp_save", "dcp_load")}
        before = open_sockets()
        safeckpt.save(f"{root}/warm", state, overwrite=True)
        safeckpt.load(f"{root}/warm", state)
        out["sockets"] = [open_sockets() - before]  # what safeckpt's group (and store clients) added
        if dcp_reps == reps:  # (large worlds: DCP's calls take minutes; its imports are done)
            dcp.save(state["model"], checkpoint_id=f"{root}/dcp-warm")
            dcp.load(state["model"], checkpoint_id=f"{root}/dcp-warm")
        for i in range(reps):
            for what, call in (
                ("save", lambda i=i: safeckpt.save(f"{root}/ck-{i}", state)),
                ("load", lambda i=i: safeckpt.load(f"{root}/ck-{i}", state)),
            ):
                before = dict(_dist.STATS)
                seconds = _timed(call)
                out[what].append((seconds, {k: _dist.STATS[k] - before[k] for k in before}))
            if i >= dcp_reps:
                continue
            for what, call in (
                ("dcp_save", lambda i=i: dcp.save(state["model"], checkpoint_id=f"{root}/dcp-{i}")),
                ("dcp_load", lambda i=i: dcp.load(state["model"], checkpoint_id=f"{root}/dcp-{i}")),
            ):
                with _DcpCounter() as counter:
                    seconds = _timed(call)
                out[what].append((seconds, {"rounds": counter.rounds, "sent": counter.sent}))
        manifest = os.path.getsize(f"{root}/ck-0/manifest.json") if rank == 0 else 0
        queue.put((rank, out, manifest, None))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, None, 0, traceback.format_exc()))


def run_world(world: int, layout: str, reps: int, dcp_reps: int, base: str, timeout: float) -> dict[str, Any]:
    root = tempfile.mkdtemp(prefix=f"scale-{layout}-{world}-", dir=base)
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, layout, root, reps, dcp_reps, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    manifest = 0
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world:
            rank, out, size, error = queue.get(timeout=max(1.0, deadline - time.monotonic()))
            if error:
                raise RuntimeError(f"rank {rank} failed:\n{error}")
            results[rank] = out
            manifest = max(manifest, size)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        shutil.rmtree(root, ignore_errors=True)
    row: dict[str, Any] = {"world": world, "layout": layout, "manifest": manifest,
                           "sockets": results[world - 1]["sockets"][0], "sockets0": results[0]["sockets"][0]}
    for what in ("save", "load", "dcp_save", "dcp_load"):
        per_rep = list(zip(*(results[r][what] for r in range(world)), strict=True))
        row[what] = statistics.median(max(t for t, _ in rep) for rep in per_rep)
        stats = results[world - 1][what][-1][1]  # a non-coordinator, last rep
        row[what + "_rounds"] = stats["rounds"]
        row[what + "_recv"] = stats.get("received")
        row[what + "_sent"] = stats["sent"]
        row[what + "_coord_recv"] = results[0][what][-1][1].get("received")
    return row


def _table(rows: list[dict[str, Any]]) -> str:
    head = ("| layout | ranks | sockets (rank n-1 / 0) | manifest B | save: rounds | save: B recv / sent (rank n-1) | save: B recv (rank 0) "
            "| load: rounds | load: B recv (rank n-1) | save ms | DCP save ms (rounds) | load ms "
            "| DCP load ms (rounds) | save / DCP | load / DCP |")
    lines = [head, "|" + "|".join(["---"] * 15) + "|"]
    for r in rows:
        lines.append(
            f"| {r['layout']} | {r['world']} | {r['sockets']} / {r['sockets0']} | {r['manifest']:,} | {r['save_rounds']} "
            f"| {r['save_recv']:,} / {r['save_sent']:,} | {r['save_coord_recv']:,} | {r['load_rounds']} "
            f"| {r['load_recv']:,} | {1e3 * r['save']:.0f} | {1e3 * r['dcp_save']:.0f} ({r['dcp_save_rounds']}) "
            f"| {1e3 * r['load']:.0f} | {1e3 * r['dcp_load']:.0f} ({r['dcp_load_rounds']}) "
            f"| {r['save'] / r['dcp_save']:.2f} | {r['load'] / r['dcp_load']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", default="8,16,32,64,128")
    ap.add_argument("--layouts", default="ddp,fsdp")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--root", default="/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    ap.add_argument("--dcp-reps", type=int, default=None,
                    help="timed DCP rounds (default: --reps up to 32 ranks, 1 above, without warm-up)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds one world size may take")
    args = ap.parse_args()
    os.environ.setdefault("SAFECKPT_TIMEOUT", "300")
    rows = []
    for layout in args.layouts.split(","):
        for world in [int(w) for w in args.worlds.split(",")]:
            started = time.monotonic()
            dcp_reps = args.dcp_reps if args.dcp_reps is not None else (args.reps if world <= 32 else 1)
            row = run_world(world, layout, args.reps, dcp_reps, args.root, args.timeout)
            rows.append(row)
            print(f"# {layout} x {world}: {time.monotonic() - started:.0f}s\n" + _table([row]).splitlines()[-1],
                  file=sys.stderr, flush=True)  # each row as it comes: a later world size may not fit
    text = (f"safeckpt {safeckpt.__version__}, torch {torch.__version__}, {os.cpu_count()} CPUs, "
            f"{args.reps} reps (medians; DCP: {args.dcp_reps or 'reps up to 32 ranks, 1 above'}), "
            f"{N_TENSORS} tensors, root {args.root}\n\n" + _table(rows))
    print(text)
    os.makedirs(os.path.join(os.path.dirname(__file__), "results"), exist_ok=True)
    with open(os.path.join(os.path.dirname(__file__), "results", "scale.md"), "w") as f:
        f.write(text + "\n")



def constants() -> str:
    """The per-record constants of the cost model (one process): the coordinator's CPU per
    rank in a save's two decisions, manifest parse + validation speed, and the job store's
    set() rate (every collective marks each rank's arrival there)."""
    import json as _json

    from torch.distributed import TCPStore

    from safeckpt.coord.dist import SLOT, _decoded, _framed
    from safeckpt.format.manifest import parse_manifest

    lines = []
    n = 4096
    payload = {"ok": True, "value": {"path": "/checkpoints/run-17/step-0000012000", "step": 12000, "overwrite": True,
                                     "layout_hash": "ab" * 32, "digest": "cd" * 16, "trees": "ef" * 8,
                                     "irregular": {}}}
    one = _framed(_json.dumps(payload).encode(), SLOT)
    slots = list(one.repeat(n, 1).unbind(0))  # as _gather_slots receives them: rows of one buffer
    t0 = time.perf_counter()
    values = [v["value"] for v in _decoded(slots, None)]
    ref = values[0]
    assert all(v["path"] == ref["path"] and v["layout_hash"] == ref["layout_hash"] for v in values)
    per = (time.perf_counter() - t0) / n
    lines.append(f"- coordinator, per rank record of a decision (decode 1 KiB slot + compare): {per * 1e6:.1f} us")
    root = tempfile.mkdtemp()
    try:
        for r in range(n):
            with open(os.path.join(root, f"rank-{r:05d}.safetensors"), "wb") as f:
                f.write(b"x")
        t0 = time.perf_counter()
        for r in range(n):
            os.stat(os.path.join(root, f"rank-{r:05d}.safetensors"))
        per = (time.perf_counter() - t0) / n
        lines.append(f"- coordinator, per rank file checked at commit (stat, local ext4/tmpfs): {per * 1e6:.1f} us")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    # A format-3 manifest of 1,024 ranks x 2,000 FSDP2 tensors, as tests/test_format3 builds it.
    from tests.test_format3 import _synthesized

    raw, _ = _synthesized(1024, 2000)
    t0 = time.perf_counter()
    reps = 5
    for _ in range(reps):
        parse_manifest(raw, "/synthetic")
    per = (time.perf_counter() - t0) / reps
    lines.append(f"- manifest of 1,024 ranks x 2,000 FSDP2 tensors: {len(raw):,} B, parsed and validated in "
                 f"{per * 1e3:.0f} ms ({len(raw) / per / 1e6:.1f} MB/s)")
    store = TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    t0 = time.perf_counter()
    m = 20000
    for i in range(m):
        store.set(f"safeckpt/group-1/arrived/{i % 1024}", str(i))
    per = (time.perf_counter() - t0) / m
    lines.append(f"- job store set() from one client, loopback: {per * 1e6:.0f} us ({1 / per:,.0f}/s)")
    return "\n".join(lines)


if __name__ == "__main__":
    if "--constants" in sys.argv:
        print(constants())
    else:
        main()
