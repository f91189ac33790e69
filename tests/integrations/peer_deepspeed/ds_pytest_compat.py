"""pytest plugin for running DeepSpeed's own tests under pytest >= 8.4 (loaded by ``run.py``
with ``-p ds_pytest_compat``, stock and injected runs alike).

DeepSpeed's ``DistributedFixture`` classes (a fixture run on N ranks, e.g. the 4-rank save in
``test_elastic_checkpoint_change_dp``) announce themselves through the ``_pytestfixturefunction``
attribute older pytest looked for; pytest 8.4+ no longer does, so every test using one fails
with "fixture not found". This registers each such class as a fixture of its module, which is
what older pytest did with it; DeepSpeed's conftest then runs it on its ranks as before.
"""

from __future__ import annotations

from typing import Any

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makeitem(collector: Any, name: str, obj: Any) -> None:
    if isinstance(obj, type) and getattr(obj, "is_dist_fixture", False) and name == obj.__name__:
        manager = collector.session._fixturemanager
        if not manager.getfixturedefs(name, collector):
            manager._register_fixture(name=name, func=obj, nodeid=collector.nodeid, scope="function")
