"""torchrun entry point of tests/integrations/test_hf_tier.py: ``hf_tier.py OUT``.

Two ranks (gloo, CPU), each its own simulated node (``GROUP_RANK`` = its rank, its own
``local_dir``), ``with_safeckpt(Trainer, local_dir=..., durable_every=2, replicas=1)`` saving at
every step of a tiny Llama (attention dropout: a resume is bit-exact only with every rank's RNG):

- ``OUT/straight``: trains to step 6 (durable: 2, 4, 6);
- ``OUT/crashed``: the same run, failing at the start of step 6 (an exception on both ranks after
  step 5 was saved on the nodes only); then a new trainer resumes with
  ``resume_from_checkpoint=True`` and trains to step 6.

Writes per run: the losses and every rank's full state (model, optimizer state, RNG) after
training, and ``OUT/result.json`` (rank 0) with what was under ``crashed`` before the resume.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hf_tiny as tiny  # noqa: E402

os.environ.update({k: v for k, v in tiny.OFFLINE_ENV.items() if k not in os.environ})

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

STEPS = 6


class Crash(Exception):
    pass


def run(out: str, nodes: str, crash_at: int | None, resume: Any) -> dict[str, Any]:
    from safetensors.torch import save_file
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from safeckpt.integrations.hf import with_safeckpt

    losses: dict[int, float] = {}

    class Record(TrainerCallback):
        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            if logs and "loss" in logs:
                losses[state.global_step] = float(logs["loss"])

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if crash_at is not None and state.global_step + 1 == crash_at:
                raise Crash(f"crash at the start of step {crash_at}")

    r = dist.get_rank()
    model = tiny.model(seed=3)
    args = TrainingArguments(output_dir=out, max_steps=STEPS, per_device_train_batch_size=2, learning_rate=3e-3,
                             logging_steps=1, save_strategy="steps", save_steps=1, save_total_limit=None,
                             report_to="none", use_cpu=True, seed=7, dataloader_num_workers=0, disable_tqdm=True,
                             ddp_backend="gloo")
    cls = with_safeckpt(Trainer, local_dir=os.path.join(nodes, f"node{r}"), durable_every=2, replicas=1,
                        keep_local=2, check_finite=True)
    trainer = cls(model=model, args=args, train_dataset=tiny.TokenData(24, 1), callbacks=[Record()])
    crashed = False
    try:
        result = trainer.train(resume_from_checkpoint=resume)
    except Crash:
        crashed = True
    if crashed:
        return {"crashed": True, "losses": losses}
    state = {f"model/{k}": v.detach().clone() for k, v in trainer.model.state_dict().items()}
    for i, st in trainer.optimizer.state_dict()["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                state[f"optim/{i}/{k}"] = v.clone().reshape(-1)
    state["rng"] = torch.get_rng_state()
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(out, f"state-rank{r}.safetensors"))
    return {"crashed": False, "losses": losses, "global_step": result.global_step}


def main() -> int:
    out = os.path.abspath(sys.argv[1])
    dist.init_process_group("gloo", timeout=timedelta(seconds=90))
    os.environ["GROUP_RANK"] = str(dist.get_rank())  # each rank its own simulated node
    straight = run(os.path.join(out, "straight"), os.path.join(out, "nodes-straight"), None, None)
    crashed = run(os.path.join(out, "crashed"), os.path.join(out, "nodes"), STEPS, None)
    dist.barrier()
    before = sorted(n for n in os.listdir(os.path.join(out, "crashed")) if not n.startswith("."))  # not the run file
    resumed = run(os.path.join(out, "crashed"), os.path.join(out, "nodes"), None, True)
    if dist.get_rank() == 0:
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump({"straight": straight, "crashed": crashed, "resumed": resumed, "before": before}, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
