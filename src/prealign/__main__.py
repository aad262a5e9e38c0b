"""``python -m prealign ...`` is the ``prealign`` command."""

import sys

from prealign.loaders.cli import main

if __name__ == "__main__":  # (documentation tools import every module: only run as a program)
    sys.exit(main())
