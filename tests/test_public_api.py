"""The public names are a contract (SPEC.md): pin them."""

import inspect

import safeckpt

SPEC_NAMES = {
    "save", "load", "verify", "read_state_dict", "CheckpointManager", "RNGState",
    "CheckpointInfo", "CheckpointError", "RankFailure", "RankMismatch", "CorruptCheckpoint",
    "IncompatibleCheckpoint", "CheckpointNotFound",
}


def test_spec_names_exported():
    assert SPEC_NAMES <= set(safeckpt.__all__)
    for name in safeckpt.__all__:
        assert hasattr(safeckpt, name), name


def test_all_is_sorted_and_complete():
    assert safeckpt.__all__ == sorted(safeckpt.__all__)
    import __future__

    public = {
        n for n in dir(safeckpt)
        if not n.startswith("_") and not inspect.ismodule(getattr(safeckpt, n))
        and not isinstance(getattr(safeckpt, n), __future__._Feature)
    }
    assert public <= set(safeckpt.__all__), public - set(safeckpt.__all__)


def test_exception_tree():
    for name in ("RankFailure", "RankMismatch", "CorruptCheckpoint", "IncompatibleCheckpoint", "CheckpointNotFound"):
        assert issubclass(getattr(safeckpt, name), safeckpt.CheckpointError)
    assert issubclass(safeckpt.CheckpointNotFound, FileNotFoundError)
    # the storage's own failures are part of the tree (exit 74), also where backends import it
    from safeckpt.storage.base import StorageError

    assert StorageError is safeckpt.StorageError and issubclass(StorageError, safeckpt.CheckpointError)
    assert issubclass(safeckpt.CheckpointError, Exception)


def test_signatures_match_spec():
    save = inspect.signature(safeckpt.save)
    assert list(save.parameters)[:2] == ["path", "state"]
    for kw in ("metadata", "overwrite", "timeout", "extra_files", "write_files", "frozen", "collective"):
        assert save.parameters[kw].kind is inspect.Parameter.KEYWORD_ONLY
    load = inspect.signature(safeckpt.load)
    for kw in ("strict", "timeout"):
        assert load.parameters[kw].kind is inspect.Parameter.KEYWORD_ONLY
    mgr = inspect.signature(safeckpt.CheckpointManager)
    assert list(mgr.parameters)[:9] == [
        "root", "keep_last", "keep_best", "best_metric", "best_mode", "keep_every", "async_save", "timeout",
        "preemption_signals",
    ][:9]
    assert mgr.parameters["keep_last"].default == 3
    for method in ("restore", "save", "wait", "close", "list", "latest"):
        assert callable(getattr(safeckpt.CheckpointManager, method))
    assert isinstance(inspect.getattr_static(safeckpt.CheckpointManager, "preempted"), property)
    fields = {"path", "step", "world_size", "created_at", "metrics", "nbytes"}
    assert fields <= set(safeckpt.CheckpointInfo.__dataclass_fields__)
    assert {"ok", "problems"} <= set(safeckpt.VerifyReport.__dataclass_fields__)
