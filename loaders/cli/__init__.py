"""The ``prealign`` command for people (``demo``, ``inspect``), its synthetic data and its picture.

No library module imports this subpackage: it sits on top of ``prealign.loaders``.
"""

from prealign.loaders.cli.main import main

__all__ = ["main"]
