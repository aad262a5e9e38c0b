"""prealign loaders: sources, token-budget micro-batch planning, DP-balanced packed loading.

Flow: source (:class:`HFSource`, :class:`WebDatasetSource`) -> index pass (lengths, locations,
bad-data policy) -> planner (:func:`plan_microbatches`, same plan on every rank) -> this rank's
micro-batches -> DataLoader workers read, transform and collate -> :class:`PackedLoader` batches,
resumable with ``state_dict`` / ``load_state_dict``.

The names below are what a user needs, imported on first use (``import prealign.loaders`` loads
neither torch nor any submodule). Everything else is importable from its module: the errors from
:mod:`prealign.loaders.errors`, the planner's records from :mod:`prealign.loaders.plan.planner`, ...
A name that used to be exported here still resolves, with a ``DeprecationWarning`` naming its
module.
"""

from __future__ import annotations

from prealign.schemas.lazy import lazy_names

_EXPORTS = {
    # the loaders
    "prealign.loaders.loader": ["PackedLoader"],
    "prealign.loaders.streaming": ["StreamingPackedLoader"],
    # sources and how they are read
    "prealign.loaders.sources.source": ["HFSource", "Source"],
    "prealign.loaders.mixture": ["Mixture", "Component"],
    "prealign.loaders.sources.webdataset": ["WebDatasetSource", "numpy_fields"],
    "prealign.loaders.sources.remote": ["RemoteOptions"],
    "prealign.loaders.sources.tar_decode": ["DecodeLimits"],
    # options and policies
    "prealign.loaders.options": [
        "IndexOptions",
        "LoadingOptions",
        "ShuffleOptions",
        "WorkerConfig",
    ],
    "prealign.loaders.policy": ["BadDataPolicy", "Oversize", "PackStrategy"],
    # planning
    "prealign.loaders.plan.planner": ["PlannerConfig", "plan_microbatches"],
    "prealign.loaders.plan.cost": ["CostModel"],
    # indexes and shards
    "prealign.loaders.index.build": ["build_index"],
    "prealign.loaders.index.sample_index": ["SampleIndex"],
    "prealign.loaders.index.shard_writer": ["ShardWriter"],
    # VLMs
    "prealign.loaders.media.vlm": ["VLMSampleTransform"],
    "prealign.loaders.media.chat_tokenizer": ["HFChatTokenizer"],
    # several ranks, resume
    "prealign.loaders.handoff.batch_share": ["BatchShare"],
    "prealign.loaders.conformance": ["assert_resumes_exactly", "assert_resumes_elastically"],
    # the errors a training loop catches (every other: prealign.loaders.errors)
    "prealign.loaders.errors": ["WorkerError", "IndexMismatchError"],
}

# Exported here before the surface was curated: still resolved, with a DeprecationWarning.
_MOVED = {
    "prealign.loaders.errors": [
        "BadSampleError",
        "ChangedShardError",
        "CollectiveTimeoutError",
        "CorruptShardError",
        "IndexFileError",
        "LoaderUsageError",
        "MissingMemberError",
        "MissingShardError",
        "NotRegularFileError",
        "OversizeSampleError",
        "PlanError",
        "RangeIgnoredWarning",
        "RemotePermissionError",
        "RemoteReadError",
        "RemoteStallError",
        "ResumeError",
        "ShardGoneError",
        "ShardTimeoutError",
        "SourceChangedError",
        "StaleIndexError",
        "TooManyBadSamplesError",
        "UnsafeMemberError",
        "UnsupportedTorchError",
    ],
    "prealign.loaders.media.vlm": [
        "MediaError",
        "MediaProblem",
        "VideoDefaultsWarning",
        "image_processor",
    ],
    "prealign.loaders.media.chat_tokenizer": ["ChatTokenizer"],
    "prealign.loaders.plan.planner": ["MicrobatchPlan", "PlanStats", "microbatch_capacity"],
    "prealign.loaders.policy": ["BadDataReport", "BadSampleWarning", "OnBadSample"],
}

_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
_WAS = {name: module for module, names in _MOVED.items() for name in names}

__all__ = list(_WHERE)
__getattr__, __dir__ = lazy_names(__name__, _WHERE, moved=_WAS, cache=globals())
