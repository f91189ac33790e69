"""DeepSpeed's own ``tests/unit/checkpoint`` against the safeckpt integration (issue 22 req. 2).

The tests are never copied into this repository: they are taken at run time from DeepSpeed's
git history at ``COMMIT``, from ``$SAFECKPT_DEEPSPEED_GIT`` (a clone, bare or not), a local
snapshot, a cache, or a shallow fetch from GitHub. PyPI has no copy (neither the 0.19.8 sdist
nor the wheel ships ``tests/``), so where only the package registries are reachable (CI) they
cannot be had and the test using this module skips.

Each selection runs twice in subprocesses under a hard timeout: stock, and with this folder on
``PYTHONPATH`` and ``SAFECKPT_DS_INJECT=1`` (``sitecustomize.py``: every engine built in every
process, forkserver ranks included, gets ``sds.install_on_initialize()``). A test that passes
stock must pass injected or fail exactly as one of ``REFUSALS`` (the docs' table, test name and
the error it must show). Tests failing stock are reported, not judged.

Full run (prints the counts and every failure; the docs' table records its result)::

    python tests/integrations/peer_deepspeed/run.py [--files test_zero_optimizer.py ...] [-k EXPR]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

try:
    from ..peer_junit import outcomes, reachable
except ImportError:  # run as a script
    sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from peer_junit import outcomes, reachable

HERE = os.path.dirname(os.path.abspath(__file__))
# The newest DeepSpeed history available here (master of 2026-08-22, version.txt 0.19.6):
# DeepSpeed tags no release after 0.19.5 in git; the installed package is 0.19.8.
COMMIT = "edaa7221267243c7be7fb49c5d5f5c4fb97b4641"
URL = "https://github.com/deepspeedai/DeepSpeed"
MIRROR = "/work/.mirror/deepspeedai+DeepSpeed/repo"
PATHS = ["tests/conftest.py", "tests/pytest.ini", "tests/unit/__init__.py", "tests/unit/common.py",
         "tests/unit/simple_model.py", "tests/unit/util.py", "tests/unit/checkpoint"]
ALL_FILES = [
    "test_latest_checkpoint.py", "test_tag_validation.py", "test_zero_optimizer.py",
    "test_other_optimizer.py", "test_shared_weights.py", "test_convert_checkpoint.py",
    "test_lr_scheduler.py", "test_pipeline.py", "test_moe_checkpoint.py", "test_sparse.py",
    "test_mics_optimizer.py", "test_reshape_checkpoint.py",
]  # not test_universal_checkpoint.py / test_autotp_uc_checkpoint.py: universal checkpoints are
#    refused (documented); 144 parametrizations of 2-4 ranks would take hours on 2 cores

# Documented refusals (docs/how-to/deepspeed.md, "DeepSpeed's own checkpoint tests"):
# reason -> (test names, the error the test must fail with).
REFUSALS: dict[str, tuple[str, str]] = {
    "torch.load / os.path.getsize of a file in a tag (each is a safeckpt checkpoint directory)": (
        r"test_save_exclude_frozen_weights|test_save_exclude_custom_frozen_weights",
        r"IsADirectoryError: \[Errno 21\] Is a directory: .*_model_states\.pt",
    ),
}


def _git(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], capture_output=True, timeout=timeout)


def _gitdir(path: str) -> str:
    return os.path.join(path, ".git") if os.path.isdir(os.path.join(path, ".git")) else path


def source(cache: str, fetch_timeout: float = 90) -> str | None:
    """A git directory holding ``COMMIT`` of DeepSpeed, or None."""
    target = os.path.join(cache, "deepspeed.git")
    for c in filter(None, [os.environ.get("SAFECKPT_DEEPSPEED_GIT", ""), MIRROR, target]):
        if os.path.isdir(c) and _git("--git-dir", _gitdir(c), "cat-file", "-e", f"{COMMIT}^{{commit}}").returncode == 0:
            return _gitdir(c)
    if not reachable():
        return None
    try:
        if not os.path.isdir(target):
            _git("init", "--bare", "-q", target)
        r = _git("--git-dir", target, "fetch", "-q", "--depth", "1", URL, COMMIT, timeout=fetch_timeout)
    except subprocess.TimeoutExpired:
        return None
    return target if r.returncode == 0 else None


def extract(gitdir: str, dest: str) -> str:
    """DeepSpeed's checkpoint tests (and the helpers they import) under ``dest``; returns the
    ``tests`` directory to run pytest in."""
    archive = subprocess.run(["git", "--git-dir", gitdir, "archive", COMMIT, *PATHS],
                             capture_output=True, check=True, timeout=120).stdout
    subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True, timeout=120)
    return os.path.join(dest, "tests")


def _clear_stale_lock(max_age: float = 600) -> None:
    """A build of DeepSpeed's shm op killed half-way leaves torch's lock file, and every later
    DeepSpeed start waits on it forever; a real build takes well under ``max_age`` seconds."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.expanduser("~/.cache/torch_extensions")
    if not os.path.isdir(root):
        return
    for dirpath, _, files in os.walk(root):
        lock = os.path.join(dirpath, "lock")
        if "lock" in files and time.time() - os.path.getmtime(lock) > max_age:
            os.unlink(lock)


def run(tests_dir: str, junit: str, *, inject: bool, files: list[str], keyword: str | None,
        timeout: float, per_test: int = 120) -> subprocess.CompletedProcess:
    """One pytest run of DeepSpeed's tests in a subprocess (its own session, killed whole on
    timeout: raises ``subprocess.TimeoutExpired``)."""
    _clear_stale_lock()
    env = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""),
               DS_ACCELERATOR="cpu", SAFECKPT_DS_COMPAT="1", SAFECKPT_TIMEOUT="60",
               # DeepSpeed's CPU accelerator counts LOCAL_SIZE devices: its 4-rank tests run too
               LOCAL_SIZE="4", DS_UNITTEST_TIMEOUT=str(per_test), PYTHONHASHSEED="0")
    env.pop("SAFECKPT_DS_INJECT", None)
    if inject:
        env["SAFECKPT_DS_INJECT"] = "1"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
           "-p", "no:randomly", "-p", "ds_pytest_compat", f"--junitxml={junit}", f"--basetemp={junit}.tmp",
           *(["-k", keyword] if keyword else []),
           *[os.path.join("unit", "checkpoint", f) for f in files]]
    proc = subprocess.Popen(cmd, cwd=tests_dir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        raise subprocess.TimeoutExpired(cmd, timeout, output=out) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def judge(stock: dict[str, tuple[str, str]], ours: dict[str, tuple[str, str]]
          ) -> tuple[list[str], dict[str, list[str]]]:
    """Tests passing stock and failing injected beyond ``REFUSALS`` (with their errors), and
    the tests each refusal explains."""
    unexplained: list[str] = []
    hits: dict[str, list[str]] = {r: [] for r in REFUSALS}
    for name, (status, _) in sorted(stock.items()):
        if status != "passed":
            continue
        got, text = ours.get(name, ("missing", "did not run (a hang ends DeepSpeed's test session)"))
        if got == "passed":
            continue
        reason = next((r for r, (names, err) in REFUSALS.items()
                       if re.search(names, name) and re.search(err, text)), None)
        if reason is None:
            unexplained.append(f"{name} [{got}]: {_short(text)}")
        else:
            hits[reason].append(name)
    return unexplained, hits


def _short(text: str, limit: int = 600) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.match(r"^E\s", ln)]
    return " | ".join((errors or lines)[:6])[:limit]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", nargs="*", default=ALL_FILES)
    p.add_argument("-k", dest="keyword", default=None)
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--workdir", default=None, help="keep the extracted tests and junit files here")
    p.add_argument("--only", choices=("stock", "injected"), default=None)
    args = p.parse_args(argv)
    cache = os.path.join(os.path.expanduser("~"), ".cache", "safeckpt-peer")
    os.makedirs(cache, exist_ok=True)
    gitdir = source(cache)
    if gitdir is None:
        print(f"DeepSpeed's git history at {COMMIT} is not reachable: set SAFECKPT_DEEPSPEED_GIT")
        return 2
    work = args.workdir or tempfile.mkdtemp(prefix="ds-peer-")
    results = {}
    for mode in ("stock", "injected"):
        if args.only and mode != args.only:
            continue
        root = os.path.join(work, mode)
        os.makedirs(root, exist_ok=True)
        tests_dir = extract(gitdir, root)
        junit = os.path.join(work, f"{mode}.xml")
        t0 = time.monotonic()
        proc = run(tests_dir, junit, inject=mode == "injected", files=args.files, keyword=args.keyword,
                   timeout=args.timeout)
        with open(os.path.join(work, f"{mode}.log"), "w") as f:
            f.write(proc.stdout)
        results[mode] = outcomes(junit)
        counts = {s: sum(v[0] == s for v in results[mode].values()) for s in ("passed", "failed", "skipped")}
        print(f"{mode}: {counts} in {time.monotonic() - t0:.0f} s ({junit})")
    if len(results) == 2:
        stock, ours = results["stock"], results["injected"]
        unexplained, hits = judge(stock, ours)
        for reason, names in hits.items():
            print(f"refusal ({len(names)}): {reason}")
            for n in names:
                print(f"    {n}")
        print(f"failing stock too: {sorted(n for n, (s, _) in stock.items() if s == 'failed')}")
        print(f"unexplained ({len(unexplained)}):")
        for u in unexplained:
            print(f"    {u}")
        return 1 if unexplained else 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
