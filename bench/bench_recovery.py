"""Fast recovery: the node-local tier (``CheckpointManager(local_dir=..., replicas=1)``) vs root.

One run, N simulated nodes of one rank each (``GROUP_RANK`` per process, gloo on 127.0.0.1),
a state of ``--params`` float32 parameters (replicated, as DDP's: its bytes are spread over the
ranks' files) plus a per-rank tensor. Every local directory lives under ``--local`` (default
/dev/shm: a RAM disk); ``root`` under ``--dir`` (a disk). Reported per rank 0, the slowest rank
where it says so; each figure is the median of ``--repeat`` measurements (the loops: of
``--loop-repeat`` interleaved runs of each):

- ``plain copy``: the time to copy the state's tensors into preallocated host buffers (what a
  local save must at least block for); ``local save blocked``: ``mgr.save`` returning;
  ``local save complete``: ``mgr.wait`` (file written, replicas sent, verified, published);
- ``restore after node loss (local + peers)``: node N-1's directory wiped, root's checkpoints
  moved away (so not a byte can be read from them), a fresh job restores the newest step;
- ``heal after the restore (background)``: a lost node of one rank loads the files it fetched
  from the memory files it received them into and writes them to its ``local_dir`` after the
  restore returns, on the manager's background worker (``mgr.wait()`` joins it; timed here);
- ``restore, no node lost (local only)``: the same restore with every node holding its copies
  (a restart after a crash that lost no node): no transfer, no heal;
- ``restore from root (cold)``: no local data, root's files dropped from the page cache
  (fsync + POSIX_FADV_DONTNEED) first;
- ``plain read from local_dir``: reading every file of the restored step from the node's own
  directory (the same bytes the restore loaded; not the node's older local steps);
- ``peak host memory``: the highest rank's peak resident memory (VmHWM, reset before) above what
  it held before the local saves (warm-up included), and before each restore (its heal
  included, the plain read's buffers not);
- ``train loop``: ``--loop-steps`` steps of an MLP of the same size on each rank (forward,
  backward, SGD) with no checkpoint vs a local save at every step (the 2-core VM shares its
  cores between training and the background save: the overhead shows that competition).

``--device cuda``: the model on the GPU (every rank on cuda:0); the snapshot then goes through
pinned host buffers (``engine.staging``), and the restore copies into the CUDA tensors.

    python bench/bench_recovery.py --params 12000000 --nodes 2 --dir /tmp/bench-rec
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


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model(params: int):
    import torch
    from torch import nn

    width = 1024
    depth = max(1, params // (width * width))
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(depth)])


def _memory(field: str) -> int:
    """A /proc/self/status figure (VmRSS, VmHWM) in bytes; 0 where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _peak_reset() -> int:
    """Reset this process's peak resident memory (Linux: clear_refs 5); its resident memory now."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return _memory("VmRSS")


def _drop_cache(path: str) -> None:
    for dirpath, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, phase: str, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      GROUP_RANK=str(rank), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    import safeckpt

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    model = _model(args.params).to(args.device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    state = {"model": model, "mine": safeckpt.PerRank(torch.full((1024,), float(rank)))}
    local = os.path.join(args.local, f"node{rank}")
    root = os.path.join(args.dir, "root")
    res: dict = {}

    def peak_above(base: int) -> float:
        """The highest rank's peak resident memory since ``base`` was taken (_peak_reset), in MiB."""
        most = torch.tensor([float(_memory("VmHWM") - base)])
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        return float(most) / 2**20

    def timed(fn) -> float:
        dist.barrier()
        t = time.perf_counter()
        fn()
        took = time.perf_counter() - t
        slowest = torch.tensor([took])
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        return float(slowest)

    if phase == "save":
        tensors = [p.detach() for p in model.parameters()]
        pinned = args.device != "cpu"
        bufs = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned) for t in tensors]

        def plain_copy() -> None:
            for b, t in zip(bufs, tensors, strict=True):
                b.copy_(t, non_blocking=pinned)
            if pinned:
                torch.cuda.synchronize()

        res["plain copy"] = median([timed(plain_copy) for _ in range(args.repeat)])
        del bufs  # the plain copy's buffers are not the tier's
        base = _peak_reset()
        mgr = safeckpt.CheckpointManager(root, local_dir=local, durable_every=1000, replicas=1,
                                         preemption_signals=())
        mgr.save(1, state)  # the first save builds the groups and the host buffers: not counted
        mgr.wait()
        blocked, complete = [], []
        for step in range(2, 2 + args.repeat):
            blocked.append(timed(lambda step=step: mgr.save(step, state)))
            complete.append(timed(mgr.wait))
        res["local save blocked"] = median(blocked)
        res["local save complete"] = median(complete)
        res["peak host memory of local saves, above the state (MiB)"] = peak_above(base)
        mgr.close()  # drains the newest step to root
        res["bytes"] = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(root) for f in fs
                           if os.path.relpath(dp, root).startswith("step-"))  # the checkpoints, not the lease
        # the training loop, without and with a local save at every step
        x = torch.randn(64, 1024, device=args.device)

        def loop(save: bool, mgr=None) -> None:
            for i in range(args.loop_steps):
                opt.zero_grad()
                model(x).pow(2).mean().backward()
                opt.step()
                if save:
                    mgr.save(100 + i, state)
            if save:
                mgr.wait()
            if args.device != "cpu":
                torch.cuda.synchronize()

        loop_root = os.path.join(args.dir, "loop-root")
        m2 = safeckpt.CheckpointManager(loop_root, local_dir=os.path.join(args.local, f"loop{rank}"),
                                        durable_every=None, replicas=1, preemption_signals=())
        m2.save(99, state)  # warm: groups and host buffers
        m2.wait()
        plain_runs, saving_runs = [], []
        for _ in range(args.loop_repeat):  # interleaved, so that both see the same machine
            plain_runs.append(timed(lambda: loop(False)))
            saving_runs.append(timed(lambda: loop(True, m2)))
        res["train loop, no checkpoint"] = median(plain_runs)
        res["train loop, local save every step"] = median(saving_runs)
        m2._last = None  # the loop's steps are not drained to root
        m2.close()
    elif phase == "node-loss":
        mgr = safeckpt.CheckpointManager(root, local_dir=local, durable_every=1000, replicas=1,
                                         preemption_signals=())
        got: list = []
        restores, reads, heals, peaks = [], [], [], []
        base = _peak_reset()
        for i in range(args.repeat):
            if i:  # the last node is lost again (what the restore healed is wiped)
                if rank == world - 1:
                    shutil.rmtree(local)
                dist.barrier()
            restores.append(timed(lambda: got.append(mgr.restore(state))))
            heals.append(timed(mgr.wait))  # the lost node writes what it loaded from memory
            peaks.append(peak_above(base))  # before the plain read's own buffers
            # the restored step's files only (the node keeps older local steps too)
            files = [os.path.join(dp, f) for dp, _, fs in os.walk(local) for f in fs
                     if f.startswith("rank-") and os.path.basename(dp) == f"step-{got[-1]:010d}"]
            assert files, f"no files of step {got[-1]} under {local}"
            _drop_cache(local) if not args.local.startswith("/dev/shm") else None
            reads.append(timed(lambda files=files: [open(f, "rb").read() for f in files]))
            base = _peak_reset()
        res["peak host memory of restores, above the state (MiB)"] = max(peaks)
        res["restore after node loss (local + peers)"] = median(restores)
        res["heal after the restore (background)"] = median(heals)
        # every node holding its copies again (healed): a restart after a crash that lost no node
        res["restore, no node lost (local only)"] = median([timed(lambda: mgr.restore(state))
                                                            for _ in range(args.repeat)])
        res["restored step"] = got[0]
        res["plain read from local_dir"] = median(reads)
        res["restore / plain read, median of pairs"] = median([a / b for a, b in zip(restores, reads, strict=True)])
        mgr._last = None
        mgr.close()
    elif phase == "root":
        if rank == 0:
            _drop_cache(root)
        mgr = safeckpt.CheckpointManager(root, local_dir=os.path.join(args.local, f"fresh{rank}"),
                                         durable_every=1000, preemption_signals=())
        got = []
        res["restore from root (cold)"] = timed(lambda: got.append(mgr.restore(state)))
        res["restored step (root)"] = got[0]
        mgr.close()
    state.clear()
    model = opt = None  # noqa: F841 - dropped before the group (NOTES.md section 5)
    import gc

    gc.collect()
    dist.destroy_process_group()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(res, f)


def _phase(args: argparse.Namespace, phase: str) -> dict:
    ctx = mp.get_context("spawn")
    out = os.path.join(args.dir, f"{phase}.json")
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, args.nodes, port, args, phase, out)) for r in range(args.nodes)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)
        if p.exitcode != 0:
            raise SystemExit(f"{phase}: a rank exited with {p.exitcode}")
    with open(out) as f:
        return json.load(f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=int, default=12_000_000)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--loop-steps", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=5, help="saves and restores measured (medians)")
    ap.add_argument("--loop-repeat", type=int, default=3, help="runs of each loop, interleaved (medians)")
    ap.add_argument("--dir", default="/tmp/bench-recovery")
    ap.add_argument("--local", default="/dev/shm/bench-recovery")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (every rank on cuda:0)")
    args = ap.parse_args()
    for d in (args.dir, args.local):
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
    res = _phase(args, "save")
    # node N-1 lost, root's checkpoints moved away: nothing can be read from them (root keeps
    # its run file: without it the nodes' data would be another run's, see engine.local_tier)
    from safeckpt.engine.local_tier import RUN_FILE

    shutil.rmtree(os.path.join(args.local, f"node{args.nodes - 1}"))
    root, aside = os.path.join(args.dir, "root"), os.path.join(args.dir, "root-aside")
    os.makedirs(aside)
    moved = [n for n in os.listdir(root) if n != RUN_FILE]
    for n in moved:
        os.rename(os.path.join(root, n), os.path.join(aside, n))
    res.update(_phase(args, "node-loss"))
    left = [n for n in os.listdir(root) if n != RUN_FILE]
    res["bytes read from root"] = 0 if not left else f"root holds {left}?"
    for n in moved:
        os.rename(os.path.join(aside, n), os.path.join(root, n))
    res.update(_phase(args, "root"))
    shutil.rmtree(args.local, ignore_errors=True)
    print(f"state: {args.params / 1e6:.0f}M float32 parameters ({res['bytes'] / 2**20:.0f} MiB per step), "
          f"{args.nodes} nodes x 1 rank, replicas=1, device {args.device}")
    for k, v in res.items():
        unit = " MiB" if "(MiB)" in k else "x" if "/" in k else " s"
        print(f"  {k:45s} {v:.3f}{unit}" if isinstance(v, float) else f"  {k:45s} {v}")
    share = res["bytes"] / args.nodes / 2**20
    print(f"  peak host memory above the state: saves {res['peak host memory of local saves, above the state (MiB)']:.0f}"
          f" MiB, restores {res['peak host memory of restores, above the state (MiB)']:.0f} MiB (a rank's share of "
          f"the step: {share:.0f} MiB; a save needs three copies of it, {3 * share:.0f} MiB: the staged copy, the file "
          f"it sends and the one it receives; a lost node's restore what its rank loads, here the whole step)")
    r = res["restore / plain read, median of pairs"]
    print(f"  restore, no node lost / plain read: {res['restore, no node lost (local only)'] / res['plain read from local_dir']:.2f}x")
    print(f"  restore (local + peers) / plain read: {r:.2f}x; local save blocked / plain copy: "
          f"{res['local save blocked'] / res['plain copy']:.2f}x; train loop overhead: "
          f"{100 * (res['train loop, local save every step'] / res['train loop, no checkpoint'] - 1):.0f}%")


if __name__ == "__main__":
    sys.exit(main())
