"""Pytest plugin (``-p tests.integrations.peer_lightning_inject``) for running Lightning's own
test-suite with safeckpt injected into every ``Trainer``, as a user would drop it in.

Every strategy Lightning builds is looked at once it is chosen (``_AcceleratorConnector.
_init_strategy``): a plain ``DDPStrategy`` (``"ddp"``, ``"ddp_spawn"``, ``"ddp_fork"``,
``devices=2`` on "auto", or an instance) becomes ``SafeckptDDPStrategy`` with the same options;
a single-device run gets ``SafeckptIO`` as its CheckpointIO. A test that passes its own
CheckpointIO plugin keeps it (it tests that IO, not ours). Used by
``tests/integrations/test_lightning_peer.py``; Lightning's tests are never copied into the
repository (they are extracted from Lightning's own git history at test time).
"""

from __future__ import annotations

import json
import os

from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.pytorch.trainer.connectors import accelerator_connector as _ac

from safeckpt.integrations.lightning import SafeckptDDPStrategy, SafeckptIO, SafeckptStrategyMixin

_original_init_strategy = _ac._AcceleratorConnector._init_strategy
INJECTED: list[str] = []


def _as_safeckpt(s: DDPStrategy) -> SafeckptDDPStrategy:
    new = SafeckptDDPStrategy(
        start_method=s._start_method,
        process_group_backend=s._process_group_backend,
        timeout=s._timeout,
        checkpoint_timeout=float(os.environ.get("SAFECKPT_TIMEOUT", "60")),
        **s._ddp_kwargs,
    )
    for attr in ("_accelerator", "_checkpoint_io", "_precision_plugin", "parallel_devices",
                 "cluster_environment", "_ddp_comm_state", "_ddp_comm_hook", "_ddp_comm_wrapper",
                 "_model_averaging_period"):
        if hasattr(s, attr):
            setattr(new, attr, getattr(s, attr))
    return new


def _init_strategy(self: _ac._AcceleratorConnector) -> None:
    _original_init_strategy(self)
    user_io = getattr(self, "checkpoint_io", None) is not None
    if type(self.strategy) is DDPStrategy and not user_io:
        self.strategy = _as_safeckpt(self.strategy)
        INJECTED.append("ddp")
    elif type(self.strategy) is SingleDeviceStrategy and not user_io:
        self.checkpoint_io = SafeckptIO()
        INJECTED.append("io")
    elif isinstance(self.strategy, SafeckptStrategyMixin):
        INJECTED.append("ddp")


_ac._AcceleratorConnector._init_strategy = _init_strategy


def pytest_sessionfinish(session, exitstatus):  # noqa: ARG001
    """Write how many Trainers got which injection (``$SAFECKPT_PEER_COUNTS``, JSON)."""
    path = os.environ.get("SAFECKPT_PEER_COUNTS")
    if path:
        with open(path, "w") as f:
            json.dump({k: INJECTED.count(k) for k in ("io", "ddp")}, f)


def pytest_report_header(config):  # noqa: ARG001
    return "safeckpt: injected into every Trainer (SafeckptDDPStrategy for DDP, SafeckptIO otherwise)"
