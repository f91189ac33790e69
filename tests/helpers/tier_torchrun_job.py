"""The training script of tests/test_local_tier_torchrun.py, run by real ``torchrun`` launches
(one per simulated node, each with its own ``local_dir``); it never sets ``GROUP_RANK`` itself.

``save`` phase: saves steps 1..LAST through ``CheckpointManager(root, local_dir=...,
durable_every=DURABLE, replicas=1)`` (step DURABLE is committed under root, the later ones
are on the local tier only), writes ``saved.<rank>.json`` (its pid, GROUP_RANK, node), then
waits for the test's ``go`` file (the test has SIGKILLed one node meanwhile) and tries one
more save: the survivors must raise a CheckpointError within the timeout
(``after.<rank>.json``). It never calls close(): nothing is drained to root, as when the job
is killed.

``restore`` phase: an audit hook records every file opened under root; restore, compare with
the expected values (``restored.<rank>.json``), then save one more step and close (drained to
root; ``closed.<rank>.json``).
"""

from __future__ import annotations

import json
import os
import sys
import time

DURABLE = 4  # durable_every: step 4 reaches root, 5 and 6 do not
LAST = 6
TIMEOUT = 20.0  # the manager's timeout (s)


def state(step: int, rank: int) -> dict:
    import torch

    import safeckpt

    return {
        "w": torch.arange(4099, dtype=torch.float32) * 0.5 + step,  # replicated over the ranks
        "b": torch.full((65,), float(step), dtype=torch.float64),
        "mine": safeckpt.PerRank(torch.arange(37, dtype=torch.float32) + 1000 * rank + step),
        "meta": {"step": step},
    }


def same(a: dict, b: dict) -> bool:
    import torch

    return (torch.equal(a["w"], b["w"]) and torch.equal(a["b"], b["b"])
            and torch.equal(a["mine"].value, b["mine"].value) and a["meta"] == b["meta"])


def write_json(path: str, data: dict) -> None:
    with open(f"{path}.tmp", "w") as f:
        json.dump(data, f)
    os.replace(f"{path}.tmp", path)


def main() -> None:
    phase, root, local, out = sys.argv[1:5]
    import torch.distributed as dist

    import safeckpt

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    group_rank = os.environ["GROUP_RANK"]  # set by torchrun (the c10d rendezvous assigns it)
    mgr = safeckpt.CheckpointManager(root, local_dir=local, durable_every=DURABLE, replicas=1, keep_last=None,
                                     keep_local=3, preemption_signals=(), timeout=TIMEOUT)
    me = {"rank": rank, "pid": os.getpid(), "group_rank": group_rank, "node": mgr._tier.node,
          "local_dir": local, "world": dist.get_world_size(),
          "local_world": int(os.environ["LOCAL_WORLD_SIZE"])}
    if phase == "save":
        for step in range(1, LAST + 1):
            mgr.save(step, state(step, rank))
        mgr.wait()  # step LAST is published on every node with its replicas acknowledged
        write_json(os.path.join(out, f"saved.{rank}.json"), me)
        deadline = time.monotonic() + 120
        while not os.path.exists(os.path.join(out, "go")):  # one node is SIGKILLed meanwhile
            if time.monotonic() > deadline:
                os._exit(3)
            time.sleep(0.05)
        t0 = time.monotonic()
        try:
            mgr.save(LAST + 1, state(LAST + 1, rank))
            mgr.wait()
            me["after"] = None
        except safeckpt.CheckpointError as exc:
            me["after"] = [type(exc).__name__, str(exc)[:2000], time.monotonic() - t0]
        write_json(os.path.join(out, f"after.{rank}.json"), me)
        os._exit(0)  # the job dies: no close(), no drain to root

    root_real = os.path.realpath(root)
    opened: list[str] = []

    def audit(event: str, args: tuple) -> None:
        if event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
            path = os.fsdecode(args[0])
            if os.path.realpath(path).startswith(root_real + os.sep) or os.path.realpath(path) == root_real:
                opened.append(path)

    sys.addaudithook(audit)
    st = state(0, rank)
    t0 = time.monotonic()
    got = mgr.restore(st)
    me["restore_s"] = time.monotonic() - t0
    me["opened_under_root"] = list(opened)
    me["restored"] = got
    me["exact"] = same(st, state(LAST, rank))
    me["exact_older"] = same(st, state(DURABLE, rank))
    write_json(os.path.join(out, f"restored.{rank}.json"), me)
    mgr.save(LAST + 1, state(LAST + 1, rank))  # the job goes on; close() drains it to root
    mgr.close()
    write_json(os.path.join(out, f"closed.{rank}.json"), me)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
