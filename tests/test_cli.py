"""The `safeckpt` command line: every command, its output and its exit codes.

Commands run in-process through ``cli.main([...])`` (fast, output captured); one test runs the
installed console script in a subprocess to prove the entry point works.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

import safeckpt
from safeckpt import cli
from safeckpt.coord.lease import LOCK_NAME, RootLock
from safeckpt.engine.reader import open_manifest

STAGING = ".step-0000000040.safeckpt-staging-0123abcd"
TRASH = ".step-0000000005.safeckpt-trash-deadbeef"


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def _state(model: nn.Module, **extra):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    return {"model": model, "optim": opt, **extra}


def _managed_root(root: Path, steps=(10, 20, 30)) -> Path:
    model = _model()
    state = _state(model, rng=safeckpt.RNGState())
    with safeckpt.CheckpointManager(root, keep_last=None, preemption_signals=()) as mgr:
        for s in steps:
            mgr.save(s, state, metrics={"loss": 1.0 / s})
    return root


def _flip_byte(path: Path) -> None:
    """Flip a byte inside the last tensor chunk of the data file ``path`` (not its index: a
    damaged index is seen without reading the data)."""
    man = open_manifest(str(path.parent))
    end = max(c["end"] for rec in man["tensors"].values() for c in rec.get("chunks", ()) if c["file"] == path.name)
    with open(path, "r+b") as f:
        f.seek(end - 3)
        b = f.read(1)
        f.seek(end - 3)
        f.write(bytes([b[0] ^ 0x10]))


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    """Read-only checkpoints shared by the tests that do not modify them."""
    base = tmp_path_factory.mktemp("ckpts")
    model = _model()
    state = _state(model, epoch=3)
    safeckpt.save(base / "a", state, metadata={"run": "demo"})
    safeckpt.save(base / "a2", state, metadata={"run": "demo"})
    with torch.no_grad():
        model[0].weight[1, 2] += 0.5
    state["epoch"] = 4
    safeckpt.save(base / "b", state, metadata={"run": "other"})
    extra = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))  # last layer: another shape
    extra.register_buffer("counter", torch.zeros(2, dtype=torch.int64))
    safeckpt.save(base / "c", {"model": extra, "epoch": 3}, metadata={"run": "demo"})
    bad = base / "bad"
    safeckpt.save(bad, state)
    _flip_byte(bad / "rank-00000.safetensors")
    _managed_root(base / "root")
    return {"base": base, "a": base / "a", "a2": base / "a2", "b": base / "b", "c": base / "c",
            "bad": bad, "root": base / "root"}


# ----------------------------------------------------------------------------- generic


def test_help_lists_every_command_and_version(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0
    for command in ("ls", "inspect", "verify", "gc", "diff", "consolidate", "convert"):
        assert command in out
    code, out, _ = run(capsys, "--version")
    assert code == 0 and safeckpt.__version__ in out


def test_usage_errors_exit_2(capsys):
    code, _, err = run(capsys)
    assert code == 2 and "COMMAND" in err
    code, _, err = run(capsys, "verify")
    assert code == 2


def test_missing_path_is_one_clear_line_with_the_error_exit_code(capsys, tmp_path):
    code, out, err = run(capsys, "inspect", tmp_path / "nope")
    assert code == safeckpt.CheckpointNotFound.exit_code == 2
    assert out == ""
    assert err.count("\n") == 1 and "nope" in err and err.startswith("safeckpt inspect: error:")


def test_works_without_rich(capsys, ckpts, monkeypatch):
    monkeypatch.setitem(sys.modules, "rich", None)  # `import rich` now raises ImportError
    monkeypatch.setenv("SAFECKPT_PROGRESS", "1")  # would draw a bar: falls back to none, with a hint
    code, out, err = run(capsys, "verify", ckpts["bad"])
    assert code == 5 and "checksum mismatch" in out and "pip install 'safeckpt[cli]'" in err


def test_console_script_entry_point(ckpts):
    exe = Path(sys.executable).with_name("safeckpt")
    assert exe.exists(), "the safeckpt console script is not installed next to this python"
    # One run (each pays for importing torch): the exit code must reach the shell.
    bad = subprocess.run([str(exe), "verify", "--json", str(ckpts["bad"])], capture_output=True, text=True, timeout=120)
    assert bad.returncode == safeckpt.CorruptCheckpoint.exit_code == 5, bad.stderr
    assert json.loads(bad.stdout)["ok"] is False


# ----------------------------------------------------------------------------- ls


def test_ls_table_and_json(capsys, ckpts):
    code, out, _ = run(capsys, "ls", ckpts["root"])
    assert code == 0
    lines = [ln for ln in out.splitlines() if ln.startswith("step-")]
    assert [ln.split()[0] for ln in lines] == ["step-0000000010", "step-0000000020", "step-0000000030"]
    assert all("committed" in ln and "loss=" in ln and "KiB" in ln for ln in lines)
    assert "writer lease" not in out  # the manager released it on close

    code, out, _ = run(capsys, "ls", "--json", ckpts["root"])
    data = json.loads(out)
    assert code == 0 and data["lease"] is None
    assert [(e["step"], e["status"], e["world_size"]) for e in data["entries"]] == [
        (10, "committed", 1), (20, "committed", 1), (30, "committed", 1)]
    assert data["entries"][0]["metrics"] == {"loss": 0.1}
    assert data["entries"][0]["nbytes"] > 0 and data["entries"][0]["created_at"].endswith("Z")


def test_ls_shows_leftovers_corrupt_incomplete_and_unmanaged(capsys, tmp_path):
    root = _managed_root(tmp_path / "root")
    (root / STAGING).mkdir()
    (root / STAGING / "rank-00000.safetensors").write_bytes(b"x" * 100)
    (root / "step-0000000050").mkdir()
    (root / "step-0000000050" / "manifest.json").write_text("{not json")
    (root / "step-0000000060").mkdir()  # no manifest: incomplete
    (root / "notes").mkdir()  # foreign: not listed, never touched
    with open(root / "step-0000000020" / "rank-00000.safetensors", "r+b") as f:
        f.truncate(100)  # sizes are checked even without --verify
    _flip_byte(root / "step-0000000010" / "rank-00000.safetensors")  # only --verify sees this
    safeckpt.save(root / "final", {"model": _model()})  # saved outside the manager: listed too

    code, out, _ = run(capsys, "ls", "--json", root)
    assert code == 0
    status = {e["name"]: e["status"] for e in json.loads(out)["entries"]}
    assert status == {
        "step-0000000010": "committed",
        "step-0000000020": "corrupt",
        "step-0000000030": "committed",
        STAGING: "staging (leftover)",
        "step-0000000050": "corrupt",
        "step-0000000060": "incomplete",
        "final": "committed",
    }
    code, out, _ = run(capsys, "ls", "--verify", "--json", root)
    entries = {e["name"]: e for e in json.loads(out)["entries"]}
    assert entries["step-0000000010"]["status"] == "corrupt"
    assert "checksum mismatch" in entries["step-0000000010"]["problems"][0]
    assert entries["step-0000000030"]["status"] == "committed"
    assert entries["final"]["managed"] is False

    code, out, _ = run(capsys, "ls", root)
    assert code == 0
    assert "staging (leftover)" in out and "incomplete" in out and "corrupt" in out
    assert f"safeckpt gc {root}" in out
    assert "notes" not in out


def test_ls_shows_the_writer_lease(capsys, tmp_path):
    root = _managed_root(tmp_path / "root", steps=(1,))
    lock = RootLock(str(root))
    lock.acquire()
    try:
        code, out, _ = run(capsys, "ls", root)
        assert code == 0 and "writer lease" in out and "LIVE" in out and str(os.getpid()) in out
        (root / STAGING).mkdir()
        code, out, _ = run(capsys, "ls", "--json", root)
        data = json.loads(out)
        assert data["lease"]["live"] is True and data["lease"]["pid"] == os.getpid()
        assert {e["name"]: e["status"] for e in data["entries"]}[STAGING] == "staging (live writer)"
    finally:
        lock.release()


def test_ls_missing_root(capsys, tmp_path):
    code, _, err = run(capsys, "ls", tmp_path / "none")
    assert code == 2 and "no such directory" in err and err.count("\n") == 1
    (tmp_path / "file").write_text("x")
    code, _, err = run(capsys, "ls", tmp_path / "file")
    assert code == 2 and "is a file, not a directory" in err and err.count("\n") == 1


# ----------------------------------------------------------------------------- inspect


def test_inspect_text_and_json(capsys, ckpts):
    code, out, _ = run(capsys, "inspect", ckpts["a"])
    assert code == 0
    assert "world size  1" in out and "run = 'demo'" in out and "torch" in out
    assert "model/0.weight" in out and "(16, 8)" in out and "512 B" in out and "replicated" in out

    code, out, _ = run(capsys, "inspect", "--json", "--values", ckpts["a"])
    data = json.loads(out)
    assert code == 0
    assert data["metadata"] == {"run": "demo"} and data["world_size"] == 1
    assert data["torch_version"] == torch.__version__ and data["safeckpt_version"] == safeckpt.__version__
    tensors = {t["key"]: t for t in data["tensors"]}
    assert tensors["model/0.weight"] == {"key": "model/0.weight", "dtype": "F32", "shape": [16, 8],
                                         "nbytes": 512, "scope": "replicated", "chunks": 1}
    assert "optim/state/0/exp_avg" in tensors
    assert data["objects"]["model"] == {"kind": "module", "tensors": 4, "nbytes": 4 * (16 * 8 + 16 + 16 * 3 + 3)}
    assert data["values"]["epoch"] == 3 and data["values"]["optim/param_groups/0/lr"] == 1e-3


def test_inspect_managed_checkpoint_shows_step_and_metrics(capsys, ckpts):
    code, out, _ = run(capsys, "inspect", ckpts["root"] / "step-0000000020")
    assert code == 0 and "step        20" in out and "loss=0.05" in out
    assert "rng/" in out and "per_rank" in out


# ----------------------------------------------------------------------------- verify


def test_verify_exit_codes(capsys, ckpts, tmp_path):
    code, out, _ = run(capsys, "verify", ckpts["a"])
    assert code == 0 and out.startswith("OK")
    code, out, _ = run(capsys, "verify", ckpts["bad"])
    assert code == 5 and out.startswith("CORRUPT") and "checksum mismatch" in out
    code, out, _ = run(capsys, "verify", "--no-deep", ckpts["bad"])  # same size: only checksums catch it
    assert code == 0 and "no checksums" in out
    code, out, _ = run(capsys, "verify", "--json", ckpts["bad"])
    data = json.loads(out)
    assert code == 5 and data["ok"] is False and data["deep"] is True and data["exit_code"] == 5
    code, _, err = run(capsys, "verify", tmp_path / "missing")
    assert code == 2 and "missing" in err

    trunc = tmp_path / "trunc"
    safeckpt.save(trunc, {"model": _model()})
    with open(trunc / "rank-00000.safetensors", "r+b") as f:
        f.truncate(64)
    code, out, _ = run(capsys, "verify", "--no-deep", trunc)
    assert code == 5 and "truncated" in out
    (trunc / "manifest.json").write_text("[]")
    code, out, _ = run(capsys, "verify", trunc)
    assert code == 5 and "not a safeckpt manifest" in out


def test_deep_verify_with_progress_bar_agrees(capsys, ckpts, monkeypatch):
    monkeypatch.setenv("SAFECKPT_PROGRESS", "1")  # draw bars even though stderr is captured
    assert run(capsys, "verify", ckpts["a"])[0] == 0
    code, out, _ = run(capsys, "verify", ckpts["bad"])
    assert code == 5 and "checksum mismatch" in out
    code, out, _ = run(capsys, "ls", "--verify", "--json", ckpts["root"])
    assert code == 0 and {e["status"] for e in json.loads(out)["entries"]} == {"committed"}


# ----------------------------------------------------------------------------- gc


def _litter(root: Path) -> None:
    (root / STAGING).mkdir()
    (root / STAGING / "rank-00000.safetensors").write_bytes(b"x" * 10)
    (root / TRASH).mkdir()
    (root / "notes").mkdir()  # foreign
    (root / "notes" / "keep.txt").write_text("mine")
    (root / ".hidden-tool-dir").mkdir()  # foreign, hidden
    (root / "step-0000000099").mkdir()  # incomplete: not ours to delete
    (root / "README").write_text("mine")


def test_gc_removes_leftovers_only(capsys, tmp_path):
    root = _managed_root(tmp_path / "root")
    _litter(root)
    before = sorted(os.listdir(root))
    code, out, _ = run(capsys, "gc", "--dry-run", root)
    assert code == 0 and "would remove" in out and sorted(os.listdir(root)) == before

    code, out, _ = run(capsys, "gc", root)
    assert code == 0, out
    assert sorted(os.listdir(root)) == sorted([".hidden-tool-dir", "README", "notes", "step-0000000010",
                                               "step-0000000020", "step-0000000030", "step-0000000099"])
    assert (root / "notes" / "keep.txt").read_text() == "mine"
    assert "step-0000000099" in out and "left alone" in out
    assert [i.step for i in safeckpt.CheckpointManager(root, preemption_signals=()).list()] == [10, 20, 30]

    code, out, _ = run(capsys, "gc", "--json", root)
    assert code == 0 and json.loads(out)["removed"] == []


def test_gc_retention_rules_never_delete_the_newest(capsys, tmp_path):
    root = _managed_root(tmp_path / "root", steps=(10, 20, 30, 40))
    _litter(root)
    code, out, _ = run(capsys, "gc", "--dry-run", "--json", "--keep-last", "2", root)
    plan = json.loads(out)
    assert code == 0 and sorted(r["name"] for r in plan["removed"]) == sorted([STAGING, TRASH, "step-0000000010", "step-0000000020"])
    assert (root / "step-0000000010").exists()

    code, out, _ = run(capsys, "gc", "--json", "--keep-every", "20", root)
    data = json.loads(out)
    assert code == 0
    assert {r["name"]: r["reason"] for r in data["removed"]} == {
        STAGING: "staging leftover", TRASH: "trash leftover", "step-0000000010": "retention",
        "step-0000000030": "retention"}
    assert data["kept"] == ["step-0000000020", "step-0000000040"]
    assert (root / "notes").exists() and (root / "step-0000000099").exists()

    code, out, _ = run(capsys, "gc", "--json", "--keep-best", "1", "--best-metric", "loss", "--best-mode", "max", root)
    assert code == 0 and [r["name"] for r in json.loads(out)["removed"]] == []  # best (20) and newest (40)
    code, out, _ = run(capsys, "gc", "--keep-last", "1", root)
    assert code == 0 and sorted(p for p in os.listdir(root) if p.startswith("step-")) == ["step-0000000040", "step-0000000099"]


def test_gc_bad_retention_arguments(capsys, tmp_path):
    root = _managed_root(tmp_path / "root", steps=(1,))
    code, _, err = run(capsys, "gc", "--keep-best", "2", root)
    assert code == 2 and "best_metric" in err
    code, _, err = run(capsys, "gc", "--keep-last", "0", root)
    assert code == 2 and "keep_last" in err
    assert (root / "step-0000000001").exists()


def test_gc_refuses_while_a_live_writer_holds_the_lease(capsys, tmp_path):
    root = _managed_root(tmp_path / "root", steps=(1, 2))
    _litter(root)
    lock = RootLock(str(root))
    lock.acquire()
    try:
        code, out, err = run(capsys, "gc", "--keep-last", "1", root)
        assert code == safeckpt.CheckpointLocked.exit_code == 7
        assert "live writer" in err and err.count("\n") == 1
        assert (root / STAGING).exists() and (root / "step-0000000001").exists()

        code, out, _ = run(capsys, "gc", "--dry-run", root)
        assert code == 0 and "would refuse" in out and (root / STAGING).exists()

        code, out, err = run(capsys, "gc", "--break-lock", root)
        assert code == 0 and "broke the writer lease" in err
        assert not (root / STAGING).exists() and not (root / TRASH).exists()
        assert (root / "notes").exists() and (root / "step-0000000001").exists()
        assert not (root / LOCK_NAME).exists()  # gc held the lease while deleting, then let go
    finally:
        lock.release()


def test_gc_takes_over_a_stale_lease(capsys, tmp_path):
    root = _managed_root(tmp_path / "root", steps=(1,))
    _litter(root)
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(proc.stdout)
    (root / LOCK_NAME).write_text(json.dumps({"run_id": "crashed", "host": socket.gethostname(),
                                              "pid": dead_pid, "started": 0, "lease": 120}))
    code, out, _ = run(capsys, "ls", root)
    assert "stale" in out
    code, out, _ = run(capsys, "gc", root)
    assert code == 0 and not (root / STAGING).exists() and not (root / LOCK_NAME).exists()


# ----------------------------------------------------------------------------- diff


def test_diff_identical(capsys, ckpts):
    code, out, _ = run(capsys, "diff", ckpts["a"], ckpts["a2"])
    assert code == 0 and "identical" in out
    code, out, _ = run(capsys, "diff", "--json", ckpts["a"], ckpts["a2"])
    data = json.loads(out)
    assert code == 0 and data["identical"] is True and all(t["max_abs_diff"] == 0 for t in data["tensors"])


def test_diff_reports_tensor_value_and_metadata_differences(capsys, ckpts):
    code, out, _ = run(capsys, "diff", ckpts["a"], ckpts["b"])
    assert code == 1
    assert "model/0.weight" in out and "0.5" in out and "epoch" in out and "metadata/run" in out

    code, out, _ = run(capsys, "diff", "--json", ckpts["a"], ckpts["b"])
    data = json.loads(out)
    assert code == 1 and data["identical"] is False
    differing = {t["key"]: t["max_abs_diff"] for t in data["tensors"] if not t["equal"]}
    assert set(differing) == {"model/0.weight"} and differing["model/0.weight"] == pytest.approx(0.5)
    assert data["values"] == [{"key": "epoch", "a": 3, "b": 4}]
    assert data["metadata"] == [{"key": "metadata/run", "a": "demo", "b": "other"}]
    assert data["only_in_a"] == data["only_in_b"] == []

    code, out, _ = run(capsys, "diff", "--json", "--atol", "1", ckpts["a"], ckpts["b"])
    assert code == 1  # within atol, but epoch and metadata still differ
    assert all(t["equal"] for t in json.loads(out)["tensors"])


def test_diff_missing_keys_and_shape_mismatch(capsys, ckpts):
    code, out, _ = run(capsys, "diff", "--json", ckpts["a"], ckpts["c"])
    data = json.loads(out)
    assert code == 1
    assert "model/counter" in data["only_in_b"] and "optim/state/0/exp_avg" in data["only_in_a"]
    assert {m["key"] for m in data["mismatched"]} == {"model/2.weight", "model/2.bias"}
    mismatch = {m["key"]: m for m in data["mismatched"]}["model/2.weight"]
    assert mismatch["a"]["shape"] == [3, 16] and mismatch["b"]["shape"] == [4, 16]
    code, out, _ = run(capsys, "diff", ckpts["a"], ckpts["c"])
    assert "only in A" in out and "only in B" in out and "dtype/shape differ" in out


def test_diff_of_a_corrupt_checkpoint_is_an_error(capsys, ckpts, tmp_path):
    code, _, err = run(capsys, "diff", ckpts["a"], ckpts["bad"])
    assert code == 5 and "checksum" in err
    code, _, err = run(capsys, "diff", ckpts["a"], tmp_path / "nope")
    assert code == 2


def test_max_abs_diff_edge_values():
    from safeckpt.cli.diff import _max_abs_diff

    a = torch.tensor([1.0, float("nan"), float("inf"), -0.0, 2.0])
    assert _max_abs_diff(a, a.clone()) == 0.0
    assert _max_abs_diff(a, torch.tensor([1.0, float("nan"), float("inf"), 0.0, 2.5])) == 0.5
    assert _max_abs_diff(a, torch.tensor([1.0, 0.0, float("inf"), 0.0, 2.0])) == float("inf")
    assert _max_abs_diff(torch.tensor([True, False]), torch.tensor([True, True])) == 1.0
    assert _max_abs_diff(torch.arange(10, dtype=torch.int64), torch.arange(10, dtype=torch.int64) * 2, piece=3) == 9.0
    # dtypes torch will not promote together (a checkpoint whose dtype changed): compared widened
    assert _max_abs_diff(torch.arange(4, dtype=torch.int64), torch.tensor([0, 2, 4, 6], dtype=torch.uint64)) == 3.0
    assert _max_abs_diff(torch.ones(3, dtype=torch.uint32), torch.ones(3, dtype=torch.bfloat16)) == 0.0


# ----------------------------------------------------------------------------- consolidate


def test_consolidate_only_model_loads_into_the_plain_module(capsys, ckpts, tmp_path, monkeypatch):
    out_file = tmp_path / "model.safetensors"
    code, out, _ = run(capsys, "consolidate", ckpts["b"], "-o", out_file, "--only", "model")
    assert code == 0 and "4 tensor(s)" in out
    loaded = load_file(str(out_file))
    assert set(loaded) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    fresh = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    fresh.load_state_dict(loaded, strict=True)
    expect = safeckpt.read_state_dict(ckpts["b"])
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, expect[f"model/{k}"])
    with safe_open(str(out_file), "pt") as f:
        assert f.metadata()["format"] == "pt"  # what Hugging Face loaders check

    code, _, err = run(capsys, "consolidate", ckpts["b"], "-o", out_file, "--only", "model")
    assert code == 8 and "--overwrite" in err
    monkeypatch.setenv("SAFECKPT_PROGRESS", "1")
    code, _, _ = run(capsys, "consolidate", ckpts["a"], "-o", out_file, "--only", "model", "--overwrite")
    assert code == 0 and not torch.equal(load_file(str(out_file))["0.weight"], loaded["0.weight"])
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]  # no temp file left


def test_consolidate_everything_and_errors(capsys, ckpts, tmp_path):
    out_file = tmp_path / "full.safetensors"
    step20 = ckpts["root"] / "step-0000000020"
    code, _, _ = run(capsys, "consolidate", step20, "-o", out_file)
    assert code == 0
    full = load_file(str(out_file))
    expect = {k: v for k, v in safeckpt.read_state_dict(step20).items() if isinstance(v, torch.Tensor)}
    assert set(full) == set(expect)
    for k in expect:
        assert torch.equal(full[k], expect[k]), k
    with safe_open(str(out_file), "pt") as f:
        meta = f.metadata()
    assert meta["safeckpt.step"] == "20"
    assert json.loads(meta["safeckpt.values"])["optim/param_groups"][0]["lr"] == 1e-3

    code, _, err = run(capsys, "consolidate", step20, "-o", tmp_path / "x.safetensors", "--only", "nope")
    assert code == 1 and "model" in err and not (tmp_path / "x.safetensors").exists()
    code, _, err = run(capsys, "consolidate", ckpts["bad"], "-o", tmp_path / "y.safetensors")
    assert code == 5 and not (tmp_path / "y.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full.safetensors"]


# ----------------------------------------------------------------------------- convert


def test_convert_to_hugging_face_single_and_sharded(capsys, ckpts, tmp_path):
    out_dir = tmp_path / "hf"
    code, out, _ = run(capsys, "convert", ckpts["a"], out_dir, "--to", "hf")
    assert code == 0 and "model.safetensors" in out
    fresh = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    fresh.load_state_dict(load_file(str(out_dir / "model.safetensors")), strict=True)

    code, _, err = run(capsys, "convert", ckpts["a"], out_dir, "--to", "hf")
    assert code == 8 and "overwrite" in err
    code, _, _ = run(capsys, "convert", ckpts["a"], out_dir, "--to", "hf", "--max-shard-size", "300", "--overwrite")
    assert code == 0
    index = json.loads((out_dir / "model.safetensors.index.json").read_text())
    merged = {}
    for fname in set(index["weight_map"].values()):
        merged.update(load_file(str(out_dir / fname)))
    assert set(merged) == set(index["weight_map"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert not (out_dir / "model.safetensors").exists()  # the earlier single file was replaced

    code, _, err = run(capsys, "convert", ckpts["a"], out_dir, "--to", "hf", "--max-shard-size", "lots")
    assert code == 2 and "size" in err


def test_convert_from_torch_save_needs_allow_pickle(capsys, tmp_path):
    model = _model()
    src = tmp_path / "model.pt"
    torch.save({"model": model.state_dict(), "epoch": 7}, src)
    code, _, err = run(capsys, "convert", src, tmp_path / "imported", "--from", "torch-save")
    assert code == 1 and "--allow-pickle" in err and not (tmp_path / "imported").exists()
    code, out, _ = run(capsys, "convert", src, tmp_path / "imported", "--from", "torch-save", "--allow-pickle")
    assert code == 0 and "safeckpt checkpoint" in out
    assert run(capsys, "verify", tmp_path / "imported")[0] == 0
    flat = safeckpt.read_state_dict(tmp_path / "imported")
    assert flat["epoch"] == 7 and torch.equal(flat["model/0.weight"], model.state_dict()["0.weight"])
    code, _, err = run(capsys, "convert", src, tmp_path / "x", "--from", "torch-save", "--only", "model")
    assert code == 2 and "--to hf" in err


def test_convert_from_dcp(capsys, tmp_path):
    import warnings

    import torch.distributed.checkpoint as dcp

    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": model.state_dict(), "extra": {"epoch": 3}}, checkpoint_id=str(tmp_path / "dcp"))
    code, _, _ = run(capsys, "convert", tmp_path / "dcp", tmp_path / "imported", "--from", "dcp")
    assert code == 0
    code, out, _ = run(capsys, "consolidate", tmp_path / "imported", "-o", tmp_path / "m.safetensors", "--only", "model")
    assert code == 0
    fresh = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    fresh.load_state_dict(load_file(str(tmp_path / "m.safetensors")), strict=True)
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters()))
    code, _, err = run(capsys, "convert", tmp_path / "nothing", tmp_path / "x", "--from", "dcp")
    assert code == 2 and ".metadata" in err


def test_gc_puts_back_a_checkpoint_an_overwrite_set_aside(tmp_path):
    """An overwrite on a filesystem without renameat2 flags killed between its two renames
    leaves the committed checkpoint only under ``.<name>.safeckpt-replaced-<hex>``: `safeckpt gc`
    renames it back (it was counted as committed and never deleted, but stayed aside)."""
    root = tmp_path / "root"
    root.mkdir()
    safeckpt.save(str(root / "step-0000000005"), {"w": torch.arange(4.0)}, step=5)
    aside = root / ".step-0000000005.safeckpt-replaced-0123456789ab"
    os.rename(root / "step-0000000005", aside)
    assert cli.main(["gc", str(root)]) == 0
    assert (root / "step-0000000005").is_dir() and not aside.exists()
    assert torch.equal(safeckpt.read_state_dict(str(root / "step-0000000005"))["w"], torch.arange(4.0))


def test_ls_of_a_root_that_is_also_the_local_dir_shows_both(capsys, tmp_path):
    """local_dir == root: the node's tier table and root's checkpoints, not the tier alone."""
    root = str(tmp_path / "root")
    with safeckpt.CheckpointManager(root, local_dir=root, durable_every=2, keep_last=2,
                                    preemption_signals=()) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"w": torch.arange(8, dtype=torch.float32) * step, "v": step})
    code, out, _ = run(capsys, "ls", root)
    assert code == 0
    assert "local tier" in out, out
    assert [ln.split()[0] for ln in out.splitlines() if ln.startswith("step-")] == [
        "step-0000000002", "step-0000000003"], out
    code, out, _ = run(capsys, "ls", "--json", root)
    data = json.loads(out)
    assert [e["step"] for e in data["entries"]] == [2, 3]
    assert data["local_tier"] and data["local_tier"][0]["steps"], data["local_tier"]
