"""``python -m torchntk``: see :mod:`torchntk.cli`."""

from torchntk.cli import main

raise SystemExit(main())
