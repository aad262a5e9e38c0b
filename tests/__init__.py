"""The test suite. ``ROOT`` is the repository's root folder, whatever the depth of a test file below
tests/."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
