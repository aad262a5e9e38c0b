"""prealign schemas: parallel layouts, declared batch schemas and their validation.

The names below are imported on first use: ``import prealign.schemas.errors`` (what every layer imports)
loads no torch. ``Source`` is the deprecated name of :class:`FieldSource`.
"""
from __future__ import annotations

import importlib
import warnings

_EXPORTS = {
    "prealign.schemas.layout": ["ParallelLayout", "PadPolicy", "FP8Recipe", "CPLayout", "round_up"],
    "prealign.schemas.schema": ["BatchSchema", "FieldSpec", "Role", "FieldSource", "causal_lm_schema", "rl_schema",
                                "topk_fields", "IGNORE_INDEX"],
    "prealign.schemas.validate": ["validate_batch", "Violation", "validate_packed_seq_params"],
    "prealign.schemas.distributed": ["check_startup"],
    "prealign.schemas.vlm": ["vlm_schema", "VisionTokens", "validate_vlm_batch", "media_violations"],
    "prealign.schemas.errors": ["PrealignError", "ConfigError", "DataError", "LayoutError", "SchemaError", "SampleError",
                                "BucketOverflowError", "BatchValidationError", "StartupMismatchError", "ArgumentError",
                                "OffsetOverflowError", "BackendVersionError", "PackingUnsupportedError"],
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = list(_WHERE)


def __getattr__(name: str):
    if name == "Source":
        warnings.warn("prealign.schemas.Source is renamed FieldSource (where a token field's values come from)",
                      DeprecationWarning, stacklevel=2)
        name = "FieldSource"
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'prealign.schemas' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
