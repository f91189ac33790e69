"""Benchmark loads, many-tensor saves and tiny saves (issue 12, targets 1 and 2).

Run ``.venv/bin/python bench/bench_load.py`` (``--quick``: everything small; under 4 minutes
on the 2-core development VM even while heavily loaded, most of it process start-up; ``--help``
lists the knobs). Not part of ``make test``. Every figure is the median of
``--reps`` runs, methods interleaved (their order rotates every run), each compared with
baselines measured in the same run on the same files. Distributed runs use gloo on 127.0.0.1
(one spawn per world size); each rank times only its own call between two barriers and a run's
time is the slowest rank's. Every method's result is checked once against the saved values
before its runs are timed. Output: Markdown on stdout and in ``--out``
(default ``bench/results/load-latest.md``, git-ignored).

Sections (``--sections``, comma-separated; default all):

- ``cold`` (A) cold loads: files dropped from the page cache with ``posix_fadvise(DONTNEED)``
  (after fsync) before every call; ``safeckpt.load`` into freshly allocated and into reused
  targets vs a raw sequential read of the same bytes (16 MiB ``os.preadv`` into an existing
  buffer) and ``torch.distributed.checkpoint.load`` (same targets) of the same state saved by DCP;
  world sizes ``--worlds``, replicated (every rank loads everything) and FSDP2-sharded
  (``fully_shard`` on a CPU mesh; each rank loads its shards) states of ``--size-mib``.
- ``warm`` (B) the same loads at world size 1 with the files in the page cache: GB/s with
  checksums verified (and, for reference, without).
- ``many`` (C) one process: a 1,000-tensor transformer-like state and 4,000 tensors of 16 KiB:
  ``safeckpt.save`` vs one ``os.writev`` + fsync of the same bytes; async
  ``CheckpointManager.save()`` blocking time vs a ``copy_`` into reused buffers.
- ``tiny`` (D) ``safeckpt.save`` of ``{"x": 1 KiB tensor, "step": int}`` at world size 1 (no
  process group), 2 and 4: per-save fixed cost (agreement + write + commit).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import shutil
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # bench_save and tests.helpers.dist_harness, also in spawned ranks

import torch  # noqa: E402
from bench_save import GB, MiB, bench_async, machine, med, rng  # noqa: E402
from load_many import bench_many_sync, verify_async  # noqa: E402
from load_states import many_tensor_shapes, nbytes_of, random_state, shapes_for_bytes  # noqa: E402
from load_workers import run_jobs, tiny_job  # noqa: E402

from tests.helpers.dist_harness import run as dist_run  # noqa: E402

SECTIONS = {"cold": "A", "warm": "B", "many": "C", "tiny": "D"}
COLD_METHODS = ["raw", "safeckpt-fresh", "safeckpt-reused", "dcp-fresh", "dcp-reused"]
WARM_METHODS = ["raw", "safeckpt-fresh", "safeckpt-reused", "safeckpt-reused-nocheck"]
TINY_WORLDS = (1, 2, 4)
COLLECTIVE_TIMEOUT = 900  # s: a barrier, or one load or save call, that takes longer is a hang
TARGETS = {"vs_raw": 0.85, "dcp_x": 2.0, "warm_gbs": 8.0, "sync_raw": 0.75, "async_copy": 2.0,
           "tiny_ms": {1: 10.0, 2: 25.0, 4: 50.0}}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for ln in f:
            if ln.startswith("MemAvailable:"):
                return int(ln.split()[1]) * 1024
    return 1 << 62


# --------------------------------------------------------------------------- distributed part
def plan_jobs(args: argparse.Namespace, root: str) -> tuple[dict[int, list[dict]], list[str]]:
    """Jobs per world size; configurations that would not fit in memory are skipped (noted)."""
    per_world: dict[int, list[dict]] = {}
    skipped: list[str] = []
    avail = mem_available()
    if "cold" in args.sections:
        for size_mib in args.size_mib:
            size = nbytes_of(shapes_for_bytes(size_mib * MiB)[0])
            for world in args.worlds:
                for kind in args.kinds:
                    per_rank = size if kind == "replicated" else size // world
                    # one copy of the state per rank at a time, plus as much for the loaders' and
                    # savers' own buffers
                    need = world * per_rank * 2
                    if need > 0.8 * avail:
                        skipped.append(f"{size_mib} MiB {kind} at world size {world}: needs ~{need / GB:.1f} GB "
                                       f"of memory, {avail / GB:.1f} GB available")
                        continue
                    per_world.setdefault(world, []).append(dict(
                        job="load", kind=kind, size=size_mib * MiB, cache="cold", reps=args.reps,
                        methods=COLD_METHODS, dir=os.path.join(root, f"cold-{size_mib}-{world}-{kind}")))
    if "warm" in args.sections:
        per_world.setdefault(1, []).append(dict(
            job="load", kind="replicated", size=args.warm_mib * MiB, cache="warm", reps=args.reps,
            methods=WARM_METHODS, dir=os.path.join(root, "warm")))
    if "tiny" in args.sections:
        for world in TINY_WORLDS[1:]:
            per_world.setdefault(world, []).append(dict(job="tiny", reps=args.tiny_reps,
                                                        dir=os.path.join(root, f"tiny-{world}")))
    return dict(sorted(per_world.items())), skipped


def run_world(world: int, jobs: list[dict], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Run the jobs on ``world`` ranks; per job, each run's time is the slowest rank's."""
    threads = max(1, (os.cpu_count() or 1) // world)
    env = {"SAFECKPT_TIMEOUT": str(COLLECTIVE_TIMEOUT), "OMP_NUM_THREADS": str(threads)}
    outs = dist_run(run_jobs, world, jobs, threads, timeout=args.timeout, env=env, pg_timeout=COLLECTIVE_TIMEOUT)
    bad = [o for o in outs if not o.ok]
    if bad:
        raise RuntimeError("; ".join(f"rank {o.rank}: {o.error_type or f'exit code {o.exitcode}'}: "
                                     f"{o.message.strip()}" for o in bad))
    results = []
    for i, job in enumerate(jobs):
        per_rank = [o.value[i] for o in outs]
        res = dict(per_rank[0], world=world)
        if job["job"] == "load":
            res["times"] = {m: [max(r["times"][m][k] for r in per_rank) for k in range(job["reps"])]
                            for m in job["methods"]}
            res["faults"] = {m: max(r["faults"][m] for r in per_rank) for m in job["methods"]}
            res["local_bytes"] = max(r["local_bytes"] for r in per_rank)
        else:
            res["times"] = [max(r["times"][k] for r in per_rank) for k in range(job["reps"])]
        results.append(res)
    return results


# --------------------------------------------------------------------------- report
def _t(xs: list[float]) -> str:
    return f"{med(xs):.3f} ({rng(xs)})"


def _ok(good: bool) -> str:
    return "✓" if good else "✗"


def report_cold(rows: list[dict]) -> list[str]:
    L = ["**A. Cold load** (files dropped from this VM's page cache with `posix_fadvise(DONTNEED)` after "
         "fsync before every call; the host may still cache the virtual disk). Seconds: median (min–max) "
         "of the slowest rank. *raw*: 16 MiB `os.preadv` of the same bytes (the chunks this rank needs) "
         "into an existing buffer; *fresh*: targets allocated just before the call (pages not yet "
         "touched); *reused*: existing targets (for FSDP2, the model's own sharded parameters). "
         f"Targets: safeckpt ≥ {TARGETS['vs_raw']}× raw speed, DCP time ≥ {TARGETS['dcp_x']:.0f}× safeckpt's.",
         "",
         "| state | world | targets | MiB read per rank | raw s | safeckpt s | DCP s | safeckpt GB/s per rank "
         "| safeckpt speed vs raw | DCP time / safeckpt | page faults per 4 KiB (safeckpt, DCP) |",
         "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        t, nb = r["times"], r["local_bytes"]
        raw = med(t["raw"])
        for tgt in ("fresh", "reused"):
            sc, dc = med(t[f"safeckpt-{tgt}"]), med(t[f"dcp-{tgt}"])
            vs_raw, dcp_x = raw / sc, dc / sc
            flt = f"{r['faults'][f'safeckpt-{tgt}']:.2f}, {r['faults'][f'dcp-{tgt}']:.2f}"
            L.append(f"| {r['global_bytes'] / MiB:.0f} MiB {r['cfg']['kind']}, {r['n_tensors']} tensors "
                     f"| {r['world']} | {tgt} | {nb / MiB:.0f} | {_t(t['raw'])} | {_t(t[f'safeckpt-{tgt}'])} "
                     f"| {_t(t[f'dcp-{tgt}'])} | {nb / sc / GB:.2f} "
                     f"| {vs_raw:.2f}× {_ok(vs_raw >= TARGETS['vs_raw'])} | {dcp_x:.2f}× {_ok(dcp_x >= TARGETS['dcp_x'])} "
                     f"| {flt} |")
    L.append("")
    return L


def report_warm(r: dict) -> list[str]:
    nb, t = r["local_bytes"], r["times"]
    L = [f"**B. Warm load**, world size 1, {r['global_bytes'] / MiB:.0f} MiB in {r['n_tensors']} tensors, "
         f"files in the page cache (read through before every call). Target: ≥ {TARGETS['warm_gbs']:.0f} GB/s "
         "with checksums verified.",
         "",
         "| method | median s (min–max) | GB/s | |",
         "|---|---:|---:|---|"]
    labels = {"raw": "*raw 16 MiB `os.preadv` into an existing buffer (reference)*",
              "safeckpt-fresh": "safeckpt.load, fresh targets, checksums verified",
              "safeckpt-reused": "safeckpt.load, reused targets, checksums verified",
              "safeckpt-reused-nocheck": "*safeckpt.load, reused targets, `verify_checksums=False`*"}
    for m, label in labels.items():
        gbs = nb / med(t[m]) / GB
        mark = _ok(gbs >= TARGETS["warm_gbs"]) if m in ("safeckpt-fresh", "safeckpt-reused") else ""
        L.append(f"| {label} | {_t(t[m])} | {gbs:.2f} | {mark} |")
    L.append("")
    return L


def report_many(many: dict[str, dict]) -> list[str]:
    L = ["**C. Many tensors**, one process. *sync*: `safeckpt.save` vs a raw write of the same bytes "
         "(one file, `os.writev` of the tensors' memory + fsync; output removed and `os.sync()` between "
         f"runs); target: safeckpt ≥ {TARGETS['sync_raw']}× raw speed. *async*: `CheckpointManager(async_save=True)"
         ".save()` blocking time in steady state vs a plain `copy_` of the same tensors into reused buffers; "
         f"target ≤ {TARGETS['async_copy']:.0f}× the copy.",
         "",
         "| state | what | median s (min–max) | ratio | |",
         "|---|---|---:|---:|---|"]
    for name, r in many.items():
        if "sync" in r:
            s = r["sync"]
            ratio = med(s["raw"]) / med(s["safeckpt"])
            L.append(f"| {name} | raw `os.writev` + fsync | {_t(s['raw'])} | | |")
            L.append(f"| {name} | sync `safeckpt.save` | {_t(s['safeckpt'])} | speed {ratio:.2f}× raw "
                     f"| {_ok(ratio >= TARGETS['sync_raw'])} |")
        if "async" in r:
            a = r["async"]
            ratio = med(a["async"]) / med(a["copy"])
            paired = med([x / c for x, c in zip(a["async"], a["copy"])])
            L.append(f"| {name} | plain `copy_` into reused buffers | {_t(a['copy'])} | | |")
            L.append(f"| {name} | async `save()` blocking time | {_t(a['async'])} | {ratio:.2f}× copy "
                     f"(paired runs {paired:.2f}×) | {_ok(ratio <= TARGETS['async_copy'])} |")
            L.append(f"| {name} | *async background write + commit* | {_t(a['background'])} | | |")
    L.append("")
    return L


def report_tiny(tiny: dict[int, list[float]]) -> list[str]:
    L = ["**D. Tiny state** `{\"x\": 1 KiB tensor, \"step\": int}`: `safeckpt.save` wall time (slowest "
         "rank; world size 1 without a process group). At world size 4 this is the agreement + commit "
         "overhead.",
         "",
         "| world | median ms | min–max ms | target | |",
         "|---:|---:|---:|---:|---|"]
    for world, xs in sorted(tiny.items()):
        m, lim = med(xs) * 1e3, TARGETS["tiny_ms"][world]
        L.append(f"| {world} | {m:.1f} | {min(xs) * 1e3:.1f}–{max(xs) * 1e3:.1f} | {'≤' if world < 4 else '<'} "
                 f"{lim:.0f} ms | {_ok(m <= lim)} |")
    L.append("")
    return L


def report(args: argparse.Namespace, res: dict[str, Any], load_before: tuple, wall: float) -> str:
    now = _dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    cmd = " ".join(["bench/bench_load.py", *sys.argv[1:]])
    L = [f"### safeckpt load / small-save benchmark ({now}, `{cmd}`)", ""]
    L += [f"- **{k}**: {v}" for k, v in machine(args.dir or "/tmp").items()]
    load_after = os.getloadavg()
    L.append(f"- **load average** (1/5/15 min) at start {'/'.join(f'{x:.1f}' for x in load_before)}, at end "
             f"{'/'.join(f'{x:.1f}' for x in load_after)}; total bench time {wall:.0f} s")
    L.append(f"- every figure is a **median** of {args.reps} runs (tiny saves: {args.tiny_reps}; async: "
             f"{args.async_reps}) after an untimed, checked warm-up run; ✓/✗: meets the issue-12 target; "
             "GB/s = 10⁹ bytes of tensor data per second; ranks get "
             f"{os.cpu_count()}/world torch threads")
    L.append("")
    if res.get("cold"):
        L += report_cold(res["cold"])
    for note in res.get("skipped", []):
        L.append(f"- skipped: {note}")
    if res.get("skipped"):
        L.append("")
    if res.get("warm"):
        L += report_warm(res["warm"])
    if res.get("many"):
        L += report_many(res["many"])
    if res.get("tiny"):
        L += report_tiny(res["tiny"])
    for err in res.get("errors", []):
        L.append(f"- **error**: {err}")
    return "\n".join(L)


# --------------------------------------------------------------------------- main
def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="everything small (16 MiB states, 2 runs)")
    ap.add_argument("--sections", default="cold,warm,many,tiny", help="any of cold,warm,many,tiny (or A,B,C,D)")
    ap.add_argument("--size-mib", default=None, help="cold-load state sizes, comma-separated (default 512)")
    ap.add_argument("--warm-mib", type=int, default=None, help="warm-load state size (default 1024)")
    ap.add_argument("--worlds", default="1,2,4", help="world sizes for cold loads")
    ap.add_argument("--kinds", default="replicated,sharded", help="cold-load states: replicated, sharded")
    ap.add_argument("--reps", type=int, default=None, help="timed runs per load method (default 5)")
    ap.add_argument("--tiny-reps", type=int, default=None, help="timed tiny saves per world size (default 20)")
    ap.add_argument("--async-reps", type=int, default=None, help="runs of each many-tensor test (default 7)")
    ap.add_argument("--many-d", type=int, default=None,
                    help="d_model of the 1,000-tensor state (default 256: ~270 MiB; --quick 64)")
    ap.add_argument("--dir", default=None, help="directory to write into (default: a new dir under /tmp)")
    ap.add_argument("--timeout", type=int, default=4 * 3600,
                    help="seconds allowed for all the jobs of one world size (a hang in a collective "
                    f"fails after {COLLECTIVE_TIMEOUT} s anyway)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "load-latest.md"))
    args = ap.parse_args()
    q = args.quick
    args.size_mib = [int(s) for s in (args.size_mib or ("16" if q else "512")).split(",") if s.strip()]
    args.warm_mib = args.warm_mib or (16 if q else 1024)
    args.reps = args.reps or (2 if q else 5)
    args.tiny_reps = args.tiny_reps or (5 if q else 20)
    args.async_reps = args.async_reps or (2 if q else 7)
    args.many_d = args.many_d or (64 if q else 256)
    args.worlds = [int(w) for w in args.worlds.split(",") if w.strip()]
    args.kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    alias = {v: k for k, v in SECTIONS.items()}
    args.sections = {alias.get(s.strip().upper(), s.strip()) for s in args.sections.split(",") if s.strip()}
    if args.sections - set(SECTIONS):
        ap.error(f"unknown sections {sorted(args.sections - set(SECTIONS))}; choose from {list(SECTIONS)}")
    if set(args.kinds) - {"replicated", "sharded"}:
        ap.error("--kinds: replicated and/or sharded")
    if min(args.reps, args.tiny_reps, args.async_reps, *args.worlds, *args.size_mib) < 1:
        ap.error("sizes, world sizes and run counts must be >= 1")
    return args


def run_many(args: argparse.Namespace, root: str) -> dict[str, dict]:
    states = {f"1,000 tensors, transformer-like (d_model={args.many_d})": many_tensor_shapes(args.many_d),
              "4,000 tensors of 16 KiB": {f"t{i}": (64, 64) for i in range(4000)}}
    out: dict[str, dict] = {}
    for name, shapes in states.items():
        state = random_state(shapes, seed=1)
        label = f"{name}, {nbytes_of(shapes) / MiB:.0f} MiB"
        log(f"many: {label}: sync save vs raw write ...")
        out[label] = {"sync": bench_many_sync(state, root, args.async_reps, log)}
        log(f"many: {label}: async save vs copy ...")
        out[label]["async"] = bench_async(state, root, args.async_reps, log)
        verify_async(state, root)  # last: it overwrites the state
        del state
    return out


def main() -> None:
    args = parse_args()
    parent = args.dir or "/tmp"
    os.makedirs(parent, exist_ok=True)
    root = tempfile.mkdtemp(prefix="safeckpt-bench-load-", dir=parent)
    load_before = os.getloadavg()
    t_all = time.perf_counter()
    res: dict[str, Any] = {"errors": []}
    try:
        per_world, res["skipped"] = plan_jobs(args, root)
        for world, jobs in per_world.items():
            log(f"world size {world}: {', '.join(j['job'] + '/' + j.get('cache', '') for j in jobs)} ...")
            t0 = time.perf_counter()
            try:
                for job, r in zip(jobs, run_world(world, jobs, args)):
                    if job["job"] == "tiny":
                        res.setdefault("tiny", {})[world] = r["times"]
                    elif job["cache"] == "warm":
                        res["warm"] = r
                    else:
                        res.setdefault("cold", []).append(r)
            except (RuntimeError, AssertionError) as exc:
                res["errors"].append(f"world size {world}: {exc}")
                log(f"world size {world} FAILED: {exc}")
            log(f"world size {world}: {time.perf_counter() - t0:.0f} s")
        if "tiny" in args.sections:
            log("tiny save, world size 1 (no process group) ...")
            res.setdefault("tiny", {})[1] = tiny_job(0, 1, dict(reps=args.tiny_reps,
                                                                 dir=os.path.join(root, "tiny-1")))["times"]
        if "many" in args.sections:
            res["many"] = run_many(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if res.get("cold"):
        res["cold"].sort(key=lambda r: (r["cfg"]["size"], r["cfg"]["kind"], r["world"]))
    text = report(args, res, load_before, time.perf_counter() - t_all)
    print(text)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text + "\n")
    log(f"wrote {args.out}")
    if res["errors"]:
        sys.exit(1)


if __name__ == "__main__":
    torch.set_num_threads(os.cpu_count() or 1)
    main()
