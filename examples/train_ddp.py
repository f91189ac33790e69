"""Train a small MLP with DDP on CPU and checkpoint it with safeckpt.

Run it with torchrun (2 ranks, gloo, no GPU needed)::

    torchrun --standalone --nproc-per-node 2 examples/train_ddp.py --root ./ckpts --steps 60

Run the same command again after an interruption and it resumes from the newest valid
checkpoint under ``--root``. Send SIGTERM (or SIGUSR1) to any one rank and every rank stops at
the same step after saving it.

Everything that influences training is either checkpointed or a pure function of the step:

- the batch of step ``s`` on rank ``r`` is generated from a seed derived from ``(seed, s, r)``;
- dropout and input-noise augmentation draw from the global torch/Python RNGs, which are saved
  per rank by ``safeckpt.RNGState()``;
- model, AdamW and the warmup+cosine LR schedule are saved by the manager.

So N steps straight through and N/2 steps + restart + N/2 steps give bit-identical states.

Options used by ``examples/run_demo.py`` to drive the demo: ``--pid-dir``/``--marker-step``
(each rank writes ``rank-R.pid`` after that step, so a supervisor can signal one rank),
``--summary-dir`` (each rank writes ``rank-R.json`` describing what it did), ``--step-time``
(simulated compute per step), ``--fail-at-step``/``--fail-rank`` (simulate a crash).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import signal
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import safeckpt

IN_DIM, HIDDEN, OUT_DIM = 32, 64, 4


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", required=True, help="checkpoint root directory")
    p.add_argument("--steps", type=int, default=60, help="train until this step (total)")
    p.add_argument("--save-every", type=int, default=10, help="save every K steps")
    p.add_argument("--keep-last", type=int, default=3, help="retention: keep the newest N")
    p.add_argument("--async-save", action="store_true", help="save in the background")
    p.add_argument("--batch-size", type=int, default=64, help="per-rank batch size")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--timeout", type=float, default=60.0, help="safeckpt timeout (seconds)")
    p.add_argument("--step-time", type=float, default=0.0,
                   help="extra seconds of simulated compute per step")
    p.add_argument("--fail-at-step", type=int, default=None,
                   help="simulate a crash: --fail-rank raises an error at this step")
    p.add_argument("--fail-rank", type=int, default=1)
    p.add_argument("--pid-dir", default=None, help="write rank-R.pid here after --marker-step")
    p.add_argument("--marker-step", type=int, default=None)
    p.add_argument("--summary-dir", default=None, help="write rank-R.json here at the end")
    return p.parse_args(argv)


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(IN_DIM, HIDDEN), nn.GELU(), nn.Dropout(0.1),
        nn.Linear(HIDDEN, HIDDEN), nn.GELU(), nn.Dropout(0.1),
        nn.Linear(HIDDEN, OUT_DIM),
    )


def batch(seed: int, step: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``step`` on ``rank``: a pure function of (seed, step, rank)."""
    teacher = torch.Generator().manual_seed(seed)
    w = torch.randn(IN_DIM, OUT_DIM, generator=teacher) / IN_DIM**0.5
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1_009 + rank)
    x = torch.randn(size, IN_DIM, generator=g)
    y = torch.tanh(x @ w) + 0.01 * torch.randn(size, OUT_DIM, generator=g)
    return x, y


def write_json(path: str, obj: object) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    def log(msg: str) -> None:
        if rank == 0:
            print(f"[rank 0] {msg}", flush=True)

    # Our own SIGTERM handler, installed *before* the manager: safeckpt chains to it, so we can
    # tell which rank received the signal itself. It only records; it never exits.
    got_signal: list[str] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: got_signal.append(signal.Signals(signum).name))

    torch.manual_seed(args.seed)  # same initial weights on every rank
    model = DDP(make_model())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    warmup = max(1, args.steps // 10)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [
        torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=warmup),
        torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, args.steps - warmup)),
    ], milestones=[warmup])

    # Per-rank randomness (dropout, augmentation) differs between ranks and is checkpointed.
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + 7919 * (rank + 1))

    state = {"model": model, "optim": opt, "sched": sched, "rng": safeckpt.RNGState()}
    summary: dict[str, object] = {"rank": rank, "pid": os.getpid(), "saves": []}
    # Leaving the block closes the manager: it waits for a background save (raising its
    # error) and releases the writer lease, also when training raised.
    with safeckpt.CheckpointManager(args.root, keep_last=args.keep_last,
                                    async_save=args.async_save, timeout=args.timeout) as mgr:
        start = mgr.restore(state)
        summary["resumed_from"] = start
        if start is None:
            start = 0
            log(f"fresh start: no checkpoint under {args.root}; training steps 1..{args.steps} "
                f"on {world} ranks")
        else:
            log(f"resumed from step {start} ({os.path.join(args.root, '')}); training steps "
                f"{start + 1}..{args.steps} on {world} ranks")

        def save(step: int, loss: float, why: str) -> None:
            t0 = time.perf_counter()
            info = mgr.save(step, state, metrics={"loss": loss})
            ms = (time.perf_counter() - t0) * 1e3
            summary["saves"].append(step)  # type: ignore[union-attr]
            if info is not None:
                log(f"step {step:4d}  loss {loss:.6f}  saved {os.path.basename(info.path)} "
                    f"({info.nbytes / 1024:.1f} KiB, {ms:.0f} ms){why}")
            else:
                log(f"step {step:4d}  loss {loss:.6f}  saving step {step} in the background "
                    f"(blocked {ms:.0f} ms){why}")

        step, loss_value, preempted = start, float("nan"), False
        model.train()
        for step in range(start + 1, args.steps + 1):
            x, y = batch(args.seed, step, rank, args.batch_size)
            if random.random() < 0.5:  # augmentation: Python RNG decides, torch RNG draws
                x = x + 0.05 * torch.randn_like(x)
            loss = F.mse_loss(model(x), y)  # dropout draws from the torch RNG
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            loss_value = mean.item() / world
            if args.step_time:
                time.sleep(args.step_time)

            if args.fail_at_step == step and rank == args.fail_rank:
                raise RuntimeError(f"simulated crash on rank {rank} at step {step}")
            if args.pid_dir and args.marker_step == step:
                write_json(os.path.join(args.pid_dir, f"rank-{rank}.pid"), os.getpid())

            if mgr.preempted:  # True on every rank at the same step once any rank got SIGTERM
                save(step, loss_value, "  <- preempted: saved and stopping")
                preempted = True
                break
            if step % args.save_every == 0 or step == args.steps:
                save(step, loss_value, "")

    summary.update(stopped_at=step, preempted=preempted, got_signal=got_signal,
                   final_loss=loss_value, latest=getattr(mgr.latest(), "step", None))
    if preempted:
        print(f"[rank {rank}] stopped at step {step} (signal received by this rank: "
              f"{', '.join(got_signal) or 'none'})", flush=True)
    else:
        log(f"finished at step {step}, loss {loss_value:.6f}")
    if args.summary_dir:
        write_json(os.path.join(args.summary_dir, f"rank-{rank}.json"), summary)
    # A DDP module (or its optimizer) still alive when the process group is destroyed makes gloo
    # abort a few percent of processes at exit (NOTES.md section 5): free them first.
    state.clear()
    del sched, opt, model
    gc.collect()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
