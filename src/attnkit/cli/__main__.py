import sys

from attnkit.cli import main

sys.exit(main())
