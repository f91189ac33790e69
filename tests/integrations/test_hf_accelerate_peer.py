"""Accelerate's own checkpoint tests, run against SafeckptAccelerator (issue 19 req. 5).

accelerate's sdist (the pinned version, the one installed) is downloaded at test time with
``pip download`` (never copied into this repository); its ``tests/test_state_checkpointing.py``
and ``tests/test_accelerator.py -k "save_load_model or stateful_dataloader"`` run in a scratch
directory in a subprocess under a hard timeout, with a conftest
(``scripts/hf_accelerate_peer_conftest.py``) that makes every ``Accelerator`` a
``SafeckptAccelerator`` and makes accelerate's own state writer/reader fail, so a test passes
only through safeckpt. Every peer test must pass, or be skipped by accelerate itself on this
machine (``SKIPPED_BY_ACCELERATE``), or fail as one of the README's documented refusals
(``REFUSALS``, none today). Without network access the test is skipped, unless
``SAFECKPT_REQUIRE_PEER_TESTS=1`` (CI), where it fails.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile

import pytest

from tests.integrations.peer_junit import outcomes as _outcomes

accelerate = pytest.importorskip("accelerate")
pytest.importorskip("parameterized")
pytest.importorskip("torchdata")

PINNED = "1.15.0"
FILES = ("tests/test_state_checkpointing.py", "tests/test_accelerator.py")
SELECT = "CheckpointTest or save_load_model or stateful_dataloader"
HARD_TIMEOUT = 480  # seconds for the whole peer run (about 90 s alone on 2 cores)
SCRIPTS = os.path.join(os.path.dirname(__file__), "scripts")

# Test name (without the parameter suffix) -> why accelerate skips it here. Only these may skip.
SKIPPED_BY_ACCELERATE = {
    "test_map_location": "@require_non_cpu: launches itself on an accelerator device",
}
# Test name -> the README's documented refusal (the error text it must fail with). Empty: every
# peer test passes.
REFUSALS: dict[str, str] = {}


def _download(dest: str) -> str:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "--no-build-isolation", f"accelerate=={PINNED}", "-d", dest, "-q"]
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=180)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        why = getattr(exc, "stderr", "") or str(exc)
        if os.environ.get("SAFECKPT_REQUIRE_PEER_TESTS") == "1":
            pytest.fail(f"could not download accelerate=={PINNED}'s sdist: {why[-2000:]}")
        pytest.skip(f"could not download accelerate=={PINNED}'s sdist (no network?): {why[-300:]}")
    names = [n for n in os.listdir(dest) if n.endswith(".tar.gz")]
    assert names, f"pip download left no sdist in {dest}: {os.listdir(dest)}"
    return os.path.join(dest, names[0])


def _extract(sdist: str, dest: str) -> None:
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            rel = member.name.split("/", 1)[-1]
            if rel in FILES and member.isfile():
                with tar.extractfile(member) as src, open(os.path.join(dest, os.path.basename(rel)), "wb") as out:
                    shutil.copyfileobj(src, out)
    missing = [f for f in FILES if not os.path.exists(os.path.join(dest, os.path.basename(f)))]
    assert not missing, f"{sdist} lacks {missing}"




def _base(name: str) -> str:
    test = name.rsplit("::", 1)[-1]
    for known in (*SKIPPED_BY_ACCELERATE, *REFUSALS):
        if test == known or test.startswith(known + "_"):
            return known
    return test


@pytest.mark.timeout(HARD_TIMEOUT + 240)
def test_accelerate_checkpoint_tests_pass_against_safeckpt_accelerator(tmp_path):
    if accelerate.__version__ != PINNED:
        pytest.skip(f"accelerate {accelerate.__version__} installed; the peer tests are pinned to {PINNED}")
    sdist = _download(str(tmp_path / "dl"))
    work = tmp_path / "peer"
    work.mkdir()
    _extract(sdist, str(work))
    shutil.copy(os.path.join(SCRIPTS, "hf_accelerate_peer_conftest.py"), work / "conftest.py")
    log, junit = work / "calls.jsonl", work / "junit.xml"
    env = dict(os.environ, SAFECKPT_PEER_LOG=str(log), OMP_NUM_THREADS="1", SAFECKPT_TIMEOUT="60")
    cmd = [sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", "-q",
           "--rootdir", str(work), "--timeout", "120", f"--junitxml={junit}", "-k", SELECT,
           *(os.path.basename(f) for f in FILES)]
    proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=HARD_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"accelerate's tests ran past {HARD_TIMEOUT} s:\n{output[-4000:]}")
    assert junit.exists(), f"no results (exit {proc.returncode}):\n{output[-4000:]}"
    results = _outcomes(str(junit))
    assert len(results) >= 38, f"only {len(results)} peer tests ran:\n{output[-3000:]}"

    wrong = []
    for name, (status, text) in sorted(results.items()):
        base = _base(name)
        if status == "skipped" and base not in SKIPPED_BY_ACCELERATE:
            wrong.append(f"{name}: skipped ({text.strip()[:200]})")
        elif status == "failed" and (base not in REFUSALS or REFUSALS[base] not in text):
            wrong.append(f"{name}: failed, not a documented refusal:\n{text.strip()[-1500:]}")
        elif status == "passed" and base in REFUSALS:
            wrong.append(f"{name}: passes, but the README lists it as a refusal (update the table)")
    assert not wrong, "\n".join(wrong)

    # Every test that saves went through safeckpt (accelerate's own writer raises, see conftest).
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    saved = {c["test"] for c in calls if c["save"] > 0}
    loaded = {c["test"] for c in calls if c["load"] > 0}
    assert len(saved) >= 32 and len(loaded) >= 30, (len(saved), len(loaded))
