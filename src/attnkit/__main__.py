"""``python -m attnkit``: the same command line as ``attnkit``."""

import sys

from attnkit.cli import main

sys.exit(main())
