"""Trainer save and resume time: stock Trainer vs ``with_safeckpt(Trainer)`` (and with
``async_save=True``: its save time is what blocks training), same run, 2 ranks.

Usage: python bench/bench_hf_resume.py [--reps 3] [--layers 12] [--hidden 512] [--cache warm]
                                        [--process new] [--ranks 2] [--profile DIR] [--json FILE]

Each variant trains a tiny-vocabulary Llama (fp32, AdamW) for 2 steps on 2 ranks (``--ranks``) and saves after
each (timed: the whole ``_save_checkpoint``, slowest rank; ``save`` is the first save of the
process, which allocates what later saves reuse, ``save_next`` the second); then a new Trainer resumes with
``train(resume_from_checkpoint=True)``, by default in 2 new processes (``--process new``), as a
job does after a preemption: its allocations are first touches, as they are in production
(``--process same`` resumes in the processes that saved, whose heap still holds the pages the
first Trainer freed). Two resume times (slowest rank): ``restore``, the time spent in the code
that finds and reads the checkpoint (Trainer's ``get_last_checkpoint``,
``TrainerState.load_from_json``, ``_load_from_checkpoint``, ``_load_optimizer_and_scheduler``,
``_load_scaler``, ``_load_rng_state``; for safeckpt also its pick and manifest read before
Trainer's loop; ``restore_cpu``: the CPU time of that process in it, all threads, which a busy
machine inflates less than wall time), and ``to_begin``, from ``train()`` to the first
``on_train_begin`` (adds the model wrapping and data loader setup both variants share, so it is
noisier). Variants alternate within each repetition (with new processes, who goes first
alternates too); before each resume the checkpoint files are read into the page cache
(``--cache warm``, default), dropped from it (``cold``) or left as each save left them
(``as-saved``: safeckpt drops what it writes, torch.save does not).
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


def _trainer(cls: type, out: str, layers: int, hidden: int, steps: int) -> Any:
    from accelerate.state import AcceleratorState, GradientState
    from transformers import TrainerCallback, TrainingArguments

    marks = _MARKS

    class Mark(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            marks.setdefault("begin", time.perf_counter())

    class Timed(cls):  # type: ignore[misc, valid-type]
        def _save_checkpoint(self, model: Any, trial: Any) -> None:
            t = time.perf_counter()
            super()._save_checkpoint(model, trial)
            marks.setdefault("saves", []).append(time.perf_counter() - t)

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=1,
                             save_strategy="steps", save_steps=1, report_to="none", use_cpu=True,
                             disable_tqdm=True, dataloader_num_workers=0, ddp_backend="gloo",
                             logging_steps=100, seed=0)
    return Timed(model=_model(layers, hidden), args=args, train_dataset=_Data(8), callbacks=[Mark()])


def _save(cls: type, out: str, layers: int, hidden: int) -> tuple[float, float]:
    """Train two steps, saving after each; the time each ``_save_checkpoint`` took (the first
    save of a process allocates what later ones reuse, such as an async save's buffers)."""
    _MARKS.clear()
    _trainer(cls, out, layers, hidden, SAVED_STEPS).train()
    first, second = _MARKS["saves"]
    return first, second


def _resume(cls: type, out: str, layers: int, hidden: int, profile: str | None) -> dict[str, float]:
    """``train(resume_from_checkpoint=True)`` of a new Trainer: restore, restore_cpu, to_begin."""
    import torch.distributed as dist

    marks = _MARKS
    t2 = _trainer(cls, out, layers, hidden, SAVED_STEPS + 1)
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
    marks.clear()
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
    return {"restore": marks["restore"], "restore_cpu": marks["restore_cpu"], "to_begin": marks["begin"] - t0}


_VARIANT_NAMES = ("stock", "safeckpt", "safeckpt-async")
SAVED_STEPS = 2  # the saving job's steps, each saved; the resume trains one more (and saves it)


def _variants() -> dict[str, type]:
    from transformers import Trainer

    from safeckpt.integrations.hf import with_safeckpt

    classes = [Trainer, with_safeckpt(Trainer), with_safeckpt(Trainer, async_save=True)]
    return dict(zip(_VARIANT_NAMES, classes, strict=True))


def _slowest(values: list[float]) -> list[float]:
    """Each value's maximum over the ranks (every rank gets the list)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _size(out: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(out) for f in fs)


def _worker(rank: int, world: int, port: int, job: dict[str, Any], q: Any) -> None:
    """One rank of a job: ``job["what"]`` is "save" or "resume" (one variant, then the process
    ends: a resume starts in a new process, as after a preemption) or "both" (every variant and
    repetition, save and resume in the same process)."""
    os.environ.update(ENV)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    variants = _variants()
    layers, hidden, what = job["layers"], job["hidden"], job["what"]
    result: Any = None
    if what == "save":
        result = dict(zip(("save", "save_next"), _slowest(list(_save(variants[job["variant"]], job["out"],
                                                                     layers, hidden))), strict=True))
    elif what == "resume":
        r = _resume(variants[job["variant"]], job["out"], layers, hidden, job["profile"])
        result = dict(zip(("restore", "restore_cpu", "to_begin"),
                          _slowest([r["restore"], r["restore_cpu"], r["to_begin"]]), strict=True))
    else:  # both, in this process
        result = []
        for rep in range(job["reps"]):
            for name, cls in variants.items():
                out = os.path.join(job["base"], f"{name}-{rep}")
                saves = _save(cls, out, layers, hidden)
                dist.barrier()
                if job["cache"] != "as-saved" and rank == 0:
                    _set_cache(out, warm=job["cache"] == "warm")
                dist.barrier()
                prof = _profile_dir(job["profile"], name, rep == job["reps"] - 1)
                r = _resume(cls, out, layers, hidden, prof)
                vals = _slowest([*saves, r["restore"], r["to_begin"], r["restore_cpu"]])
                if rank == 0:
                    result.append({"variant": name, "rep": rep, "save": vals[0], "save_next": vals[1],
                                   "restore": vals[2], "to_begin": vals[3], "restore_cpu": vals[4],
                                   "bytes": _size(out)})
                    shutil.rmtree(out, ignore_errors=True)
                dist.barrier()
    if rank == 0:
        q.put(result)
    dist.barrier()
    dist.destroy_process_group()


def _profile_dir(profile: str | None, variant: str, last: bool) -> str | None:
    if not profile or variant == "stock" or not last:
        return None
    d = os.path.join(profile, variant)
    os.makedirs(d, exist_ok=True)
    return d


def _run_job(job: dict[str, Any]) -> Any:
    """Run ``job`` on ``job["ranks"]`` new rank processes; rank 0's result."""
    import multiprocessing as mp
    import queue
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, job["ranks"], port, job, q)) for r in range(job["ranks"])]
    for pr in procs:
        pr.start()
    while True:
        try:
            result = q.get(timeout=5)
            break
        except queue.Empty:
            if any(not pr.is_alive() and pr.exitcode for pr in procs):
                for pr in procs:
                    pr.kill()
                sys.exit("a worker failed (see its traceback above)")
    for pr in procs:
        pr.join(60)
    return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--ranks", type=int, default=2, help="ranks (processes) of each job")
    p.add_argument("--profile", default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--cache", choices=("warm", "cold", "as-saved"), default="warm",
                   help="page cache before the resume: every checkpoint file read (warm), dropped "
                        "(cold), or as each save left it (safeckpt drops what it writes)")
    p.add_argument("--process", choices=("new", "same"), default="new",
                   help="resume in new processes, as after a preemption (default), or in the "
                        "processes that saved (their heap is warm: fewer first-touch faults)")
    a = p.parse_args()
    if a.profile:
        os.makedirs(a.profile, exist_ok=True)
    base = tempfile.mkdtemp(prefix="bench-hf-resume-", dir=os.environ.get("BENCH_DIR"))
    job = {"layers": a.layers, "hidden": a.hidden, "cache": a.cache, "profile": a.profile, "ranks": a.ranks}
    if a.process == "same":
        rows = _run_job({**job, "what": "both", "reps": a.reps, "base": base})
    else:
        rows = []
        names = list(_VARIANT_NAMES)
        for rep in range(a.reps):
            for name in names if rep % 2 == 0 else names[::-1]:  # alternate who goes first
                out = os.path.join(base, f"{name}-{rep}")
                row = {"variant": name, "rep": rep,
                       **_run_job({**job, "what": "save", "variant": name, "out": out})}
                if a.cache != "as-saved":
                    _set_cache(out, warm=a.cache == "warm")
                prof = _profile_dir(a.profile, name, rep == a.reps - 1)
                row.update(_run_job({**job, "what": "resume", "variant": name, "out": out, "profile": prof}))
                row["bytes"] = _size(out)
                rows.append(row)
                shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(base, ignore_errors=True)
    for r in rows:
        print(json.dumps(r))
    names = list(dict.fromkeys(r["variant"] for r in rows))
    for what in ("save", "save_next", "restore", "restore_cpu", "to_begin"):
        med = {v: statistics.median(r[what] for r in rows if r["variant"] == v) for v in names}
        print(f"{what}: " + ", ".join(f"{v} {med[v]:.3f} s" + (f" ({med[v] / med['stock']:.2f}x)" if v != "stock" else "")
                                      for v in names))
    sizes = {r["variant"]: r["bytes"] // (SAVED_STEPS + 1) for r in rows}  # checkpoints in each run
    print(f"bytes per checkpoint: {sizes}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    sys.exit(0)


if __name__ == "__main__":
    main()
