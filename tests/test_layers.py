"""The package's layers, checked from the source: imports point down only, and only the
coordination layer (plus the DCP bridge, conversion from DCP, and the framework integrations)
touches torch.distributed's process groups. See docs/architecture.md.

Every import is read from the AST, those inside functions included (lazy imports count: a
lazy import upward is still a dependency upward).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import safeckpt

PACKAGE = Path(safeckpt.__file__).parent

# Lowest first. A module may import modules of its own layer or of lower layers.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("safeckpt.errors", "safeckpt._settings", "safeckpt._humanize", "safeckpt._version",
              "safeckpt.retention")),
    ("format", ("safeckpt.format",)),
    ("storage", ("safeckpt.storage",)),
    ("coord", ("safeckpt.coord",)),
    ("engine", ("safeckpt.engine", "safeckpt.manager", "safeckpt.per_rank", "safeckpt.rng",
                "safeckpt.dcp", "safeckpt")),
    ("convert", ("safeckpt.convert",)),
    ("cli", ("safeckpt.cli",)),
    ("integrations", ("safeckpt.integrations",)),
]

# Who may import torch.distributed itself (process groups, collectives). DTensor types
# (torch.distributed.tensor) are data, allowed everywhere.
PROCESS_GROUP_USERS = ("safeckpt.coord.dist", "safeckpt.dcp", "safeckpt.convert", "safeckpt.integrations")
DATA_ONLY = ("torch.distributed.tensor",)


def _layer(module: str) -> int:
    best, rank = -1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            hit = module == p or module.startswith(p + ".") or (p.endswith("_") and module.startswith(p))
            if hit and len(p) > best:
                best, rank = len(p), i
    assert rank >= 0, f"{module} belongs to no layer: add it to LAYERS"
    return rank


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(module: str, path: Path) -> list[tuple[str, int]]:
    """(absolute module imported, line) for every import statement in the file."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append((target, node.lineno))
            # ``from . import x``: x may be a submodule
            found += [(f"{target}.{a.name}", node.lineno) for a in node.names]
    return found


MODULES = _modules()


def test_every_module_has_a_layer() -> None:
    for module in MODULES:
        _layer(module)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module: str) -> None:
    mine = _layer(module)
    up = []
    for target, line in _imports(module, MODULES[module]):
        if target not in MODULES or target == "safeckpt":
            continue  # third-party, an attribute (``from . import __version__``), or the root
        if _layer(target) > mine:
            up.append(f"line {line}: {target} ({LAYERS[_layer(target)][0]}) from {LAYERS[mine][0]}")
    assert not up, f"{module} imports upward:\n" + "\n".join(up)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_only_coordination_uses_process_groups(module: str) -> None:
    if any(module == p or module.startswith(p + ".") for p in PROCESS_GROUP_USERS):
        return
    bad = [f"line {line}: {t}" for t, line in _imports(module, MODULES[module])
           if (t == "torch.distributed" or t.startswith("torch.distributed."))
           and not any(t == d or t.startswith(d + ".") for d in DATA_ONLY)]
    assert not bad, f"{module} imports torch.distributed outside coord/:\n" + "\n".join(bad)


def test_the_rule_catches_an_upward_import(tmp_path) -> None:
    """The checker itself: a format module importing coordination is reported."""
    fake = tmp_path / "format" / "bad.py"
    fake.parent.mkdir()
    fake.write_text("from ..coord.dist import Coordinator\nimport torch.distributed as dist\n")
    targets = [t for t, _ in _imports("safeckpt.format.bad", fake)]
    assert "safeckpt.coord.dist" in targets and "torch.distributed" in targets
    assert _layer("safeckpt.coord.dist") > _layer("safeckpt.format.bad")


def test_public_api_is_importable_from_the_root() -> None:
    for name in safeckpt.__all__:
        assert getattr(safeckpt, name) is not None, name
