"""Any tree of JSON values and tensors, with any dict keys, round trips (issue 8, item 7).

Hypothesis builds nested dicts/lists/tuples whose keys hold ``/``, ``@``, ``%``, escapes,
empty strings, unicode, ints, and whose leaves are None/bools/ints (beyond 64 bits)/floats
(nan, inf, -0.0)/strings and tensors of several dtypes and shapes (0-d and empty included).
Each is saved, then read back nested (exactly the saved tree), flat (one entry per leaf, no
two keys colliding), and loaded in place into a target of the same layout.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import safeckpt
from tests.helpers.fuzz_bases import first_difference

_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32,
           torch.int8, torch.uint8, torch.bool]
_ODD_KEYS = ["/", "a/b", "/a", "a/", "@tensor", "@tuple", "@dict", "@float", "@", "%", "%2F", "%40",
             "%25", "a%2Fb", "..", ".", "", " ", "\x00", "\u00e9/\u4e2d", "@tensor/x", "state"]


def _tensor(dtype: torch.dtype, shape: list[int], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(-100, 100, shape, generator=g)
    return (t > 0) if dtype == torch.bool else t.to(dtype)


tensors = st.builds(_tensor, st.sampled_from(_DTYPES), st.lists(st.integers(0, 3), max_size=3),
                    st.integers(0, 2**31))
scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats()
           | st.text(max_size=6) | st.sampled_from(_ODD_KEYS))
keys = st.sampled_from(_ODD_KEYS) | st.text(max_size=6) | st.integers(-3, 3)
trees = st.recursive(
    scalars | tensors,
    lambda inner: (st.lists(inner, max_size=3) | st.lists(inner, max_size=3).map(tuple)
                   | st.dictionaries(keys, inner, max_size=4)),
    max_leaves=14,
)


def _flat_leaves(value: Any) -> int:
    if isinstance(value, dict) and value:
        return sum(_flat_leaves(v) for v in value.values())
    return 1


def _text_collision(value: Any) -> bool:
    """A dict with an int key and a str key of the same text (1 and "1"): one flat name."""
    if isinstance(value, dict):
        texts = [str(k) for k in value]
        return len(set(texts)) != len(texts) or any(_text_collision(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_text_collision(v) for v in value)
    return False


def _unlike(value: Any) -> Any:
    """Same layout (tensor shapes/dtypes, containers), other values."""
    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value) if value.dtype != torch.bool else ~value
    if isinstance(value, dict):
        return {k: _unlike(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_unlike(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_unlike(v) for v in value)
    return "other" if value != "other" else None


# A top-level None has its own test below (known bug), so the property keeps checking the rest.
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tree=trees.filter(lambda t: t is not None))
def test_any_tree_round_trips(tree: Any) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "ck")
        safeckpt.save(path, {"entry": tree})
        nested = safeckpt.read_state_dict(path, nested=True)
        assert first_difference(tree, nested["entry"]) is None, first_difference(tree, nested["entry"])
        flat = safeckpt.read_state_dict(path)
        if not _text_collision(tree):
            assert len(flat) == _flat_leaves(tree), sorted(flat)
        target = {"entry": _unlike(tree)}
        safeckpt.load(path, target)
        assert first_difference(tree, target["entry"]) is None, first_difference(tree, target["entry"])
        assert safeckpt.verify(path).ok


def test_entry_saved_as_none_is_loaded(tmp_path) -> None:
    safeckpt.save(tmp_path / "ck", {"entry": None, "x": 1})
    target: dict[str, Any] = {"entry": "other", "x": 2}
    safeckpt.load(tmp_path / "ck", target)
    assert target == {"entry": None, "x": 1}
