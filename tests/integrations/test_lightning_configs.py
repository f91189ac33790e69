"""Lightning integration, issue 22 requirements 3 and 4, in one process: the configs real
projects keep (Namespace, pathlib paths, enums, dataclasses, a callback whose ``state_key`` is
its class, OmegaConf when installed) go through a checkpoint with their types, pickle-free;
Lightning's own ``Model.load_from_checkpoint`` classmethod reads a safeckpt checkpoint with
every ``map_location`` form Lightning accepts; the strategy loads without a Trainer as
Lightning's connector does; a value that cannot be stored is refused naming its key."""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
import pathlib

import pytest

pytest.importorskip("lightning")

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402

import safeckpt  # noqa: E402
from tests.integrations import lightning_app as app  # noqa: E402


class Color(enum.Enum):
    RED = "red"
    BLUE = 2


@dataclasses.dataclass(frozen=True)
class Optim:
    name: str = "adamw"
    betas: tuple = (0.9, 0.99)
    where: pathlib.Path = pathlib.Path("/data/x")


def _values() -> dict:
    return {
        "path": pathlib.Path("/data/train"),
        "pure": pathlib.PurePosixPath("a/b"),
        "color": Color.BLUE,
        "optim": Optim(),
        "ns": argparse.Namespace(depth=3, act="relu", root=pathlib.Path("/r")),
        "cls": Color,
        "tags": {"a", "b"},
        "by_class": {Color: 1, "x": (1, 2)},
        "escaped": {"__safeckpt_type__": "not a record"},
    }


class Configured(app.Net):
    def __init__(self, cfg: dict | None = None, data_dir: pathlib.Path = pathlib.Path("/d"),
                 mode: Color = Color.RED) -> None:
        super().__init__()
        self.save_hyperparameters()


class Counter(pl.Callback):
    """Legacy-style callback keyed by its class (Lightning still reads such keys)."""

    def __init__(self) -> None:
        self.count = 0
        self.seen = None

    @property
    def state_key(self):
        return type(self)

    def on_train_batch_end(self, *args, **kwargs) -> None:
        self.count += 1

    def state_dict(self):
        return {"count": self.count, "color": Color.RED, "where": pathlib.Path("/cb")}

    def load_state_dict(self, state):
        self.seen = state
        self.count = state["count"]


def _trainer(root, epochs, callbacks=()):
    from safeckpt.integrations.lightning import SafeckptIO

    return app.trainer(str(root), "auto", epochs, 1, callbacks=list(callbacks), plugins=[SafeckptIO()])


@pytest.mark.timeout(120)
def test_configs_round_trip_and_load_from_checkpoint_classmethod(tmp_path):
    from safeckpt.integrations import lightning as sl

    app.scramble(0)
    model = Configured(cfg=_values(), data_dir=pathlib.Path("/data"), mode=Color.BLUE)
    cb = Counter()
    _trainer(tmp_path, 1, [cb]).fit(model)
    path = tmp_path / "ckpts" / "last.ckpt"
    assert (path / "manifest.json").is_file()
    assert "pickle" not in (path / "manifest.json").read_text().lower()

    ckpt = sl.read_checkpoint(path)
    hp = ckpt["hyper_parameters"]
    assert hp["cfg"] == _values() and hp["data_dir"] == pathlib.Path("/data") and hp["mode"] is Color.BLUE
    assert type(hp["cfg"]["optim"]) is Optim and type(hp["cfg"]["ns"]) is argparse.Namespace
    assert type(hp["cfg"]["pure"]) is pathlib.PurePosixPath and hp["cfg"]["cls"] is Color
    assert type(hp["cfg"]["tags"]) is set and hp["cfg"]["by_class"][Color] == 1
    assert ckpt["callbacks"][Counter] == {"count": cb.count, "color": Color.RED, "where": pathlib.Path("/cb")}

    # Lightning's own classmethod, with every map_location form torch.load takes
    calls = []

    def to_cpu(storage, location):
        calls.append(location)
        return storage

    for loc in (None, "cpu", torch.device("cpu"), {"cpu": "cpu"}, {"cuda:0": "cpu"}, to_cpu,
                lambda storage, location: None):
        loaded = Configured.load_from_checkpoint(path, map_location=loc, strict=True)
        assert loaded.hparams["cfg"] == _values() and loaded.hparams["mode"] is Color.BLUE, loc
        assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items()), loc
    assert calls and set(calls) == {"cpu"}
    # kwargs override the saved hyper-parameters
    assert Configured.load_from_checkpoint(path, mode=Color.RED).hparams["mode"] is Color.RED
    # Lightning's own loader still reads files that are not safeckpt checkpoints
    torch.save({"not": "ours"}, tmp_path / "plain.pt")
    from lightning.pytorch.core import saving

    assert saving.pl_load(tmp_path / "plain.pt", weights_only=True) == {"not": "ours"}

    # the class-keyed callback state comes back through Lightning's resume
    app.scramble(0)
    cb2 = Counter()
    _trainer(tmp_path, 2, [cb2]).fit(Configured(cfg=_values()), ckpt_path=str(path))
    assert cb2.seen == {"count": cb.count, "color": Color.RED, "where": pathlib.Path("/cb")}
    assert cb2.count > cb.count


def test_value_codec_unknown_classes_and_refusals(tmp_path):
    from safeckpt.integrations._lightning import values

    encoded = values.encode({"x": _values()}, "hp")
    assert values.decode(encoded) == {"x": _values()}
    # a class whose module this process has not imported comes back as its plain value
    record = {values.TYPE: "enum", "class": "not_imported_module_xyz:Color", "name": "RED", "value": "red"}
    with pytest.warns(safeckpt.SafeckptWarning, match="not defined in this process"):
        assert values.decode(record) == "red"
    dc = {values.TYPE: "dataclass", "class": "os:path", "value": {"a": 1}}  # not a dataclass
    with pytest.warns(safeckpt.SafeckptWarning):
        assert values.decode(dc) == {"a": 1}
    with pytest.raises(safeckpt.CheckpointError, match=r"object at 'hp/bad/0'"):
        values.encode({"bad": [object()]}, "hp")
    with pytest.raises(safeckpt.CheckpointError, match="_thread.lock at 'lock'"):
        import threading

        values.encode(threading.Lock(), "lock")


def test_omegaconf_configs_round_trip(tmp_path):
    omegaconf = pytest.importorskip("omegaconf")
    from safeckpt.integrations._lightning import values

    cfg = omegaconf.OmegaConf.create({"model": {"lr": 0.1, "layers": [1, 2]}, "ref": "${model.lr}"})
    lst = omegaconf.OmegaConf.create([1, {"a": 2}])
    back = values.decode(values.encode({"cfg": cfg, "lst": lst}))
    assert isinstance(back["cfg"], omegaconf.DictConfig) and back["cfg"] == cfg
    assert back["cfg"].ref == 0.1  # interpolation kept, not resolved at save
    assert isinstance(back["lst"], omegaconf.ListConfig) and back["lst"] == lst


@pytest.mark.timeout(120)
def test_strategy_loads_without_a_trainer_as_lightnings_connector_does(tmp_path):
    from safeckpt.integrations import lightning as sl

    app.scramble(0)
    model = app.Net()
    _trainer(tmp_path, 1).fit(model)
    path = str(tmp_path / "ckpts" / "last.ckpt")
    expected = sl.read_checkpoint(path)

    # a fresh Trainer whose strategy has no module yet (test_preloaded_checkpoint_lifecycle)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=sl.SafeckptDDPStrategy(), logger=False,
                         max_steps=2, default_root_dir=str(tmp_path))
    connector = trainer._checkpoint_connector
    connector.resume_start(path)
    got = connector._loaded_checkpoint
    assert set(got) >= {"state_dict", "optimizer_states", "loops", "callbacks", "hyper_parameters"}
    assert all(torch.equal(got["state_dict"][k], v) for k, v in expected["state_dict"].items())
    assert got["global_step"] == expected["global_step"]
    # and the strategy on its own, the module then loaded through Lightning's load_state_dict
    strategy = sl.SafeckptDDPStrategy()
    fresh = app.Net()
    strategy.connect(fresh)
    ckpt = strategy.load_checkpoint(path)
    strategy.load_model_state_dict(ckpt, strict=True)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in model.state_dict().items())
    with pytest.raises(safeckpt.CheckpointNotFound):
        strategy.load_checkpoint(os.path.join(tmp_path, "absent.ckpt"))
