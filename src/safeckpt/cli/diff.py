"""``safeckpt diff``: per-tensor max |A-B|, keys on one side only, value and metadata differences."""

from __future__ import annotations

import argparse
import math
from typing import Any

from .. import _humanize as human
from ..engine.reader import TensorReader, open_manifest
from .common import (
    ABSENT,
    EXIT_DIFFERENT,
    UI,
    _json_safe,
    _short,
    _step,
    _tensor_nbytes,
    _tensor_order,
    _values,
)
from .paths import checkpoint_arg


def _max_abs_diff(a: Any, b: Any, piece: int = 1 << 22) -> float:
    """max |a - b| over elements (NaN == NaN, equal infinities count as 0), in bounded pieces."""
    import torch

    fa, fb = a.reshape(-1), b.reshape(-1)
    wide = torch.complex128 if (a.is_complex() or b.is_complex()) else torch.float64
    best = 0.0
    for start in range(0, fa.numel(), piece):
        x, y = fa[start:start + piece], fb[start:start + piece]
        if x.dtype != y.dtype:  # torch does not promote every pair (int64 vs uint64): compare widened
            x, y = x.to(wide), y.to(wide)
        same = x == y
        if x.is_floating_point() or x.is_complex():
            same |= torch.isnan(x) & torch.isnan(y)
        if bool(same.all()):
            continue
        d = (x.to(wide) - y.to(wide)).abs()  # real float64 either way
        d = torch.where(same, torch.zeros((), dtype=d.dtype), d)
        d = torch.nan_to_num(d, nan=math.inf)  # NaN against a number: infinitely different
        best = max(best, float(d.max()))
    return best


def _dict_diff(a: dict[str, Any], b: dict[str, Any], prefix: str) -> list[dict[str, Any]]:
    """Keys whose values differ (NaN equals NaN), absent ones shown as ``"<absent>"``."""
    out = []
    for k in dict.fromkeys([*a, *b]):
        x, y = _json_safe(a.get(k, ABSENT)), _json_safe(b.get(k, ABSENT))
        if x != y:
            out.append({"key": prefix + k, "a": x, "b": y})
    return out


def _bitwise_equal(a: Any, b: Any) -> bool:
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def cmd_diff(args: argparse.Namespace, ui: UI) -> int:
    pa, pb = checkpoint_arg(args.a), checkpoint_arg(args.b)
    ma, mb = open_manifest(pa), open_manifest(pb)
    ta, tb = ma["tensors"], mb["tensors"]
    only_a = [k for k in _tensor_order(ma) if k not in tb]
    only_b = [k for k in _tensor_order(mb) if k not in ta]
    common = [k for k in _tensor_order(ma) if k in tb]
    results: list[dict[str, Any]] = []
    mismatched: list[dict[str, Any]] = []
    comparable = [k for k in common if list(ta[k]["shape"]) == list(tb[k]["shape"])]
    total = sum(_tensor_nbytes(ta[k]) + _tensor_nbytes(tb[k]) for k in comparable)
    ra, rb = TensorReader(pa, ma), TensorReader(pb, mb)
    try:
        with ui.progress(total, "comparing") as advance:
            for k in common:
                da, db = ta[k]["dtype"], tb[k]["dtype"]
                sa, sb = list(ta[k]["shape"]), list(tb[k]["shape"])
                if sa != sb or da != db:
                    mismatched.append({"key": k, "a": {"dtype": da, "shape": sa}, "b": {"dtype": db, "shape": sb}})
                if sa != sb:
                    continue
                x, y = ra.new(k), rb.new(k)
                same = _bitwise_equal(x, y)
                diff = 0.0 if same else _max_abs_diff(x, y)
                results.append({"key": k, "dtype": da if da == db else f"{da}/{db}", "shape": sa,
                                "identical": same, "max_abs_diff": diff,
                                "equal": same or (da == db and diff <= args.atol)})
                del x, y
                if advance:
                    advance(_tensor_nbytes(ta[k]) + _tensor_nbytes(tb[k]))
    finally:
        ra.close()
        rb.close()

    va, vb = _values(ma), _values(mb)
    values = _dict_diff(va, vb, "")
    meta = _dict_diff(ma.get("metadata") or {}, mb.get("metadata") or {}, "metadata/")
    meta += _dict_diff(ma.get("metrics") or {}, mb.get("metrics") or {}, "metrics/")
    differing = [r for r in results if not r["equal"]]
    different = bool(only_a or only_b or mismatched or differing or values or meta)
    code = EXIT_DIFFERENT if different else 0
    if args.json:
        ui.json({"a": pa, "b": pb, "identical": not different, "exit_code": code,
                 "only_in_a": only_a, "only_in_b": only_b, "mismatched": mismatched,
                 "tensors": results, "values": values, "metadata": meta,
                 "steps": [ma.get("step"), mb.get("step")],
                 "world_sizes": [ma.get("world_size"), mb.get("world_size")]})
        return code
    ui.echo(f"A  {pa}  (step {_step(ma.get('step'))}, world size {ma.get('world_size')})")
    ui.echo(f"B  {pb}  (step {_step(mb.get('step'))}, world size {mb.get('world_size')})")
    shown = results if args.all else differing
    if shown:
        ui.echo("")
        ui.table(["TENSOR", "DTYPE", "SHAPE", "MAX |A-B|"],
                 [[r["key"], r["dtype"], human.shape(r["shape"]),
                   "0" if r["identical"] else f"{r['max_abs_diff']:.6g}"] for r in shown], right={3})
    sections = [
        ("only in A", [f"{k}  {ta[k]['dtype']} {human.shape(ta[k]['shape'])}" for k in only_a]),
        ("only in B", [f"{k}  {tb[k]['dtype']} {human.shape(tb[k]['shape'])}" for k in only_b]),
        ("dtype/shape differ", [f"{m['key']}  A {m['a']['dtype']} {human.shape(m['a']['shape'])}, "
                                f"B {m['b']['dtype']} {human.shape(m['b']['shape'])}" for m in mismatched]),
        ("values differ", [f"{v['key']}  A {_short(v['a'], 40)}, B {_short(v['b'], 40)}" for v in values]),
        ("metadata differ", [f"{m['key']}  A {_short(m['a'], 40)}, B {_short(m['b'], 40)}" for m in meta]),
    ]
    for title, lines in sections:
        if lines:
            ui.echo("")
            ui.echo(f"{title} ({len(lines)}):")
            for line in lines:
                ui.echo(f"  {line}")
    ui.echo("")
    if different:
        ui.echo(f"different: {len(differing)} of {len(results)} compared tensor(s) differ"
                + (f" beyond --atol {args.atol:g}" if args.atol else "")
                + f", {len(only_a)} only in A, {len(only_b)} only in B, {len(mismatched)} dtype/shape, "
                f"{len(values)} value(s), {len(meta)} metadata")
    else:
        ui.echo(f"identical: {len(results)} tensor(s), {len(va)} value(s)"
                + (f" (within --atol {args.atol:g})" if any(not r["identical"] for r in results) else ""))
    return code


