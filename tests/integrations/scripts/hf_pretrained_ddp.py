"""torchrun entry point of tests/integrations/test_hf_pretrained_ddp.py: ``hf_pretrained_ddp.py OUT``.

Two ranks (gloo, CPU) train a tiny untied Llama with ``with_safeckpt(Trainer, max_shard_size=...)``
for 4 steps, saving at steps 2 and 4; rank 0 then writes ``save_pretrained`` of the trained model
to ``OUT/ref`` (what stock Trainer's checkpoint holds) and ``OUT/result.json``.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hf_tiny as tiny  # noqa: E402

os.environ.update({k: v for k, v in tiny.OFFLINE_ENV.items() if k not in os.environ})

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

SHARD = "40KB"


def main() -> int:
    out = os.path.abspath(sys.argv[1])
    dist.init_process_group("gloo", timeout=timedelta(seconds=90))
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments

    from safeckpt.integrations.hf import with_safeckpt

    cfg = tiny.config(0.0)
    cfg.tie_word_embeddings = False
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    args = TrainingArguments(output_dir=out, max_steps=4, per_device_train_batch_size=2, learning_rate=3e-3,
                             logging_steps=1, save_strategy="steps", save_steps=2, report_to="none",
                             use_cpu=True, seed=7, dataloader_num_workers=0, disable_tqdm=True,
                             ddp_backend="gloo")
    trainer = with_safeckpt(Trainer, max_shard_size=SHARD)(model=model, args=args,
                                                          train_dataset=tiny.TokenData(16, 1))
    trainer.train()
    if dist.get_rank() == 0:
        trainer.model.save_pretrained(os.path.join(out, "ref"), max_shard_size=SHARD)
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump({"ok": True, "step": trainer.state.global_step}, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
