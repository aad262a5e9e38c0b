"""prealign schemas: parallel layouts, declared batch schemas and their validation."""
from .distributed import check_startup
from .errors import (
                     ArgumentError,
                     BackendVersionError,
                     BatchValidationError,
                     BucketOverflowError,
                     ConfigError,
                     DataError,
                     LayoutError,
                     OffsetOverflowError,
                     PackingUnsupportedError,
                     PrealignError,
                     SampleError,
                     SchemaError,
                     StartupMismatchError,
)
from .layout import CPLayout, FP8Recipe, PadPolicy, ParallelLayout, round_up
from .schema import IGNORE_INDEX, BatchSchema, FieldSpec, Role, Source, causal_lm_schema, rl_schema, topk_fields
from .validate import Violation, validate_batch, validate_packed_seq_params
from .vlm import VisionTokens, media_violations, validate_vlm_batch, vlm_schema

__all__ = ["ParallelLayout", "PadPolicy", "FP8Recipe", "CPLayout", "round_up", "BatchSchema", "FieldSpec", "Role",
           "Source", "causal_lm_schema", "rl_schema", "topk_fields", "IGNORE_INDEX", "validate_batch", "Violation",
           "check_startup", "PrealignError", "ConfigError", "LayoutError", "SchemaError", "SampleError", "DataError", "BucketOverflowError",
           "BatchValidationError", "StartupMismatchError", "ArgumentError", "OffsetOverflowError"]
__all__ += ["vlm_schema", "VisionTokens", "validate_vlm_batch", "media_violations"]
__all__ += ["validate_packed_seq_params", "BackendVersionError"]
__all__ += ["PackingUnsupportedError"]
