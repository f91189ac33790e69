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


def _from_target(package: str, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` statement in ``package`` reads from."""
    if not node.level:
        return node.module or ""
    base = package.split(".")[: len(package.split(".")) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str, path: Path) -> list[tuple[str, int]]:
    """(absolute module imported, line) for every import statement in the file."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = _from_target(package, node)
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


def _package_init_imports(module: str, path: Path) -> list[str]:
    """Lines where ``module`` imports a name of the package ``__init__`` itself (``from .. import
    save``, ``import safeckpt``), not a submodule of it."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    bad = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import) and any(a.name == "safeckpt" for a in node.names):
            bad.append(f"line {node.lineno}: import safeckpt")
        elif isinstance(node, ast.ImportFrom):
            target = _from_target(package, node)
            names = [a.name for a in node.names if f"{target}.{a.name}" not in MODULES]
            if target == "safeckpt" and names:
                bad.append(f"line {node.lineno}: from safeckpt import {', '.join(names)}")
    return bad


# The layers the package ``__init__`` itself imports: none of their modules may import it back
# (``from .. import __version__`` worked only because ``__init__`` set it before importing the
# engine). The CLI, conversion and integrations sit above it and may use the public names.
BELOW_INIT = {name for name, _ in LAYERS[:5]}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_below_the_public_names_imports_the_package_init(module: str) -> None:
    if module == "safeckpt" or LAYERS[_layer(module)][0] not in BELOW_INIT:
        return
    bad = _package_init_imports(module, MODULES[module])
    assert not bad, f"{module} imports the package __init__ it is part of:\n" + "\n".join(bad)


# What the integrations may use of the engine besides the public names: reading a committed
# checkpoint's manifest and tensors, frozen-parameter fingerprints, and the names and records of
# files a save commits beside its tensors. Saves and loads go through safeckpt.save/load and
# CheckpointManager (their options are what the integrations need), never the jobs themselves.
ENGINE_FOR_INTEGRATIONS = ("safeckpt.engine.reader", "safeckpt.engine.frozen", "safeckpt.engine.extra")


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("safeckpt.integrations")))
def test_integrations_use_only_the_declared_engine_modules(module: str) -> None:
    bad = [f"line {line}: {t}" for t, line in _imports(module, MODULES[module])
           if t.startswith("safeckpt.engine.") and t in MODULES and t not in ENGINE_FOR_INTEGRATIONS]
    assert not bad, (f"{module} imports engine modules outside {ENGINE_FOR_INTEGRATIONS}:\n" + "\n".join(bad)
                     + "\nUse the public calls (safeckpt.save/load, CheckpointManager) or declare the module here.")


def test_the_init_rule_catches_a_package_import(tmp_path) -> None:
    fake = tmp_path / "engine" / "bad.py"
    fake.parent.mkdir()
    fake.write_text("from .. import __version__\nfrom .. import errors\nimport safeckpt\n")
    bad = _package_init_imports("safeckpt.engine.bad", fake)
    assert bad == ["line 1: from safeckpt import __version__", "line 3: import safeckpt"]
