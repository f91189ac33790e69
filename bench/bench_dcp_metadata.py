"""How a safeckpt.dcp checkpoint's metadata grows with ranks and tensors (docs/how-to/dcp.md).

For each layer count and world size: an FSDP2 stack of ``nn.Linear(64, 64)`` layers plus AdamW
state (parameters, ``exp_avg``, ``exp_avg_sq`` sharded; each ``step`` a replicated scalar),
saved through ``safeckpt.dcp.StorageWriter`` and through DCP's ``FileSystemWriter``; prints the
sizes of ``manifest.json``, ``dcp_metadata.json`` and DCP's own ``.metadata``. Tensor data is
tiny: only the metadata matters here. gloo on 127.0.0.1.

    python bench/bench_dcp_metadata.py --layers 32,128 --worlds 1,2,4
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import socket
import sys
import tempfile
from datetime import timedelta


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, layers: int, root: str, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import safeckpt.dcp

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    try:
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(layers)])
        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters())
        model(torch.randn(2, 64)).sum().backward()
        opt.step()
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        ours, theirs = os.path.join(root, "safeckpt"), os.path.join(root, "filesystem")
        dcp.save(state, storage_writer=safeckpt.dcp.StorageWriter(ours))
        dcp.save(state, storage_writer=dcp.FileSystemWriter(theirs))
        dist.barrier()
        if rank == 0:
            queue.put({
                "tensors": len(msd) + sum(len(v) for v in osd["state"].values()),
                "sharded": len(msd) + sum(1 for v in osd["state"].values() for t in v.values() if t.dim() > 0),
                "manifest": os.path.getsize(os.path.join(ours, "manifest.json")),
                "dcp_metadata": os.path.getsize(os.path.join(ours, "dcp_metadata.json")),
                "dcp_own_metadata": os.path.getsize(os.path.join(theirs, ".metadata")),
            })
    finally:
        dist.destroy_process_group()


def measure(layers: int, world: int) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    root = tempfile.mkdtemp(prefix="bench-dcp-meta-")
    try:
        procs = [ctx.Process(target=_worker, args=(r, world, port, layers, root, queue)) for r in range(world)]
        for p in procs:
            p.start()
        got = queue.get(timeout=600)
        for p in procs:
            p.join(60)
        return got
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", default="32,128")
    ap.add_argument("--worlds", default="1,2,4")
    a = ap.parse_args(argv)
    print("layers  ranks  tensors (sharded)  manifest.json  dcp_metadata.json  DCP's .metadata")
    for layers in (int(x) for x in a.layers.split(",")):
        for world in (int(x) for x in a.worlds.split(",")):
            r = measure(layers, world)
            print(f"{layers:6d}  {world:5d}  {r['tensors']:7d} ({r['sharded']:4d})  {r['manifest']:13,d}  "
                  f"{r['dcp_metadata']:17,d}  {r['dcp_own_metadata']:15,d}", flush=True)
            print(json.dumps({"layers": layers, "world": world, **r}), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
