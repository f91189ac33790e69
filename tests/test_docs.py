"""The docs' code blocks run: the getting-started and how-to pages cannot drift from the code.

A fenced ``python`` or ``bash`` block preceded by an HTML comment (invisible on the site) is
run::

    <!-- test: run -->                      one process: ``python block.py`` / ``bash -e``
    <!-- test: run torchrun=2 -->           ``torchrun --standalone --nproc-per-node 2 block.py``
    <!-- test: run requires=lightning -->   skipped unless every named module imports

Options combine (``torchrun=2 requires=deepspeed env=DS_ACCELERATOR=cpu``). The runnable
blocks of one page run in order, in one fresh directory (a ``bash`` block can look at what the
``python`` block before it saved), each in its own process with a hard timeout that kills its
whole process group. ``safeckpt`` and ``torchrun`` on ``PATH`` are this interpreter's.

Blocks without the comment are illustrations (fragments, endpoints that need a real cloud
account); every page's build is checked by ``mkdocs build --strict`` (``make docs``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.helpers.dist_harness import is_gloo_teardown_abort

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
# Pages whose runnable blocks are executed; every page under docs/ is scanned so that a marker
# on a page not listed here is an error rather than silently ignored.
EXECUTED = ("getting-started.md", "how-to/")
TIMEOUT = {"python": 150.0, "bash": 60.0}  # per block; the page's pytest timeout is above the sum
MARK = re.compile(r"^<!--\s*test:\s*run\b(?P<opts>[^>]*)-->\s*$")
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[\w-]*)")
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
    "WANDB_MODE": "disabled", "DISABLE_MLFLOW_INTEGRATION": "TRUE", "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_DISABLE_TELEMETRY": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
    "SAFECKPT_TIMEOUT": "60",
}


@dataclass
class Block:
    page: str
    line: int
    lang: str
    code: str
    torchrun: int = 0
    requires: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"


def parse(page: Path) -> list[Block]:
    """The marked blocks of one page, in order."""
    lines = page.read_text().split("\n")
    rel = page.relative_to(DOCS).as_posix()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = MARK.match(lines[i].strip())
        if not m:
            i += 1
            continue
        f = FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
        if not f or f.group("lang") not in ("python", "bash"):
            raise AssertionError(f"{rel}:{i + 1}: a test marker must precede a ```python or ```bash block")
        indent, body, j = f.group("indent"), [], i + 2
        while not lines[j].strip().startswith("```"):
            body.append(lines[j][len(indent):])
            j += 1
        block = Block(rel, i + 2, f.group("lang"), "\n".join(body) + "\n")
        for opt in shlex.split(m.group("opts")):
            key, _, value = opt.partition("=")
            if key == "torchrun":
                block.torchrun = int(value)
            elif key == "requires":
                block.requires = value.split(",")
            elif key == "env":
                k, _, v = value.partition("=")
                block.env[k] = v
            else:
                raise AssertionError(f"{rel}:{i + 1}: unknown test option {opt!r}")
        out.append(block)
        i = j + 1
    return out


def pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def executed(page: Path) -> bool:
    rel = page.relative_to(DOCS).as_posix()
    return any(rel == p or (p.endswith("/") and rel.startswith(p)) for p in EXECUTED)


def _run(block: Block, cwd: Path) -> None:
    env = {**os.environ, **OFFLINE_ENV, **block.env}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    script = cwd / f"block_{block.line}.{'py' if block.lang == 'python' else 'sh'}"
    script.write_text(block.code)
    if block.lang == "bash":
        cmd = ["bash", "-euo", "pipefail", str(script)]
    elif block.torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={block.torchrun}", str(script)]
    else:
        cmd = [sys.executable, str(script)]
    t0 = time.monotonic()
    log = cwd / f"block_{block.line}.log"
    with open(log, "w") as sink:  # a file, not a pipe: a stray grandchild cannot block the read
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            proc.wait(timeout=TIMEOUT[block.lang])
        except subprocess.TimeoutExpired:
            _kill_tree(proc.pid)
            proc.wait()
            pytest.fail(f"{block.name}: no result within {TIMEOUT[block.lang]:.0f} s (killed)\n"
                        f"{log.read_text(errors='replace')[-6000:]}")
    out = log.read_text(errors="replace")
    if proc.returncode != 0 and block.torchrun and is_gloo_teardown_abort(out):
        # gloo's own abort at interpreter exit (NOTES.md section 5), after the block's code ran to
        # its end; the page's later blocks check what it left on disk.
        print(f"{block.name}: tolerated gloo teardown abort (rc {proc.returncode})")
        return
    if proc.returncode != 0:
        pytest.fail(f"{block.name}: exit status {proc.returncode} after {time.monotonic() - t0:.1f} s\n"
                    f"--- block ---\n{block.code}--- output ---\n{out[-6000:]}")


def _kill_tree(pid: int) -> None:
    """SIGKILL ``pid``, its process group and every descendant (torchrun's workers included)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    todo, tree = [pid], []
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children.get(p, [])
    with contextlib.suppress(OSError):
        os.killpg(pid, signal.SIGKILL)
    for p in tree:
        with contextlib.suppress(OSError):
            os.kill(p, signal.SIGKILL)


def _missing(block: Block) -> list[str]:
    return [m for m in block.requires if importlib.util.find_spec(m) is None]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("page", [p for p in pages() if executed(p)],
                         ids=lambda p: p.relative_to(DOCS).as_posix())
def test_page_examples_run(page: Path, tmp_path: Path) -> None:
    blocks = parse(page)
    if not blocks:
        pytest.skip("no runnable blocks")
    missing = sorted({m for b in blocks for m in _missing(b)})
    if missing:
        pytest.skip(f"needs {', '.join(missing)}")
    for block in blocks:
        _run(block, tmp_path)


def test_markers_only_on_executed_pages() -> None:
    """A marker on a page whose blocks are not run would promise a check that never happens."""
    stray = [b.name for p in pages() if not executed(p) for b in parse(p)]
    assert not stray, f"runnable markers on pages test_docs does not execute: {stray}"


def test_every_how_to_page_has_a_runnable_example() -> None:
    without = [p.relative_to(DOCS).as_posix() for p in pages() if executed(p) and not parse(p)]
    assert not without, f"pages promised to be executed but with no runnable block: {without}"


def test_cli_page_lists_the_exit_codes() -> None:
    """docs/cli.md's exit-code table is EXIT_CODES, row for row (as the README's is)."""
    from safeckpt.cli.common import EXIT_CODES

    rows = re.findall(r"^\| (\d+) \| (.+) \|$", (DOCS / "cli.md").read_text(), re.M)
    assert [(int(c), m.replace("\\|", "|")) for c, m in rows] == list(EXIT_CODES)


def test_teardown_tolerance_is_only_for_gloo_exit_abort() -> None:
    """The docs runner forgives gloo's exit abort, never an exception in the block or library."""
    report = ("rank 0: kept [20, 30]\nterminate called without an active exception\n"
              "Traceback (most recent call last):\n  File \"<frozen runpy>\", line 198, in _run_module_as_main\n"
              "  File \"/v/site-packages/torch/distributed/run.py\", line 1032, in <module>\n"
              "ChildFailedError:\n  exitcode  : -6 (pid: 1)  (SIGABRT)\n")
    assert is_gloo_teardown_abort(report)
    in_block = report.replace("Traceback (most recent call last):\n",
                              "Traceback (most recent call last):\n  File \"/tmp/block_79.py\", line 3\n")
    in_library = in_block.replace("/tmp/block_79.py", "/w/src/safeckpt/manager.py")
    assert not is_gloo_teardown_abort(in_block)
    assert not is_gloo_teardown_abort(in_library)
    assert not is_gloo_teardown_abort(report.replace("-6", "-9"))
    assert not is_gloo_teardown_abort(report.replace("terminate called", "killed"))
