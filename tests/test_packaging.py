"""The wheel is what users install: `python -m build` makes one that holds every module of
the package (the layered subpackages included), carries the version and SPDX license, and
installs into a fresh venv whose `safeckpt` CLI works on a checkpoint saved by the installed
library (the demo's commands: save, `ls`, `verify`).

The fresh venv gets the library's dependencies (torch, safetensors, ...) from this venv's
site-packages through a path file, so nothing is downloaded; safeckpt itself comes only from
the wheel (the editable install's hook is not active there, and the test checks where it
imported from).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

import safeckpt

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("build")


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, **kw)
    assert proc.returncode == 0, f"{cmd}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    return proc


@pytest.mark.timeout(420)
def test_wheel_builds_installs_in_a_fresh_venv_and_runs_the_cli(tmp_path: Path) -> None:
    src = tmp_path / "src-copy"  # build from a copy: no build/ or egg-info left in the repository
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist), str(src)])
    (wheel,) = dist.glob("safeckpt-*.whl")
    assert wheel.name.startswith(f"safeckpt-{safeckpt.__version__}-"), wheel.name

    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        meta = zf.read(f"safeckpt-{safeckpt.__version__}.dist-info/METADATA").decode()
    package = ROOT / "src" / "safeckpt"
    expected = {f"safeckpt/{p.relative_to(package).as_posix()}" for p in package.rglob("*.py")}
    assert expected - names == set(), sorted(expected - names)
    assert "safeckpt/py.typed" in names
    assert f"Version: {safeckpt.__version__}" in meta
    assert "License-Expression: Apache-2.0" in meta, meta[:1500]

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])
    vpy = venv / "bin" / "python"
    site = _run([str(vpy), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).stdout.strip()
    (Path(site) / "deps-from-test-venv.pth").write_text(sysconfig.get_path("purelib") + "\n")
    _run([str(vpy), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", str(wheel)])

    work = tmp_path / "work"
    work.mkdir()
    save = (
        "import safeckpt, torch\n"
        f"assert safeckpt.__file__.startswith({str(venv)!r}), safeckpt.__file__\n"
        "mgr = safeckpt.CheckpointManager('ckpts')\n"
        "mgr.save(1, {'model': {'w': torch.arange(6.0)}, 'step': 1})\n"
        "mgr.save(2, {'model': {'w': torch.arange(6.0) * 2}, 'step': 2})\n"
        "out = {'model': {'w': torch.zeros(6)}, 'step': 0}\n"
        "assert mgr.restore(out) == 2 and out['step'] == 2\n"
        "assert torch.equal(out['model']['w'], torch.arange(6.0) * 2)\n"
    )
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONNOUSERSITE": "1"}
    _run([str(vpy), "-c", save], cwd=work, env=env)
    version = _run([str(venv / "bin" / "safeckpt"), "--version"], env=env).stdout
    assert safeckpt.__version__ in version, version
    listing = _run([str(venv / "bin" / "safeckpt"), "ls", "ckpts", "--json"], cwd=work, env=env).stdout
    entries = json.loads(listing)["entries"]
    assert [(e["step"], e["status"]) for e in entries] == [(1, "committed"), (2, "committed")], listing
    _run([str(vpy), "-m", "safeckpt.cli", "verify", "ckpts/step-0000000002"], cwd=work, env=env)
