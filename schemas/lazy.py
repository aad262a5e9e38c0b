"""Packages whose names are imported on first use (``import prealign`` and its layers stay cheap: no
torch).

>>> getattr_, dir_ = lazy_names("pkg", {"sqrt": "math"})
>>> getattr_("sqrt")(4.0), dir_()
(2.0, ['sqrt'])
"""

from __future__ import annotations

import importlib
import sys
import warnings
from typing import Callable


def lazy_names(
    package: str,
    where: dict[str, str],
    *,
    moved: dict[str, str] | None = None,
    renamed: dict[str, str] | None = None,
    cache: dict | None = None,
) -> tuple[Callable, Callable]:
    """``(__getattr__, __dir__)`` for ``package``: a name of ``where`` (name -> module) is imported
    from its module on first use (and kept in ``cache``, the package's globals); a name of ``moved``
    (name -> module: no longer exported) or of ``renamed`` (old name -> new name) still resolves,
    with a ``DeprecationWarning`` saying where it is now; anything else is an ``AttributeError``."""
    moved, renamed = moved or {}, renamed or {}

    def __getattr__(name: str):  # (PEP 562: a missing name is an AttributeError)
        if name in renamed:
            warnings.warn(
                f"{package}.{name} is renamed {renamed[name]}", DeprecationWarning, stacklevel=2
            )
            return __getattr__(renamed[name])
        if name in moved:
            warnings.warn(
                f"{package}.{name} is no longer exported from {package}: import it from "
                f"{moved[name]}",
                DeprecationWarning,
                stacklevel=2,
            )
            return getattr(importlib.import_module(moved[name]), name)
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(where[name]), name)
        if cache is not None:
            cache[name] = value
        return value

    def dir_() -> list[str]:
        return sorted(where)

    return __getattr__, dir_


def is_instance(obj, module: str, name: str) -> bool:
    """``isinstance(obj, module.name)`` without importing ``module``: an object cannot be an
    instance of a class whose module was never imported, so a check on a path that must stay light
    (``prealign index --text``: no torch) costs a dict look-up.

    >>> import numbers
    >>> is_instance(1.0, "numbers", "Real"), is_instance(1.0, "a_module.never_imported", "Real")
    (True, False)
    """
    cls = getattr(sys.modules.get(module), name, None)
    return cls is not None and isinstance(obj, cls)
