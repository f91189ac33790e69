"""For running DeepSpeed's own ``tests/unit/checkpoint`` against the integration (issue 22
req. 2; ``run.py`` here drives it): put this folder on PYTHONPATH and every Python process of
DeepSpeed's own test run (pytest and the forkserver/spawn ranks its DistributedTest starts)
installs safeckpt into every DeepSpeed engine it builds, as ``sds.install_on_initialize()`` in
a user's script would. Active only with ``SAFECKPT_DS_INJECT=1``.

``SAFECKPT_DS_COMPAT=1`` (stock and injected runs alike) bridges the one difference between the
newest DeepSpeed tests available (2026-08 master) and the installed 0.19.8: 0.19.8 removed
sparse-gradient tracking, and the tests' ``compare_deepspeed_states`` still compares
``engine.sparse_tensor_module_names`` of the saved and the loaded engine; both are empty now.
"""

import os

if os.environ.get("SAFECKPT_DS_COMPAT") == "1":
    from deepspeed.runtime.engine import DeepSpeedEngine

    if not hasattr(DeepSpeedEngine, "sparse_tensor_module_names"):
        DeepSpeedEngine.sparse_tensor_module_names = frozenset()

if os.environ.get("SAFECKPT_DS_INJECT") == "1":
    from safeckpt.integrations import deepspeed as _sds

    _sds.install_on_initialize(timeout=float(os.environ.get("SAFECKPT_TIMEOUT", "60")))
