"""Private helpers of the DeepSpeed integration (``safeckpt.integrations.deepspeed``)."""
