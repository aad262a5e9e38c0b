"""Declared batch schemas: what every field of a collated batch is, its dtype, dims and padding.

A schema is data (JSON round trip, stable fingerprint) so that every rank can prove at startup that
it builds the same batches (:func:`prealign.schemas.check_startup`).
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
import numbers
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping

import numpy as np

from .checks import fields_of
from .errors import SchemaError

if TYPE_CHECKING:
    import torch

IGNORE_INDEX = -100

_DTYPES = ("int64", "int32", "float32", "bfloat16", "float16", "bool", "uint8")
"""The dtype names a schema may declare (torch is imported only when one is turned into a
``torch.dtype``: a schema is built without it, e.g. by ``prealign index``)."""


def torch_dtype(name: str) -> torch.dtype:
    """``"int64"`` -> ``torch.int64`` (only the dtypes batches use)."""
    _check_dtype_name(name)
    import torch

    return getattr(torch, name)


def _check_dtype_name(name: str) -> None:
    if name not in _DTYPES:
        raise SchemaError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _enum_value(what: str, enum_cls, value):
    try:
        return enum_cls(value)
    except ValueError:
        raise SchemaError(
            f"{what}: expected one of {[e.value for e in enum_cls]}, got {value!r}"
        ) from None


class Role(enum.Enum):
    """What a field is indexed by."""

    TOKEN = "token"  # one entry per token; padded and CP-sharded like input_ids
    SEQUENCE = "sequence"  # one entry per sample, stacked to [N, ...]
    MEDIA = "media"  # ragged per sample (pixel_values), concatenated over the batch, never sharded
    META = "meta"  # produced by the collator: cu_seqlens*, max_seqlen


class FieldSource(enum.Enum):
    """Where a TOKEN field's values come from (``FieldSpec(source=...)``)."""

    SAMPLE = "sample"  # the sample's own field, as given
    NEXT_TOKEN = "next_token"  # the sample's field shifted left by one inside its sequence (labels)
    LOSS_MASK = (
        "loss_mask"  # 1.0 where the output label is not the ignore index (times sample loss_mask)
    )
    POSITIONS = "positions"  # each slot's position inside its (padded) sequence
    PADDING_MASK = "padding_mask"  # True on pad slots (Megatron convention)


Source = FieldSource
"""Deprecated alias of :class:`FieldSource` (``prealign.schemas.Source`` warns); it read as a data
source."""


def _int64(value) -> bool:
    return isinstance(value, numbers.Integral) and -(2**63) <= value < 2**63


def _python(value):
    """A numpy scalar as its Python number (``np.int64(3)`` -> 3, ``np.bool_`` -> bool): what
    ``to_json`` and the fingerprint can write; anything else as it is."""
    return value.item() if isinstance(value, np.generic) else value


_INT_RANGES = {"int64": (-(2**63), 2**63 - 1), "int32": (-(2**31), 2**31 - 1), "uint8": (0, 255)}
_FLOAT_MAX = {
    "float32": 3.4028234663852886e38,
    "bfloat16": 3.3895313892515355e38,
    "float16": 65504.0,
}
"""The largest finite value of each float dtype (``torch.finfo(dtype).max``)."""
_BF16_ZERO = 2.0**-134
"""Half bfloat16's smallest subnormal (2**-133): a float32 of at most this magnitude is written as
0 (round to nearest even)."""


def _what_holds(dtype: str) -> str:
    """The values a tensor of ``dtype`` holds exactly, in words."""
    if dtype == "bool":
        return "True, False, 0 or 1"
    if dtype in _FLOAT_MAX:
        top = _FLOAT_MAX[dtype]
        return f"0, a float of magnitude <= {top:.6g} it does not write as 0, inf or NaN"
    return "an int in [{}, {}]".format(*_INT_RANGES[dtype])


def _holds(dtype: str, value: numbers.Real) -> bool:
    """Whether ``torch.full(..., value, dtype=dtype)`` writes ``value`` itself (a float dtype
    rounds to its precision; it must not overflow to inf, nor a value other than 0 underflow to 0:
    torch rounds to float32 first, then to the half dtype)."""
    if dtype == "bool":
        return value in (0, 1)
    if dtype in _FLOAT_MAX:
        if not math.isfinite(value) or value == 0:
            return True
        if abs(value) > _FLOAT_MAX[dtype]:
            return False
        single = abs(float(np.float32(value)))
        if dtype == "bfloat16":
            return single > _BF16_ZERO
        return (float(np.float16(single)) if dtype == "float16" else single) != 0
    low, high = _INT_RANGES[dtype]
    return math.isfinite(value) and value == int(value) and low <= value <= high


def _check_pad_value(spec: "FieldSpec") -> None:
    """Each of the field's dtypes holds its pad value exactly (a sample may come in any of them):
    else a :class:`SchemaError` naming the field, the value and the dtypes that cannot hold it."""
    bad = [d for d in spec.dtypes if not _holds(d, spec.pad_value)]
    if bad:
        raise SchemaError(
            f"field {spec.name!r}: pad_value: expected a value each of its dtypes holds exactly "
            f"({'; '.join(f'{d}: {_what_holds(d)}' for d in bad)}), got {spec.pad_value!r}: "
            f"padding would write another value"
        )


def _check_field_values(spec: "FieldSpec") -> None:
    """The flags are bools, the pad value a number (an int in int64), the bounds numbers (not NaN)
    with ``min_value <= max_value``: each a :class:`SchemaError` naming the field. numpy scalars
    are stored as Python numbers."""
    where = f"field {spec.name!r}"
    for key in ("required", "cp_sharded", "finite", "pad_value", "min_value", "max_value"):
        object.__setattr__(spec, key, _python(getattr(spec, key)))
    for key in ("required", "cp_sharded", "finite"):
        if not isinstance(getattr(spec, key), bool):
            raise SchemaError(f"{where}: {key}: expected a bool, got {getattr(spec, key)!r}")
    pad = spec.pad_value
    if not isinstance(pad, numbers.Real) or (isinstance(pad, numbers.Integral) and not _int64(pad)):
        raise SchemaError(
            f"{where}: pad_value: expected a bool, int or float (an int in int64), got {pad!r}"
        )
    _check_pad_value(spec)
    for key in ("min_value", "max_value"):
        value = getattr(spec, key)
        if value is not None and (not isinstance(value, numbers.Real) or value != value):
            raise SchemaError(f"{where}: {key}: expected None, an int or a float, got {value!r}")
    if spec.min_value is not None and spec.max_value is not None:
        if spec.min_value > spec.max_value:
            raise SchemaError(
                f"{where}: min_value {spec.min_value} > max_value {spec.max_value}: no value "
                f"could pass (expected min_value <= max_value)"
            )


@dataclass(frozen=True, kw_only=True)
class FieldSpec:
    """One field of a batch.

    For a TOKEN field a sample holds ``[L, *dense_shape]`` (or ``[*leading_shape, L]``) and the THD
    batch ``[1, T_local, *dense_shape]`` (or ``[*leading_shape, 1, T_local]``); BSHD ``[B, S_local,
    ...]``. Dense dims are ints or names (``"K"``) that must agree across the batch.
    """

    name: str
    role: Role = Role.TOKEN
    dtypes: tuple[str, ...] = ("int64",)
    """Accepted dtypes; the first is the default when the collator creates the field."""
    dense_shape: tuple[int | str, ...] = ()
    """Trailing dims after the token dim (top-k ``("K",)``, router ``("layers", "K")``)."""
    leading_shape: tuple[int | str, ...] = ()
    """Dims before the token dim (mRoPE ``(3,)``); a field has leading or trailing dims, not
    both."""
    pad_value: float | int | bool = 0
    source: FieldSource = FieldSource.SAMPLE
    sample_keys: tuple[str, ...] = ()
    """Sample fields to read, first present wins (default: ``(name,)``)."""
    required: bool = True
    cp_sharded: bool = True
    """TOKEN fields only: split over CP ranks like the tokens (False: keep the full sequence)."""
    finite: bool = False
    """Values must be finite (checked on the real tokens at collate time)."""
    min_value: float | None = None
    max_value: float | None = None
    """Inclusive bounds on the real tokens' values (e.g. log-probs <= 0, ids < vocab)."""

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731
        if not isinstance(self.name, str) or not self.name:
            raise SchemaError(f"field name: expected a non-empty str, got {self.name!r}")
        set_("role", _enum_value(f"field {self.name!r}: role", Role, self.role))
        set_("source", _enum_value(f"field {self.name!r}: source", FieldSource, self.source))
        if isinstance(self.dtypes, str):
            raise SchemaError(
                f"field {self.name!r}: dtypes must be a tuple of dtype names, got the str "
                f"{self.dtypes!r}"
            )
        set_("dtypes", tuple(self.dtypes))
        for d in self.dtypes:
            _check_dtype_name(d)
        if not self.dtypes:
            raise SchemaError(f"field {self.name!r}: dtypes must not be empty")
        for key, what in (
            ("dense_shape", "dims"),
            ("leading_shape", "dims"),
            ("sample_keys", "sample keys"),
        ):
            value = getattr(self, key)
            if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
                raise SchemaError(
                    f"field {self.name!r}: {key} must be a tuple of {what}, got {value!r}"
                )
            set_(key, tuple(value))
        set_("sample_keys", self.sample_keys or (self.name,))
        if not all(isinstance(k, str) and k for k in self.sample_keys):
            raise SchemaError(
                f"field {self.name!r}: sample_keys: expected non-empty str keys, got "
                f"{list(self.sample_keys)!r}"
            )
        _check_field_values(self)
        if self.dense_shape and self.leading_shape:
            raise SchemaError(
                f"field {self.name!r}: declare leading_shape or dense_shape, not both"
            )
        for d in (*self.dense_shape, *self.leading_shape):
            if not (isinstance(d, str) and d) and not (
                isinstance(d, int) and not isinstance(d, bool) and d > 0
            ):
                raise SchemaError(
                    f"field {self.name!r}: a dim must be a positive int or a name, got {d!r}"
                )
        if self.source is not FieldSource.SAMPLE and self.role is not Role.TOKEN:
            raise SchemaError(f"field {self.name!r}: source {self.source.value} needs role token")
        if not self.cp_sharded and self.source is not FieldSource.SAMPLE:
            raise SchemaError(
                f"field {self.name!r}: only sample fields can skip CP sharding (cp_sharded=False); "
                f"a {self.source.value} field is sharded like the tokens it is derived with"
            )

    @property
    def dtype(self) -> torch.dtype:
        return torch_dtype(self.dtypes[0])

    @property
    def has_bounds(self) -> bool:
        """Whether values are checked (``finite`` / ``min_value`` / ``max_value``)."""
        return self.finite or self.min_value is not None or self.max_value is not None

    @property
    def token_dim(self) -> int:
        """Index of the token dim in a sample tensor (0, or after the leading dims)."""
        return len(self.leading_shape)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "role": self.role.value,
            "dtypes": list(self.dtypes),
            "dense_shape": list(self.dense_shape),
            "leading_shape": list(self.leading_shape),
            "pad_value": self.pad_value,
            "source": self.source.value,
            "sample_keys": list(self.sample_keys),
            "required": self.required,
            "cp_sharded": self.cp_sharded,
            "finite": self.finite,
            "min_value": self.min_value,
            "max_value": self.max_value,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "FieldSpec":
        """The inverse of :meth:`to_dict`; a non-dict or an unknown key is a
        :class:`SchemaError`."""
        where = f"field {d.get('name')!r}" if isinstance(d, Mapping) else "field"
        return cls(**fields_of(where, d, cls, SchemaError))


def _check_next_token_pads(schema: "BatchSchema") -> None:
    """A next-token field (labels) writes its pad value at each sequence's last token into the
    tensor it reads (``input_ids``): each dtype of a sample field read under one of its keys must
    hold it, else a :class:`SchemaError` naming both fields."""
    for f in schema.of_role(Role.TOKEN):
        if f.source is not FieldSource.NEXT_TOKEN:
            continue
        for g in schema.of_role(Role.TOKEN):
            if g.source is not FieldSource.SAMPLE or set(g.sample_keys).isdisjoint(f.sample_keys):
                continue
            bad = "; ".join(
                f"{d}: {_what_holds(d)}" for d in g.dtypes if not _holds(d, f.pad_value)
            )
            if bad:
                raise SchemaError(
                    f"schema {schema.name!r}: field {f.name!r}: pad_value: expected a value each "
                    f"dtype of field {g.name!r} holds exactly (it is written into its tensor at "
                    f"each sequence's last token; {bad}), got {f.pad_value!r}"
                )


@dataclass(frozen=True, kw_only=True)
class BatchSchema:
    """An ordered set of :class:`FieldSpec` plus the batch-wide conventions."""

    name: str
    fields: tuple[FieldSpec, ...]
    ignore_index: int = IGNORE_INDEX
    by_name: dict = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self):
        if not isinstance(self.name, str):
            raise SchemaError(f"schema name: expected a str, got {self.name!r}")
        object.__setattr__(self, "ignore_index", _python(self.ignore_index))
        if isinstance(self.ignore_index, bool) or not _int64(self.ignore_index):
            raise SchemaError(
                f"schema {self.name!r}: ignore_index: expected an int in int64, got "
                f"{self.ignore_index!r}"
            )
        object.__setattr__(self, "fields", tuple(self.fields))
        bad = [f for f in self.fields if not isinstance(f, FieldSpec)]
        if bad:
            raise SchemaError(
                f"schema {self.name!r}: fields must be FieldSpec objects, got {bad[:3]!r}"
            )
        names = [f.name for f in self.fields]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise SchemaError(f"schema {self.name!r}: duplicate field(s) {dup}")
        if "input_ids" not in names:
            raise SchemaError(f"schema {self.name!r}: a batch needs an 'input_ids' token field")
        object.__setattr__(self, "by_name", {f.name: f for f in self.fields})
        _check_next_token_pads(self)
        object.__setattr__(self, "_hash", hash((self.name, self.fields, self.ignore_index)))

    def __hash__(self) -> int:  # cached: collators look schemas up in small caches on every batch
        return self._hash

    def __getstate__(self) -> dict:  # str hashes differ between processes: recompute, never ship
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        object.__setattr__(self, "_hash", hash((self.name, self.fields, self.ignore_index)))

    def __getitem__(self, name: str) -> FieldSpec:
        return self.by_name[name]

    def __contains__(self, name: str) -> bool:
        return name in self.by_name

    def of_role(self, role: Role) -> tuple[FieldSpec, ...]:
        return tuple(f for f in self.fields if f.role is role)

    def with_fields(self, *extra: FieldSpec, name: str | None = None) -> "BatchSchema":
        """A copy with more fields (e.g. a per-token ``mm_token_type_ids``)."""
        return BatchSchema(
            name=name or self.name, fields=(*self.fields, *extra), ignore_index=self.ignore_index
        )

    def to_json(self) -> str:
        return json.dumps(
            {
                "name": self.name,
                "ignore_index": self.ignore_index,
                "fields": [f.to_dict() for f in self.fields],
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str) -> "BatchSchema":
        """The inverse of :meth:`to_json`; anything else is a :class:`SchemaError` naming what is
        wrong."""
        expected = "{'name', 'ignore_index', 'fields': [field dicts]}"
        try:
            d = json.loads(text)
        except (ValueError, RecursionError) as exc:  # also too deep, an int too long, not UTF-8
            raise SchemaError(f"schema JSON: not JSON ({type(exc).__name__}: {exc})") from None
        except TypeError:
            d = text  # not text at all: named below
        if not isinstance(d, dict) or not isinstance(d.get("fields", []), list):
            got = type(d.get("fields") if isinstance(d, dict) else d).__name__
            raise SchemaError(f"schema JSON: expected {expected}, got {got}")
        try:
            return cls(
                name=d["name"],
                ignore_index=d["ignore_index"],
                fields=tuple(FieldSpec.from_dict(f) for f in d["fields"]),
            )
        except KeyError as exc:
            raise SchemaError(f"schema JSON: missing key {exc}") from None
        except (TypeError, AttributeError) as exc:
            raise SchemaError(
                f"schema JSON: expected {expected}, got {type(exc).__name__}: {exc}"
            ) from None

    def fingerprint(self) -> str:
        """Stable 16-hex-digit digest of the JSON form (same schema -> same string, any process)."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]


# ---- built-in schemas
# -----------------------------------------------------------------------------
def _largest_id(vocab_size: int | None) -> int | None:
    """The largest token id of a vocabulary of ``vocab_size`` ids (None: unbounded)."""
    if vocab_size is None:
        return None
    if isinstance(vocab_size, bool) or not _int64(vocab_size) or vocab_size < 1:
        raise SchemaError(f"vocab_size: expected a positive int or None, got {vocab_size!r}")
    return int(vocab_size) - 1


def core_token_fields(
    pad_token_id: int, ignore_index: int, vocab_size: int | None = None
) -> tuple[FieldSpec, ...]:
    """input_ids (ids in ``[0, vocab_size)`` when declared, checked at collate time), labels, loss
    mask, positions, padding mask."""
    return (
        FieldSpec(
            name="input_ids",
            pad_value=pad_token_id,
            min_value=0,
            max_value=_largest_id(vocab_size),
        ),
        FieldSpec(
            name="labels",
            source=FieldSource.NEXT_TOKEN,
            sample_keys=("labels", "input_ids"),
            pad_value=ignore_index,
        ),
        FieldSpec(
            name="loss_mask",
            dtypes=("float32",),
            source=FieldSource.LOSS_MASK,
            pad_value=0.0,
            required=False,
        ),
        FieldSpec(name="position_ids", source=FieldSource.POSITIONS),
        FieldSpec(
            name="padding_mask", dtypes=("bool",), source=FieldSource.PADDING_MASK, pad_value=True
        ),
    )


def token_type_field(max_type: int) -> FieldSpec:
    """``mm_token_type_ids`` int64 or int32 ``[L]`` of a VLM batch: 0 on text (and pads) up to
    ``max_type`` (1 image, 2 video: :mod:`prealign.schemas.vlm`'s ``*_TOKEN_TYPE``)."""
    return FieldSpec(
        name="mm_token_type_ids",
        dtypes=("int64", "int32"),
        pad_value=0,
        min_value=0,
        max_value=max_type,
    )


def topk_fields(topk: int | str = "K", vocab_size: int | None = None) -> tuple[FieldSpec, ...]:
    """Teacher top-k fields ``[L, K]``: log-probs (float32 or bf16, finite, <= 0, pad 0.0) and
    ids (int64 in ``[0, vocab_size)``, pad 0). They are aligned with the tokens (the teacher's
    distribution at position j predicts token j+1, like the student's logits at j): not shifted.
    """
    return (
        FieldSpec(
            name="teacher_topk_log_probs",
            dtypes=("float32", "bfloat16"),
            dense_shape=(topk,),
            pad_value=0.0,
            finite=True,
            max_value=0.0,
        ),
        FieldSpec(
            name="teacher_topk_ids",
            dtypes=("int64",),
            dense_shape=(topk,),
            pad_value=0,
            min_value=0,
            max_value=_largest_id(vocab_size),
        ),
    )


def causal_lm_schema(
    *,
    pad_token_id: int = 0,
    topk: int | str | None = None,
    vocab_size: int | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> BatchSchema:
    """SFT / pre-training: input_ids, next-token labels, loss_mask, position_ids, padding_mask.

    ``topk`` (an int, or ``"K"`` for any constant K) adds ``teacher_topk_log_probs`` /
    ``teacher_topk_ids``. ``vocab_size`` bounds ``input_ids`` and the teacher ids to ``[0,
    vocab_size)``; ids are always ``>= 0`` and never ``ignore_index`` (a negative id would become an
    ignored label still weighted 1).

    >>> causal_lm_schema(topk=64)["teacher_topk_ids"].dense_shape
    (64,)
    """
    fields = core_token_fields(pad_token_id, ignore_index, vocab_size)
    if topk is not None:
        fields += topk_fields(topk, vocab_size)
    return BatchSchema(
        name="causal_lm" if topk is None else "causal_lm_topk",
        fields=fields,
        ignore_index=ignore_index,
    )


def rl_schema(*, pad_token_id: int = 0, ignore_index: int = IGNORE_INDEX) -> BatchSchema:
    """RL (PPO/GRPO): the causal-LM fields plus per-token ``old_log_probs``, ``ref_log_probs``,
    ``advantages`` (float32, aligned with the labels) and ``response_mask`` (bool), each as given by
    the sample (no shift), and optional per-sequence ``rewards``.
    """
    per_token = tuple(
        FieldSpec(name=n, dtypes=("float32",), pad_value=0.0, required=n != "ref_log_probs")
        for n in ("old_log_probs", "ref_log_probs", "advantages")
    )
    fields = (
        *core_token_fields(pad_token_id, ignore_index),
        *per_token,
        FieldSpec(name="response_mask", dtypes=("bool",), pad_value=False),
        FieldSpec(name="rewards", role=Role.SEQUENCE, dtypes=("float32",), required=False),
    )
    return BatchSchema(name="rl", fields=fields, ignore_index=ignore_index)
