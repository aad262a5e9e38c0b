"""THD batch -> megatron-core ``PackedSeqParams``.

Which offsets go where (both are supported; TE needs the padded offsets whenever P_i != L_i):

============================  ======================  ==========================
convention                    cu_seqlens_q / _kv      cu_seqlens_q_padded / _kv
============================  ======================  ==========================
PADDED (verl, MCore, NeMo-RL)  padded offsets          padded offsets
UNPADDED (Megatron-Bridge)     true offsets            padded offsets
============================  ======================  ==========================

``max_seqlen_q/_kv`` is the longest *padded* sequence in both conventions (an upper bound TE
accepts for either set of offsets).
"""
from __future__ import annotations

import dataclasses
import enum

import torch

from prealign.schemas.layout import CPLayout


class PackedSeqConvention(enum.Enum):
    PADDED = "padded"
    UNPADDED = "unpadded"


def to_packed_seq_params(batch: dict, *, convention: PackedSeqConvention | str = PackedSeqConvention.PADDED,
                         cp_layout: CPLayout | str | None = None, device: torch.device | str | None = None):
    """Build ``megatron.core.packed_seq_params.PackedSeqParams(qkv_format="thd", ...)`` from a
    :class:`~prealign.collate.THDCollator` batch. Offsets are int32 (moved to ``device`` when given).

    With a megatron-core that knows ``cp_partition_mode`` it is set from ``cp_layout`` (default: the
    batch's own ``cp_layout``, zigzag if it has none); an older one only supports zigzag, and a
    contiguous batch under CP is an error there.
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    convention = PackedSeqConvention(convention)
    cp_layout = CPLayout(cp_layout if cp_layout is not None else batch.get("cp_layout", CPLayout.ZIGZAG.value))
    padded = batch["cu_seqlens_padded"].to(device=device, dtype=torch.int32)
    true = batch["cu_seqlens"].to(device=device, dtype=torch.int32)
    q = padded if convention is PackedSeqConvention.PADDED else true
    max_seqlen = int(batch["max_seqlen"].reshape(-1)[0])
    kwargs = dict(qkv_format="thd", cu_seqlens_q=q, cu_seqlens_kv=q, cu_seqlens_q_padded=padded,
                  cu_seqlens_kv_padded=padded, max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen)
    known = {f.name for f in dataclasses.fields(PackedSeqParams)} if dataclasses.is_dataclass(PackedSeqParams) else set()
    if "cp_partition_mode" in known:
        kwargs["cp_partition_mode"] = cp_layout.value
    elif cp_layout is CPLayout.CONTIGUOUS and batch.get("cp_size", 1) > 1:
        raise ValueError("the contiguous CP layout needs PackedSeqParams.cp_partition_mode, which this "
                         "megatron-core does not have; use CPLayout.ZIGZAG or a newer megatron-core")
    return PackedSeqParams(**kwargs)
