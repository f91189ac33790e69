"""Time ``safeckpt.verify(deep=True)`` and count the bytes it reads, local and on moto's S3.

Run with ``.venv/bin/python bench/bench_verify.py --local DIR`` (a ~1 GiB checkpoint written
there once, the transformer + AdamW state of ``bench_save.make_state``) and/or ``--s3 MB``
(a checkpoint of that size on a moto server in its own process, ``bench/moto_ranged.py``).
One JSON line per measurement on stdout. ``--cold``: drop the page cache before each local
verify (needs root). To compare two versions of safeckpt, run this script under each with
``PYTHONPATH=<checkout>/src``, alternating (see docs/benchmarks.md, "Deep verify").

Bytes read: locally, what ``Storage.hash`` and the data files opened by ``Storage.open``
read or hash (counted by wrapping them); on S3, the bytes of every ranged GET (``fetch``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # tests.helpers.read_counter

import safeckpt  # noqa: E402
from safeckpt.engine.offline import verify_on  # noqa: E402
from safeckpt.storage.base import resolve, storage_for  # noqa: E402
from tests.helpers.read_counter import counting  # noqa: E402

MiB = 1 << 20


def measure(ckpt: str, opts: dict | None, cold: bool) -> dict[str, Any]:
    store = storage_for(ckpt, opts)
    tally = counting(store)
    if cold:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
    t0 = time.perf_counter()
    report = verify_on(store, resolve(ckpt), deep=True)
    dt = time.perf_counter() - t0
    assert report.ok, report.problems
    return {"seconds": round(dt, 3), "data_bytes": report.nbytes, "read_bytes": tally[0],
            "passes": round(tally[0] / report.nbytes, 3), "cold": cold, "load": os.getloadavg()[0]}


def local(root: str, reps: int, cold: bool) -> None:
    from bench_save import make_state

    ckpt = os.path.join(root, "ck")
    if not os.path.isdir(ckpt):
        state, _ = make_state(1024 * MiB)
        safeckpt.save(ckpt, state)
    measure(ckpt, None, cold=False)  # imports, first-touch costs
    for _ in range(reps):
        print(json.dumps({"where": "local", **measure(ckpt, None, cold)}), flush=True)


def s3(mb: int, reps: int) -> None:
    import s3fs
    from bench_s3 import BUCKET, start_moto
    from bench_save import make_state

    proc, endpoint = start_moto("ranged")
    opts = {"endpoint_url": endpoint, "key": "testing", "secret": "testing",
            "client_kwargs": {"region_name": "us-east-1"}}
    try:
        s3fs.S3FileSystem(skip_instance_cache=True, **opts).call_s3("create_bucket", Bucket=BUCKET)
        url = f"s3://{BUCKET}/ck"
        state, _ = make_state(mb * MiB)
        safeckpt.save(url, state, storage_options=opts)
        del state
        measure(url, opts, cold=False)
        for _ in range(reps):
            print(json.dumps({"where": "s3", **measure(url, opts, cold=False)}), flush=True)
    finally:
        proc.kill()
        proc.wait(10)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--local", metavar="DIR", help="directory for the ~1 GiB local checkpoint")
    p.add_argument("--cold", action="store_true", help="drop the page cache before each local verify")
    p.add_argument("--s3", type=int, metavar="MB", help="size of the checkpoint on moto's S3")
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    if args.local:
        local(args.local, args.reps, args.cold)
    if args.s3:
        s3(args.s3, args.reps)


if __name__ == "__main__":
    main()
