"""Private helpers of the Hugging Face integrations (``safeckpt.integrations.hf``, ``.accelerate``)."""
