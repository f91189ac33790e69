"""``python -m safeckpt.cli``."""

from . import main

raise SystemExit(main())
