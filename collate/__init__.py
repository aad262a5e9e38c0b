"""prealign collators: aligned THD/BSHD batches, CP sharding and its inverse."""

from .bshd import BSHDCollator
from .hf import HFAttention, HFCollator, block_causal_mask, to_hf_kwargs
from .indices import cu_seqlens_to_lengths, lengths_to_cu_seqlens
from .inverse import unpack_bshd, unpack_thd, unshard_bshd, unshard_cp
from .megatron import PackedSeqConvention, to_packed_seq_params
from .mrope import MRoPECollator, mrope_position_ids
from .thd import THDCollator
from .verl import VerlTHDInputs, to_verl_thd

__all__ = [
    "THDCollator",
    "BSHDCollator",
    "unshard_cp",
    "unpack_thd",
    "unshard_bshd",
    "unpack_bshd",
    "to_packed_seq_params",
    "PackedSeqConvention",
    "lengths_to_cu_seqlens",
    "cu_seqlens_to_lengths",
]
__all__ += [
    "MRoPECollator",
    "mrope_position_ids",
    "to_hf_kwargs",
    "block_causal_mask",
    "HFAttention",
    "HFCollator",
    "to_verl_thd",
    "VerlTHDInputs",
]
