"""``python -m prealign ...`` is the ``prealign`` command."""
import sys

from prealign.loaders.cli import main

sys.exit(main())
