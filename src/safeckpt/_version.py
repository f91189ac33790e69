"""The package version, in a module of its own so no module inside the package imports its ``__init__``."""

__version__ = "0.1.0"
