"""Argument checks every layer shares. Each raises the error class its caller passes (a layer
raises its own: ``LayoutError`` in a layout, ``PlanError`` in a plan, ``ConfigError`` in a source),
naming the argument, what was expected and what came.

>>> from prealign.schemas import LayoutError, ParallelLayout
>>> int_at_least("buffer_size", 64, 2, ValueError)
64
>>> fields_of("layout", {"tp": 2}, ParallelLayout, LayoutError)
{'tp': 2}
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import numpy as np


def int_at_least(
    name: str, value, low: int, error: type[Exception], *, expected: str | None = None
) -> int:
    """``value`` as an ``int`` when it is an int (numpy ints too; never a bool, a float or a str)
    ``>= low``, else ``error("<name>: expected <expected>, got <value>")`` (``expected``: ``an int
    >= <low>`` unless given; the value's type follows when it is not an int)."""
    if (
        isinstance(value, (bool, np.bool_))
        or not isinstance(value, (int, np.integer))
        or value < low
    ):
        kind = "" if type(value) is int else f" ({type(value).__name__})"
        raise error(f"{name}: expected {expected or f'an int >= {low}'}, got {value!r}{kind}")
    return int(value)


def fields_of(where: str, data, cls, error: type[Exception]) -> dict:
    """``data`` as a dict when it is a mapping (a dict, an OmegaConf ``DictConfig``, ...) of some of
    dataclass ``cls``'s init fields, else ``error`` naming ``where``, the unknown keys and the
    fields expected."""
    if not isinstance(data, Mapping):
        raise error(f"{where}: expected a dict of {cls.__name__} fields, got {type(data).__name__}")
    data = dict(data)
    known = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(map(str, set(data) - known))
    if unknown:
        raise error(f"{where}: unknown key(s) {unknown}; expected some of {sorted(known)}")
    return data
