"""How a torch.distributed.checkpoint (DCP) save is laid out as a safeckpt checkpoint.

No torch.distributed.checkpoint import here: :mod:`safeckpt.dcp` hands in plain data (what each
rank wrote, DCP's Metadata turned into dicts), this module builds the two JSON documents, and on
the way back validates them before anything is built from them.

A checkpoint written by :class:`safeckpt.dcp.StorageWriter` is an ordinary safeckpt checkpoint
(format 2 manifest, so ``safeckpt ls/verify/inspect/consolidate`` and ``read_state_dict`` read
it) plus one file::

    <name>/
      manifest.json            safeckpt manifest, written last (the commit marker); its
                               ``metadata["safeckpt.dcp"]`` names the file below with its size
                               and xxh3-128, so the manifest's own checksum covers it
      rank-00000.safetensors   what rank 0 wrote (one file per rank that had tensor data)
      dcp_metadata.json        DCP's Metadata as JSON (never a pickle)
      .metadata                only with StorageWriter(dot_metadata=True): DCP's own pickled
                               Metadata, for tools that look for it (torchtitan's discovery);
                               size and xxh3-128 in ``metadata["safeckpt.dcp"]["dot_metadata"]``;
                               no safeckpt reader ever opens it

On an object store (no directory rename: the manifest PUT is the commit) the document is not a
separate object but ``metadata["safeckpt.dcp"]["inline"]`` in the manifest itself, so the one
PUT publishes it, and retention, overwrite and ``safeckpt gc`` (which know the manifest and the
token-named data objects) leave nothing behind.

``dcp_metadata.json``::

    {"format": "safeckpt-dcp", "format_version": 1, "dcp_version": "1.0.0",
     "entries": {fqn: {"tensor": KEY, "properties": {...}}        # chunks: the manifest's
                | {"value": TREE}                                 # non-tensor (BYTE_IO) item
                | {"bytes": KEY}},                                # a bytes item: its bytes are
                                                                  # 1-d uint8 tensor KEY
     "planner_data": {fqn: [path component, ...]} | null,         # DCP's flatten mapping
     "storage_meta": {"checkpoint_id", "save_id", "modules"} | null}

A tensor's chunks (global offsets and sizes, file, byte range, xxh3-64) live only in the
manifest's ``tensors[KEY]``, already validated by safeckpt's one validation layer (boxes tile
the tensor, byte ranges inside their files). Non-tensor values are tagged JSON trees
(``@tuple``, ``@dict``, ``@float``, as in safeckpt manifests). A ``bytes`` item (torchtitan's
dataloader state is ``pickle.dumps`` bytes) is stored as what it is, bytes, in the rank's
safetensors file (a 1-d uint8 tensor, checksummed like any chunk) and handed back as ``bytes``;
safeckpt never looks inside them (``read_state_dict`` shows that uint8 tensor).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from ..errors import CheckpointError, CorruptCheckpoint
from .manifest import DCP_DOT_METADATA
from .tree import SEP, escape_key, join_key
from .validate import MAX_DEPTH

DCP_FORMAT = "safeckpt-dcp"
DCP_FORMAT_VERSION = 1
DCP_FILE = "dcp_metadata.json"
DOT_METADATA = DCP_DOT_METADATA  # DCP's own pickled Metadata (never read by safeckpt)
BYTES_DTYPE = "U8"  # a bytes item's tensor
MANIFEST_KEY = "safeckpt.dcp"  # the key of the manifest's ``metadata`` that describes DCP_FILE
FLAT_OBJECT = "dcp"  # the one object holding every item when the state has no usable top-level names
MEMORY_FORMATS = ("contiguous_format", "channels_last", "preserve_format")
MAX_DCP_FILE = 256 << 20


# ----------------------------------------------------------------------------- values as JSON
def encode_value(value: Any, where: str, depth: int = 0) -> Any:
    """A plain Python value (DCP's non-tensor item) as a tagged JSON tree; CheckpointError
    naming ``where`` for anything JSON cannot hold without pickle."""
    if depth > MAX_DEPTH:
        raise CheckpointError(f"the value of {where!r} is nested more than {MAX_DEPTH} levels deep")
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else {"@float": repr(float(value))}
    if isinstance(value, tuple):
        return {"@tuple": [encode_value(v, where, depth + 1) for v in value]}
    if isinstance(value, list):
        return [encode_value(v, where, depth + 1) for v in value]
    if isinstance(value, Mapping):
        plain = all(isinstance(k, str) and not k.startswith("@") for k in value)
        if plain:
            return {k: encode_value(v, where, depth + 1) for k, v in value.items()}
        for k in value:
            if not (k is None or isinstance(k, (str, int, float, bool))):
                raise _unsupported(where, f"a dict key of type {type(k).__name__}")
        return {"@dict": [[k, encode_value(v, where, depth + 1)] for k, v in value.items()]}
    raise _unsupported(where, f"a {type(value).__module__}.{type(value).__qualname__}")


def _unsupported(where: str, what: str) -> CheckpointError:
    return CheckpointError(
        f"torch.distributed.checkpoint item {where!r} holds {what}; safeckpt.dcp stores non-tensor "
        "items as JSON (None, bool, int, float, str, and lists, tuples and dicts of them) so that "
        "loading never unpickles. Store it as a tensor, convert it to such values in state_dict(), "
        "or save it with torch.distributed.checkpoint's own FileSystemWriter."
    )


def check_value_tree(tree: Any, where: str, depth: int = 0) -> None:
    """Raise CorruptCheckpoint unless ``tree`` is a well-formed tagged value without tensors."""
    if depth > MAX_DEPTH:
        raise CorruptCheckpoint(f"{where} is nested more than {MAX_DEPTH} levels deep")
    if tree is None or isinstance(tree, (bool, int, float, str)):
        return
    if isinstance(tree, list):
        for v in tree:
            check_value_tree(v, where, depth + 1)
        return
    if not isinstance(tree, dict):
        raise CorruptCheckpoint(f"{where} holds a {type(tree).__name__}")
    tags = [k for k in tree if k.startswith("@")]
    if not tags:
        for v in tree.values():
            check_value_tree(v, where, depth + 1)
        return
    if len(tree) != 1 or tags[0] not in ("@tuple", "@dict", "@float"):
        raise CorruptCheckpoint(f"{where} has a malformed tagged node {sorted(tree)[:4]!r:.80}")
    body = tree[tags[0]]
    if tags[0] == "@tuple":
        if not isinstance(body, list):
            raise CorruptCheckpoint(f"{where} has a tuple that is not a list")
        for v in body:
            check_value_tree(v, where, depth + 1)
    elif tags[0] == "@dict":
        if not isinstance(body, list):
            raise CorruptCheckpoint(f"{where} has a dict that is not a list of pairs")
        for pair in body:
            if not (isinstance(pair, list) and len(pair) == 2
                    and (pair[0] is None or isinstance(pair[0], (str, int, float, bool)))):
                raise CorruptCheckpoint(f"{where} has a dict item that is not a [key, value] pair")
            check_value_tree(pair[1], where, depth + 1)
    else:
        try:
            float(body)
        except (TypeError, ValueError):
            raise CorruptCheckpoint(f"{where} has a malformed float {body!r:.40}") from None


# ----------------------------------------------------------------------------- writing
def _good_name(name: Any) -> bool:
    return isinstance(name, str) and bool(name) and SEP not in name and not name.startswith("@")


def _paths(fqns: list[str], planner_data: Any) -> dict[str, tuple] | None:
    """Each fqn's object path (DCP's flatten mapping), or None when there is no usable one."""
    if planner_data is None:
        return {f: (f,) for f in fqns}
    if not isinstance(planner_data, Mapping):
        return None
    out: dict[str, tuple] = {}
    for f in fqns:
        path = planner_data.get(f)
        if (not isinstance(path, (tuple, list)) or not path
                or not all(type(p) is str or type(p) is int for p in path) or type(path[0]) is not str):
            return None
        out[f] = tuple(path)
    return out


def planner_data_json(planner_data: Any) -> dict[str, list] | None:
    """DCP's flatten mapping as JSON, or None when it is absent or not such a mapping."""
    if not isinstance(planner_data, Mapping):
        return None
    out = {}
    for fqn, path in planner_data.items():
        if (not isinstance(fqn, str) or not isinstance(path, (tuple, list))
                or not all(type(p) is str or type(p) is int for p in path)):
            return None
        out[fqn] = list(path)
    return out


class _Node:
    """A container under construction: str keys make a dict, int keys a list."""

    __slots__ = ("items",)

    def __init__(self) -> None:
        self.items: dict[Any, Any] = {}

    def tree(self) -> Any:
        keys = list(self.items)
        if keys and all(type(k) is int for k in keys):
            out: list[Any] = [None] * (max(keys) + 1)  # DCP's set_element pads lists with None
            for k, v in self.items.items():
                out[k] = _tree_of(v)
            return out
        if all(type(k) is str and not k.startswith("@") for k in keys):
            return {k: _tree_of(v) for k, v in self.items.items()}
        return {"@dict": [[k, _tree_of(v)] for k, v in self.items.items()]}


def _tree_of(v: Any) -> Any:
    return v.tree() if isinstance(v, _Node) else v


def build_layout(fqns: list[str], tensor_fqns: set[str], values: Mapping[str, Any],
                 planner_data: Any) -> tuple[dict[str, str], dict[str, Any]]:
    """Tensor keys for the tensor fqns and the manifest's ``objects`` (their JSON trees).

    With DCP's flatten mapping, ``{"model": {"0.weight": T}}`` (fqn ``model.0.weight``, path
    ``("model", "0.weight")``) becomes object ``model`` with tensor key ``model/0.weight``:
    the keys ``safeckpt.save`` gives the same state. Without a usable mapping (or with
    top-level names a manifest cannot hold), every item goes under one object ``dcp``, keyed by
    its escaped fqn."""
    paths = _paths(fqns, planner_data)
    if paths is not None and not all(_good_name(p[0]) for p in paths.values()):
        paths = None
    keys: dict[str, str] = {}
    if paths is None:
        tree = {"@dict": []}
        for f in fqns:
            if f in tensor_fqns:
                keys[f] = f"{FLAT_OBJECT}{SEP}{escape_key(f)}"
                tree["@dict"].append([f, {"@tensor": keys[f]}])
            else:
                tree["@dict"].append([f, values[f]])
        return keys, {FLAT_OBJECT: {"kind": "tree", "tree": tree}}
    roots: dict[str, Any] = {}
    for f in fqns:
        path = paths[f]
        if f in tensor_fqns:
            keys[f] = join_key([str(p) for p in path])
            leaf: Any = {"@tensor": keys[f]}
        else:
            leaf = values[f]
        if len(path) == 1:
            roots[path[0]] = leaf
            continue
        node = roots.get(path[0])
        if not isinstance(node, _Node):
            node = roots[path[0]] = _Node()
        for p in path[1:-1]:
            child = node.items.get(p)
            if not isinstance(child, _Node):
                child = node.items[p] = _Node()
            node = child
        node.items[path[-1]] = leaf
    if len(set(keys.values())) != len(keys):
        return build_layout(fqns, tensor_fqns, values, None if planner_data is None else 0)
    top_tensors = {paths[f][0] for f in tensor_fqns if len(paths[f]) == 1}
    objects = {name: {"kind": "tensor" if name in top_tensors else "tree", "tree": _tree_of(v)}
               for name, v in roots.items()}
    return keys, objects


def dcp_document(entries: dict[str, Any], planner_data: Any, storage_meta: dict[str, Any] | None,
                 dcp_version: str | None) -> dict[str, Any]:
    """The document (a JSON tree): ``dcp_metadata.json`` as a file, or inline in the manifest."""
    return {
        "format": DCP_FORMAT,
        "format_version": DCP_FORMAT_VERSION,
        "dcp_version": dcp_version,
        "entries": entries,
        "planner_data": planner_data_json(planner_data),
        "storage_meta": storage_meta,
    }


def encode_document(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


# ----------------------------------------------------------------------------- reading
def parse_dcp_document(raw: bytes, where: str, ckpt: str, man: dict[str, Any]) -> dict[str, Any]:
    """Parse and validate ``dcp_metadata.json`` against its (validated) manifest ``man``."""
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptCheckpoint(f"{where}: not valid JSON ({exc})", path=ckpt) from None
    except RecursionError:
        raise CorruptCheckpoint(f"{where}: nested too deeply", path=ckpt) from None
    return check_dcp_document(doc, where, ckpt, man)


def check_dcp_document(doc: Any, where: str, ckpt: str, man: dict[str, Any]) -> dict[str, Any]:
    """Validate a parsed document (from the file, or inline in the manifest) against ``man``."""

    def bad(msg: str) -> CorruptCheckpoint:
        return CorruptCheckpoint(f"{where}: {msg}", path=ckpt)

    if not isinstance(doc, dict) or doc.get("format") != DCP_FORMAT:
        raise bad("not a safeckpt.dcp metadata document")
    if doc.get("format_version") != DCP_FORMAT_VERSION:
        raise bad(f"format version {doc.get('format_version')!r:.40} is not {DCP_FORMAT_VERSION} "
                  "(written by another safeckpt version?)")
    if doc.get("dcp_version") is not None and not isinstance(doc["dcp_version"], str):
        raise bad("'dcp_version' must be a string")
    entries = doc.get("entries")
    if not isinstance(entries, dict):
        raise bad("'entries' must be a JSON object")
    tensors = man["tensors"]
    used: set[str] = set()
    for fqn, e in entries.items():
        what = f"entry {fqn!r:.200}"
        if (not isinstance(e, dict) or len(e) not in (1, 2)
                or not ({"tensor"} <= set(e) or set(e) == {"value"} or set(e) == {"bytes"})):
            raise bad(f"{what} is neither a tensor, a value nor bytes")
        if "value" in e:
            try:
                check_value_tree(e["value"], what)
            except CorruptCheckpoint as exc:
                raise bad(str(exc)) from None
            continue
        key = e["bytes"] if "bytes" in e else e["tensor"]
        if not isinstance(key, str) or key not in tensors or "alias_of" in tensors[key]:
            raise bad(f"{what} names tensor {key!r:.200}, which the manifest does not hold")
        if key in used:
            raise bad(f"{what} names tensor {key!r:.200}, which another entry names too")
        used.add(key)
        if "bytes" in e:
            rec = tensors[key]
            chunks = rec.get("chunks") or []
            if (rec.get("dtype") != BYTES_DTYPE or len(rec.get("shape", ())) != 1 or len(chunks) > 1
                    or (rec["shape"][0] > 0) != bool(chunks)):
                raise bad(f"{what} names tensor {key!r:.200}, which is not 1-d uint8 in at most one chunk")
            continue
        props = e.get("properties", {})
        if not isinstance(props, dict) or set(props) - {"requires_grad", "pin_memory", "memory_format"}:
            raise bad(f"{what} has malformed properties")
        for flag in ("requires_grad", "pin_memory"):
            if not isinstance(props.get(flag, False), bool):
                raise bad(f"{what}: {flag} must be true or false")
        if props.get("memory_format", "contiguous_format") not in MEMORY_FORMATS:
            raise bad(f"{what} has unknown memory format {props.get('memory_format')!r:.40}")
    if set(tensors) - used:
        raise bad(f"tensor {sorted(set(tensors) - used)[0]!r:.200} of the manifest has no DCP entry")
    pdata = doc.get("planner_data")
    if pdata is not None:
        if not isinstance(pdata, dict):
            raise bad("'planner_data' must be a JSON object or null")
        for fqn, path in pdata.items():
            if (not isinstance(path, list) or not path
                    or not all(type(p) is str or type(p) is int for p in path)):
                raise bad(f"planner_data of {fqn!r:.200} is not a list of keys and indices")
    meta = doc.get("storage_meta")
    if meta is not None:
        if not isinstance(meta, dict):
            raise bad("'storage_meta' must be a JSON object or null")
        for k in ("checkpoint_id", "save_id"):
            if meta.get(k) is not None and not isinstance(meta[k], str):
                raise bad(f"storage_meta {k} must be a string")
        if not isinstance(meta.get("modules", []), list) or not all(isinstance(m, str) for m in meta.get("modules", [])):
            raise bad("storage_meta modules must be a list of strings")
    return doc
