"""prealign loaders: sources, token-budget micro-batch planning, DP-balanced packed loading.

Flow: source (:class:`HFSource`, :class:`WebDatasetSource`) -> index pass (lengths, locations,
bad-data policy) -> planner (:func:`plan_microbatches`, same plan on every rank) -> this rank's
micro-batches -> DataLoader workers read, transform and collate -> :class:`PackedLoader` batches,
resumable with ``state_dict`` / ``load_state_dict``.
"""
from .batch_share import BatchShare
from .chat_tokenizer import ChatTokenizer, HFChatTokenizer
from .conformance import assert_resumes_exactly
from .errors import (BadSampleError, CorruptShardError, IndexFileError, LoaderUsageError, MissingMemberError,
                     MissingShardError, OversizeSampleError, PlanError, ResumeError, ShardTimeoutError,
                     SourceChangedError, TooManyBadSamplesError, UnsafeMemberError, WorkerError)
from .index import SampleIndex, build_index
from .loader import PackedLoader
from .options import IndexOptions, LoadingOptions, ShuffleOptions
from .planner import MicrobatchPlan, PlannerConfig, PlanStats, microbatch_capacity, plan_microbatches
from .policy import BadDataPolicy, BadDataReport, BadSampleWarning, OnBadSample, Oversize, PackStrategy
from .sources import HFSource, Source
from .streaming import StreamingPackedLoader
from .tar_decode import DecodeLimits
from .webdataset_source import WebDatasetSource, numpy_fields
from .vlm import MediaError, MediaProblem, VLMSampleTransform, image_processor

__all__ = ["HFChatTokenizer", "ChatTokenizer", "PackedLoader", "StreamingPackedLoader", "IndexOptions", "LoadingOptions",
           "ShuffleOptions", "plan_microbatches", "microbatch_capacity", "MicrobatchPlan", "PlannerConfig", "PlanStats",
           "HFSource", "WebDatasetSource", "Source", "numpy_fields", "SampleIndex", "build_index", "assert_resumes_exactly",
           "PackStrategy", "Oversize", "OnBadSample", "BadDataPolicy", "BadDataReport", "BadSampleWarning",
           "PlanError", "OversizeSampleError", "BadSampleError", "UnsafeMemberError", "MissingMemberError",
           "CorruptShardError", "TooManyBadSamplesError", "ResumeError", "SourceChangedError"]
__all__ += ["IndexFileError", "LoaderUsageError", "MissingShardError", "ShardTimeoutError", "WorkerError",
            "DecodeLimits"]
__all__ += ["VLMSampleTransform", "MediaError", "MediaProblem", "image_processor", "BatchShare"]
