"""Damaged checkpoints never load silently, crash, hang, read outside, or touch the state (issue 8).

A seeded sample of the mutation fuzzer (:mod:`tests.helpers.fuzz_mutants`, :mod:`tests.helpers.fuzz_oracle`):
real checkpoints (one saved by this process, one by 2 gloo ranks with DDP, one by 2 gloo ranks
with DTensors and extra files; each in format 3 as written now and rewritten in format 2)
damaged in their manifest (plain and with a recomputed checksum), per-file indexes, data files
and directory, then read by
verify, read_state_dict, load, CheckpointManager.restore and list in a worker process with a
per-call time limit. Each bad outcome class must have zero mutants. A failure prints the
mutants and the command that reruns them; the full run (>= 5,000 mutants) is
``python -m tests.stress.fuzz --mutants 5000 --seed 1 --out FILE.md``.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers.fuzz_oracle import BAD, CALLS
from tests.stress.fuzz import example, make_bases, run_fuzz

SEED = 8
COUNT = 250
HUGE_MB = 96  # over the manifest size cap, small enough for a quick test
CALL_TIMEOUT = 45.0  # a legit call on the largest sample manifest takes ~10 s on a busy VM
SAMPLE_CALLS = tuple(c for c in CALLS if c != "cli")  # the CLI runs in the full run (time)

# Bad outcomes that the current src/ still produces in this sample (strict: when one is fixed
# the test fails as XPASS, and its entry here must go).
KNOWN: dict[str, str] = {}


# Known library findings, matched per mutant (so other mutants with the same label still fail),
# each with the reason; strict: the test fails once a finding no longer reproduces.
KNOWN_FINDINGS: dict[str, tuple[Any, str]] = {}  # none left: verify(deep=True) now checks chunks


def _known(r: dict[str, Any]) -> bool:
    return any(match(r) for match, _ in KNOWN_FINDINGS.values())


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    bases = make_bases(str(tmp_path_factory.mktemp("fuzz-bases")))
    return run_fuzz(bases, seed=SEED, count=COUNT, huge=HUGE_MB << 20, call_timeout=CALL_TIMEOUT,
                    calls=SAMPLE_CALLS)


def _params() -> list[Any]:
    return [pytest.param(label, marks=pytest.mark.xfail(strict=True, reason=KNOWN[label]))
            if label in KNOWN else label for label in BAD]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("label", _params())
def test_no_mutant_has_bad_outcome(results: list[dict[str, Any]], label: str) -> None:
    hits = [r for r in results if label in r["bad"] and not _known(r)]
    if hits:
        ids = ",".join(str(r["mutant"]["id"]) for r in hits[:20])
        pytest.fail(
            f"{len(hits)} of {len(results)} mutants: {label}\n"
            + "\n".join(example(r, label) for r in hits[:6])
            + f"\nrerun: .venv/bin/python -m tests.stress.fuzz --seed {SEED} --mutants {COUNT} "
            f"--huge-mb {HUGE_MB} --only {ids}",
            pytrace=False,
        )


@pytest.mark.timeout(600)
@pytest.mark.parametrize("finding", sorted(KNOWN_FINDINGS))
def test_known_finding_still_reproduces(results: list[dict[str, Any]], finding: str) -> None:
    match, reason = KNOWN_FINDINGS[finding]
    if not any(match(r) for r in results):
        pytest.fail(f"known finding {finding!r} no longer reproduces ({reason}): remove it from KNOWN_FINDINGS",
                    pytrace=False)


@pytest.mark.timeout(600)
def test_fuzzer_reaches_every_family(results: list[dict[str, Any]]) -> None:
    """The sample is not vacuous: every family ran, controls load, damage is refused."""
    assert len(results) == COUNT
    classes = {r["mutant"]["cls"] for r in results}
    for family in ("manifest.value", "manifest.syntax", "forged.chunks", "forged.tree",
                   "forged.index", "forged.placement", "index.edit", "data.chunk",
                   "data.bitflip_data", "data.special", "data.link", "dir.manifest_special"):
        assert family in classes, family
    assert {r["mutant"]["base"] for r in results} == {"single", "ddp", "fsdp", "single.f2", "ddp.f2", "fsdp.f2"}
    by = {o: [r for r in results if r["outcome"] == o] for o in ("CAUGHT", "BENIGN", "FORGED_LOADED")}
    assert len(by["CAUGHT"]) > COUNT // 2
    # Reformatted manifests (same parsed JSON) and consistent forged edits do load: the oracle
    # can tell a loaded checkpoint from a refused one.
    assert any(r["mutant"]["cls"] == "manifest.benign" for r in by["BENIGN"])
    assert by["FORGED_LOADED"]


def _forged_rank1_copy(verify_deep_ok: bool, read_diff: str | None) -> dict[str, Any]:
    """Full run of 2026-11-26, seed 1, #2018 (``forged.data`` on ``fsdp.f2``): the bytes of
    rank 1's per-rank copy of ``rng/numpy/key`` changed, the file checksum recomputed, the
    chunk checksum left as it was. A 1-process read uses rank 0's copy only, so it loads the
    original values; deep verify names the chunk; shallow verify reads no tensor bytes."""
    from tests.helpers.fuzz_mutants import Mutant
    from tests.helpers.fuzz_oracle import classify

    m = Mutant(2018, "fsdp.f2", "forged.data", "rank-00001.safetensors: bytes 3728-8720 of 'rng/numpy/key' changed",
               (), changed=True, forged=True, invalid=True, verify_bad=True)
    problems = [] if verify_deep_ok else ["rank-00001.safetensors: checksum mismatch in bytes 3728-8720"]
    calls = {"verify_deep": {"ok": True, "verified": verify_deep_ok, "problems": problems},
             "verify_shallow": {"ok": True, "verified": True, "problems": []},
             "read": {"ok": True, "diff": read_diff}, "load": {"ok": True, "diff": None},
             "restore": {"ok": True, "step": 2, "diff": None}, "list": {"ok": True, "steps": [1, 2]},
             "cli": {"ok": True, "cli": {}}}
    return classify(m, calls, {}, 0.0)


def test_damage_to_a_per_rank_copy_a_1_process_read_never_reads_is_benign_when_deep_verify_refuses():
    """Oracle rule (the harness's false positive in that run): a forged inconsistency confined
    to what a 1-process read does not use is BENIGN when verify refuses it; for damaged chunk
    bytes, only deep verify reads them, so shallow verify passing is no SILENT."""
    r = _forged_rank1_copy(verify_deep_ok=False, read_diff=None)
    assert r["bad"] == {} and r["outcome"] == "BENIGN", r
    r = _forged_rank1_copy(verify_deep_ok=True, read_diff=None)  # deep verify must refuse it
    assert "SILENT" in r["bad"], r
    r = _forged_rank1_copy(verify_deep_ok=False, read_diff="t[0]: 1.0 != 2.0")  # values must be equal
    assert "SILENT" in r["bad"], r


def test_the_oracle_measures_each_calls_own_peak_memory_and_time_limits_are_bad() -> None:
    """Issue 27: a call that takes too long (SLOW) or too much memory (MEMORY) is a failure, and
    a call's memory is its own peak (the kernel's mark is reset before each call), not hidden
    by an earlier call's higher peak."""
    from tests.helpers import fuzz_oracle as oracle

    assert {"SLOW", "MEMORY", "HANG"} <= set(BAD)
    start = oracle._reset_peak()
    big = bytearray(300 << 20)
    big[::4096] = b"\1" * len(range(0, len(big), 4096))  # touch every page
    del big
    assert oracle._call_peak_mb(start) > 250
    start = oracle._reset_peak()
    if oracle._status_mb("VmHWM") is not None:  # Linux: the mark was reset, the 300 MB is not counted again
        assert oracle._call_peak_mb(start) < 100
