"""``python -m chunkserve ...`` is the ``chunkserve`` command."""

import sys

from chunkserve.entrypoints.cli import main

if __name__ == "__main__":  # not when a spawned engine-core process imports it
    sys.exit(main())
