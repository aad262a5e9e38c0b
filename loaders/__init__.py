"""prealign loaders: sources, token-budget micro-batch planning, DP-balanced packed loading.

Flow: source (:class:`HFSource`, :class:`WebDatasetSource`) -> index pass (lengths, locations,
bad-data policy) -> planner (:func:`plan_microbatches`, same plan on every rank) -> this rank's
micro-batches -> DataLoader workers read, transform and collate -> :class:`PackedLoader` batches,
resumable with ``state_dict`` / ``load_state_dict``.
"""
from prealign.loaders.conformance import assert_resumes_elastically, assert_resumes_exactly
from prealign.loaders.errors import (
                     BadSampleError,
                     ChangedShardError,
                     CollectiveTimeoutError,
                     CorruptShardError,
                     IndexFileError,
                     IndexMismatchError,
                     LoaderUsageError,
                     MissingMemberError,
                     MissingShardError,
                     NotRegularFileError,
                     OversizeSampleError,
                     PlanError,
                     RangeIgnoredWarning,
                     RemotePermissionError,
                     RemoteReadError,
                     RemoteStallError,
                     ResumeError,
                     ShardGoneError,
                     ShardTimeoutError,
                     SourceChangedError,
                     StaleIndexError,
                     TooManyBadSamplesError,
                     UnsafeMemberError,
                     UnsupportedTorchError,
                     WorkerError,
)
from prealign.loaders.handoff.batch_share import BatchShare
from prealign.loaders.index.build import build_index
from prealign.loaders.index.sample_index import SampleIndex
from prealign.loaders.index.shard_writer import ShardWriter
from prealign.loaders.loader import PackedLoader
from prealign.loaders.media.chat_tokenizer import ChatTokenizer, HFChatTokenizer
from prealign.loaders.media.vlm import (
                     MediaError,
                     MediaProblem,
                     VideoDefaultsWarning,
                     VLMSampleTransform,
                     image_processor,
)
from prealign.loaders.mixture import Component, Mixture
from prealign.loaders.options import IndexOptions, LoadingOptions, ShuffleOptions, WorkerConfig
from prealign.loaders.plan.cost import CostModel
from prealign.loaders.plan.planner import (
                     MicrobatchPlan,
                     PlannerConfig,
                     PlanStats,
                     microbatch_capacity,
                     plan_microbatches,
)
from prealign.loaders.policy import BadDataPolicy, BadDataReport, BadSampleWarning, OnBadSample, Oversize, PackStrategy
from prealign.loaders.sources.remote import RemoteOptions
from prealign.loaders.sources.source import HFSource, Source
from prealign.loaders.sources.tar_decode import DecodeLimits
from prealign.loaders.sources.webdataset import WebDatasetSource, numpy_fields
from prealign.loaders.streaming import StreamingPackedLoader

__all__ = ["HFChatTokenizer", "ChatTokenizer", "PackedLoader", "StreamingPackedLoader", "IndexOptions", "LoadingOptions",
           "ShuffleOptions", "plan_microbatches", "microbatch_capacity", "MicrobatchPlan", "PlannerConfig", "PlanStats",
           "HFSource", "WebDatasetSource", "Source", "numpy_fields", "SampleIndex", "build_index", "assert_resumes_exactly",
           "PackStrategy", "Oversize", "OnBadSample", "BadDataPolicy", "BadDataReport", "BadSampleWarning",
           "PlanError", "OversizeSampleError", "BadSampleError", "UnsafeMemberError", "MissingMemberError",
           "CorruptShardError", "TooManyBadSamplesError", "ResumeError", "SourceChangedError"]
__all__ += ["IndexFileError", "LoaderUsageError", "MissingShardError", "ShardTimeoutError", "WorkerError",
            "DecodeLimits"]
__all__ += ["VLMSampleTransform", "MediaError", "MediaProblem", "image_processor", "BatchShare"]
__all__ += ["WorkerConfig", "UnsupportedTorchError"]
__all__ += ["RemoteOptions", "RemoteReadError", "RemoteStallError", "RemotePermissionError", "RangeIgnoredWarning"]
__all__ += ["CollectiveTimeoutError", "NotRegularFileError", "ShardGoneError"]
__all__ += ["assert_resumes_elastically"]
__all__ += ["CostModel"]
__all__ += ["ShardWriter"]
__all__ += ["ChangedShardError", "IndexMismatchError", "StaleIndexError", "VideoDefaultsWarning"]
__all__ += ["Mixture", "Component"]
