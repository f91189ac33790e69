"""The engine: one collective save or load, async saves, offline access (private; the public names are in ``safeckpt``)."""
