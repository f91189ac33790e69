"""Issue 12, target 4: async saves of a CUDA state against a plain pinned device-to-host copy.

For each state size (``--gib``, default 2 and 8) this measures, on one GPU and one process,
medians of ``--reps`` steady-state runs (after a warm-up save, so staging buffers exist):

- *pinned copy*: ``copy_(non_blocking=True)`` of every tensor into reused pinned host buffers,
  then a synchronize: what any async checkpointer must pay to take a snapshot.
- *copy + write + fsync*: that copy, then ``os.writev`` of the buffers to one file and fsync:
  the time-to-durable floor on this disk.
- *safeckpt async*: ``CheckpointManager(async_save=True).save()``: the time until it returns
  (the training loop's blocking time), the time until a fixed burst of GPU work enqueued
  right after it finishes (the training stream waits for the snapshot copy: this shows any
  stall beyond the copy), and the time until ``wait()`` returns (durable and committed).
- *safeckpt sync*: ``safeckpt.save`` of the CUDA state (copies to host, then writes).
- *work alone*: the same burst of GPU work with no save, for the stall figure.

Not part of ``make test`` (it needs a GPU). ``--device cpu --gib 0.05`` runs the same code
paths without one, as a smoke test of the script itself. Output: Markdown on stdout and in
``--out``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch

import safeckpt

GiB = 1 << 30
MiB = 1 << 20


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def make_state(nbytes: int, tensors: int, device: str) -> dict[str, torch.Tensor]:
    per = max(1, nbytes // tensors // 2)  # bfloat16 elements per tensor
    g = torch.Generator(device=device).manual_seed(0)
    return {f"layer{i}.weight": torch.randn(per, generator=g, device=device, dtype=torch.bfloat16)
            for i in range(tensors)}


def work_burst(device: str) -> Callable[[], None]:
    """A fixed amount of GPU (or CPU) work, standing in for the next training steps."""
    a = torch.randn(4096 if device == "cuda" else 256, 4096 if device == "cuda" else 256, device=device)

    def run() -> None:
        x = a
        for _ in range(20):
            x = torch.tanh(x @ a)

    return run


def median_ms(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:.1f} ({min(xs) * 1e3:.1f}-{max(xs) * 1e3:.1f})"


def bench_size(nbytes: int, args: argparse.Namespace, root: str) -> list[tuple[str, list[float]]]:
    dev = args.device
    state = make_state(nbytes, args.tensors, dev)
    pin = dev == "cuda"
    bufs = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for t in state.values()]
    burst = work_burst(dev)
    rows: dict[str, list[float]] = {k: [] for k in (
        "work alone", "pinned copy", "copy + write + fsync", "safeckpt async: save() returns",
        "safeckpt async: save() + work burst done", "safeckpt async: durable (wait() returns)",
        "safeckpt sync save")}
    burst()
    sync(dev)
    with safeckpt.CheckpointManager(os.path.join(root, "async"), async_save=True, keep_last=1) as mgr:
        mgr.save(0, state)  # warm-up: staging buffers allocated, plan cached
        mgr.wait()
        for rep in range(1, args.reps + 1):
            sync(dev)
            t0 = time.perf_counter()
            burst()
            sync(dev)
            rows["work alone"].append(time.perf_counter() - t0)

            t0 = time.perf_counter()
            for b, t in zip(bufs, state.values(), strict=True):
                b.copy_(t, non_blocking=True)
            sync(dev)
            rows["pinned copy"].append(time.perf_counter() - t0)

            path = os.path.join(root, f"raw{rep}")
            t0 = time.perf_counter()
            for b, t in zip(bufs, state.values(), strict=True):
                b.copy_(t, non_blocking=True)
            sync(dev)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            views = [memoryview(b.view(torch.int16).numpy()).cast("B") for b in bufs]
            for i in range(0, len(views), 1024):
                os.writev(fd, views[i:i + 1024])
            os.fsync(fd)
            os.close(fd)
            rows["copy + write + fsync"].append(time.perf_counter() - t0)
            os.unlink(path)
            os.sync()

            sync(dev)
            t0 = time.perf_counter()
            mgr.save(rep, state)
            rows["safeckpt async: save() returns"].append(time.perf_counter() - t0)
            burst()
            sync(dev)
            rows["safeckpt async: save() + work burst done"].append(time.perf_counter() - t0)
            mgr.wait()
            rows["safeckpt async: durable (wait() returns)"].append(time.perf_counter() - t0)
            os.sync()

            path = os.path.join(root, f"sync{rep}")
            sync(dev)
            t0 = time.perf_counter()
            safeckpt.save(path, state)
            rows["safeckpt sync save"].append(time.perf_counter() - t0)
            shutil.rmtree(path)
            os.sync()
        latest = mgr.latest()
    # the last async checkpoint holds exactly the state (loaded back onto the device)
    assert latest is not None and latest.step == args.reps, latest
    back = {k: torch.zeros_like(v) for k, v in state.items()}
    safeckpt.load(latest.path, back)
    bad = [k for k, v in state.items() if not torch.equal(back[k], v)]
    if bad:
        raise SystemExit(f"the async checkpoint differs from the state in {bad[:5]}")
    return list(rows.items())


def report(args: argparse.Namespace, results: dict[float, list[tuple[str, list[float]]]]) -> str:
    dev = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "CPU"
    lines = [
        f"### Async saves of a {args.device.upper()} state vs a pinned copy "
        f"({_dt.datetime.now():%Y-%m-%d %H:%M}, `bench/bench_gpu.py {' '.join(args.argv)}`)",
        "",
        f"- **device**: {dev}; torch {torch.__version__}; safeckpt {safeckpt.__version__}",
        f"- {args.tensors} bfloat16 tensors per state; medians (min-max) of {args.reps} runs, ms",
        "",
        "| state | what | ms | vs pinned copy |",
        "|---|---|---:|---:|",
    ]
    for gib, rows in results.items():
        copy = statistics.median(dict(rows)["pinned copy"])
        work = statistics.median(dict(rows)["work alone"])
        for name, xs in rows:
            ratio = statistics.median(xs) / copy if name != "work alone" else float("nan")
            lines.append(f"| {gib:g} GiB | {name} | {median_ms(xs)} | {ratio:.2f}x |".replace("nanx", ""))
        stall = statistics.median(dict(rows)["safeckpt async: save() + work burst done"]) - work
        lines.append(f"| {gib:g} GiB | *stall of the work burst by the save (done - work alone)* | "
                     f"{stall * 1e3:.1f} | {stall / copy:.2f}x |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", default="2,8", help="state sizes in GiB, comma-separated (default 2,8)")
    ap.add_argument("--tensors", type=int, default=256, help="tensors per state (default 256)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--root", default=None, help="directory to save into (default: a temp dir)")
    ap.add_argument("--out", default=None, help="also write the Markdown report here")
    args = ap.parse_args()
    args.argv = sys.argv[1:]
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device here; --device cpu runs the same code paths as a smoke test")
    root = tempfile.mkdtemp(prefix="safeckpt-gpu-", dir=args.root)
    try:
        results = {}
        for gib in [float(x) for x in args.gib.split(",")]:
            print(f"{gib:g} GiB ...", flush=True)
            results[gib] = bench_size(int(gib * GiB), args, root)
        text = report(args, results)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
