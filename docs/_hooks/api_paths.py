"""mkdocs hook: lets mkdocstrings find ``prealign``'s subpackages. setuptools installs them from the
root folders (``package-dir``: ``collate/``, ``schemas/``, ``loaders/`` become ``prealign.collate``
...), which a documentation tool walking ``src/prealign`` does not see; this hook builds, in a
temporary folder, a ``prealign/`` holding links to ``src/prealign``'s files and to the three
folders, and puts it first on ``sys.path`` for the build."""

import atexit
import os
import shutil
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def on_startup(**kwargs) -> None:
    top = tempfile.mkdtemp(prefix="prealign-api-")
    atexit.register(shutil.rmtree, top, True)
    package = os.path.join(top, "prealign")
    os.mkdir(package)
    src = os.path.join(ROOT, "src", "prealign")
    for name in os.listdir(src):
        os.symlink(os.path.join(src, name), os.path.join(package, name))
    for sub in ("collate", "schemas", "loaders"):
        os.symlink(os.path.join(ROOT, sub), os.path.join(package, sub))
    sys.path.insert(0, top)
