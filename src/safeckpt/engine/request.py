"""What one collective save is asked to do, in one immutable object, and what a caller such as
the manager folds into the save's own exchanges.

A :class:`SaveRequest` is built once, keyword by keyword, and checked when built (bad options
raise before any collective starts); the save job only reads it. :class:`CommitHooks` are run by
the coordinator inside the save's two exchanges, so the manager's lease, sweep and retention cost
no extra round.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .extra import WriteFiles, safe_extra_name
from .frozen import check_frozen_mode

CHECK_REPLICAS = ("auto", "error", "warn", "off")
INDEX_META = "safeckpt_index"  # a named file's header metadata entry holding its chunk index


@dataclass(frozen=True)
class NamedLayout:
    """Some tensors of a save laid out as safetensors files under names of the caller's, inside
    the commit (Hugging Face's ``model.safetensors`` or ``model-00001-of-00002.safetensors``):
    ``files`` maps each file name to {name in the file: the tensor's key in the save}
    (``model/lm_head.weight``); ``metadata`` is every such file's header metadata
    (``{"format": "pt"}``). The tensors are written once, there and nowhere else, each file by
    one rank (files spread over the ranks, largest first), listed and checksummed in the
    manifest like the ranks' own files; a load reads them like any other. They must be
    replicated tensors (a DDP or one-process model; FSDP2 shards need gathering first), and a
    file holds nothing but its tensors: safeckpt's index of the file goes into the header's
    metadata (``safeckpt_index``), which loaders ignore. Filesystem targets only."""

    files: Mapping[str, Mapping[str, str]]
    metadata: Mapping[str, str] = field(default_factory=lambda: {"format": "pt"})

    def __post_init__(self) -> None:
        from ..format.validate import is_named_file

        files: dict[str, dict[str, str]] = {}
        keys: set[str] = set()
        for fname, names in self.files.items():
            if not is_named_file(fname):
                raise ValueError(f"named file {fname!r}: a plain *.safetensors name (letters, digits, . _ -), "
                                 "not rank-*")
            if not names:
                raise ValueError(f"named file {fname!r} holds no tensors")
            out = {}
            for name, key in names.items():
                if not isinstance(name, str) or not name or name == "__metadata__" or not isinstance(key, str):
                    raise ValueError(f"named file {fname!r}: bad tensor name {name!r} -> {key!r}")
                if key in keys:
                    raise ValueError(f"tensor {key!r} is laid out in two named files (or twice)")
                keys.add(key)
                out[name] = key
            files[fname] = out
        meta = dict(self.metadata)
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()) or INDEX_META in meta:
            raise ValueError(f"named files' metadata must map str to str, without {INDEX_META!r}")
        object.__setattr__(self, "files", files)
        object.__setattr__(self, "metadata", meta)

    def key_files(self) -> dict[str, tuple[str, str]]:
        """Tensor key -> (file name, name in the file)."""
        return {key: (fname, name) for fname, names in self.files.items() for name, key in names.items()}


@dataclass(frozen=True, kw_only=True)
class SaveRequest:
    """One save. ``target``: the resolved checkpoint location (a directory or a URL).

    ``check_replicas``: "auto" (error with more than one rank), "error", "warn" or "off".
    ``extra_files``: small files (plain name -> bytes) the coordinator commits inside the
    checkpoint, listed with their checksum. ``write_files(staging_dir) -> [relative paths]``:
    files every rank writes itself into the checkpoint during the save (synchronous saves on a
    filesystem only). ``frozen``: "full" saves frozen parameters like the rest; "fingerprint"
    saves a fingerprint of each instead (see :mod:`safeckpt.engine.frozen`); tensors that
    ``named`` lays out are always saved in full (then the whole save keeps frozen parameters in
    full). ``named``: a :class:`NamedLayout` (or its ``files`` mapping), some tensors as files
    under the caller's names (``model.safetensors``).
    """

    target: str
    state: Mapping[str, Any]
    metadata: Mapping[str, Any] | None = None
    overwrite: bool = False
    step: int | None = None
    metrics: Mapping[str, Any] | None = None
    check_replicas: str = "auto"
    extra_files: Mapping[str, bytes] = field(default_factory=dict)
    write_files: WriteFiles | None = None
    frozen: str = "full"
    named: NamedLayout | Mapping[str, Mapping[str, str]] | None = None

    def __post_init__(self) -> None:
        if self.check_replicas not in CHECK_REPLICAS:
            raise ValueError(f"check_replicas must be one of {CHECK_REPLICAS}, got {self.check_replicas!r}")
        check_frozen_mode(self.frozen)
        if self.step is not None and (not isinstance(self.step, int) or isinstance(self.step, bool) or self.step < 0):
            raise ValueError(f"step must be a non-negative int, got {self.step!r}")
        extra = {}
        for name, data in (self.extra_files or {}).items():
            if not isinstance(data, (bytes, bytearray, memoryview)):
                raise TypeError(f"extra_files[{name!r}] must be bytes, got {type(data).__name__}")
            extra[safe_extra_name(name)] = bytes(data)
        object.__setattr__(self, "extra_files", extra)
        if isinstance(self.named, Mapping):  # {file: {name in file: key}}, metadata {"format": "pt"}
            object.__setattr__(self, "named", NamedLayout(files=self.named) if self.named else None)
        if self.named is not None:
            if not isinstance(self.named, NamedLayout):
                raise TypeError(f"named must be a NamedLayout, got {type(self.named).__name__}")
            clash = sorted(set(self.named.files) & set(extra))
            if clash:
                raise ValueError(f"{clash[0]!r} is both a named file and an extra file")


@dataclass(frozen=True)
class CommitHooks:
    """Run by the coordinator inside a save's exchanges: ``before_stage`` before the staging
    place is created (the manager takes the writer lease and sweeps leftovers), ``after_commit``
    with the saved step right after the checkpoint is published (retention). An error in
    ``after_commit`` is raised on every rank with ``after_commit_hint`` (the checkpoint stays
    committed)."""

    before_stage: Callable[[], None] | None = None
    after_commit: Callable[[int | None], Any] | None = None
    after_commit_hint: str = ""


NO_HOOKS = CommitHooks()
