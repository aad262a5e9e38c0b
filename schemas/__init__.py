"""prealign schemas: parallel layouts, declared batch schemas and their validation.

The names below are imported on first use: ``import prealign.schemas.errors`` (what every layer
imports) loads no torch. ``Source`` is the deprecated name of :class:`FieldSource`.
"""

from __future__ import annotations

from prealign.schemas.lazy import lazy_names

_EXPORTS = {
    "prealign.schemas.layout": ["ParallelLayout", "PadPolicy", "FP8Recipe", "CPLayout", "round_up"],
    "prealign.schemas.schema": [
        "BatchSchema",
        "FieldSpec",
        "Role",
        "FieldSource",
        "causal_lm_schema",
        "rl_schema",
        "topk_fields",
        "IGNORE_INDEX",
    ],
    "prealign.schemas.validate": ["validate_batch", "Violation", "validate_packed_seq_params"],
    "prealign.schemas.distributed": ["check_startup"],
    "prealign.schemas.vlm": [
        "vlm_schema",
        "image_tokens_schema",
        "VisionTokens",
        "validate_vlm_batch",
        "media_violations",
    ],
    "prealign.schemas.contract": [
        "ModelContract",
        "Consumer",
        "ConsumerUnsupportedError",
        "check_consumer",
    ],
    "prealign.schemas.errors": [
        "PrealignError",
        "ConfigError",
        "DataError",
        "LayoutError",
        "SchemaError",
        "SampleError",
        "BucketOverflowError",
        "BatchValidationError",
        "StartupMismatchError",
        "ArgumentError",
        "OffsetOverflowError",
        "BackendVersionError",
        "PackingUnsupportedError",
    ],
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = list(_WHERE)
__getattr__, __dir__ = lazy_names(
    __name__, _WHERE, renamed={"Source": "FieldSource"}, cache=globals()
)
