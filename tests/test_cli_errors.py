"""The CLI on bad inputs: every error is one line on stderr with its documented exit code.

Every command meets every kind of bad path (missing, a file, a FIFO, a dangling symlink, a root
instead of a checkpoint, damaged manifests: invalid JSON, edited, forged with wrong types;
truncated, symlinked and FIFO data files, a URL without credentials...) in-process through
``cli.main`` (the same code the console script runs). Then real subprocesses of the installed
``safeckpt`` script, started together to share the cost of importing torch, check what only a
process shows: the exit status, no traceback from the interpreter, ``--debug`` tracebacks,
Ctrl-C, a closed output pipe, permission denied (as an unprivileged user when run as root).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from torch import nn

import safeckpt
from safeckpt import cli
from safeckpt.cli.common import EXIT_CODES
from safeckpt.format.manifest import CHECKSUM_FIELD, MANIFEST, encode_manifest

pytestmark = pytest.mark.timeout(300)

EXE = Path(sys.executable).with_name("safeckpt")
DATA = "rank-00000.safetensors"
CORRUPT = safeckpt.CorruptCheckpoint.exit_code
NOT_FOUND = 2


def _state():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return {"model": model, "optim": opt, "epoch": 1}


def _edit(ckpt: Path, fn, *, forge: bool) -> None:
    """Change the parsed manifest; ``forge`` recomputes its checksum (a buggy writer), so the
    checks behind the checksum see the edit."""
    man = json.loads((ckpt / MANIFEST).read_text())
    man.pop(CHECKSUM_FIELD, None)
    fn(man)
    raw = encode_manifest(man) if forge else json.dumps(man).encode()
    (ckpt / MANIFEST).write_bytes(raw)


def _first_tensor(man):
    return next(iter(man["tensors"].values()))


MANIFEST_DAMAGE = {
    "invalid_json": None,
    "edited_world_size": (lambda m: m.__setitem__("world_size", "abc"), False),
    "forged_world_size": (lambda m: m.__setitem__("world_size", "abc"), True),
    "forged_tensors_list": (lambda m: m.__setitem__("tensors", []), True),
    "forged_objects_null": (lambda m: m.__setitem__("objects", None), True),
    "forged_dtype": (lambda m: _first_tensor(m).__setitem__("dtype", "F99"), True),
    "forged_shape": (lambda m: _first_tensor(m).__setitem__("shape", "x"), True),
    "forged_negative_shape": (lambda m: _first_tensor(m).__setitem__("shape", [-3, 4]), True),
    "forged_no_files": (lambda m: m.__setitem__("files", {}), True),
}
DATA_DAMAGE = ("truncated_data", "data_symlink_outside", "data_fifo")


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("bad")
    good = base / "good"
    safeckpt.save(good, _state())
    p: dict[str, Path] = {"good": good, "missing": base / "missing", "file": base / "notes.txt",
                          "safetensors_file": base / "weights.safetensors", "fifo": base / "fifo",
                          "dangling_symlink": base / "dangling", "symlink_to_good": base / "link",
                          "empty_dir": base / "empty", "root": base / "root", "manifest_file": good / MANIFEST}
    p["file"].write_text("not a checkpoint")
    shutil.copy(good / DATA, p["safetensors_file"])
    os.mkfifo(p["fifo"])
    os.symlink(base / "nowhere", p["dangling_symlink"])
    os.symlink(good, p["symlink_to_good"])
    p["empty_dir"].mkdir()
    (p["root"] / "step-0000000010").mkdir(parents=True)

    def copy(name: str) -> Path:
        p[name] = base / name
        shutil.copytree(good, p[name])
        return p[name]

    (copy("invalid_json") / MANIFEST).write_text("{not json")
    for name, spec in MANIFEST_DAMAGE.items():
        if spec is not None:
            _edit(copy(name), spec[0], forge=spec[1])
    os.truncate(copy("truncated_data") / DATA, 50)
    ck = copy("data_symlink_outside")
    os.replace(ck / DATA, base / "outside.safetensors")
    os.symlink(base / "outside.safetensors", ck / DATA)
    ck = copy("data_fifo")
    os.unlink(ck / DATA)
    os.mkfifo(ck / DATA)
    p["out"] = base / "out" / "full.safetensors"
    p["out"].parent.mkdir()
    p["hf"] = base / "hf"
    return p


def run(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line(code: int, out: str, err: str, command: str) -> None:
    """The contract: no traceback; an error is exactly one line ``safeckpt CMD: ...``."""
    assert "Traceback" not in err + out
    assert code != 70, f"internal error (a bug) reported: {err}"
    assert code in {c for c, _ in EXIT_CODES}, (code, err)
    results = {("verify", CORRUPT), ("diff", 1)}  # answers on stdout, not errors
    if code == 0 or ((command, code) in results and err == ""):
        return
    lines = err.splitlines()
    assert len(lines) == 1 and err.endswith("\n"), err
    assert lines[0].startswith(f"safeckpt {command}: "), err


COMMANDS = {
    "ls": lambda p, x: ["ls", x],
    "inspect": lambda p, x: ["inspect", x],
    "verify": lambda p, x: ["verify", x],
    "gc": lambda p, x: ["gc", "--dry-run", x],
    "diff B": lambda p, x: ["diff", p["good"], x],
    "diff A": lambda p, x: ["diff", x, p["good"]],
    "consolidate": lambda p, x: ["consolidate", x, "-o", p["out"], "--overwrite"],
    "convert": lambda p, x: ["convert", x, p["hf"], "--to", "hf", "--overwrite"],
}
ALL_2 = dict.fromkeys(COMMANDS, NOT_FOUND)
CORRUPT_MANIFEST = {**dict.fromkeys(COMMANDS, CORRUPT), "ls": 0, "gc": NOT_FOUND}
CORRUPT_DATA = {**CORRUPT_MANIFEST, "inspect": 0}  # inspect reads only the manifest
EXPECTED: dict[str, dict[str, int]] = {
    "good": {**dict.fromkeys(COMMANDS, 0), "gc": NOT_FOUND},  # gc refuses a checkpoint directory
    "symlink_to_good": {**dict.fromkeys(COMMANDS, 0), "gc": NOT_FOUND},
    "missing": ALL_2, "file": ALL_2, "safetensors_file": ALL_2, "fifo": ALL_2,
    "dangling_symlink": ALL_2, "manifest_file": ALL_2,
    "empty_dir": {**ALL_2, "ls": 0, "gc": 0},
    "root": {**ALL_2, "ls": 0, "gc": 0},
    "invalid_json": CORRUPT_MANIFEST,
    **{name: CORRUPT_MANIFEST for name in MANIFEST_DAMAGE},
    **{name: CORRUPT_DATA for name in DATA_DAMAGE},
}
HINTS = {  # what the one line must say for paths of the wrong kind
    "file": "is a file, not a", "safetensors_file": "plain safetensors file", "fifo": "FIFO",
    "dangling_symlink": "does not exist", "missing": "no such", "manifest_file": "pass the checkpoint directory",
    "root": "checkpoint root",
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_command_on_every_bad_path(capsys, paths, name):
    for command, argv in COMMANDS.items():
        code, out, err = run(capsys, *argv(paths, paths[name]))
        assert code == EXPECTED[name][command], (name, command, code, err)
        assert_one_line(code, out, err, command.split()[0])
        if command == "verify" and code == CORRUPT:
            assert out.startswith("CORRUPT") and err == ""
        hint = HINTS.get(name)
        if hint and code == NOT_FOUND and command not in ("ls", "gc"):
            assert hint in err, (command, err)


def test_forged_manifest_edits_never_reach_the_commands_as_bugs(capsys, paths, tmp_path):
    """Random value edits with a recomputed checksum: every command reports them as corrupt
    (one line) or, for an edit that keeps the checkpoint consistent, works; never a bug."""
    good = json.loads((paths["good"] / MANIFEST).read_text())
    rng = random.Random(1234)
    leaves = []

    def walk(node, where):
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for k, v in items:
            walk(v, (*where, k))
        leaves.append(where)

    walk(good, ())
    leaves = [w for w in leaves if w and w[0] != CHECKSUM_FIELD]
    values = [None, -1, 0, 2**70, 1.5, "abc", "", [], {}, [1, 2], {"@tensor": "nope"}, True, "../x"]
    outcomes = {}
    for i in range(40):
        where, value = rng.choice(leaves), rng.choice(values)
        ck = tmp_path / f"m{i}"
        shutil.copytree(paths["good"], ck)

        def put(man, where=where, value=value):
            node = man
            for k in where[:-1]:
                node = node[k]
            node[where[-1]] = value

        _edit(ck, put, forge=True)
        for command in ("inspect", "verify", "diff", "consolidate"):
            argv = {"inspect": ["inspect", ck], "verify": ["verify", ck], "diff": ["diff", paths["good"], ck],
                    "consolidate": ["consolidate", ck, "-o", tmp_path / "o.safetensors", "--overwrite"]}[command]
            code, out, err = run(capsys, *argv)
            assert_one_line(code, out, err, command)
            outcomes[code] = outcomes.get(code, 0) + 1
    assert outcomes.get(CORRUPT, 0) > 40  # most edits are caught, not loaded


def test_usage_errors_are_one_line(capsys, paths):
    cases = [
        (["verify"], "safeckpt verify: error: the following arguments are required: CKPT"),
        (["bogus"], "invalid choice"),
        (["diff", paths["good"], paths["good"], "--atol", "lots"], "invalid float value"),
        (["gc", paths["root"], "--keep-last", "-1"], "keep_last"),
        (["gc", paths["root"], "--keep-best", "2"], "best_metric"),
        (["consolidate", paths["good"], "-o", paths["empty_dir"]], "is a directory"),
        (["consolidate", paths["good"], "-o", paths["file"] / "x.safetensors"], "is a file, not a directory"),
        (["consolidate", paths["good"], "-o", paths["missing"] / "x.safetensors"], "does not exist"),
        (["consolidate", paths["good"], "-o", "s3://bucket/x.safetensors"], "local path"),
        (["convert", paths["good"], "s3://bucket/hf", "--to", "hf"], "local directory"),
        (["convert", paths["good"], paths["file"], "--to", "hf"], "must be a directory"),
        (["inspect", ""], "empty"),
        (["ls", "s3://"], "names no bucket"),
    ]
    for argv, needle in cases:
        code, out, err = run(capsys, *argv)
        assert code == 2, (argv, err)
        assert err.count("\n") == 1 and needle in err and "Traceback" not in err, (argv, err)
        assert "usage:" not in err  # argparse's multi-line usage block is not printed


def test_unexpected_exception_is_one_line_naming_a_bug_and_debug_shows_the_traceback(capsys, paths, monkeypatch):
    def broken(args, ui):
        return {}["missing-key"]

    make = cli.app._parser  # (the parser holds each command's function: replace it there)
    monkeypatch.setattr(cli.app, "_parser", lambda: _with_func(make(), "inspect", broken))
    code, out, err = run(capsys, "inspect", paths["good"])
    assert code == 70 and out == ""
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "internal error: KeyError: 'missing-key'" in err and "bug in safeckpt" in err and "--debug" in err
    for argv in (["--debug", "inspect", paths["good"]], ["inspect", paths["good"], "--debug"]):
        code, _, err = run(capsys, *argv)
        assert code == 70 and "Traceback (most recent call last)" in err and "KeyError" in err
        assert err.splitlines()[-1].startswith("safeckpt inspect: internal error: KeyError")
    # an expected error with --debug: same line and code, traceback added
    code, _, err = run(capsys, "--debug", "verify", paths["file"])
    assert code == 2 and "Traceback" in err and err.splitlines()[-1].startswith("safeckpt verify: error:")


def _with_func(parser, command, func):
    sub = next(a for a in parser._actions if a.dest == "command")
    sub.choices[command].set_defaults(func=func)
    return parser


def test_os_errors_have_specific_lines():
    from safeckpt.cli.exit_codes import describe

    cases = [
        (PermissionError(13, "Permission denied", "/x/manifest.json"), 74, "permission denied: /x/manifest.json"),
        (NotADirectoryError(20, "Not a directory", "/x/f/y"), 2, "not a directory: /x/f/y"),
        (IsADirectoryError(21, "Is a directory", "/x/d"), 2, "/x/d is a directory"),
        (FileNotFoundError(2, "No such file or directory", "/x/n"), 2, "no such file or directory: /x/n"),
        (OSError(28, "No space left on device", "/x/o"), 74, "no space left"),
        (OSError(30, "Read-only file system", "/x/o"), 74, "read-only file system: /x/o"),
        (OSError(5, "Input/output error", "/x/o"), 74, "input/output error"),
        (FileExistsError(17, "File exists", "/x/o"), 8, "/x/o already exists"),
        (KeyboardInterrupt(), 130, "interrupted"),
        (MemoryError(), 1, "out of memory"),
        (safeckpt.CorruptCheckpoint("bad\nthing \x1b[1mhere\x1b[0m"), 5, "error: bad; thing here"),
        (TypeError("nope"), 70, "internal error: TypeError: nope; this is a bug in safeckpt, rerun with --debug"),
    ]
    for exc, code, needle in cases:
        got, line = describe(exc)
        assert got == code and needle in line and "\n" not in line, (exc, got, line)
    # a storage library's exception is the object store refusing, not a bug
    NoCredentialsError = type("NoCredentialsError", (Exception,), {"__module__": "botocore.exceptions"})
    got, line = describe(NoCredentialsError("Unable to locate credentials"), "s3://bucket/run")
    assert got == 74 and "s3://bucket/run" in line and "AWS_ACCESS_KEY_ID" in line


def test_cli_docs_list_the_exit_codes_the_cli_uses():
    section = (Path(__file__).resolve().parents[1] / "docs" / "cli.md").read_text()
    rows = dict(re.findall(r"^\| (\d+) \| (.+) \|$", section, re.MULTILINE))
    assert {int(c) for c in rows} == {c for c, _ in EXIT_CODES}
    for code, meaning in EXIT_CODES:
        assert rows[str(code)].replace("\\|", "|") == meaning, code
    assert f"exits {70}" in section and "--debug" in section


# ----------------------------------------------------------------------------- convert


def _unimportable_module(tmp_path: Path, name: str):
    """A module importable only while this returns, so pickles of its class cannot be loaded later."""
    (tmp_path / f"{name}.py").write_text("class Custom:\n    def __init__(self):\n        self.x = 1\n")
    sys.path.insert(0, str(tmp_path))
    try:
        import importlib

        return importlib.import_module(name)
    finally:
        sys.path.remove(str(tmp_path))


def _forget(module) -> None:
    sys.modules.pop(module.__name__, None)


def test_convert_imports_bad_sources(capsys, paths, tmp_path):
    import warnings

    import torch.distributed.checkpoint as dcp

    mod = _unimportable_module(tmp_path, "safeckpt_test_gone_a")
    pt = tmp_path / "custom.pt"
    torch.save({"model": {"w": torch.ones(2)}, "obj": mod.Custom()}, pt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": {"w": torch.ones(2)}, "obj": mod.Custom()}, checkpoint_id=str(tmp_path / "dcp_custom"))
        dcp.save({"model": {"w": torch.ones(2)}}, checkpoint_id=str(tmp_path / "dcp_ok"))
    _forget(mod)
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(pt.read_bytes()[:300])
    garbage_dcp = tmp_path / "dcp_garbage"
    shutil.copytree(tmp_path / "dcp_ok", garbage_dcp)
    (garbage_dcp / ".metadata").write_bytes(b"garbage")
    cut_dcp = tmp_path / "dcp_cut"
    shutil.copytree(tmp_path / "dcp_ok", cut_dcp)
    for f in cut_dcp.glob("*.distcp"):
        os.truncate(f, 10)
    fifo_dcp = tmp_path / "dcp_fifo"
    shutil.copytree(tmp_path / "dcp_ok", fifo_dcp)
    os.mkfifo(fifo_dcp / "__9_0.distcp")
    dst = tmp_path / "imported"

    cases = [
        # (SRC, --from, extra flags, exit code, what the line says)
        (paths["missing"], "dcp", [], 2, ".metadata"),
        (paths["file"], "dcp", [], 2, "--from dcp takes a torch.distributed.checkpoint directory"),
        (pt, "dcp", [], 2, "use --from torch-save"),
        (paths["fifo"], "dcp", [], 2, "FIFO"),
        (paths["empty_dir"], "dcp", [], 2, "no .metadata"),
        ("s3://bucket/dcp", "dcp", [], 2, "local paths only"),
        (garbage_dcp, "dcp", [], CORRUPT, "unreadable .metadata"),
        (cut_dcp, "dcp", [], CORRUPT, "could not read it"),
        (fifo_dcp, "dcp", [], CORRUPT, "__9_0.distcp is not a regular file"),
        (tmp_path / "dcp_custom", "dcp", [], 1, "--allow-pickle"),
        (tmp_path / "dcp_custom", "dcp", ["--allow-pickle"], 1, "safeckpt_test_gone_a.Custom"),
        (paths["missing"], "torch-save", ["--allow-pickle"], 2, "no such file"),
        (tmp_path / "dcp_ok", "torch-save", ["--allow-pickle"], 2, "use --from dcp"),
        (paths["fifo"], "torch-save", ["--allow-pickle"], 2, "not a regular file"),
        ("s3://bucket/x.pt", "torch-save", ["--allow-pickle"], 2, "local paths only"),
        (paths["file"], "torch-save", ["--allow-pickle"], CORRUPT, "not a readable torch.save file"),
        (truncated, "torch-save", ["--allow-pickle"], CORRUPT, "not a readable torch.save file"),
        (pt, "torch-save", [], 1, "--allow-pickle"),
        (pt, "torch-save", ["--allow-pickle"], 1, "pickled safeckpt_test_gone_a.Custom object"),
        (pt, "torch-save", ["--allow-pickle", "--no-weights-only"], 1, "safeckpt_test_gone_a.Custom"),
    ]
    for src, fmt, flags, want, needle in cases:
        code, out, err = run(capsys, "convert", src, dst, "--from", fmt, *flags)
        assert code == want and needle in err, (src, fmt, flags, code, err)
        assert_one_line(code, out, err, "convert")
        assert not dst.exists()
    # the unimportable class: the line names it and says what to do
    _, _, err = run(capsys, "convert", pt, dst, "--from", "torch-save", "--allow-pickle", "--no-weights-only")
    assert "cannot be imported here" in err and "PYTHONPATH" in err
    # DST may be a URL (safeckpt.save writes it); the source stays local
    code, out, err = run(capsys, "convert", tmp_path / "dcp_ok", "memory://safeckpt-cli-errors/imported", "--from", "dcp")
    assert code == 0, err
    assert torch.equal(safeckpt.read_state_dict("memory://safeckpt-cli-errors/imported")["model/w"], torch.ones(2))
    code, out, err = run(capsys, "convert", "memory://safeckpt-cli-errors/imported", tmp_path / "hf", "--to", "hf")
    assert code == 0, err
    code, _, err = run(capsys, "convert", tmp_path / "dcp_ok", paths["good"], "--from", "dcp")
    assert code == 8 and err.count("\n") == 1 and "--overwrite" in err


# ----------------------------------------------------------------------------- real processes


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "SAFECKPT_"))}
    env.update(AWS_EC2_METADATA_DISABLED="true", AWS_CONFIG_FILE="/nonexistent",
               AWS_SHARED_CREDENTIALS_FILE="/nonexistent", PYTHONWARNINGS="", **extra)
    return env


PATCHED = (  # cli.main with one command replaced, to raise what no input can (yet)
    "import os, signal, sys, time\n"
    "from safeckpt import cli\n"
    "def fail(args, ui):\n"
    "    if sys.argv[1] == 'sigint':\n"
    "        signal.signal(signal.SIGINT, signal.default_int_handler)  # as at a terminal, even if\n"
    "        os.kill(os.getpid(), signal.SIGINT)  # started in the background with SIGINT ignored\n"
    "        time.sleep(30)\n"
    "    raise TypeError('unsupported operand')\n"
    "make = cli.app._parser\n"
    "def parser():\n"
    "    p = make()\n"
    "    next(a for a in p._actions if a.dest == 'command').choices['inspect'].set_defaults(func=fail)\n"
    "    return p\n"
    "cli.app._parser = parser\n"
    "sys.exit(cli.main(sys.argv[2:]))\n"
)


def test_real_processes(paths, tmp_path):
    """The installed script and ``python -m safeckpt.cli``, run together (each imports torch)."""
    shared = Path(tempfile.mkdtemp(prefix="safeckpt-cli-"))  # traversable by an unprivileged user
    try:
        shared.chmod(0o755)
        locked = shared / "ck"
        shutil.copytree(paths["good"], locked)
        for p in (locked, *locked.iterdir()):
            p.chmod(0o755 if p.is_dir() else 0o644)
        (locked / MANIFEST).chmod(0)
        unprivileged: list[str] = []  # root reads anything: drop to nobody for the permission check
        if os.geteuid() == 0:
            if shutil.which("setpriv") is None:
                pytest.skip("running as root without setpriv: cannot test permission denied")
            unprivileged = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
        r_closed, w_closed = os.pipe()
        os.close(r_closed)  # the reader is gone before the command writes: `safeckpt ... | head -0`
        py = [sys.executable]
        jobs = {
            # name: (argv, Popen kwargs, exit code, stderr check)
            "corrupt": ([str(EXE), "inspect", str(paths["forged_world_size"])], {}, CORRUPT, "one"),
            "file": ([*py, "-m", "safeckpt.cli", "diff", str(paths["good"]), str(paths["file"])], {}, 2, "one"),
            "bug": ([*py, "-c", PATCHED, "bug", "inspect", str(paths["good"])], {}, 70, "one"),
            "bug_debug": ([*py, "-c", PATCHED, "bug", "inspect", "--debug", str(paths["good"])], {}, 70, "traceback"),
            "sigint": ([*py, "-c", PATCHED, "sigint", "inspect", str(paths["good"])], {}, 130, "one"),
            "s3": ([str(EXE), "ls", "s3://safeckpt-no-such-bucket-for-tests/run"], {}, 74, "one"),
            "pipe": ([str(EXE), "inspect", "--values", str(paths["good"])], {"stdout": w_closed}, 141, "empty"),
            "denied": ([*unprivileged, str(EXE), "inspect", str(locked)], {}, 74, "one"),
        }
        procs = {}
        for name, (argv, kwargs, _, _) in jobs.items():
            kwargs = {"stdout": subprocess.PIPE, **kwargs}
            procs[name] = subprocess.Popen(argv, stderr=subprocess.PIPE, env=_clean_env(), text=True, cwd=shared, **kwargs)
        os.close(w_closed)
        for name, proc in procs.items():
            out, err = proc.communicate(timeout=240)
            _, _, code, check = jobs[name]
            assert proc.returncode == code, (name, proc.returncode, err)
            if check == "one":
                assert err.count("\n") == 1 and "Traceback" not in err, (name, err)
            elif check == "empty":
                assert err == "", (name, err)
            else:
                assert "Traceback (most recent call last)" in err and "TypeError: unsupported operand" in err
            procs[name] = err
        assert "bug in safeckpt, rerun with --debug" in procs["bug"]
        assert procs["bug_debug"].splitlines()[-1] == procs["bug"].strip()
        assert procs["sigint"].strip() == "safeckpt inspect: interrupted"
        assert "s3://safeckpt-no-such-bucket-for-tests/run" in procs["s3"] and "credentials" in procs["s3"]
        assert "permission denied" in procs["denied"] and str(locked / MANIFEST) in procs["denied"]
        assert "world_size" in procs["corrupt"]
        assert "is a file, not a checkpoint" in procs["file"]
    finally:
        shutil.rmtree(shared, ignore_errors=True)

