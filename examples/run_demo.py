"""The safeckpt demo (``make demo``): preempt a 2-rank DDP job, resume it, prove it bit-exact.

1. Train ``examples/train_ddp.py`` for N steps straight through (reference root).
2. Train again in a fresh root and send a real SIGTERM to ONE worker process (rank 1) part-way
   through. ``mgr.preempted`` becomes true on every rank at the same step; they save that step
   and exit cleanly.
3. Run the same command again: it resumes from the newest valid checkpoint and trains to N.
4. Compare the final checkpoints of both roots: model, AdamW state, LR scheduler, and the RNG
   state of every rank must be bit-for-bit identical.
5. Verify every checkpoint (deep checksums), ``safeckpt diff`` the two final checkpoints and
   show ``safeckpt ls`` of the resumed root.

Exit status 0 only if everything matched. Runs on CPU (gloo) in about 30 s on two idle cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import torch
from safetensors import safe_open

import safeckpt

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN = os.path.join(HERE, "train_ddp.py")
NPROC = 2
ACTIVE: list[Run] = []  # torchrun jobs started by this demo (killed if the demo is interrupted)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="safeckpt demo: preempt, resume, compare bit-exact")
    p.add_argument("--workdir", default="demo_run", help="deleted and recreated (default ./demo_run)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--signal-after", type=int, default=25,
                   help="send SIGTERM to rank 1 once it has finished this step")
    p.add_argument("--step-time", type=float, default=0.02, help="simulated compute per step (s)")
    p.add_argument("--async-save", action="store_true", help="use background saves")
    p.add_argument("--run-timeout", type=float, default=120.0, help="kill a torchrun after this (s)")
    return p.parse_args()


# --------------------------------------------------------------------------- running torchrun
def banner(text: str) -> None:
    print(f"\n=== {text} ===", flush=True)


class Run:
    """One ``torchrun`` of train_ddp.py, its output streamed (indented) and kept."""

    def __init__(self, args: argparse.Namespace, root: str, summary_dir: str, extra: list[str]) -> None:
        os.makedirs(summary_dir, exist_ok=True)
        self.summary_dir = summary_dir
        self.timeout = args.run_timeout
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(NPROC), TRAIN,
            "--root", root, "--steps", str(args.steps), "--save-every", str(args.save_every),
            "--step-time", str(args.step_time), "--summary-dir", summary_dir,
            *(["--async-save"] if args.async_save else []), *extra,
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        print("$ torchrun --standalone --nproc-per-node 2 examples/train_ddp.py "
              + " ".join(cmd[cmd.index(TRAIN) + 1:]), flush=True)
        self.lines: list[str] = []
        ACTIVE.append(self)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env, start_new_session=True)
        self._reader = threading.Thread(target=self._pump, daemon=True)
        self._reader.start()
        self.started = time.monotonic()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            print("    " + line.rstrip("\n"), flush=True)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the torchrun we started, and its workers
            self.proc.wait()

    def wait(self) -> int:
        try:
            rc = self.proc.wait(timeout=max(1.0, self.timeout - (time.monotonic() - self.started)))
        except subprocess.TimeoutExpired:
            self.kill()
            rc = -1
            print(f"    !! torchrun did not finish within {self.timeout:.0f}s; killed", flush=True)
        self._reader.join(timeout=5)
        return rc

    def summaries(self) -> list[dict[str, Any]]:
        out = []
        for r in range(NPROC):
            path = os.path.join(self.summary_dir, f"rank-{r}.json")
            with open(path) as f:
                out.append(json.load(f))
        return out


# --------------------------------------------------------------------------- comparing checkpoints
def _bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and _bits(a) == _bits(b)


def compare_checkpoints(a: str, b: str) -> tuple[list[str], dict[str, Any]]:
    """Bit-exact comparison of two checkpoints. Returns (differences, statistics)."""
    diffs: list[str] = []
    stats: dict[str, Any] = {"tensors": 0, "bytes": 0, "values": 0, "by_entry": {}}
    with open(os.path.join(a, "manifest.json")) as f:
        man_a = json.load(f)
    with open(os.path.join(b, "manifest.json")) as f:
        man_b = json.load(f)

    # 1. The full (rank 0) view, as any tool would read it: safeckpt.read_state_dict.
    sd_a, sd_b = safeckpt.read_state_dict(a), safeckpt.read_state_dict(b)
    for key in sorted(set(sd_a) ^ set(sd_b)):
        diffs.append(f"{key}: only in {'the straight run' if key in sd_a else 'the resumed run'}")
    for key in sorted(set(sd_a) & set(sd_b)):
        va, vb = sd_a[key], sd_b[key]
        entry = key.split("/", 1)[0]
        stats["by_entry"].setdefault(entry, [0, 0])
        if isinstance(va, torch.Tensor) or isinstance(vb, torch.Tensor):
            stats["tensors"] += 1
            stats["by_entry"][entry][0] += 1
            if not (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and _same_tensor(va, vb)):
                detail = ""
                if isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.shape == vb.shape \
                        and va.is_floating_point():
                    detail = f" (max abs diff {(va.double() - vb.double()).abs().max().item():.3g})"
                diffs.append(f"{key}: tensors differ{detail}")
            else:
                stats["bytes"] += va.numel() * va.element_size()
        else:
            stats["values"] += 1
            stats["by_entry"][entry][1] += 1
            if va != vb:
                diffs.append(f"{key}: {va!r} != {vb!r}")

    # 2. Every rank's own state: per-rank tensors (RNG of rank 1, ...) in every rank's file, and
    #    the JSON trees of every rank (Python RNG state of rank 1, ...).
    files_a, files_b = sorted(man_a["files"]), sorted(man_b["files"])
    if files_a != files_b:
        diffs.append(f"different files: {files_a} vs {files_b}")
    for name in sorted(set(files_a) & set(files_b)):
        with safe_open(os.path.join(a, name), "pt") as fa, safe_open(os.path.join(b, name), "pt") as fb:
            keys_a, keys_b = set(fa.keys()), set(fb.keys())
            for k in sorted(keys_a ^ keys_b):
                diffs.append(f"{name}: tensor {k!r} only in one run")
            for k in sorted(keys_a & keys_b):
                if not _same_tensor(fa.get_tensor(k), fb.get_tensor(k)):
                    diffs.append(f"{name}: {k} differs")
    for field in ("world_size", "step", "metrics", "objects"):
        if man_a.get(field) != man_b.get(field):
            diffs.append(f"manifest field {field!r} differs")
    stats["ranks"] = int(man_a.get("world_size", 1))
    return diffs, stats


# --------------------------------------------------------------------------- the demo
def cli(*argv: str) -> bool:
    """Run ``safeckpt ARGV...`` (the CLI module of the installed package) and show its output."""
    shown = " ".join(os.path.relpath(x) if os.path.isabs(x) else x for x in argv)
    print(f"$ safeckpt {shown}", flush=True)
    proc = subprocess.run([sys.executable, "-m", "safeckpt.cli", *argv],
                          capture_output=True, text=True, timeout=120)
    print((proc.stdout + proc.stderr).rstrip(), flush=True)
    return proc.returncode == 0


def main() -> int:
    args = parse_args()
    t_start = time.monotonic()
    work = os.path.abspath(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    ref_root = os.path.join(work, "straight")
    root = os.path.join(work, "preempted")
    failures: list[str] = []

    def check(ok: bool, what: str) -> bool:
        print(f"  [{'ok' if ok else 'FAIL'}] {what}", flush=True)
        if not ok:
            failures.append(what)
        return ok

    mode = "background (async) saves" if args.async_save else "blocking saves"
    print(f"safeckpt {safeckpt.__version__} demo: DDP on CPU, {NPROC} ranks (gloo), {args.steps} "
          f"steps, a checkpoint every {args.save_every} steps, {mode}; work dir {work}")

    # ---- 1. straight run
    banner(f"1/4  reference: {args.steps} steps straight through -> {ref_root}")
    run = Run(args, ref_root, os.path.join(work, "summary-straight"), [])
    rc = run.wait()
    check(rc == 0, f"reference run exited with status {rc}")
    if rc != 0:
        return finish(failures, t_start)

    # ---- 2. the same job, preempted by SIGTERM to one rank
    banner(f"2/4  same job in a fresh root, preempted by SIGTERM to rank 1 -> {root}")
    pid_dir = os.path.join(work, "pids")
    os.makedirs(pid_dir)
    run = Run(args, root, os.path.join(work, "summary-preempted"),
              ["--pid-dir", pid_dir, "--marker-step", str(args.signal_after)])
    pid_file = os.path.join(pid_dir, "rank-1.pid")
    victim = None
    while run.proc.poll() is None and time.monotonic() - run.started < args.run_timeout:
        if os.path.exists(pid_file):
            with open(pid_file) as f:
                victim = int(json.load(f))
            os.kill(victim, signal.SIGTERM)  # a real signal, to one worker process only
            print(f"  >> sent SIGTERM to rank 1 (pid {victim}) after it finished step "
                  f"{args.signal_after}", flush=True)
            break
        time.sleep(0.005)
    rc = run.wait()
    check(victim is not None, "found rank 1's worker process and signalled it")
    check(rc == 0, f"preempted job exited cleanly (status {rc})")
    if rc != 0 or victim is None:
        return finish(failures, t_start)
    s = run.summaries()
    stops = [x["stopped_at"] for x in s]
    stop = stops[0]
    check(all(x["preempted"] for x in s), "every rank saw mgr.preempted")
    check(len(set(stops)) == 1, f"every rank stopped at the same step ({stops})")
    check(s[1]["got_signal"] == ["SIGTERM"] and s[0]["got_signal"] == [],
          f"only rank 1 received the signal (rank 0: {s[0]['got_signal']}, rank 1: {s[1]['got_signal']}); "
          "safeckpt chained to the script's own handler")
    check(stop < args.steps, f"the job stopped early, at step {stop} of {args.steps}")
    latest = safeckpt.CheckpointManager(root, preemption_signals=()).latest()
    check(latest is not None and latest.step == stop,
          f"step {stop} was saved before exiting (newest committed: "
          f"{getattr(latest, 'step', None)})")

    # ---- 3. resume
    banner(f"3/4  resume: the same command again, trains to step {args.steps}")
    run = Run(args, root, os.path.join(work, "summary-resumed"), [])
    rc = run.wait()
    check(rc == 0, f"resumed job exited with status {rc}")
    if rc != 0:
        return finish(failures, t_start)
    s = run.summaries()
    check([x["resumed_from"] for x in s] == [stop] * NPROC,
          f"every rank resumed from step {stop} ({[x['resumed_from'] for x in s]})")
    check([x["stopped_at"] for x in s] == [args.steps] * NPROC, f"trained to step {args.steps}")

    # ---- 4. compare + verify + ls
    banner("4/4  compare the final checkpoints, verify, list")
    mgr_ref = safeckpt.CheckpointManager(ref_root, preemption_signals=())
    mgr = safeckpt.CheckpointManager(root, preemption_signals=())
    final_ref, final = mgr_ref.latest(), mgr.latest()
    exact = False
    if check(final_ref is not None and final is not None and final_ref.step == final.step == args.steps,
             f"both roots end with a checkpoint of step {args.steps}"):
        assert final_ref is not None and final is not None
        diffs, stats = compare_checkpoints(final_ref.path, final.path)
        for d in diffs[:20]:
            print(f"    differs: {d}")
        parts = ", ".join(f"{e} ({t} tensors, {v} values)" for e, (t, v) in sorted(stats["by_entry"].items()))
        if diffs:
            check(False, f"resumed != straight: {len(diffs)} difference(s) in the final state "
                         f"(compared {stats['tensors']} tensors and {stats['values']} other values: {parts})")
        else:
            exact = check(True, f"resumed == straight, bit for bit: {stats['tensors']} tensors "
                                f"({stats['bytes'] / 1024:.1f} KiB) and {stats['values']} other values: "
                                f"{parts}; plus the per-rank state (RNG) of all {stats['ranks']} ranks")
    all_infos = mgr_ref.list() + mgr.list()
    bad = [(i.path, safeckpt.verify(i.path, deep=True)) for i in all_infos]
    bad = [(p, r.problems) for p, r in bad if not r.ok]
    check(not bad, f"all {len(all_infos)} committed checkpoints verify with deep checksums"
          + (f": {bad}" if bad else ""))
    steps_left = [i.step for i in mgr.list()]
    print(f"  retention (keep_last=3) left steps {steps_left} in {root}"
          + (f"; step {stop} is kept because the resumed run restored from it"
             if stop in steps_left[:-3] else ""))
    print()
    if final_ref is not None and final is not None:
        check(cli("diff", final_ref.path, final.path),
              "safeckpt diff of the two final checkpoints: identical (exit 0)")
        print()
    check(cli("ls", root), "safeckpt ls")

    # ---- summary
    banner("summary")
    print(f"  reference run : steps 1..{args.steps} without interruption")
    print(f"  preempted run : SIGTERM to rank 1 (pid {victim}) after step {args.signal_after}; "
          f"both ranks stopped at step {stop} and saved it")
    print(f"  resumed run   : restored step {stop} on both ranks, trained {stop + 1}..{args.steps}")
    if exact:
        print("  final state   : BIT-EXACT match with the reference run (model, AdamW, LR "
              "scheduler, RNG of every rank)")
    return finish(failures, t_start)


def finish(failures: list[str], t_start: float) -> int:
    took = time.monotonic() - t_start
    if failures:
        print(f"\nDEMO FAILED after {took:.1f}s: {len(failures)} check(s) did not pass:")
        for f in failures:
            print(f"  - {f}")
        return 1
    print(f"\nDEMO PASSED in {took:.1f}s: preempted + resumed training is bit-exact with "
          "the uninterrupted run.")
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        sys.exit(main())
    finally:
        for active in ACTIVE:
            active.kill()
