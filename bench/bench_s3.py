"""Benchmark safeckpt on S3 against s3fs moving the same bytes: save vs ``pipe_file``, load vs
``cat_file``.

Run with ``.venv/bin/python bench/bench_s3.py`` (``--quick`` for a 64 MiB state; ``--help``).
Not part of ``make test``. The S3 server is moto's, in its own process on 127.0.0.1, so both
sides pay the same HTTP and server costs; s3fs is the client of both. One process, no process
group. Every pair is measured back to back in the same run, alternating which goes first;
objects are deleted between runs (outside the timed region).

- save: ``safeckpt.save(s3://...)`` (hashing, the manifest, the commit checks) vs
  ``S3FileSystem.pipe_file`` of a ``bytes`` object as large as safeckpt's data file (already in
  memory: no serialisation at all).
- load: ``safeckpt.load`` into existing tensors (every chunk verified) vs ``cat_file`` of
  safeckpt's data object (one GET, bytes in memory, nothing copied into tensors).

Two servers (``--server``): ``stock`` is ``python -m moto.server``; ``ranged`` is the same
with ranged GETs served in O(range), as S3 does (``bench/moto_ranged.py``: stock moto reads the
whole object for every ranged GET, which penalises parallel ranged reads).

Output: a Markdown report on stdout and in ``bench/results/s3-latest.md`` (git-ignored).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

import safeckpt
from safeckpt.engine.reader import open_manifest
from safeckpt.storage.base import storage_for

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_save import empty_like_state, make_state, nbytes  # noqa: E402

MiB = 1 << 20
BUCKET = "bench"
SERVERS = {
    "stock": ["-m", "moto.server"],
    "ranged": [os.path.join(HERE, "moto_ranged.py")],
}


def start_moto(server: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, *SERVERS[server], "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("moto server did not start")


def timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def run(server: str, state: dict[str, torch.Tensor], reps: int) -> dict[str, Any]:
    """Interleaved runs against one server; run 0 (connections, caches) is not counted."""
    import s3fs

    proc, endpoint = start_moto(server)
    opts = {"endpoint_url": endpoint, "key": "testing", "secret": "testing",
            "client_kwargs": {"region_name": "us-east-1"}}
    res: dict[str, list[float]] = {k: [] for k in ("save", "pipe", "load", "cat")}
    loads = [os.getloadavg()]
    t_start = time.monotonic()
    try:
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **opts)
        fs.call_s3("create_bucket", Bucket=BUCKET)
        store = storage_for(f"s3://{BUCKET}", opts)
        payload: list[bytes] = []  # as many bytes as safeckpt's data object (known after run 0)
        for i in range(reps + 1):
            url = f"s3://{BUCKET}/ck-{i}"

            def save(url: str = url) -> None:
                safeckpt.save(url, state, storage_options=opts)

            def pipe(i: int = i) -> None:
                fs.pipe_file(f"{BUCKET}/raw-{i}", payload[0])

            if not payload:
                t_save = timed(save)
                size = sum(int(f["size"]) for f in open_manifest(url, store)["files"].values())
                payload.append((os.urandom(MiB) * (size // MiB + 1))[:size])
                t_pipe = timed(pipe)
            elif i % 2:
                t_pipe, t_save = timed(pipe), timed(save)
            else:
                t_save, t_pipe = timed(save), timed(pipe)
            (name,) = open_manifest(url, store)["files"]
            dst = empty_like_state(state)

            def load(dst: dict = dst, url: str = url) -> None:
                safeckpt.load(url, dst, storage_options=opts)

            def cat(obj: str = f"{BUCKET}/ck-{i}/{name}") -> None:
                fs.cat_file(obj)

            if i % 2:
                t_cat, t_load = timed(cat), timed(load)
            else:
                t_load, t_cat = timed(load), timed(cat)
            for k in state:
                assert torch.equal(state[k], dst[k]), k
            if i:
                for k, v in (("save", t_save), ("pipe", t_pipe), ("load", t_load), ("cat", t_cat)):
                    res[k].append(v)
            print(f"[{server}] run {i}: save {t_save:.3f}s pipe_file {t_pipe:.3f}s load {t_load:.3f}s "
                  f"cat_file {t_cat:.3f}s", file=sys.stderr, flush=True)
            fs.rm(f"{BUCKET}/ck-{i}", recursive=True)
            fs.rm_file(f"{BUCKET}/raw-{i}")
    finally:
        proc.kill()
        proc.wait(10)
    loads.append(os.getloadavg())
    return {"res": res, "size": len(payload[0]), "elapsed": time.monotonic() - t_start, "loads": loads}


def table(server: str, r: dict[str, Any]) -> list[str]:
    res, size = r["res"], r["size"]

    def row(name: str, key: str, base: str | None) -> str:
        xs = res[key]
        tail = "1.00× | |"
        if base is not None:
            tail = f"**{med(res[base]) / med(xs):.2f}×** | {med([b / x for b, x in zip(res[base], xs)]):.2f}× |"
        return f"| {name} | {med(xs):.3f} | {min(xs):.3f}–{max(xs):.3f} | {size / med(xs) / 1e6:.0f} | {tail}"

    (a1, a5, a15), (b1, b5, b15) = r["loads"]
    what = ("stock `python -m moto.server`" if server == "stock"
            else "`bench/moto_ranged.py` (moto, ranged GETs in O(range))")
    return [
        f"**{server}** server: {what}; {len(res['save'])} runs, {r['elapsed']:.0f} s; load average "
        f"{a1:.1f}/{a5:.1f}/{a15:.1f} at start, {b1:.1f}/{b5:.1f}/{b15:.1f} at end",
        "",
        "| method | median s | min–max s | MB/s | throughput vs baseline (medians) | paired |",
        "|---|---:|---:|---:|---:|---:|",
        row("`safeckpt.save`", "save", "pipe"),
        row("*`s3fs.pipe_file` of as many bytes*", "pipe", None),
        row("`safeckpt.load` (verified)", "load", "cat"),
        row("*`s3fs.cat_file` of the data object*", "cat", None),
        "",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="64 MiB state, 3 runs")
    ap.add_argument("--size-mib", type=int, default=None, help="state size (default 256, --quick 64)")
    ap.add_argument("--reps", type=int, default=None, help="runs per method (default 7, --quick 3)")
    ap.add_argument("--server", choices=("stock", "ranged", "both"), default="both")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "s3-latest.md"))
    args = ap.parse_args()
    size = (args.size_mib or (64 if args.quick else 256)) * MiB
    reps = args.reps or (3 if args.quick else 7)
    state, desc = make_state(size)
    servers = ["stock", "ranged"] if args.server == "both" else [args.server]
    results = {s: run(s, state, reps) for s in servers}
    fsize = next(iter(results.values()))["size"]
    lines = [
        f"### safeckpt on S3 ({_dt.datetime.now():%Y-%m-%d %H:%M}, `bench/bench_s3.py`)",
        "",
        f"- **client**: s3fs {_version('s3fs')}, Python {platform.python_version()}, torch "
        f"{torch.__version__}; **server**: moto {_version('moto')} in its own process on 127.0.0.1",
        f"- **state**: {nbytes(state) / MiB:.0f} MiB float32 in {len(state)} tensors ({desc}); one "
        f"process, so one data object of {fsize / MiB:.1f} MiB",
        "- every figure is a median; throughput vs baseline = baseline time / safeckpt time "
        "(≥ 1: as fast or faster); *paired* = median of the per-run ratios; MB/s = 10⁶ bytes of "
        "the data object per second",
        "",
    ]
    for server, r in results.items():
        lines += table(server, r)
    text = "\n".join(lines)
    print(text)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)


def _version(name: str) -> str:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:  # noqa: BLE001
        return "?"


if __name__ == "__main__":
    main()
