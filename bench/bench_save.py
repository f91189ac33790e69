"""Benchmark safeckpt against torch.save, safetensors and torch.distributed.checkpoint.

Run with ``make bench`` (or ``.venv/bin/python bench/bench_save.py --quick`` for a ~128 MiB
state). Not part of ``make test``. Every number is the median of ``--reps`` runs measured in
this process, on this machine, in the same run as the baselines it is compared with. Output:
a Markdown report on stdout and in ``bench/results/latest.md`` (git-ignored).

Sections (``--sections``, comma-separated; default all):

- ``save``   one process, no process group: safeckpt.save vs torch.save (+fsync),
             safetensors save_file (+fsync), dcp.save (fsyncs itself). Outputs are removed
             (and ``os.sync()`` called) between runs, outside the timed region.
- ``load``   into existing, already-allocated tensors: safeckpt.load (checksums verified, and
             not), torch.load(weights_only=True) + copy_, safetensors load_file + copy_,
             dcp.load. "cold" = after posix_fadvise(DONTNEED) of the files (dropped from this
             VM's page cache; the host may still cache the disk), "warm" = right after that.
- ``async``  CheckpointManager(async_save=True).save() wall time until it returns, in steady
             state (after a warm-up save, so staging buffers are reused), vs a plain copy_ of
             the same tensors into reused, already-touched buffers, vs a synchronous save.
- ``train``  mean step time of a CPU MLP + AdamW loop with no checkpointing, a sync save
             every K steps and an async save every K steps.
- ``dist``   2 ranks (spawn, gloo), replicated state: each rank writes ~1/2 of the bytes.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import mmap
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import safeckpt

GB = 1e9
MiB = 1 << 20
HERE = os.path.dirname(os.path.abspath(__file__))

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
warnings.filterwarnings("ignore", category=FutureWarning)


# --------------------------------------------------------------------------- state
def make_state(target_bytes: int, seed: int = 0) -> tuple[dict[str, torch.Tensor], str]:
    """A flat dict of float32 tensors shaped like a small transformer plus AdamW state.

    Per layer: qkv (3d x d), attn out (d x d), mlp up (4d x d), mlp down (d x 4d), their biases
    and two LayerNorms; plus an embedding (vocab x d). For every parameter ``p`` there are also
    ``optim.exp_avg.p`` and ``optim.exp_avg_sq.p`` and a 0-d ``optim.step.p``, as AdamW keeps.
    """
    d = 1024 if target_bytes >= 512 * MiB else 512
    vocab = 32000 if d == 1024 else 8000
    layer_shapes = {
        "attn.qkv.weight": (3 * d, d), "attn.qkv.bias": (3 * d,),
        "attn.out.weight": (d, d), "attn.out.bias": (d,),
        "mlp.up.weight": (4 * d, d), "mlp.up.bias": (4 * d,),
        "mlp.down.weight": (d, 4 * d), "mlp.down.bias": (d,),
        "ln1.weight": (d,), "ln1.bias": (d,), "ln2.weight": (d,), "ln2.bias": (d,),
    }
    per_layer = sum(torch.Size(s).numel() for s in layer_shapes.values()) * 4 * 3
    emb = vocab * d * 4 * 3
    layers = max(1, round((target_bytes - emb) / per_layer))
    params: dict[str, tuple[int, ...]] = {"embed.weight": (vocab, d)}
    for i in range(layers):
        for k, s in layer_shapes.items():
            params[f"layers.{i}.{k}"] = s
    params["final_ln.weight"] = (d,)
    params["final_ln.bias"] = (d,)
    g = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for name, shape in params.items():
        state[f"model.{name}"] = torch.randn(shape, generator=g)
    for name, shape in params.items():
        state[f"optim.exp_avg.{name}"] = torch.randn(shape, generator=g) * 1e-3
        state[f"optim.exp_avg_sq.{name}"] = torch.rand(shape, generator=g) * 1e-6
        state[f"optim.step.{name}"] = torch.tensor(100.0)
    desc = (f"transformer-like: d_model={d}, {layers} layers, vocab {vocab}; "
            f"{len(params)} params + AdamW exp_avg/exp_avg_sq/step")
    return state, desc


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def empty_like_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {k: torch.empty_like(v) for k, v in state.items()}
    for v in out.values():
        v.zero_()  # touch every page
    return out


# --------------------------------------------------------------------------- helpers
def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def files_under(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    return [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]


def drop_cache(path: str) -> None:
    """Drop ``path``'s (already fsynced) pages from the page cache."""
    for f in files_under(path):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.remove(path)
    os.sync()


def settle() -> None:
    gc.collect()
    os.sync()


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def rng(xs: list[float]) -> str:
    return f"{min(xs):.3f}–{max(xs):.3f}"


def check_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    if bad:
        raise AssertionError(f"{what}: {len(bad)} tensors differ after load, e.g. {bad[:3]}")


# --------------------------------------------------------------------------- save / load
def save_safeckpt(state: dict, p: str) -> None:
    safeckpt.save(p, state)


def save_torch(state: dict, p: str) -> None:
    with open(p, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def save_safetensors(state: dict, p: str) -> None:
    from safetensors.torch import save_file

    save_file(state, p)
    fsync_path(p)


def save_dcp(state: dict, p: str) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=p)  # FileSystemWriter(sync_files=True) fsyncs each file


def load_safeckpt(p: str, dst: dict) -> None:
    safeckpt.load(p, dst)


def load_safeckpt_noverify(p: str, dst: dict) -> None:
    safeckpt.load(p, dst, verify_checksums=False)


def load_torch(p: str, dst: dict) -> None:
    sd = torch.load(p, weights_only=True)
    with torch.no_grad():
        for k, t in dst.items():
            t.copy_(sd[k])


def load_safetensors(p: str, dst: dict) -> None:
    from safetensors.torch import load_file

    sd = load_file(p)
    with torch.no_grad():
        for k, t in dst.items():
            t.copy_(sd[k])


def load_dcp(p: str, dst: dict) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.load(dst, checkpoint_id=p)


_DIRECT_BUF: list[mmap.mmap] = []


def save_odirect(state: dict, p: str) -> None:
    """Disk reference: as many bytes written with O_DIRECT (no page cache) + fsync."""
    piece = 64 * MiB
    if not _DIRECT_BUF:
        buf = mmap.mmap(-1, piece)  # page-aligned, as O_DIRECT needs
        buf[:] = torch.randn(piece // 4).numpy().tobytes()
        _DIRECT_BUF.append(buf)
    view = memoryview(_DIRECT_BUF[0])
    left = -(-nbytes(state) // 4096) * 4096
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_DIRECT", 0), 0o644)
    try:
        while left:
            left -= os.write(fd, view[: min(piece, left)])
        os.fsync(fd)
    finally:
        os.close(fd)


SAVERS: dict[str, tuple[Callable, str]] = {
    "disk": (save_odirect, "*disk reference: O_DIRECT write of as many bytes + fsync*"),
    "safeckpt": (save_safeckpt, "safeckpt.save"),
    "torch": (save_torch, "torch.save + fsync"),
    "safetensors": (save_safetensors, "safetensors save_file + fsync"),
    "dcp": (save_dcp, "torch.distributed.checkpoint.save"),
}
LOADERS: list[tuple[str, Callable, str]] = [
    ("safeckpt", load_safeckpt, "safeckpt.load (in place, checksums verified)"),
    ("safeckpt", load_safeckpt_noverify, "safeckpt.load (in place, verify_checksums=False)"),
    ("torch", load_torch, "torch.load(weights_only=True) + copy_"),
    ("safetensors", load_safetensors, "safetensors load_file + copy_"),
    ("dcp", load_dcp, "torch.distributed.checkpoint.load (in place)"),
]


def bench_save_load(state: dict, root: str, reps: int, do_load: bool, log: Callable) -> dict[str, Any]:
    size = nbytes(state)
    save_times: dict[str, list[float]] = {k: [] for k in SAVERS}
    cold: dict[str, list[float]] = {lbl: [] for _, _, lbl in LOADERS}
    warm: dict[str, list[float]] = {lbl: [] for _, _, lbl in LOADERS}
    dst = empty_like_state(state) if do_load else {}
    # warm-up: the first large write of a process is often slow on this VM
    for key, (fn, _) in SAVERS.items():
        p = os.path.join(root, f"warmup-{key}")
        fn(state, p)
        remove(p)
    for rep in range(reps):
        for key, (fn, _) in SAVERS.items():  # interleaved, so drift hits every method alike
            p = os.path.join(root, f"{key}-{rep}")
            settle()
            t0 = time.perf_counter()
            fn(state, p)
            save_times[key].append(time.perf_counter() - t0)
            if do_load:
                for lkey, lfn, lbl in LOADERS:
                    if lkey != key:
                        continue
                    for t in dst.values():
                        t.zero_()
                    drop_cache(p)
                    settle()
                    t0 = time.perf_counter()
                    lfn(p, dst)
                    cold[lbl].append(time.perf_counter() - t0)
                    if rep == 0:
                        check_equal(state, dst, lbl)
                    settle()
                    t0 = time.perf_counter()
                    lfn(p, dst)
                    warm[lbl].append(time.perf_counter() - t0)
            remove(p)
        log(f"  save/load rep {rep + 1}/{reps}: "
            + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in save_times.items()))
    return {"size": size, "save": save_times, "cold": cold, "warm": warm}


# --------------------------------------------------------------------------- async
def bench_async(state: dict, root: str, reps: int, log: Callable) -> dict[str, list[float]]:
    bufs = empty_like_state(state)

    def plain_copy() -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            for k, b in bufs.items():
                b.copy_(state[k])
        return time.perf_counter() - t0

    res: dict[str, list[float]] = {"copy": [], "async": [], "background": [], "sync": []}
    amgr = safeckpt.CheckpointManager(os.path.join(root, "async"), keep_last=1, async_save=True,
                                      preemption_signals=())
    smgr = safeckpt.CheckpointManager(os.path.join(root, "sync"), keep_last=1, preemption_signals=())
    try:
        plain_copy()
        amgr.save(0, state)  # warm-up: allocates the staging buffers
        amgr.wait()
        smgr.save(0, state)
        for rep in range(1, reps + 1):
            if rep % 2:  # alternate the order, so neither side always goes first
                settle()
                res["copy"].append(plain_copy())
            settle()
            t0 = time.perf_counter()
            amgr.save(rep, state)
            t1 = time.perf_counter()
            amgr.wait()
            t2 = time.perf_counter()
            res["async"].append(t1 - t0)
            res["background"].append(t2 - t1)
            if not rep % 2:
                settle()
                res["copy"].append(plain_copy())
            settle()
            t0 = time.perf_counter()
            smgr.save(rep, state)
            res["sync"].append(time.perf_counter() - t0)
            log(f"  async rep {rep}/{reps}: copy {res['copy'][-1]:.3f}s, async save() "
                f"{res['async'][-1]:.3f}s, sync save {res['sync'][-1]:.3f}s")
    finally:
        amgr.close()
        smgr.close()
        remove(os.path.join(root, "async"))
        remove(os.path.join(root, "sync"))
    return res


# --------------------------------------------------------------------------- training
def make_mlp(width: int, depth: int) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    layers.append(nn.Linear(width, 1))
    return nn.Sequential(*layers)


def train_run(mode: str, root: str, width: int, depth: int, batch: int, steps: int, every: int) -> dict[str, float]:
    torch.manual_seed(0)
    model = make_mlp(width, depth)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(batch, width)
    y = torch.randn(batch, 1)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()

    step()  # warm-up: AdamW allocates its state
    mgr = None
    state = {"model": model, "optim": opt}
    if mode != "none":
        mgr = safeckpt.CheckpointManager(os.path.join(root, f"train-{mode}"), keep_last=2,
                                         async_save=(mode == "async"), preemption_signals=())
        mgr.save(0, state)  # warm-up save: steady state (async staging buffers allocated)
        mgr.wait()
    settle()
    per_step = []
    t_start = time.perf_counter()
    for i in range(1, steps + 1):
        t0 = time.perf_counter()
        step()
        if mgr is not None and i % every == 0:
            mgr.save(i, state)
        per_step.append(time.perf_counter() - t0)
    loop = time.perf_counter() - t_start
    t0 = time.perf_counter()
    if mgr is not None:
        mgr.close()
    drain = time.perf_counter() - t0
    remove(os.path.join(root, f"train-{mode}"))
    return {"mean": loop / steps, "max": max(per_step), "drain": drain}


def bench_train(root: str, reps: int, width: int, depth: int, batch: int, steps: int, every: int,
                log: Callable) -> dict[str, Any]:
    model = make_mlp(width, depth)
    params = sum(p.numel() for p in model.parameters())
    res: dict[str, list[dict[str, float]]] = {"none": [], "sync": [], "async": []}
    modes = list(res)
    for rep in range(reps):
        for mode in modes[rep % 3:] + modes[: rep % 3]:  # rotate the order every run
            res[mode].append(train_run(mode, root, width, depth, batch, steps, every))
        log(f"  train rep {rep + 1}/{reps}: "
            + ", ".join(f"{m} {v[-1]['mean'] * 1e3:.1f}ms/step" for m, v in res.items()))
    return {"params": params, "ckpt_bytes": params * 4 * 3, "runs": res}


# --------------------------------------------------------------------------- 2 ranks
def _dist_worker(rank: int, world: int, port: int, target_bytes: int, root: str, reps: int, out: str) -> None:
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        state, _ = make_state(target_bytes)  # same seed on every rank: replicated (DDP-like)
        times, per_rank_bytes = [], None
        for rep in range(reps + 1):  # rep 0 is a warm-up
            p = os.path.join(root, f"dist-{rep}")
            if rank == 0:
                settle()
            dist.barrier()
            t0 = time.perf_counter()
            safeckpt.save(p, state)
            dist.barrier()
            dt = time.perf_counter() - t0
            if rep:
                times.append(dt)
            if rank == 0:
                with open(os.path.join(p, "manifest.json")) as f:
                    man = json.load(f)
                per_rank_bytes = [0] * world
                for info in man["files"].values():
                    per_rank_bytes[int(info["rank"])] += int(info["size"])
                remove(p)
            dist.barrier()
        if rank == 0:
            with open(out, "w") as f:
                json.dump({"times": times, "per_rank_bytes": per_rank_bytes, "size": nbytes(state)}, f)
    finally:
        dist.destroy_process_group()


def bench_dist(target_bytes: int, root: str, reps: int, world: int = 2) -> dict[str, Any]:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join(root, "dist.json")
    mp.spawn(_dist_worker, args=(world, port, target_bytes, root, reps, out), nprocs=world, join=True)
    with open(out) as f:
        res = json.load(f)
    os.remove(out)
    res["world"] = world
    return res


# --------------------------------------------------------------------------- report
def machine(root: str) -> dict[str, str]:
    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    mem = "?"
    try:
        with open("/proc/meminfo") as f:
            mem = f"{int(f.readline().split()[1]) / (1 << 20):.1f} GiB"
    except OSError:
        pass
    disk = "?"
    try:
        best = ("", "", "")
        with open("/proc/mounts") as f:
            for ln in f:
                dev, mnt, fs = ln.split()[:3]
                if os.path.realpath(root).startswith(mnt.rstrip("/") + "/") and len(mnt) >= len(best[1]):
                    best = (dev, mnt, fs)
        dev = os.path.basename(best[0])
        rot = "?"
        rp = f"/sys/block/{dev}/queue/rotational"
        if os.path.exists(rp):
            with open(rp) as f:
                rot = "kernel says rotational" if f.read().strip() == "1" else "non-rotational"
        free = shutil.disk_usage(root).free / GB
        disk = f"{best[0]} ({best[2]} on {best[1]}, {rot}, {free:.0f} GB free)"
    except OSError:
        pass
    try:
        commit = subprocess.run(["git", "-C", HERE, "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", HERE, "status", "--porcelain", "--", "../src"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        commit += " (src modified)" if dirty else ""
    except (OSError, subprocess.SubprocessError):
        commit = "?"
    import safetensors

    return {
        "CPU": f"{os.cpu_count()} × {cpu} (torch threads: {torch.get_num_threads()})",
        "RAM": mem,
        "disk": disk,
        "versions": (f"Python {platform.python_version()}, torch {torch.__version__}, "
                     f"safetensors {safetensors.__version__}, safeckpt {safeckpt.__version__} @ {commit}"),
        "kernel": platform.release(),
    }


def report(args: argparse.Namespace, info: dict[str, str], desc: str, n_tensors: int,
           res: dict[str, Any], load_before: tuple, load_after: tuple, wall: float) -> str:
    L: list[str] = []
    now = _dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    L.append(f"### safeckpt benchmark ({now}, `bench/bench_save.py{' --quick' if args.quick else ''}`)")
    L.append("")
    for k, v in info.items():
        L.append(f"- **{k}**: {v}")
    L.append(f"- **load average** (1/5/15 min) at start {'/'.join(f'{x:.1f}' for x in load_before)}, "
             f"at end {'/'.join(f'{x:.1f}' for x in load_after)}; total bench time {wall:.0f} s")
    size = res.get("size")
    if size:
        L.append(f"- **state**: {size / MiB:.0f} MiB float32 in {n_tensors} tensors ({desc})")
    L.append(f"- every figure is a **median** (save/load and 2 ranks: {args.reps} runs; async: "
             f"{args.async_reps}; training: {args.train_reps} per mode); min–max shows the spread; "
             "GB/s = 10⁹ bytes of tensor data per second")
    L.append("")
    if "save" in res:
        sv = res["save"]
        base = med(sv["safeckpt"])
        L.append(f"**Save**, 1 process, fsync'd, to `{args.dir or '/tmp'}` (output removed and `os.sync()` between runs):")
        L.append("")
        L.append("| method | median s | min–max s | GB/s | time vs safeckpt |")
        L.append("|---|---:|---:|---:|---:|")
        for key, (_, label) in SAVERS.items():
            m = med(sv[key])
            L.append(f"| {label} | {m:.3f} | {rng(sv[key])} | {size / m / GB:.2f} | {m / base:.2f}× |")
        L.append("")
    if res.get("cold") and any(res["cold"].values()):
        cold, warm = res["cold"], res["warm"]
        base_c = med(cold[LOADERS[0][2]])
        L.append("**Load** into existing tensors. *cold*: files dropped from the guest page cache "
                 "with `posix_fadvise(DONTNEED)` first (this VM's virtual disk may still be cached by "
                 "the host, so cold reads are faster than a real cold disk); *warm*: the same load "
                 "repeated with the file in the page cache:")
        L.append("")
        L.append("| method | cold median s | cold GB/s | cold vs safeckpt | warm median s | warm GB/s |")
        L.append("|---|---:|---:|---:|---:|---:|")
        for _, _, label in LOADERS:
            c, w = med(cold[label]), med(warm[label])
            L.append(f"| {label} | {c:.3f} | {size / c / GB:.2f} | {c / base_c:.2f}× | {w:.3f} | {size / w / GB:.2f} |")
        L.append("")
    if "async" in res:
        L.append(f"**Async save blocking time** ({args.async_reps} runs), steady state (staging buffers "
                 "reused after a warm-up save): `CheckpointManager(async_save=True).save()` until it "
                 "returns, vs a plain `copy_` of the same tensors into reused, already-touched buffers:")
        L.append("")
        L.append("| state | what | median s | min–max s | vs plain copy |")
        L.append("|---|---|---:|---:|---:|")
        for sname, a in res["async"].items():
            cp = med(a["copy"])
            rows = [
                ("plain `copy_` into reused buffers", a["copy"]),
                ("**async `save()` blocking time**", a["async"]),
                ("async: background write + commit (until `wait()`)", a["background"]),
                ("sync `CheckpointManager.save()`", a["sync"]),
            ]
            for label, xs in rows:
                L.append(f"| {sname} | {label} | {med(xs):.3f} | {rng(xs)} | {med(xs) / cp:.2f}× |")
            paired = med([x / c for x, c in zip(a["async"], a["copy"])])
            L.append(f"| {sname} | *median of per-run ratios async `save()` / copy (measured back to back)* "
                     f"| | | {paired:.2f}× |")
        L.append("")
    if "train" in res:
        t = res["train"]
        runs = t["runs"]
        base = med([r["mean"] for r in runs["none"]])
        L.append(f"**Training-step slowdown**: MLP {args.width}×{args.depth} ({t['params'] / 1e6:.1f} M params, "
                 f"{t['ckpt_bytes'] / MiB:.0f} MiB checkpoint with AdamW state), batch {args.batch}, "
                 f"{args.train_steps} steps, a save every {args.save_every} steps (after one untimed "
                 "warm-up save), `state={'model': model, 'optim': opt}`; "
                 f"{args.train_reps} runs per mode, modes interleaved; a run's slowdown is paired "
                 "with the no-checkpoint run next to it:")
        L.append("")
        L.append("| checkpointing | mean step ms | slowdown (medians) | slowdown (median of paired runs) "
                 "| max step ms | `close()` wait s |")
        L.append("|---|---:|---:|---:|---:|---:|")
        names = {"none": "none", "sync": f"sync save every {args.save_every}",
                 "async": f"async save every {args.save_every}"}
        for mode, label in names.items():
            m = med([r["mean"] for r in runs[mode]])
            paired = med([r["mean"] / n["mean"] - 1 for r, n in zip(runs[mode], runs["none"])])
            mx = med([r["max"] for r in runs[mode]])
            dr = med([r["drain"] for r in runs[mode]])
            L.append(f"| {label} | {m * 1e3:.1f} | {(m / base - 1) * 100:+.1f}% | {paired * 100:+.1f}% "
                     f"| {mx * 1e3:.0f} | {dr:.3f} |")
        L.append("")
    if "dist" in res:
        d = res["dist"]
        m = med(d["times"])
        per = ", ".join(f"rank {r}: {b / MiB:.0f} MiB" for r, b in enumerate(d["per_rank_bytes"]))
        one = f"; 1 process: {size / med(res['save']['safeckpt']) / GB:.2f} GB/s" if "save" in res else ""
        L.append(f"**{d['world']} ranks** (gloo, same machine and disk), replicated state of "
                 f"{d['size'] / MiB:.0f} MiB on every rank, `safeckpt.save`: median {m:.3f} s "
                 f"({rng(d['times'])}), {d['size'] / m / GB:.2f} GB/s of checkpoint{one}. "
                 f"Bytes written per rank: {per}.")
        L.append("")
    return "\n".join(L)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="~128 MiB state, smaller MLP, 5 reps")
    ap.add_argument("--size-mib", type=int, default=None, help="state size (default 1024, --quick 128)")
    ap.add_argument("--reps", type=int, default=5, help="runs per save/load method and 2-rank save")
    ap.add_argument("--async-reps", type=int, default=9, help="runs of the async blocking-time test")
    ap.add_argument("--train-reps", type=int, default=7, help="runs per training mode")
    ap.add_argument("--dir", default=None, help="directory to write into (default: a new dir under /tmp)")
    ap.add_argument("--sections", default="save,load,async,train,dist")
    ap.add_argument("--width", type=int, default=None, help="MLP width (default 2048, --quick 1024)")
    ap.add_argument("--depth", type=int, default=None, help="MLP hidden layers (default 5, --quick 3)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--train-steps", type=int, default=None, help="default 20")
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--many-tensors", type=int, default=4000,
                    help="also time async saves of this many 16 KiB tensors (per-tensor overhead; 0: skip)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "latest.md"))
    args = ap.parse_args()
    if min(args.reps, args.async_reps, args.train_reps) < 1:
        ap.error("--reps, --async-reps and --train-reps must be >= 1")
    size_mib = args.size_mib or (128 if args.quick else 1024)
    args.width = args.width or (1024 if args.quick else 2048)
    args.depth = args.depth or (3 if args.quick else 5)
    args.train_steps = args.train_steps or 20
    sections = {s.strip() for s in args.sections.split(",") if s.strip()}
    unknown = sections - {"save", "load", "async", "train", "dist"}
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)}")

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    parent = args.dir or "/tmp"
    os.makedirs(parent, exist_ok=True)
    root = tempfile.mkdtemp(prefix="safeckpt-bench-", dir=parent)
    load_before = os.getloadavg()
    t_all = time.perf_counter()
    res: dict[str, Any] = {}
    try:
        state, desc = make_state(size_mib * MiB)
        res["size"] = nbytes(state)
        log(f"state: {res['size'] / MiB:.0f} MiB in {len(state)} tensors; writing under {root}")
        if sections & {"save", "load"}:
            log("save/load ...")
            sl = bench_save_load(state, root, args.reps, "load" in sections, log)
            res["save"], res["cold"], res["warm"] = sl["save"], sl["cold"], sl["warm"]
        if "async" in sections:
            log("async ...")
            res["async"] = {f"{res['size'] / MiB:.0f} MiB, {len(state)} tensors":
                            bench_async(state, root, args.async_reps, log)}
            if args.many_tensors:
                many = {f"t{i}": torch.randn(64, 64) for i in range(args.many_tensors)}
                res["async"][f"{nbytes(many) / MiB:.0f} MiB, {len(many)} tensors of 16 KiB"] = (
                    bench_async(many, root, args.async_reps, log))
                del many
        if "train" in sections:
            log("train ...")
            res["train"] = bench_train(root, args.train_reps, args.width, args.depth, args.batch,
                                       args.train_steps, args.save_every, log)
        if "dist" in sections:
            log("2 ranks ...")
            del state
            gc.collect()
            res["dist"] = bench_dist(size_mib * MiB, root, args.reps)
            state, _ = make_state(size_mib * MiB)
        n_tensors = len(state)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    wall = time.perf_counter() - t_all
    text = report(args, machine(parent), desc, n_tensors, res, load_before, os.getloadavg(), wall)
    print(text)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text + "\n")
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
