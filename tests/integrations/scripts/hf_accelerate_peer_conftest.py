"""conftest.py for accelerate's own checkpoint tests run against SafeckptAccelerator.

Copied (with accelerate's test files, from its sdist) into a scratch directory by
tests/integrations/test_hf_accelerate_peer.py. Every ``Accelerator`` the tests create is a
``SafeckptAccelerator``; accelerate's own state writer and reader are made to fail, so a test
can pass only through safeckpt. Per test, the number of safeckpt save_state/load_state calls is
written to $SAFECKPT_PEER_LOG (JSON lines) for the runner to check.
"""

import json
import os

import accelerate
import accelerate.accelerator
import pytest

from safeckpt.integrations import accelerate as sa

accelerate.Accelerator = sa.SafeckptAccelerator
accelerate.accelerator.Accelerator = sa.SafeckptAccelerator


def _stock(*args, **kwargs):
    raise AssertionError("accelerate's own checkpoint writer/reader was called: the test did not "
                         "go through SafeckptAccelerator")


accelerate.accelerator.save_accelerator_state = _stock
accelerate.accelerator.load_accelerator_state = _stock

CALLS = {"save": 0, "load": 0}
_save, _load = sa.save_state, sa.load_state


def _counted_save(*args, **kwargs):
    CALLS["save"] += 1
    return _save(*args, **kwargs)


def _counted_load(*args, **kwargs):
    CALLS["load"] += 1
    return _load(*args, **kwargs)


sa.save_state = _counted_save
sa.load_state = _counted_load


@pytest.fixture(autouse=True)
def _count_safeckpt_calls(request):
    CALLS["save"] = CALLS["load"] = 0
    yield
    with open(os.environ["SAFECKPT_PEER_LOG"], "a") as f:
        f.write(json.dumps({"test": request.node.nodeid, **CALLS}) + "\n")
