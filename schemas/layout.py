"""Parallel layout: how Megatron/TE will split a batch, and the padding that split requires.

Notation (see README): ``L_i`` true length of sequence i, ``P_i`` its padded length,
``T = sum(P_i)`` the global packed length, ``T_local = T / cp`` what one CP rank holds.

    PadPolicy.MINIMAL (default)            PadPolicy.PER_SEQUENCE (verl / Megatron-Bridge)
    P_i = round_up(L_i, 2*cp) if cp > 1    P_i = round_up(L_i, 2*cp*tp) if cp > 1
          else L_i                                else round_up(L_i, tp)
    then, for both, only the LAST sequence grows, by the least amount, until
      T % total_multiple == 0   (T_local % tp under SP; the rows of one SP rank,
                                 T_local / tp under SP else T_local, % lcm(FP8 block,
                                 token_multiple))
      T >= cp * min_local_rows
      T == smallest length bucket >= T   (when buckets are configured)

Static shapes (CUDA graphs): ``length_buckets=(T,)`` makes every batch exactly ``T`` rows, and
``max_seqs=N`` gives ``cu_seqlens`` / ``cu_seqlens_padded`` exactly ``N + 1`` entries, the unused
trailing ones repeating the total (megatron-core's own padding for graphs); the planner never puts
more than ``N`` sequences in a micro-batch. With both, ``max_seqlen`` is ``T`` too (global, as TE
and megatron-core read it under CP), so nothing TE is given varies between batches.
"""

from __future__ import annotations

import enum
import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

from .checks import fields_of, int_at_least
from .errors import BucketOverflowError, LayoutError
from .parallel_state import megatron_parallel_sizes

MAX_PACKED_LENGTH = 2**31 - 1
"""The largest packed length ``T`` (and offset) an int32 ``cu_seqlens`` holds."""


def round_up(n: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``n`` (adds nothing when already aligned).

    >>> round_up(5, 4), round_up(8, 4), round_up(0, 4)
    (8, 8, 0)
    """
    if multiple < 1:
        raise LayoutError(f"round_up: multiple must be >= 1, got {multiple}")
    return -(-n // multiple) * multiple


def round_up_array(n: np.ndarray, multiple: int) -> np.ndarray:
    """Element-wise :func:`round_up` of an integer array (int64, a new array)."""
    if multiple < 1:
        raise LayoutError(f"round_up: multiple must be >= 1, got {multiple}")
    return -(-np.asarray(n, dtype=np.int64) // multiple) * multiple


def is_power_of_two(n: int) -> bool:
    """True for 1, 2, 4, 8, ... (the CP sizes hybrid CP cuts a group into).

    >>> [is_power_of_two(n) for n in (0, 1, 2, 3, 4)]
    [False, True, True, False, True]
    """
    return n >= 1 and not n & (n - 1)


class PadPolicy(enum.Enum):
    """How much each sequence is padded. See the module docstring."""

    MINIMAL = "minimal"
    PER_SEQUENCE = "per_sequence"


class FP8Recipe(enum.Enum):
    """FP8/FP4 recipe; :attr:`multiple` is the block the rows of one SP rank (``T_local / tp`` under
    SP, ``T_local`` without) must be a multiple of: TE's quantizers work on each rank's share.

    NVFP4 is MXFP8's alias: its 16-element scaling blocks are not the binding rule, the FP4 GEMM's
    token dimension is (megatron-core 0.16.1 ``fp4_utils.get_fp4_align_size``: 32 FP4 values per
    16-byte TMA-aligned access; TE's NVFP4 quantizer checks ``first_dim % 32``). It is also what
    ``"nvfp4"`` meant before it was named, so saved states keep their fingerprints (``"fp8": 32``).

    >>> multiples = [r.multiple for r in FP8Recipe]
    >>> multiples, FP8Recipe.coerce("nvfp4") is FP8Recipe.NVFP4 is FP8Recipe.MXFP8
    ([1, 16, 32, 128], True)
    """

    NONE = 1
    FP8 = 16  # delayed / tensorwise scaling
    MXFP8 = 32  # 32-element scaling blocks
    NVFP4 = 32  # FP4 GEMM's TMA alignment (see above)
    BLOCKWISE = 128

    @property
    def multiple(self) -> int:
        """Rows of one SP rank are a multiple of this."""
        return self.value

    @classmethod
    def coerce(cls, value) -> "FP8Recipe":
        if isinstance(value, cls):
            return value
        if value is None or value is False:
            return cls.NONE
        by_name = {
            "none": cls.NONE,
            "fp8": cls.FP8,
            "delayed": cls.FP8,
            "tensorwise": cls.FP8,
            "mxfp8": cls.MXFP8,
            "fp4": cls.MXFP8,
            "nvfp4": cls.NVFP4,
            "blockwise": cls.BLOCKWISE,
        }
        if isinstance(value, str) and value.lower() in by_name:
            return by_name[value.lower()]
        if isinstance(value, int) and not isinstance(value, bool):
            for recipe in cls:
                if recipe.value == value:
                    return recipe
        raise LayoutError(
            f"fp8: expected one of none/16/32/128 or {sorted(by_name)}, got {value!r}"
        )


class CPLayout(enum.Enum):
    """How packed rows are split over CP ranks.

    ZIGZAG: each padded sequence is cut into ``2*cp`` chunks; rank r keeps chunks r and 2cp-1-r
    (Megatron/TE default, load-balanced for causal attention). CONTIGUOUS: rank r keeps rows
    ``[r*T_local, (r+1)*T_local)`` of the global padded buffer (verl's ``cp_layout="contiguous"``).
    """

    ZIGZAG = "zigzag"
    CONTIGUOUS = "contiguous"


def is_flag(value) -> bool:
    """A bool (numpy's too) or an int 0 or 1 (not 0.0, not "1", not "no")."""
    return isinstance(value, (bool, np.bool_)) or (
        isinstance(value, (int, np.integer)) and value in (0, 1)
    )


def _positive_int(name: str, value) -> int:
    return int_at_least(name, value, 1, LayoutError, expected="a positive int")


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    """The model-parallel shape constraints a batch must satisfy. Validated at construction.

    >>> lay = ParallelLayout(tp=2, cp=2)
    >>> lay.seq_multiple, lay.local_multiple, lay.total_multiple
    (4, 2, 4)
    >>> lay.padded_lengths([5, 3]).tolist()
    [8, 4]
    """

    tp: int = 1
    """Tensor-parallel size."""
    cp: int = 1
    """Context-parallel size."""
    sp: bool | None = None
    """Sequence parallel; ``None`` means ``tp > 1`` (Megatron's usual setting)."""
    fp8: FP8Recipe = FP8Recipe.NONE
    """FP8/FP4 recipe: the rows of one SP rank (``T/(cp*tp)`` under SP, ``T/cp`` without; BSHD
    ``B*S/(cp*tp)``) must be a multiple of ``fp8.multiple`` (``"mxfp8"`` and ``"nvfp4"``: 32)."""
    pad_policy: PadPolicy = PadPolicy.MINIMAL
    length_buckets: tuple[int, ...] | None = None
    """Allowed global padded lengths T (THD) or S (BSHD), e.g. for CUDA graphs; sorted ascending."""
    min_local_rows: int = 0
    """Every CP rank holds at least this many rows (``T >= cp * min_local_rows``)."""
    cp_layout: CPLayout = CPLayout.ZIGZAG
    token_multiple: int = 1
    """The rows of one SP rank are also a multiple of this (e.g. 128 for HybridEP's dispatch
    chunks)."""
    max_seqs: int | None = None
    """THD: ``cu_seqlens`` / ``cu_seqlens_padded`` have exactly ``max_seqs + 1`` entries (trailing
    ones repeat the total), and no micro-batch holds more sequences (static shapes for CUDA
    graphs)."""

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731  (frozen dataclass)
        for key in ("tp", "cp", "token_multiple"):  # (a numpy int kept as an int)
            set_(key, _positive_int(key, getattr(self, key)))
        if self.max_seqs is not None:
            set_("max_seqs", _positive_int("max_seqs", self.max_seqs))
            if self.max_seqs > MAX_PACKED_LENGTH:
                raise LayoutError(
                    f"max_seqs: expected at most {MAX_PACKED_LENGTH} sequences (int32 cu_seqlens), "
                    f"got {self.max_seqs}"
                )
        if not (self.sp is None or is_flag(self.sp)):
            raise LayoutError(f"sp: expected a bool or None, got {self.sp!r}")
        set_("sp", self.tp > 1 if self.sp is None else bool(self.sp))
        set_("fp8", FP8Recipe.coerce(self.fp8))
        try:
            set_("pad_policy", PadPolicy(self.pad_policy))
            set_("cp_layout", CPLayout(self.cp_layout))
        except ValueError as exc:
            raise LayoutError(str(exc)) from None
        set_("min_local_rows", int_at_least("min_local_rows", self.min_local_rows, 0, LayoutError))
        if self.cp * self.min_local_rows > MAX_PACKED_LENGTH:
            raise LayoutError(
                f"min_local_rows: cp * min_local_rows = {self.cp * self.min_local_rows} rows "
                f"would not fit int32 cu_seqlens (at most {MAX_PACKED_LENGTH})"
            )
        if self.total_multiple > MAX_PACKED_LENGTH:
            raise LayoutError(
                f"total multiple {self.total_multiple} (tp={self.tp}, cp={self.cp}, sp={self.sp}, "
                f"fp8={self.fp8.name}, token_multiple={self.token_multiple}): the shortest batch "
                f"would not fit int32 cu_seqlens (at most {MAX_PACKED_LENGTH} rows)"
            )
        if self.length_buckets is not None:
            if isinstance(self.length_buckets, (str, bytes)) or not hasattr(
                self.length_buckets, "__iter__"
            ):
                raise LayoutError(
                    f"length_buckets: expected a tuple of ints or None, got {self.length_buckets!r}"
                )
            buckets = tuple(
                sorted(_positive_int("length_buckets[*]", b) for b in self.length_buckets)
            )
            if not buckets:
                raise LayoutError("length_buckets: expected at least one bucket or None, got ()")
            if buckets[-1] > MAX_PACKED_LENGTH:
                raise LayoutError(
                    f"length_buckets: {buckets[-1]} rows would not fit int32 cu_seqlens (at most "
                    f"{MAX_PACKED_LENGTH})"
                )
            bad = [b for b in buckets if b % self.total_multiple]
            if bad:
                raise LayoutError(
                    f"length_buckets: every bucket must be a multiple of the total multiple "
                    f"{self.total_multiple} (tp={self.tp}, cp={self.cp}, sp={self.sp}, "
                    f"fp8={self.fp8.name}, token_multiple={self.token_multiple}), "
                    f"got {bad}; use e.g. {[round_up(b, self.total_multiple) for b in bad]}"
                )
            set_("length_buckets", buckets)

    @property
    def static_length(self) -> int | None:
        """``T`` when every THD batch has static shapes (one length bucket and ``max_seqs``): the
        ``max_seqlen`` emitted then (global, an upper bound of every ``P_i``); None otherwise."""
        if (
            self.max_seqs is not None
            and self.length_buckets is not None
            and len(self.length_buckets) == 1
        ):
            return self.length_buckets[0]
        return None

    # ---- derived multiples -------------------------------------------------------------------
    @property
    def zigzag(self) -> bool:
        return self.cp > 1 and self.cp_layout is CPLayout.ZIGZAG

    @property
    def seq_multiple(self) -> int:
        """Every ``P_i`` is a multiple of this."""
        if self.pad_policy is PadPolicy.MINIMAL:
            return 2 * self.cp if self.zigzag else 1
        align = self.tp * self.cp * (2 if self.zigzag else 1)
        return math.lcm(align, self.fp8.multiple) if self.fp8 is not FP8Recipe.NONE else align

    @property
    def sp_size(self) -> int:
        """How many ranks share one CP rank's rows after the SP scatter: ``tp`` under SP, else 1."""
        return self.tp if self.sp else 1

    @property
    def row_multiple(self) -> int:
        """The rows of one SP rank are a multiple of this: ``lcm(fp8.multiple, token_multiple)``.

        >>> ParallelLayout(fp8="nvfp4", token_multiple=128).row_multiple
        128
        """
        return math.lcm(self.fp8.multiple, self.token_multiple)

    @property
    def local_multiple(self) -> int:
        """``T_local`` is a multiple of this: ``sp_size * row_multiple`` (the rows of one SP rank,
        ``T_local / sp_size``, are a multiple of the FP8 recipe's block, which TE's quantizers need,
        and of ``token_multiple``).

        >>> ParallelLayout(tp=4, fp8="mxfp8").local_multiple  # 32 rows on each of the 4 SP ranks
        128
        """
        return self.sp_size * self.row_multiple

    @property
    def total_multiple(self) -> int:
        """``T`` is a multiple of this (and so is every length bucket)."""
        return math.lcm(self.seq_multiple, self.cp * self.local_multiple)

    # ---- THD ------------------------------------------------------------------------------------
    def aligned_length(self, length: int) -> int:
        """``P_i`` before the last-sequence extension."""
        return round_up(length, self.seq_multiple)

    def total_length(self, aligned_sum: int) -> int:
        """Global padded length ``T`` of a THD batch whose aligned lengths sum to
        ``aligned_sum`` (:meth:`ThdPadding.total`)."""
        return thd_padding(self).total(aligned_sum)

    def padded_lengths(self, lengths) -> torch.Tensor:
        """``[N]`` true lengths (tensor, array or list) -> int64 tensor ``[N]`` of padded lengths
        ``P``."""
        import torch  # here: planning imports this module, and needs no torch

        lengths = (
            lengths.detach().cpu().numpy()
            if isinstance(lengths, torch.Tensor)
            else np.asarray(lengths)
        )
        padded = round_up_array(lengths, self.seq_multiple)
        aligned_sum = int(padded.sum())
        padded[-1] += self.total_length(aligned_sum) - aligned_sum
        return torch.from_numpy(padded)

    # ---- BSHD -----------------------------------------------------------------------------------
    def bshd_multiple(self, batch_size: int) -> int:
        """The padded row length ``S`` is a multiple of this for a batch of ``batch_size`` rows."""
        # zigzag cuts every row into 2*cp chunks; contiguous only into cp (columns [r*S/cp,
        # (r+1)*S/cp))
        if self.pad_policy is PadPolicy.PER_SEQUENCE:
            align = self.tp * self.cp * (2 if self.zigzag else 1)
        else:
            align = math.lcm(2 * self.cp if self.zigzag else 1, self.cp * self.sp_size)
        fp8 = self.row_multiple
        # the rows of one SP rank, B * S / (cp * sp_size), must be a multiple of the FP8 multiple
        return (
            math.lcm(align, self.cp * self.sp_size * fp8 // math.gcd(batch_size, fp8))
            if fp8 > 1
            else align
        )

    def bshd_length(self, max_length: int, batch_size: int) -> int:
        """Padded row length ``S`` for a BSHD batch whose longest sequence has ``max_length``
        tokens."""
        multiple = self.bshd_multiple(batch_size)
        s = max(round_up(max_length, multiple), round_up(self.cp * self.min_local_rows, multiple))
        s = self._bucket(s)
        if s % multiple:
            raise LayoutError(
                f"length bucket {s} is not a multiple of {multiple}, required for BSHD with "
                f"batch size {batch_size} under {self}"
            )
        return s

    # ---- helpers
    # ----------------------------------------------------------------------------------
    def _bucket(self, length: int) -> int:
        if self.length_buckets is None:
            return length
        for bucket in self.length_buckets:
            if bucket >= length:
                return bucket
        raise BucketOverflowError(
            f"aligned length {length} exceeds the largest length bucket {self.length_buckets[-1]}; "
            f"add a larger bucket or lower the token budget"
        )

    def to_dict(self) -> dict:
        """JSON-friendly description (used in fingerprints and loader state)."""
        out = {
            "tp": self.tp,
            "cp": self.cp,
            "sp": self.sp,
            "fp8": self.fp8.value,
            "pad_policy": self.pad_policy.value,
            "cp_layout": self.cp_layout.value,
            "length_buckets": list(self.length_buckets) if self.length_buckets else None,
            "min_local_rows": self.min_local_rows,
        }
        if (
            self.token_multiple != 1
        ):  # only when set: the fingerprints of layouts of before stay the same
            out["token_multiple"] = self.token_multiple
        if self.max_seqs is not None:
            out["max_seqs"] = self.max_seqs
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "ParallelLayout":
        """The inverse of :meth:`to_dict`; unknown keys are a :class:`LayoutError`."""
        data = fields_of("layout", data, cls, LayoutError)
        if isinstance(data.get("length_buckets"), list):
            data["length_buckets"] = tuple(data["length_buckets"])
        return cls(**data)

    @classmethod
    def from_megatron(cls, pg_collection=None, **overrides) -> "ParallelLayout":
        """Read tp/cp sizes from megatron-core: its initialised ``parallel_state``, or the
        ``ProcessGroupCollection`` newer releases pass around (``pg_collection``).

        ``overrides`` set the fields megatron-core does not know (``sp``, ``fp8``,
        ``pad_policy``...).
        """
        sizes = megatron_parallel_sizes(pg_collection)
        return cls(**{"tp": sizes["tp"], "cp": sizes["cp"], **overrides})


@dataclass(frozen=True)
class ThdPadding:
    """A layout's THD padding rule, its multiples computed once (:func:`thd_padding`): every
    ``P_i`` is a multiple of :attr:`seq_multiple`, then ``T`` is :meth:`total` of their sum."""

    layout: ParallelLayout
    seq_multiple: int
    """:attr:`ParallelLayout.seq_multiple`."""
    total_multiple: int
    """:attr:`ParallelLayout.total_multiple`."""
    least_total: int
    """The smallest ``T``: ``cp * min_local_rows`` rounded up to :attr:`total_multiple`."""

    def total(self, aligned_sum: int) -> int:
        """``T`` of a THD batch whose aligned lengths sum to ``aligned_sum``: rounded up to
        :attr:`total_multiple`, at least :attr:`least_total`, then its length bucket (if any)."""
        m = self.total_multiple
        total = max(-(-aligned_sum // m) * m, self.least_total)
        return total if self.layout.length_buckets is None else self.layout._bucket(total)


@functools.lru_cache(maxsize=64)
def thd_padding(layout: ParallelLayout) -> ThdPadding:
    """``layout``'s :class:`ThdPadding`, cached per layout (what collating a batch reads, with no
    ``lcm`` per batch).

    >>> pad = thd_padding(ParallelLayout(tp=2, cp=2, min_local_rows=8))
    >>> pad.seq_multiple, pad.total_multiple, pad.least_total, pad.total(9)
    (4, 4, 16, 16)
    """
    m = layout.total_multiple
    least = round_up(layout.cp * layout.min_local_rows, m)
    return ThdPadding(layout, layout.seq_multiple, m, least)
