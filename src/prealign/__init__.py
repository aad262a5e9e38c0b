"""prealign: DataLoader-side batches for Megatron-style TP/CP/SP training.

The three layers are subpackages, each importable on its own:

- :mod:`prealign.schemas`: parallel layouts, declared batch schemas, validation, ``check_startup``;
- :mod:`prealign.collate`: THD/BSHD collators, CP zigzag shards and their inverse, PackedSeqParams;
- :mod:`prealign.loaders`: sources (HF, webdataset), token-budget planning, ``PackedLoader``.

The common entry points are offered here too, imported on first use (``import prealign`` stays
cheap):

>>> import prealign
>>> layout = prealign.ParallelLayout(tp=2, cp=2)
>>> batch = prealign.THDCollator(schema=prealign.causal_lm_schema(), layout=layout)(
...     [{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}])
>>> batch["input_ids"].shape, batch["cu_seqlens_padded"].tolist()
(torch.Size([1, 8]), [0, 4, 8])
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from prealign.schemas.lazy import lazy_names

try:
    __version__ = version("prealign")
except PackageNotFoundError:  # pragma: no cover - running from a source tree without an install
    __version__ = "0+unknown"

_EXPORTS = {
    "prealign.schemas": [
        "ParallelLayout",
        "PadPolicy",
        "FP8Recipe",
        "BatchSchema",
        "FieldSpec",
        "causal_lm_schema",
        "rl_schema",
        "vlm_schema",
        "validate_batch",
        "check_startup",
        "PrealignError",
    ],
    "prealign.collate": [
        "THDCollator",
        "BSHDCollator",
        "unshard_cp",
        "unpack_thd",
        "unshard_bshd",
        "unpack_bshd",
        "to_packed_seq_params",
    ],
    "prealign.loaders": [
        "PackedLoader",
        "WebDatasetSource",
        "HFSource",
        "BadDataPolicy",
        "plan_microbatches",
    ],
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = ["__version__"]
__all__ += list(_WHERE)
__getattr__, _ = lazy_names(__name__, _WHERE, cache=globals())


def __dir__() -> list[str]:
    return sorted(__all__)
