"""JSON helpers for the fuzzer: canonical form, node paths, picking nodes, value edits, forging.

``forge`` re-signs an edited manifest with safeckpt's own checksum function, so edits reach the
validation behind the checksum (see :mod:`tests.helpers.fuzz_mutants`).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Iterator
from typing import Any

Path = tuple[Any, ...]


def canon(obj: Any) -> str:
    """Canonical text of parsed JSON: equal iff the parsed values are equal (key order aside)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=True)


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), allow_nan=True).encode()


def forge(obj: Any) -> bytes | None:
    """``obj`` encoded with a valid manifest checksum, or None when that cannot be done."""
    try:
        from safeckpt.format import manifest as _manifest
    except Exception:  # noqa: BLE001 - src mid-edit: no forging this run
        return None
    name = getattr(_manifest, "CHECKSUM_FIELD", None)
    digest = getattr(_manifest, "manifest_digest", None)
    if not isinstance(obj, dict) or not name or digest is None:
        return None
    body = {k: v for k, v in obj.items() if k != name}
    try:
        body[name] = digest(body)
        return dumps(body)
    except (RecursionError, ValueError, TypeError):
        return None


def fmt_path(path: Path) -> str:
    out = ""
    for p in path:
        if isinstance(p, int):
            out += f"[{p}]"
        elif out and p.replace("_", "").isalnum():
            out += f".{p}"
        else:
            out += f"[{p!r}]" if out else p
    return out or "<root>"


def walk(obj: Any, path: Path = ()) -> Iterator[tuple[Path, Any]]:
    """Every node (path, value), parents before children."""
    yield path, obj
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from walk(v, (*path, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from walk(v, (*path, i))


def get(obj: Any, path: Path) -> Any:
    for p in path:
        obj = obj[p]
    return obj


def put(obj: Any, path: Path, value: Any) -> None:
    get(obj, path[:-1])[path[-1]] = value


def group_of(path: Path) -> tuple[Any, ...]:
    """Paths that differ only in list indices or tensor/file names form one group."""
    return tuple(
        "#" if isinstance(p, int) else ("*" if i == 1 and path[0] in ("tensors", "files") else p)
        for i, p in enumerate(path)
    )


REGIONS = {"header": 0.2, "files": 0.15, "tensors": 0.35, "objects": 0.3}


def pick_node(rng: random.Random, man: dict[str, Any], want: Callable[[Path, Any], bool]) -> Path | None:
    """A node satisfying ``want``: region first, then a group uniformly, then a member."""
    regions = list(REGIONS)
    for _ in range(8):
        region = rng.choices(regions, weights=[REGIONS[r] for r in regions])[0]
        groups: dict[tuple[Any, ...], list[Path]] = {}
        for path, value in walk(man):
            if not path:
                continue
            top = path[0] if path[0] in ("files", "tensors", "objects") else "header"
            if top == region and want(path, value):
                groups.setdefault(group_of(path), []).append(path)
        if groups:
            members = groups[rng.choice(sorted(groups, key=repr))]
            return rng.choice(members)
    return None


def is_leaf(path: Path, value: Any) -> bool:
    return not isinstance(value, (dict, list)) or not value


def value_edits(v: Any) -> list[tuple[str, Any]]:
    """Replacements for a JSON value: other numbers, types, signs, strings, null."""
    common: list[tuple[str, Any]] = [("null", None), ("list", [v] if not isinstance(v, list) else []),
                                     ("object", {}), ("bool", True)]
    if isinstance(v, bool):
        return [("not", not v), ("int", int(v)), ("string", str(v).lower()), ("null", None)]
    if isinstance(v, int):
        return common + [("+1", v + 1), ("-1", v - 1), ("negate", -v - 1), ("zero", 0),
                         ("2**63", 2**63), ("10**30", 10**30), ("-2**63", -(2**63)),
                         ("float", float(v)), ("+0.5", v + 0.5), ("string", str(v)), ("false", False)]
    if isinstance(v, float):
        return common + [("negate", -v), ("double", v * 2 if v else 1.0), ("zero", 0.0),
                         ("int", int(v) if math.isfinite(v) else 0), ("nan", math.nan),
                         ("inf", math.inf), ("string", repr(v))]
    if isinstance(v, str):
        return common + [("empty", ""), ("append", v + "x"), ("chop", v[:-1]), ("upper", v.upper()),
                         ("dotdot", "../" + v), ("absolute", "/etc/hostname"), ("int", 0),
                         ("long", v * 1000 if v else "x" * 1000), ("nul", v + "\x00"),
                         ("unicode", v + "\u00e9"), ("lone surrogate", v + "\ud800")]
    if v is None:
        return [("zero", 0), ("empty string", ""), ("false", False), ("object", {}), ("list", [])]
    if isinstance(v, dict):
        return [("null", None), ("list", []), ("string", "x"), ("one key", {"x": 1})]
    return [("null", None), ("object", {}), ("string", "x"), ("one item", [0])]
