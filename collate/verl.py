"""CP-rank THD batch -> what verl's megatron engine forward gets back from its own
``preprocess_thd_engine`` (verl 0.9.1, ``verl/models/mcore/util.py``), so the forward can skip that
per-sequence Python loop and take prealign's batch instead.

``preprocess_thd_engine(nested)`` returns ``(rows [1, T/cp, ...], PackedSeqParams, position_ids [1,
T/cp])``; :func:`to_verl_thd` returns the same triple from a batch of
``THDCollator(schema, ParallelLayout(tp, cp, pad_policy=PadPolicy.PER_SEQUENCE), cp_rank=r)``
(verl's padding rule; add ``fp8`` / ``length_buckets`` / ``min_local_rows`` to match its options).
The rows and the offsets agree element for element (tested); positions agree on every real token (on
pads verl leaves 0 in some slots and counts on in others, prealign counts on: no real token ever
reads a pad's position). For the loss side (verl's ``logits_processor`` args) take any other token
field the same way: ``to_verl_thd(batch, "teacher_topk_ids").rows``; ``"labels"`` are verl's
``need_roll`` ids except on each sequence's last token, where prealign has the ignore index instead
of a wrap to the first token.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from prealign.schemas.errors import ConfigError

from .megatron import PackedSeqConvention, to_packed_seq_params


class VerlTHDInputs(NamedTuple):
    """Unpacks like ``preprocess_thd_engine``'s result: ``rows, packed_seq_params, position_ids =
    ...``."""

    rows: torch.Tensor
    """The field on this CP rank, ``[1, T/cp, *dense]`` (verl's ``input_ids_rmpad``)."""
    packed_seq_params: Any
    """megatron-core ``PackedSeqParams(qkv_format="thd")``, padded offsets everywhere (verl's
    convention)."""
    position_ids: torch.Tensor
    """int64 ``[1, T/cp]``, each slot's position in its sequence."""


def to_verl_thd(
    batch: dict, field: str = "input_ids", *, device: torch.device | str | None = None
) -> VerlTHDInputs:
    """verl's ``preprocess_thd_engine(nested_field)`` output, read from a prealign THD batch (module
    docstring).

    ``batch``: a :class:`~prealign.collate.THDCollator` batch of one CP rank (or unsharded when
    cp=1); ``field``: a TOKEN field of it with the token dim at 1 (``input_ids``, ``labels``,
    ``loss_mask``, ``teacher_topk_*``...). Tensors are moved to ``device`` when given.
    """
    if "cp_gather_index" in batch:
        raise ConfigError(
            "to_verl_thd: the batch was built with defer_cp_shard=True (whole sequences plus "
            "cp_gather_index); verl's engine takes the CP-sharded rows: use defer_cp_shard=False"
        )
    if (
        field not in batch
        or not torch.is_tensor(batch[field])
        or batch[field].ndim < 2
        or batch[field].shape[0] != 1
    ):
        got = (
            tuple(batch[field].shape)
            if torch.is_tensor(batch.get(field))
            else ("missing" if field not in batch else type(batch[field]).__name__)
        )
        raise ConfigError(
            f"to_verl_thd: field {field!r} must be a THD token field [1, T_out, ...]; got {got}"
        )
    params = to_packed_seq_params(batch, convention=PackedSeqConvention.PADDED, device=device)
    rows, positions = batch[field], batch["position_ids"]
    if device is not None:
        rows, positions = rows.to(device), positions.to(device)
    return VerlTHDInputs(rows, params, positions)
