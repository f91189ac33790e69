"""torchrun entry point of tests/integrations/test_hf_pretrained_fsdp2.py: ``hf_pretrained_fsdp2.py OUT [tied]``.

Two ranks (gloo, CPU). A tiny untied Llama (attention dropout, so a resume is bit-exact only with
every rank's RNG restored) is FSDP2-sharded by transformers at load time
(``from_pretrained(distributed_config=DistributedConfig(fsdp_size=2))``, which runs
``fully_shard``) and trained with ``with_safeckpt(Trainer, pretrained=True, max_shard_size=...)``
for 6 steps, saving at 3 and 6 (``OUT/straight``); then new models and trainers resume from
``OUT/straight/checkpoint-3`` into ``OUT/resumed`` and train to step 6. After each run every rank
gathers the model's full tensors and rank 0 writes them (``full.safetensors``) with the per-step
losses; each rank writes its own local shards (``shards-rankR.safetensors``) and its torch RNG.
With ``tied`` the Llama ties ``lm_head.weight`` to its embedding, and each run reports how many
full tensors the saves gathered (``DTensor.full_tensor`` calls inside the integration's gather)
and how many distinct DTensor parameters and buffers the model has.
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

SHARD = "40KB"
STEPS = 6


def sharded_model(src: str) -> Any:
    from transformers import LlamaForCausalLM
    from transformers.distributed import DistributedConfig

    return LlamaForCausalLM.from_pretrained(src, distributed_config=DistributedConfig(fsdp_size=2))


def run(src: str, out: str, resume: str | None) -> dict[str, Any]:
    from safetensors.torch import save_file
    from torch.distributed.tensor import DTensor
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from safeckpt.integrations.hf import with_safeckpt

    losses: dict[int, float] = {}

    class Losses(TrainerCallback):
        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            if logs and "loss" in logs:
                losses[state.global_step] = float(logs["loss"])

    import safeckpt.integrations.hf as hf

    model = sharded_model(src)
    sharded = sorted(n for n, p in model.named_parameters() if isinstance(p, DTensor))
    distinct = len({id(t) for t in [*model.parameters(), *model.buffers()] if isinstance(t, DTensor)})
    gathered = [0]
    gather = hf.gather_full

    def counting(m: Any) -> Any:  # the integration's gather, counting its full_tensor calls
        orig = DTensor.full_tensor

        def full_tensor(self: Any, *a: Any, **k: Any) -> Any:
            gathered[0] += 1
            return orig(self, *a, **k)

        DTensor.full_tensor = full_tensor  # type: ignore[method-assign]
        try:
            return gather(m)
        finally:
            DTensor.full_tensor = orig  # type: ignore[method-assign]

    hf.gather_full = counting
    args = TrainingArguments(output_dir=out, max_steps=STEPS, per_device_train_batch_size=2, learning_rate=3e-3,
                             logging_steps=1, save_strategy="steps", save_steps=3, report_to="none",
                             use_cpu=True, seed=7, dataloader_num_workers=0, disable_tqdm=True,
                             ddp_backend="gloo")
    trainer = with_safeckpt(Trainer, pretrained=True, max_shard_size=SHARD)(
        model=model, args=args, train_dataset=tiny.TokenData(24, 1), callbacks=[Losses()])
    try:
        result = trainer.train(resume_from_checkpoint=resume)
    finally:
        hf.gather_full = gather
    with torch.no_grad():
        full = {k: (v.full_tensor() if isinstance(v, DTensor) else v).contiguous()
                for k, v in model.state_dict().items()}
        local = {k: (v.to_local() if isinstance(v, DTensor) else v).contiguous().clone()
                 for k, v in model.state_dict().items()}
    r = dist.get_rank()
    save_file(local, os.path.join(out, f"shards-rank{r}.safetensors"))
    save_file({"torch": torch.get_rng_state()}, os.path.join(out, f"rng-rank{r}.safetensors"))
    if r == 0:
        save_file(full, os.path.join(out, "full.safetensors"))
    return {"global_step": result.global_step, "losses": losses, "sharded": sharded, "gathered": gathered[0],
            "distinct": distinct}


def main() -> int:
    out = os.path.abspath(sys.argv[1])
    tied = sys.argv[2:] == ["tied"]
    dist.init_process_group("gloo", timeout=timedelta(seconds=90))
    src = os.path.join(out, "tiny-llama")
    if dist.get_rank() == 0:
        cfg = tiny.config(0.1)
        cfg.tie_word_embeddings = tied
        torch.manual_seed(4)
        from transformers import LlamaForCausalLM

        LlamaForCausalLM(cfg).save_pretrained(src)
    dist.barrier()
    straight = run(src, os.path.join(out, "straight"), None)
    resumed = run(src, os.path.join(out, "resumed"), os.path.join(out, "straight", "checkpoint-3"))
    if dist.get_rank() == 0:
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump({"ok": True, "straight": straight, "resumed": resumed}, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
