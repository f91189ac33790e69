"""Trainer save and resume time: stock Trainer vs ``with_safeckpt(Trainer)`` (and with
``async_save=True``: its save time is what blocks training), same run, 2 ranks.

Usage: python bench/bench_hf_resume.py [--reps 3] [--layers 12] [--hidden 512] [--profile DIR]

Both variants train a tiny-vocabulary Llama (fp32, AdamW) for 1 step, save (timed: the whole
``_save_checkpoint``, slowest rank), then a new Trainer resumes with
``train(resume_from_checkpoint=True)``. Two resume times (slowest rank): ``restore``, the time
spent in the code that finds and reads the checkpoint (Trainer's ``get_last_checkpoint``,
``TrainerState.load_from_json``, ``_load_from_checkpoint``, ``_load_optimizer_and_scheduler``,
``_load_scaler``, ``_load_rng_state``; for safeckpt also its pick and manifest read before
Trainer's loop; ``restore_cpu``: the CPU time of that process in it, all threads, which a busy
machine inflates less than wall time), and ``to_begin``, from ``train()`` to the first ``on_train_begin`` (adds the
model wrapping and data loader setup both variants share, so it is noisier). Variants alternate
within each repetition; before each resume the checkpoint files are read into the page cache (``--cache warm``, default), dropped from it (``cold``) or left as each save left them (``as-saved``: safeckpt drops what it writes, torch.save does not).
``--profile DIR`` writes a pyinstrument profile of safeckpt's resume per rank (DIR/<variant>/).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any

ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_DISABLED": "true",
       "TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
       "OMP_NUM_THREADS": "1", "DISABLE_MLFLOW_INTEGRATION": "TRUE"}


def _model(layers: int, hidden: int) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 8 // 3, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=8, vocab_size=4096,
                      max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(cfg)


class _Data:
    def __init__(self, n: int) -> None:
        import torch

        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(3, 4096, (n, 16), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


_MARKS: dict[str, float] = {}
_DEPTH = [0]  # nested timed calls count once


def timed(owner: Any, name: str) -> None:
    """Add the time spent in ``owner.name`` to ``_MARKS["restore"]``."""
    real = getattr(owner, name)
    if getattr(real, "_bench_timed", False):
        return

    def wrapper(*a: Any, **kw: Any) -> Any:
        t, c = time.perf_counter(), time.process_time()
        _DEPTH[0] += 1
        try:
            return real(*a, **kw)
        finally:
            _DEPTH[0] -= 1
            if not _DEPTH[0]:
                _MARKS["restore"] = _MARKS.get("restore", 0.0) + time.perf_counter() - t
                _MARKS["restore_cpu"] = _MARKS.get("restore_cpu", 0.0) + time.process_time() - c
    wrapper._bench_timed = True  # type: ignore[attr-defined]
    if isinstance(owner, type) and isinstance(owner.__dict__.get(name), classmethod):
        setattr(owner, name, classmethod(lambda cls, *a, **kw: wrapper(*a, **kw)))
    else:
        setattr(owner, name, wrapper)


def _set_cache(root: str, *, warm: bool) -> None:
    """Every file of the checkpoints under ``root`` read into the page cache (warm) or dropped
    from it (cold): safeckpt's writer drops what it wrote (so a save does not evict the job's
    cached data) while torch.save leaves it cached, so "as saved" favours stock."""
    for d, _, names in os.walk(root):
        for n in names:
            with open(os.path.join(d, n), "rb", buffering=0) as f:
                if warm:
                    while f.read(8 << 20):
                        pass
                else:
                    os.fsync(f.fileno())
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _trial(cls: type, out: str, layers: int, hidden: int, profile: str | None,
           cache: str = "warm") -> dict[str, float]:
    import torch.distributed as dist
    from accelerate.state import AcceleratorState, GradientState
    from transformers import TrainerCallback, TrainingArguments

    marks = _MARKS
    marks.clear()

    class Mark(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            marks.setdefault("begin", time.perf_counter())

    class Timed(cls):  # type: ignore[misc, valid-type]
        def _save_checkpoint(self, model: Any, trial: Any) -> None:
            t = time.perf_counter()
            super()._save_checkpoint(model, trial)
            marks["save"] = time.perf_counter() - t

    def trainer(steps: int) -> Any:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=1,
                                 save_strategy="steps", save_steps=1, report_to="none", use_cpu=True,
                                 disable_tqdm=True, dataloader_num_workers=0, ddp_backend="gloo",
                                 logging_steps=100, seed=0)
        return Timed(model=_model(layers, hidden), args=args, train_dataset=_Data(8), callbacks=[Mark()])

    trainer(1).train()
    dist.barrier()
    if cache != "as-saved" and dist.get_rank() == 0:
        _set_cache(out, warm=cache == "warm")
    dist.barrier()
    t2 = trainer(2)
    import transformers.trainer as hf_trainer
    from transformers.trainer_callback import TrainerState

    for name in ("_load_from_checkpoint", "_load_optimizer_and_scheduler", "_load_scaler",
                 "_load_rng_state", "_safeckpt_prepare_resume"):
        if hasattr(cls, name):
            timed(cls, name)
    timed(hf_trainer, "get_last_checkpoint")
    timed(TrainerState, "load_from_json")
    from safeckpt import CheckpointManager

    for name in ("resume_candidates", "restore"):  # the pick (older versions: restore)
        if hasattr(CheckpointManager, name):
            timed(CheckpointManager, name)
    marks.pop("begin", None)
    marks["restore"] = marks["restore_cpu"] = 0.0
    prof = None
    if profile:
        from pyinstrument import Profiler

        prof = Profiler(interval=0.001)
        prof.start()
    t0 = time.perf_counter()
    t2.train(resume_from_checkpoint=True)
    if prof is not None:
        prof.stop()
        with open(os.path.join(profile, f"resume-rank{dist.get_rank()}.txt"), "w") as f:
            f.write(prof.output_text(unicode=False, color=False, show_all=False))
    return {"save": marks["save"], "restore": marks["restore"], "restore_cpu": marks["restore_cpu"],
            "to_begin": marks["begin"] - t0}


def _worker(rank: int, world: int, port: int, reps: int, layers: int, hidden: int,
            profile: str | None, base: str, q: Any, cache: str) -> None:
    os.environ.update(ENV)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist
    from transformers import Trainer

    from safeckpt.integrations.hf import with_safeckpt

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    rows = []
    variants = {"stock": Trainer, "safeckpt": with_safeckpt(Trainer),
                "safeckpt-async": with_safeckpt(Trainer, async_save=True)}
    for rep in range(reps):
        for name, cls in variants.items():
            out = os.path.join(base, f"{name}-{rep}")
            prof_dir = os.path.join(profile, name) if profile and name != "stock" and rep == reps - 1 else None
            if prof_dir:
                os.makedirs(prof_dir, exist_ok=True)
            r = _trial(cls, out, layers, hidden, prof_dir,
                       cache)
            t = torch.tensor([r["save"], r["restore"], r["to_begin"], r["restore_cpu"]], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if rank == 0:
                size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(out) for f in fs)
                rows.append({"variant": name, "rep": rep, "save": t[0].item(), "restore": t[1].item(),
                             "to_begin": t[2].item(), "restore_cpu": t[3].item(), "bytes": size})
                shutil.rmtree(out, ignore_errors=True)
            dist.barrier()
    if rank == 0:
        q.put(rows)
    dist.destroy_process_group()


def main() -> None:
    import multiprocessing as mp
    import socket

    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--profile", default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--cache", choices=("warm", "cold", "as-saved"), default="warm",
                   help="page cache before the resume: every checkpoint file read (warm), dropped "
                        "(cold), or as each save left it (safeckpt drops what it writes)")
    a = p.parse_args()
    if a.profile:
        os.makedirs(a.profile, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = tempfile.mkdtemp(prefix="bench-hf-resume-", dir=os.environ.get("BENCH_DIR"))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, a.reps, a.layers, a.hidden, a.profile, base, q, a.cache))
             for r in range(2)]
    for pr in procs:
        pr.start()
    import queue

    while True:
        try:
            rows = q.get(timeout=5)
            break
        except queue.Empty:
            if any(not pr.is_alive() and pr.exitcode for pr in procs):
                for pr in procs:
                    pr.kill()
                sys.exit("a worker failed (see its traceback above)")
    for pr in procs:
        pr.join(60)
    shutil.rmtree(base, ignore_errors=True)
    for r in rows:
        print(json.dumps(r))
    names = list(dict.fromkeys(r["variant"] for r in rows))
    for what in ("save", "restore", "restore_cpu", "to_begin"):
        med = {v: statistics.median(r[what] for r in rows if r["variant"] == v) for v in names}
        print(f"{what}: " + ", ".join(f"{v} {med[v]:.3f} s" + (f" ({med[v] / med['stock']:.2f}x)" if v != "stock" else "")
                                      for v in names))
    sizes = {r["variant"]: r["bytes"] // 2 for r in rows}  # two checkpoints in each run
    print(f"bytes per checkpoint: {sizes}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    sys.exit(0)


if __name__ == "__main__":
    main()
