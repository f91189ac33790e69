"""Every reference to a module in docstrings, comments and docs names one that exists.

Modules move (house rounds); a docstring that still says ``_format3`` or
``safeckpt._storage_posix`` sends the next maintainer looking for a file that is gone. Each
double-backticked ``safeckpt.x.y`` (or ``:mod:``/``:func:``/``:class:`` role naming one) and each
double-backticked ``_module`` reference (or "see _module") in the package's sources and in docs/ is resolved from
the sources themselves (the AST: no framework needs to be installed): the longest dotted prefix
that is a module of the package, then a name that module defines or imports.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import safeckpt

PACKAGE = Path(safeckpt.__file__).parent
ROOT = PACKAGE.parent.parent
DOTTED = re.compile(r"(?:``|:(?:mod|func|class|meth|data|attr|exc):`~?)(safeckpt(?:\.[A-Za-z_][A-Za-z0-9_]*)*)(?:\(\))?`")
PRIVATE = re.compile(r"``(_[a-z][a-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)(?:\(\))?``"
                     r"|\bsee (_[a-z][a-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)")


@cache
def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


@cache
def _names(module: str) -> frozenset[str]:
    """Names a module defines or imports at any depth (functions, classes, their members,
    assignments, imports), as plain names and as ``Class.member``."""
    tree = ast.parse(_modules()[module].read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.add(node.name)
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        found.add(f"{node.name}.{item.name}")
                    elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        found.add(f"{node.name}.{item.target.id}")
                    elif isinstance(item, ast.Assign):
                        found.update(f"{node.name}.{t.id}" for t in item.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.Assign):
            found.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            found.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            found.update((a.asname or a.name).split(".")[0] for a in node.names)
    return frozenset(found)


def _resolves(ref: str) -> bool:
    parts = ref.split(".")
    modules = _modules()
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        if module in modules:
            rest = parts[cut:]
            if not rest:
                return True
            names = _names(module)
            if rest[0] not in names:
                return False
            if len(rest) == 1 or len(rest) > 2:
                return True
            member = ".".join(rest)  # Class.member, the class defined here or imported here
            return member in names or any(member in _names(m) for m in modules)
    return False


def _private_resolves(ref: str) -> bool:
    """``_module`` (a module's last name) or ``_name`` (something the package defines)."""
    first, *rest = ref.split(".")
    for module in _modules():
        if module.rsplit(".", 1)[-1] == first:
            return not rest or _resolves(f"{module}.{'.'.join(rest)}")
    return not rest and any(first in _names(m) for m in _modules())


def _sources() -> list[Path]:
    docs = sorted((ROOT / "docs").rglob("*.md")) if (ROOT / "docs").is_dir() else []
    return [*sorted(PACKAGE.rglob("*.py")), *docs, ROOT / "README.md"]


def _stale() -> list[str]:
    stale = []
    for path in _sources():
        text = path.read_text()
        for lineno, line in enumerate(text.splitlines(), 1):
            for m in DOTTED.finditer(line):
                if not _resolves(m.group(1)):
                    stale.append(f"{path.relative_to(ROOT)}:{lineno}: {m.group(1)}")
            for m in PRIVATE.finditer(line):
                ref = m.group(1) or m.group(2)
                if not _private_resolves(ref):
                    stale.append(f"{path.relative_to(ROOT)}:{lineno}: {ref}")
    return stale


def test_every_module_reference_names_a_module_that_exists():
    stale = _stale()
    assert not stale, "references to modules or names that do not exist:\n" + "\n".join(stale)


def test_the_check_catches_stale_references():
    assert _resolves("safeckpt.engine.save.SaveJob.finish")
    assert _resolves("safeckpt.storage.base.StorageError") or _resolves("safeckpt.errors.StorageError")
    assert not _resolves("safeckpt._format3")
    assert not _resolves("safeckpt.storage.posix.no_such_function")
    assert _private_resolves("_version") and not _private_resolves("_format3")
    assert not _private_resolves("_manifest.parse_manifest")
