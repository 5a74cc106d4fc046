"""``python -m chunkserve ...`` is the ``chunkserve`` command."""

import sys

from chunkserve.entrypoints.cli import main

if __name__ == "__main__":  # run, not imported
    sys.exit(main())
