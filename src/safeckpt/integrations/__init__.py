"""Optional integrations with training frameworks (DeepSpeed, Lightning, Hugging Face).

Each submodule imports its framework itself; ``import safeckpt`` imports none of them.
"""
