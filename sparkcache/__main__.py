"""``python -m sparkcache``: the same as the ``sparkcache`` console script."""

import sys

from .cli import main

sys.exit(main())
