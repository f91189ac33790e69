"""Mutants of a real checkpoint: seeded, described in words, applied as plain file operations.

A :class:`Mutant` is data (picklable, reproducible from ``(seed, id)``): a class name for the
tables, a one-line description, and ``ops``, file operations on a copy of the base root
(:func:`tests.helpers.fuzz_files.apply`). Generators: :mod:`tests.helpers.fuzz_manifest` (manifest JSON and
text), :mod:`tests.helpers.fuzz_index` (format 3: per-file indexes, chunk bytes located through them,
the placement fields) and :mod:`tests.helpers.fuzz_files` (data files, directory). Bases come in
format 3 (as written now) and format 2 (``NAME.f2``); a generator that does not apply to a
base's format returns None and another (base, class) is drawn.

Two families of manifest edits:

- plain: the edit is written as is, so the manifest's own checksum no longer matches; any
  successful load of a manifest whose parsed JSON differs from the original is SILENT.
- ``forged.*``: the same edits with the manifest checksum recomputed (a buggy writer, another
  tool), so the checks behind the checksum are exercised too; ``forged.index`` and
  ``forged.data`` edit a format-3 file's index or chunk bytes and recompute every checksum over
  them (index, file, manifest; :mod:`tests.helpers.fuzz_index`). ``invalid`` says whether the
  edit breaks an invariant of the format (a load that succeeds is then SILENT); ``False`` means
  a consistent alternative checkpoint (loading it is fine), ``None`` that it depends.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from tests.helpers.fuzz_bases import MANIFEST, STEP_A, STEP_B
from tests.helpers.fuzz_files import DATA_KINDS, DIR_KINDS, g_data, g_dir
from tests.helpers.fuzz_index import (
    g_chunk_bytes,
    g_forged_data,
    g_index,
    g_index_plain,
    read_index,
)
from tests.helpers.fuzz_json import canon, dumps, forge
from tests.helpers.fuzz_manifest import (
    MANIFEST_GENS,
    changed_from,
    g_benign,
    g_dup_key,
    g_huge,
    g_nesting,
    g_syntax,
)


@dataclass(frozen=True)
class Mutant:
    id: int
    base: str
    cls: str
    desc: str
    ops: tuple[tuple[Any, ...], ...]
    changed: bool = False  # the parsed manifest differs from the original
    forged: bool = False  # the manifest checksum was recomputed after the edit
    invalid: bool | None = None  # (forged) the edit breaks a format invariant
    verify_bad: bool = False  # bytes verify(deep=True) checks were changed: it must fail


@dataclass
class BaseView:
    """What the generator knows of a base: the newer checkpoint's manifest and data files."""

    name: str
    root: str
    manifest_raw: bytes
    manifest: dict[str, Any]
    files: dict[str, bytes]
    older_files: dict[str, bytes]
    forge_ok: bool = field(default=False)
    fmt: int = 3  # the manifest's format_version
    indexes: dict[str, dict[str, Any]] = field(default_factory=dict)  # format 3: file -> its index

    @classmethod
    def load(cls, name: str, root: str) -> BaseView:
        ckpt = os.path.join(root, STEP_B)
        raw = _read(os.path.join(ckpt, MANIFEST))
        man = json.loads(raw)
        files = {n: _read(os.path.join(ckpt, n)) for n in man["files"]}
        older = {n: _read(os.path.join(root, STEP_A, n)) for n in os.listdir(os.path.join(root, STEP_A))
                 if n in man["files"]}  # data files (not extra files)
        view = cls(name, root, raw, man, files, older, fmt=man.get("format_version", 2))
        if view.fmt == 3:
            for n, data in files.items():
                idx = read_index(data, man["files"][n])
                if idx is not None:
                    view.indexes[n] = idx
        view.forge_ok = _accepted(forge(man), ckpt)
        return view


def _accepted(forged: bytes | None, ckpt: str) -> bool:
    """Whether safeckpt accepts our re-signed copy of an unedited manifest (else forging broke)."""
    if forged is None:
        return False
    try:
        from safeckpt.format.manifest import parse_manifest

        parse_manifest(forged, ckpt)
        return True
    except Exception:  # noqa: BLE001 - any refusal means forged edits would test nothing
        return False


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


CLASS_WEIGHTS: dict[str, float] = {
    **{f"manifest.{k}": w for k, (w, _) in MANIFEST_GENS.items()},
    **{f"forged.{k}": w * 0.8 for k, (w, _) in MANIFEST_GENS.items()},
    "manifest.dup_key": 2, "manifest.syntax": 3, "manifest.nesting": 2, "manifest.huge": 0.4,
    "manifest.benign": 1.5, "forged.multi": 6,
    "forged.index": 5, "forged.data": 2, "index.edit": 3, "data.chunk": 2,
    **{f"data.{k}": w for k, w in DATA_KINDS.items()},
    **{f"dir.{k}": w for k, w in DIR_KINDS.items()},
}


Made = tuple[str, tuple[Any, ...], bool, bool, "bool | None", bool]


def make(rng: random.Random, v: BaseView, cls: str, *, huge: int) -> Made | None:
    """One mutant of class ``cls``: (desc, ops, changed, forged, invalid, verify_bad), or None
    if n/a."""
    family, kind = cls.split(".", 1)
    if cls == "forged.multi":
        return _multi(rng, v)
    gens = {**{k: g for k, (_, g) in MANIFEST_GENS.items()}, "index": g_index, "data": g_forged_data}
    if (family in ("manifest", "forged") and kind in MANIFEST_GENS) or cls in ("forged.index", "forged.data"):
        out = gens[kind](rng, v)
        if out is None:
            return None
        desc, man, invalid, *extra = out
        ops = tuple(extra[0]) if extra else ()
        verify_bad = bool(extra[1]) if len(extra) > 1 else False
        text = forge(man) if family == "forged" else dumps(man)
        if text is None:
            return None
        changed = changed_from(text, v)
        if family == "forged" and not changed:
            return None
        return desc, ops + (("write", MANIFEST, text),), changed, family == "forged", invalid, verify_bad
    if family == "manifest":
        if kind == "huge":
            out = g_huge(rng, v, huge)
        else:
            gen = {"dup_key": g_dup_key, "syntax": g_syntax, "nesting": g_nesting, "benign": g_benign}[kind]
            out = gen(rng, v)
        return None if out is None else (*out, False, None, False)
    if cls in ("index.edit", "data.chunk"):
        out2 = (g_index_plain if cls == "index.edit" else g_chunk_bytes)(rng, v)
        return None if out2 is None else (*out2, False, False, None, True)
    gen2 = g_data if family == "data" else g_dir
    out2 = gen2(rng, v, kind)
    return None if out2 is None else (*out2, False, False, None, False)


def _multi(rng: random.Random, v: BaseView) -> Made | None:
    """2-4 manifest edits on top of each other, then signed: combinations that a check of one
    field at a time could miss (e.g. a shape and its chunks changed together)."""
    view, descs, invalids = v, [], []
    for _ in range(rng.randint(2, 4)):
        kind = rng.choice([k for k in MANIFEST_GENS if k != "files"])  # files also move data files
        if (kind == "chunks") != (view.fmt == 2) and kind in ("chunks", "placement", "layout3"):
            continue  # a generator of the other format
        try:
            out = MANIFEST_GENS[kind][1](rng, view)
        except (TypeError, KeyError, IndexError, AttributeError, ValueError):
            continue  # an earlier edit broke what this generator edits: try another
        if out is None:
            continue
        desc, man, invalid, *_ = out
        if not isinstance(man, dict) or canon(man) == canon(view.manifest):
            continue  # replaced by a non-object (nothing to sign or build on), or no edit at all
        descs.append(f"{kind}: {desc}")
        invalids.append(invalid)
        view = dataclasses.replace(view, manifest=man)
    text = forge(view.manifest) if len(descs) >= 2 else None
    if text is None or not changed_from(text, v):
        return None
    invalid = True if True in invalids else (None if None in invalids else False)
    return " + ".join(descs), (("write", MANIFEST, text),), True, True, invalid, False


BASE_WEIGHTS = {"single": 1.0, "ddp": 2.0, "fsdp": 3.0}  # NAME.f2: half of NAME's


def generate(views: dict[str, BaseView], seed: int, count: int, *, huge: int = 300 << 20,
             classes: list[str] | None = None, start: int = 0) -> Iterator[Mutant]:
    """``count`` mutants; mutant ``i`` depends only on (seed, i, the bases, classes)."""
    names = sorted(views)
    bweights = [BASE_WEIGHTS.get(n, BASE_WEIGHTS.get(n.removesuffix(".f2"), 1.0) / 2) for n in names]
    pool = [c for c in CLASS_WEIGHTS if classes is None or any(c.startswith(p) for p in classes)]
    if not all(views[n].forge_ok for n in names):
        pool = [c for c in pool if not c.startswith("forged.")]
    weights = [CLASS_WEIGHTS[c] for c in pool]
    for i in range(start, start + count):
        rng = random.Random(f"{seed}:{i}")
        for _ in range(50):
            base = names[0] if len(names) == 1 else rng.choices(names, bweights)[0]
            cls = rng.choices(pool, weights)[0]
            out = make(rng, views[base], cls, huge=huge)
            if out is not None:
                desc, ops, changed, forged, invalid, verify_bad = out
                yield Mutant(i, base, cls, desc, ops, changed, forged, invalid, verify_bad)
                break
