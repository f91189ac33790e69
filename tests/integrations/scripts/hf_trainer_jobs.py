"""Training jobs for the Trainer / TRL tests; each runs on every rank of a torchrun job.

Every job writes what the test checks as JSON (rank 0) into its output directory: per-step
losses, committed checkpoints, and anything specific to the scenario.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import hf_tiny as tiny
import torch
import torch.distributed as dist
from transformers import Trainer, TrainerCallback, TrainingArguments

from safeckpt.integrations.hf import with_safeckpt

MAX_STEPS = 12  # 16 samples per rank, batch 2: 8 steps per epoch, so the run crosses an epoch


class Record(TrainerCallback):
    """Per-step losses to ``losses.jsonl`` (rank 0), appended as they are logged, so a run that
    is killed still leaves the losses of the steps it did."""

    def __init__(self, path: str, signal_at: int | None = None) -> None:
        self.path, self.signal_at = path, signal_at
        self.start_step: int | None = None
        self.at_save: list[list[Any]] = []

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.start_step = state.global_step  # the step the run resumed from (0: fresh)

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
        if dist.get_rank() == 0 and logs and "loss" in logs:
            with open(self.path, "a") as f:
                f.write(f'{{"step": {state.global_step}, "loss": {float(logs["loss"])!r}}}\n')

    def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        # Whether the checkpoint was committed when Trainer went on (async saves: not yet).
        d = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        self.at_save.append([state.global_step, os.path.isfile(os.path.join(d, "manifest.json"))])

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        # A real SIGTERM to rank 1 only, in the middle of step `signal_at`.
        if self.signal_at is not None and state.global_step + 1 == self.signal_at and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGTERM)


class SideFileTrainer(Trainer):
    """Adds to the save like TRL's GRPO does: a file in checkpoint-N after super(), read back in
    _load_optimizer_and_scheduler."""

    counter = 0

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        super()._save_checkpoint(model, trial)
        if self.args.should_save:
            d = os.path.join(self.args.output_dir, f"checkpoint-{self.state.global_step}")
            with open(os.path.join(d, "side_state.json"), "w") as f:
                f.write(f'{{"counter": {self.state.global_step * 7}}}')

    def _load_optimizer_and_scheduler(self, checkpoint: Any) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        import json

        with open(os.path.join(checkpoint, "side_state.json")) as f:
            SideFileTrainer.counter = json.load(f)["counter"]


def args(out: str, **kw: Any) -> TrainingArguments:
    base = dict(
        output_dir=out, max_steps=MAX_STEPS, per_device_train_batch_size=2,
        per_device_eval_batch_size=4, learning_rate=3e-3, lr_scheduler_type="cosine",
        warmup_steps=2, weight_decay=0.01, logging_steps=1, save_strategy="steps",
        save_steps=4, eval_strategy="steps", eval_steps=4, save_total_limit=2,
        load_best_model_at_end=True, metric_for_best_model="loss", greater_is_better=True,
        report_to="none", use_cpu=True, seed=7, dataloader_num_workers=0,
        disable_tqdm=True, ddp_backend="gloo",
    )
    base.update(kw)
    return TrainingArguments(**base)


def ddp_job(out: str, *, resume: Any = None, signal_at: int | None = None,
            kill_save_at: int | None = None, async_save: bool = False) -> dict[str, Any]:
    """Trainer (DDP) on the tiny Llama; optional SIGTERM to rank 1, optional SIGKILL of rank 1
    in the middle of writing the checkpoint of step ``kill_save_at``; ``async_save``: saves
    commit in the background."""
    if kill_save_at is not None:
        _kill_rank1_during_save(kill_save_at, os.path.join(out, "killed-in-save"))
    os.makedirs(out, exist_ok=True)
    cls = with_safeckpt(SideFileTrainer, async_save=async_save)
    record = Record(os.path.join(out, "losses.jsonl"), signal_at)
    trainer = cls(model=tiny.model(), args=args(out), train_dataset=tiny.TokenData(32, 1),
                  eval_dataset=tiny.TokenData(8, 2), callbacks=[record])
    real_fsync = os.fsync
    if async_save:  # the background writer takes its time: training must not wait for it
        os.fsync = _slow_fsync(real_fsync, 2.0)
    try:
        result = trainer.train(resume_from_checkpoint=resume)
    finally:
        os.fsync = real_fsync
    dump_rng(out, "ddp")
    res = {
        "global_step": result.global_step, "preempted": trainer.safeckpt_preempted,
        "start_step": record.start_step, "at_save": record.at_save,
        "best_model_checkpoint": trainer.state.best_model_checkpoint,
        "side_counter": SideFileTrainer.counter,
        "log_history": trainer.state.log_history,
    }
    if signal_at is None:  # a completed run: the in-memory model (the best one) and an export
        export = os.path.join(out, "export")
        trainer.save_model(export)
        sd = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        res["export"] = export
        if dist.get_rank() == 0:
            _save_tensors(os.path.join(out, "final_model.safetensors"), sd)
            _save_logits(trainer.model, os.path.join(out, "logits.safetensors"))
    return res


def _save_tensors(path: str, sd: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in sd.items()}, path)


def _save_logits(model: Any, path: str) -> None:
    model.eval()
    with torch.no_grad():
        ids = torch.arange(3, 3 + tiny.SEQ).unsqueeze(0)
        logits = model(input_ids=ids).logits
    _save_tensors(path, {"input_ids": ids, "logits": logits})


def dump_rng(out: str, tag: str) -> None:
    """This rank's torch RNG state right after training, to compare runs rank by rank."""
    _save_tensors(os.path.join(out, f"rng-{tag}-rank{dist.get_rank()}.safetensors"),
                  {"torch": torch.get_rng_state()})


def _slow_fsync(real_fsync: Any, seconds: float) -> Any:
    """``os.fsync`` that first sleeps ``seconds`` for checkpoint data files in staging."""
    import time

    def fsync(fd: int) -> None:
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            path = ""
        if ".safeckpt-staging-" in path and path.endswith(".safetensors"):
            time.sleep(seconds)
        real_fsync(fd)

    return fsync


def _kill_rank1_during_save(step: int, marker: str) -> None:
    """SIGKILL rank 1 in the middle of writing its data file of checkpoint ``step``: when that
    file is fsynced (it is written, not yet reported to the coordinator), cut it in half and die.
    Hooks ``os.fsync`` (public), so it does not depend on safeckpt's internal module layout."""
    if dist.get_rank() != 1:
        return
    real_fsync = os.fsync
    tag = f".checkpoint-{step}.safeckpt-staging-"

    def fsync(fd: int) -> None:
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            path = ""
        if tag in path and path.endswith(".safetensors"):
            with open(marker, "w") as f:
                f.write(path)
            os.ftruncate(fd, os.fstat(fd).st_size // 2)
            os.kill(os.getpid(), signal.SIGKILL)
        real_fsync(fd)

    os.fsync = fsync


SFT_STEPS = 6


def _sharded_model(base: str) -> Any:
    """The tiny Llama, FSDP2-sharded across both ranks by transformers at load time
    (``from_pretrained(distributed_config=DistributedConfig(fsdp_size=2))``)."""
    from transformers import LlamaForCausalLM
    from transformers.distributed import DistributedConfig

    src = os.path.join(base, "tiny-llama")
    if dist.get_rank() == 0 and not os.path.exists(os.path.join(src, "config.json")):
        tiny.model(seed=4).save_pretrained(src)
    dist.barrier()
    return LlamaForCausalLM.from_pretrained(src, distributed_config=DistributedConfig(fsdp_size=2))


def sft_fsdp2_job(base: str, out: str, *, resume: Any = None) -> dict[str, Any]:
    """TRL SFTTrainer on an in-memory text dataset with an FSDP2-sharded model; saves every 3
    steps; then exports the model (every rank joins: the weights are sharded) and records its
    logits; and, like field report 5's script, calls save_model with a per-rank directory."""
    from torch.distributed.tensor import DTensor
    from trl import SFTConfig, SFTTrainer

    from safeckpt import RankMismatch

    model = _sharded_model(base)
    cfg = SFTConfig(
        output_dir=out, max_steps=SFT_STEPS, per_device_train_batch_size=2, learning_rate=3e-3,
        logging_steps=1, save_strategy="steps", save_steps=3, save_total_limit=None,
        report_to="none", use_cpu=True, seed=5, max_length=tiny.SEQ, disable_tqdm=True,
        dataloader_num_workers=0, ddp_backend="gloo",
        bf16=False,  # TRL defaults to bf16 autocast; fp32 makes the logits check exact
    )
    trainer = with_safeckpt(SFTTrainer)(
        model=model, args=cfg, train_dataset=tiny.text_dataset(24, 9),
        processing_class=tiny.tokenizer(), callbacks=[Record(os.path.join(out, "losses.jsonl"))],
    )
    result = trainer.train(resume_from_checkpoint=resume)
    dump_rng(out, "sft")
    export = os.path.join(out, "export")
    trainer.save_model(export)
    model.eval()
    with torch.no_grad():
        ids = torch.arange(3, 3 + tiny.SEQ).unsqueeze(0)
        logits = model(input_ids=ids).logits
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    if dist.get_rank() == 0:
        _save_tensors(os.path.join(out, "logits.safetensors"), {"input_ids": ids, "logits": logits})
    mismatch = None
    try:  # field report 5: each rank computed its own (timestamped) output directory
        trainer.save_model(os.path.join(out, f"export-{dist.get_rank()}"))
    except RankMismatch as exc:
        mismatch = str(exc)
    return {"global_step": result.global_step, "export": export, "mismatch": mismatch,
            "sharded": [n for n, p in model.named_parameters() if isinstance(p, DTensor)]}
