"""Private helpers of the Lightning integrations (``safeckpt.integrations.lightning``, ``.lightning_dcp``)."""
