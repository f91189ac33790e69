"""torchrun entry point for the Hugging Face integration tests: ``hf_run.py PHASE BASE``.

Runs the jobs of one phase, one after the other in the same processes (importing transformers
once per launch keeps the suite fast), and writes each job's result to
``BASE/<job>.result.json`` (rank 0). A job that raises writes its error there instead and the
launch exits non-zero.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import traceback
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hf_tiny as tiny  # noqa: E402

os.environ.update({k: v for k, v in tiny.OFFLINE_ENV.items() if k not in os.environ})

import torch.distributed as dist  # noqa: E402


def phases(base: str) -> dict[str, list[tuple[str, object]]]:
    import accelerate_jobs as aj
    import hf_trainer_jobs as tj

    def p(name: str) -> str:
        return os.path.join(base, name)

    return {
        "first": [
            ("ddp_straight", lambda: tj.ddp_job(p("straight"))),
            ("ddp_preempt", lambda: tj.ddp_job(p("resumed"), signal_at=5)),
            ("ddp_async_preempt", lambda: tj.ddp_job(p("async_resumed"), signal_at=5, async_save=True)),
            ("sft_straight", lambda: tj.sft_fsdp2_job(base, p("sft_straight"))),
            ("acc_straight", lambda: aj.job(p("acc_straight"))),
            ("acc_preempt", lambda: aj.job(p("acc_resumed"), signal_at=6)),
        ],
        "crash": [
            ("sft_resume", lambda: tj.sft_fsdp2_job(
                base, p("sft_resumed"), resume=os.path.join(p("sft_straight"), "checkpoint-3"))),
            ("ddp_crash", lambda: tj.ddp_job(p("resumed"), resume=True, kill_save_at=8)),
        ],
        "final": [
            ("ddp_final", lambda: tj.ddp_job(p("resumed"), resume=True)),
            ("ddp_async_final", lambda: tj.ddp_job(p("async_resumed"), resume=True, async_save=True)),
            ("acc_final", lambda: aj.job(p("acc_resumed"), resume=True)),
        ],
    }


def main() -> int:
    phase, base = sys.argv[1], os.path.abspath(sys.argv[2])
    dist.init_process_group("gloo", timeout=timedelta(seconds=90))
    rank = dist.get_rank()
    if phase == "crash" and rank == 0:
        # rank 1 is SIGKILLed in this phase and torchrun then SIGTERMs rank 0: let rank 0 finish
        # writing its result (it exits right after)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    rc = 0
    for name, job in phases(base)[phase]:
        try:
            out = {"ok": True, "value": job()}
        except Exception as exc:  # noqa: BLE001 - reported to the test
            traceback.print_exc()
            out = {"ok": False, "type": type(exc).__name__,
                   "mro": [c.__name__ for c in type(exc).__mro__], "msg": str(exc)}
            rc = 1
        if rank == 0:
            tiny.write_json(os.path.join(base, f"{name}.result.json"), out)
        brief = {k: v for k, v in (out.get("value") or {}).items() if not isinstance(v, (list, dict))}
        tiny.write_json(os.path.join(base, f"{name}.rank{rank}.json"), {"ok": out["ok"], **brief})
        gc.collect()
        if rc:
            break
    gc.collect()
    dist.destroy_process_group()
    return rc


if __name__ == "__main__":
    sys.exit(main())
