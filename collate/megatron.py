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

The identity rule: TE decides ``pad_between_seqs`` by object identity (``cu_seqlens_q_padded is
cu_seqlens_q``), and with padding between sequences it turns FlashAttention away. So when every
``P_i == L_i`` the true and padded offsets are one tensor object, in both conventions.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import operator
from typing import Mapping

import torch

from prealign.schemas.errors import ArgumentError, BackendVersionError, OffsetOverflowError
from prealign.schemas.layout import CPLayout
from prealign.schemas.parallel_state import import_megatron

from .indices import num_sequences


class PackedSeqConvention(enum.Enum):
    PADDED = "padded"
    UNPADDED = "unpadded"


def _known_fields(cls) -> set[str]:
    """Field names of the installed ``PackedSeqParams`` (a dataclass in every megatron-core we know;
    the constructor's parameters otherwise)."""
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return set(inspect.signature(cls).parameters)


def _enum_arg(name: str, enum_cls, value):
    try:
        return enum_cls(value.value if isinstance(value, enum.Enum) else value)
    except ValueError:
        raise ArgumentError(
            f"{name}: expected one of {[e.value for e in enum_cls]}, got {value!r}"
        ) from None


def _check_int32(*keys: str, batch: Mapping) -> None:
    """``batch[key]`` are integer tensors whose values fit int32 (the cast would truncate a float
    and wrap an int64), else an :class:`ArgumentError` / :class:`OffsetOverflowError`."""
    for key in keys:
        t = batch[key]
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise ArgumentError(f"batch: expected {key} an integer tensor, got {t.dtype}")
        big = t.dtype == torch.int64 and t.numel() and int(t.abs().max()) > 2**31 - 1
        if big:
            raise OffsetOverflowError(
                f"batch: {key}: values in [{int(t.min())}, {int(t.max())}] do not fit the int32 "
                f"offsets megatron-core and TE take (expected 0 <= value < 2**31)"
            )


def to_packed_seq_params(
    batch: dict,
    *,
    convention: PackedSeqConvention | str = PackedSeqConvention.PADDED,
    cp_layout: CPLayout | str | None = None,
    device: torch.device | str | None = None,
    cp_group=None,
    qkv_format: str = "thd",
):
    """Build ``megatron.core.packed_seq_params.PackedSeqParams(qkv_format="thd", ...)`` from a
    :class:`~prealign.collate.THDCollator` batch. Offsets are int32 (moved to ``device`` when
    given).

    ``qkv_format="sbhd"``: a batch of one sequence as megatron-core's hybrid-CP path feeds it (one
    sub-sample per forward, ``get_batch_on_this_hybrid_cp_rank``): every offsets field ``[0, P]``
    (one tensor) and ``max_seqlen = P``, the sample's global padded length.

    With a megatron-core that knows ``cp_partition_mode`` it is set from ``cp_layout`` (default: the
    batch's own ``cp_layout``, zigzag if it has none); an older one only supports zigzag, and a
    contiguous batch under CP is an error there. A megatron-core whose ``PackedSeqParams`` has
    ``pad_between_seqs`` gets it stated (True when ``cu_seqlens_q`` differs from the padded offsets,
    i.e. the UNPADDED convention with real padding; TE would otherwise infer it), and one with
    ``total_tokens`` gets ``T``, the global padded length (``cu_seqlens_padded[-1]``), from which it
    derives ``seq_idx``; ``tokens_per_sample`` is ``T`` too: one packed sample, in the unit
    Megatron-LM's ``pretrain_gpt.py`` gives it (``args.seq_length``, global tokens before the CP
    split). A hybrid-CP batch (one with ``local_cp_size``, see
    :mod:`prealign.loaders.plan.hybrid_cp`) gets ``local_cp_size`` and ``cp_group``, which must be
    the process group of exactly ``local_cp_size`` ranks this rank runs the block with (a singleton
    group for 1: newer megatron-core asserts ``cp_group.size() == local_cp_size``);
    :class:`ArgumentError` otherwise, and :class:`BackendVersionError` when the installed
    ``PackedSeqParams`` has no such fields (0.14).
    """
    PackedSeqParams = import_megatron(
        "megatron.core.packed_seq_params"
    ).PackedSeqParams  # (import warnings filtered)
    if not isinstance(batch, Mapping):
        raise ArgumentError(
            f"batch: expected a THDCollator batch (a dict), got {type(batch).__name__}"
        )
    missing = [
        k
        for k in ("cu_seqlens", "cu_seqlens_padded", "max_seqlen")
        if not isinstance(batch.get(k), torch.Tensor)
    ]
    if missing:
        raise ArgumentError(
            f"batch: expected the THD keys {missing} as tensors (a THDCollator batch), got keys "
            f"{sorted(map(str, batch))}"
        )
    convention = _enum_arg("convention", PackedSeqConvention, convention)
    cp_layout = _enum_arg(
        "cp_layout",
        CPLayout,
        cp_layout if cp_layout is not None else batch.get("cp_layout", CPLayout.ZIGZAG.value),
    )
    _check_int32("cu_seqlens", "cu_seqlens_padded", "max_seqlen", batch=batch)
    padded = batch["cu_seqlens_padded"].to(
        dtype=torch.int32
    )  # checked where they are (the loader's CPU),
    true = batch["cu_seqlens"].to(dtype=torch.int32)  # then moved: no GPU sync per check
    if padded.ndim != 1 or padded.shape != true.shape or padded.numel() < 2:
        raise ArgumentError(
            f"batch: expected cu_seqlens and cu_seqlens_padded int32 [N+1] alike, got "
            f"{tuple(true.shape)} and {tuple(padded.shape)}"
        )
    if batch["max_seqlen"].numel() != 1:
        raise ArgumentError(
            f"batch: expected max_seqlen int32 [1], got shape {tuple(batch['max_seqlen'].shape)}"
        )
    max_seqlen = int(batch["max_seqlen"].reshape(-1)[0])
    _check_offsets(true, padded, max_seqlen)
    if qkv_format not in ("thd", "sbhd"):
        raise ArgumentError(f"qkv_format: expected 'thd' or 'sbhd', got {qkv_format!r}")
    if qkv_format == "sbhd":
        if num_sequences(padded) != 1:
            raise ArgumentError(
                f"batch: qkv_format='sbhd' takes a batch of one sequence (megatron-core's "
                f"per-sample hybrid-CP form), got {num_sequences(padded)}"
            )
        true = padded = padded[[0, -1]]
        max_seqlen = int(padded[-1])
    if true is not padded and torch.equal(true, padded):
        true = padded  # the identity rule (module docstring)
    padded, true = padded.to(device), true.to(device) if true is not padded else None
    q = padded if convention is PackedSeqConvention.PADDED or true is None else true
    kwargs = dict(
        qkv_format=qkv_format,
        cu_seqlens_q=q,
        cu_seqlens_kv=q,
        cu_seqlens_q_padded=padded,
        cu_seqlens_kv_padded=padded,
        max_seqlen_q=max_seqlen,
        max_seqlen_kv=max_seqlen,
    )
    known = _known_fields(PackedSeqParams)
    if "cp_partition_mode" in known:
        kwargs["cp_partition_mode"] = cp_layout.value
    elif cp_layout is CPLayout.CONTIGUOUS and batch.get("cp_size", 1) > 1:
        raise ArgumentError(
            "cp_layout: the contiguous CP layout needs PackedSeqParams.cp_partition_mode, which "
            "this megatron-core does not have; use CPLayout.ZIGZAG or a newer megatron-core"
        )
    if "pad_between_seqs" in known:
        kwargs["pad_between_seqs"] = q is not padded
    total = int(batch["cu_seqlens_padded"][-1])
    local_cp = batch.get("local_cp_size")
    if local_cp is not None:
        try:
            local_cp = operator.index(local_cp)
        except TypeError:
            raise ArgumentError(
                f"batch: local_cp_size: expected an int, got {local_cp!r}"
            ) from None
        kwargs.update(
            local_cp_size=int(local_cp), cp_group=_hybrid_group(int(local_cp), cp_group, known)
        )
    if "total_tokens" in known:
        kwargs["total_tokens"] = total
    if "tokens_per_sample" in known:
        kwargs["tokens_per_sample"] = total
    params = PackedSeqParams(**kwargs)
    if "seq_idx" in known and getattr(params, "seq_idx", None) is None:
        params.seq_idx = seq_idx(padded, total)
    return params


def megatron_core_version() -> str:
    """The installed megatron-core's version string ("unknown" without package metadata)."""
    from importlib import metadata

    try:
        return metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        return "unknown"


def _hybrid_group(local_cp: int, cp_group, known: set[str]):
    """``cp_group`` checked for a hybrid-CP batch of ``local_cp`` ranks (see
    :func:`to_packed_seq_params`)."""
    lacking = sorted({"local_cp_size", "cp_group"} - known)
    if lacking:
        raise BackendVersionError(
            f"batch: a hybrid-CP batch (local_cp_size={local_cp}) needs PackedSeqParams fields "
            f"{lacking}, which megatron-core {megatron_core_version()} does not have "
            "(0.16 has them); plan without hybrid CP or upgrade megatron-core"
        )
    size = cp_group.size() if callable(getattr(cp_group, "size", None)) else None
    if size != local_cp:
        raise ArgumentError(
            f"cp_group: expected the process group of this rank's {local_cp} hybrid-CP rank(s) "
            f"(size {local_cp}; a singleton group for local_cp_size 1), got "
            f"{'None' if cp_group is None else f'a group of size {size}'}"
        )
    return cp_group


def seq_idx(cu_seqlens_padded: torch.Tensor, total: int) -> torch.Tensor:
    """int32 ``[1, total]``: the sequence each padded slot belongs to (Mamba's ``seq_idx``); slots
    past the last offset (none in a prealign batch) get one more index.

    >>> seq_idx(torch.tensor([0, 2, 5]), 6).tolist()
    [[0, 0, 1, 1, 1, 2]]
    """
    ends = torch.cat(
        (cu_seqlens_padded.to(torch.int64), torch.tensor([total], device=cu_seqlens_padded.device))
    )
    counts = ends.diff().clamp(min=0)
    return torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts).to(
        torch.int32
    )[None]


def _check_offsets(true: torch.Tensor, padded: torch.Tensor, max_seqlen: int) -> None:
    """The offsets TE and megatron-core read describe a packed batch: both start at 0 and never
    decrease, each padded length ``P_i`` holds its true length ``L_i`` (``P_i >= L_i``), and
    ``max_seqlen`` bounds every ``P_i`` (TE sizes its kernels by it: a smaller one reads out of
    bounds)."""
    lengths, padded_lengths = true.diff(), padded.diff()
    if (
        int(true[0]) != 0
        or int(padded[0]) != 0
        or bool((lengths < 0).any())
        or bool((padded_lengths < 0).any())
    ):
        raise ArgumentError(
            f"batch: expected cu_seqlens and cu_seqlens_padded starting at 0 and non-decreasing, "
            f"got {true.tolist()[:8]} and {padded.tolist()[:8]}"
        )
    short = torch.nonzero(padded_lengths < lengths).reshape(-1)
    if short.numel():
        i = int(short[0])
        raise ArgumentError(
            f"batch: expected each padded length >= its true length (cu_seqlens_padded holds "
            f"cu_seqlens), got sequence {i} padded to {int(padded_lengths[i])} < {int(lengths[i])}"
        )
    longest = int(padded_lengths.max())
    if max_seqlen < max(longest, 1):
        raise ArgumentError(
            f"batch: expected max_seqlen >= the longest padded sequence ({max(longest, 1)}), got "
            f"{max_seqlen}"
        )
