"""For running DeepSpeed's own ``tests/unit/checkpoint`` against the integration (issue 22
req. 2; the runner is not written yet, see the issue): put this folder on PYTHONPATH and every Python process of
DeepSpeed's own test run (pytest and the forkserver/spawn ranks its DistributedTest starts)
installs safeckpt into every DeepSpeed engine it builds, as ``sds.install_on_initialize()`` in
a user's script would. Active only with ``SAFECKPT_DS_INJECT=1``."""

import os

if os.environ.get("SAFECKPT_DS_INJECT") == "1":
    from safeckpt.integrations import deepspeed as _sds

    _sds.install_on_initialize(timeout=float(os.environ.get("SAFECKPT_TIMEOUT", "60")))
