"""``python -m chunkserve ...`` is the ``chunkserve`` command."""

import sys

from chunkserve.cli import main

sys.exit(main())
