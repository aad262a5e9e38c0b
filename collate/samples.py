"""Turn a list of sample dicts (or verl's dict of jagged nested tensors) into flat per-field
tensors.

Validation is "fast check, slow diagnosis": the happy path reads each sample's shape and dtype
once per field (no tensor op), and declared value bounds are checked with one reduction over the
concatenated rows (see ``collate.assemble``); only when something is off does a per-sample loop run
to name the sample, the field, what was expected and what came.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import weakref
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np
import torch

from prealign.schemas.errors import SampleError
from prealign.schemas.schema import BatchSchema, FieldSpec, Role, Source, dtype_name


@dataclass
class TokenSource:
    """One token field's rows before gathering: per-sample ``parts`` (list input) or one flat
    ``values`` tensor (nested input), plus ``pad``: two rows, the field's pad value then the value
    of a slot with no next token (what a next-token field such as ``labels`` holds there)."""

    parts: list[torch.Tensor] | None
    values: torch.Tensor | None
    pad: torch.Tensor  # [*leading, 2, *dense]
    token_dim: int
    diagnose: "Callable[[], None] | None" = field(default=None, repr=False)
    """Called when concatenating ``parts`` fails: raises a :class:`SampleError` naming the
    sample."""
    no_next: float = 0
    """The value of ``pad``'s second row (a slot with no next token), as a number."""
    _all_rows: torch.Tensor | None = field(default=None, repr=False)

    row_nbytes: int = field(init=False, repr=False)
    """Bytes of one token row (all dims but the token dim)."""

    def __post_init__(self):
        self.row_nbytes = self.pad.numel() // 2 * self.pad.element_size()

    def release(self) -> None:
        """Drop the cached concatenation (the collator calls it once every field that reads it is
        built)."""
        self._all_rows = None

    def rows(self) -> torch.Tensor:
        """All rows then the two pad rows, in one ``torch.cat``; built once, shared by the fields
        reading this key until :meth:`release`."""
        if self._all_rows is None:
            self._all_rows = self._cat(
                (*self.parts, self.pad) if self.parts is not None else (self.values, self.pad)
            )
        return self._all_rows

    def block(
        self, first_seq: int, end_seq: int, first_row: int, end_row: int, out: torch.Tensor
    ) -> torch.Tensor:
        """Rows of sequences ``[first_seq, end_seq)`` (rows ``[first_row, end_row)``) then the two
        pad rows, written to ``out`` (a buffer reused across blocks)."""
        if self.parts is not None:
            return self._cat((*self.parts[first_seq:end_seq], self.pad), out)
        return self._cat(
            (self.values.narrow(self.token_dim, first_row, end_row - first_row), self.pad), out
        )

    def _cat(self, tensors, out: torch.Tensor | None = None) -> torch.Tensor:
        try:
            return (
                torch.cat(tensors, self.token_dim)
                if out is None
                else torch.cat(tensors, self.token_dim, out=out)
            )
        except RuntimeError:
            if self.diagnose is not None:
                self.diagnose()
            raise


@dataclass
class FlatBatch:
    """A batch's fields, checked and ready to gather: ``token[key]`` a :class:`TokenSource`,
    SEQUENCE fields stacked ``[N, ...]``, MEDIA fields concatenated on dim 0."""

    lengths: torch.Tensor  # int64 [N]
    cu_seqlens: torch.Tensor  # int64 [N+1]
    token: dict[str, TokenSource] = field(default_factory=dict)
    sequence: dict[str, torch.Tensor] = field(default_factory=dict)
    media: dict[str, torch.Tensor] = field(default_factory=dict)
    dims: dict[str, int] = field(default_factory=dict)  # named dense dims seen (e.g. K)
    dtypes: dict[str, str] = field(default_factory=dict)  # dtype of each sample field read
    check_values: bool = True
    num_real: int = field(init=False)
    """Rows of all samples together (``cu_seqlens[-1]``)."""
    np_lengths: np.ndarray = field(init=False, repr=False)  # ``lengths`` as numpy (same memory)
    np_cu_seqlens: np.ndarray = field(init=False, repr=False)  # ``cu_seqlens`` as numpy

    def __post_init__(self):
        self.np_lengths, self.np_cu_seqlens = self.lengths.numpy(), self.cu_seqlens.numpy()
        self.num_real = int(self.np_cu_seqlens[-1])


@functools.lru_cache(maxsize=64)
def _next_pad_values(schema: BatchSchema) -> dict[str, float]:
    """sample key -> pad value of the next-token field reading it (``input_ids`` -> labels'
    -100)."""
    out: dict[str, float] = {}
    for f in schema.of_role(Role.TOKEN):
        if f.source is Source.NEXT_TOKEN:
            for key in f.sample_keys:
                out.setdefault(key, f.pad_value)
    return out


def _pad_rows(like: torch.Tensor, spec: FieldSpec, next_pad) -> torch.Tensor:
    """``[*leading, 2, *dense]``: the field's pad value, then the no-next-token value."""
    shape = list(like.shape)
    shape[spec.token_dim] = 1
    return _constant_pad_rows(
        tuple(shape),
        like.dtype,
        spec.token_dim,
        spec.pad_value,
        spec.pad_value if next_pad is None else next_pad,
    )


@functools.lru_cache(maxsize=256)
def _constant_pad_rows(shape: tuple, dtype: torch.dtype, dim: int, pad, next_pad) -> torch.Tensor:
    """Built once per shape and values; only ever read (concatenated), never written."""
    return torch.cat(
        (torch.full(shape, pad, dtype=dtype), torch.full(shape, next_pad, dtype=dtype)), dim
    )


@functools.lru_cache(maxsize=64)
def _sample_keys_read(schema: BatchSchema) -> tuple[FieldSpec, ...]:
    """Every TOKEN field that reads sample data, plus an optional sample ``loss_mask`` (which the
    derived ``loss_mask`` multiplies in) when the schema does not declare one itself."""
    specs = [
        f for f in schema.of_role(Role.TOKEN) if f.source in (Source.SAMPLE, Source.NEXT_TOKEN)
    ]
    if "loss_mask" not in schema or schema["loss_mask"].source is not Source.SAMPLE:
        # loss weights: kept as given (0.5 stays 0.5), so they must be finite and >= 0
        specs.append(
            FieldSpec(
                name="loss_mask",
                dtypes=("float32", "bool", "int64", "int32", "uint8", "bfloat16"),
                pad_value=0,
                required=False,
                finite=True,
                min_value=0,
            )
        )
    return tuple(specs)


@functools.lru_cache(maxsize=64)
def _sequence_and_media(schema: BatchSchema) -> tuple[FieldSpec, ...]:
    return schema.of_role(Role.SEQUENCE) + schema.of_role(Role.MEDIA)


@functools.lru_cache(maxsize=64)
def sample_token_keys(schema: BatchSchema) -> tuple[tuple[str, int], ...]:
    """``(sample key, token dim)`` of every per-token sample field the collator may read (e.g. for
    cutting a sample to a length: every such field must be cut alike)."""
    out: dict[str, int] = {}
    for spec in _sample_keys_read(schema):
        for key in spec.sample_keys:
            out.setdefault(key, spec.token_dim)
    return tuple(out.items())


def resolve_key(spec: FieldSpec, present: Sequence[str]) -> str | None:
    """First of ``spec.sample_keys`` present in the sample, or None."""
    for key in spec.sample_keys:
        if key in present:
            return key
    return None


# ------------------------------------------------------------------------------------------------
def flatten(batch, schema: BatchSchema, *, check_values: bool = True) -> FlatBatch:
    """A list of sample dicts, or a dict of jagged nested tensors, -> :class:`FlatBatch`."""
    if type(batch) is not list and isinstance(batch, Mapping):  # (a list skips the ABC checks)
        return _flatten_nested(batch, schema, check_values)
    if type(batch) is not list and (
        not isinstance(batch, Sequence) or isinstance(batch, (str, bytes))
    ):
        raise SampleError(
            sample=None,
            field=None,
            expected="a list of sample dicts or a dict of nested tensors",
            actual=type(batch).__name__,
        )
    if len(batch) == 0:
        raise SampleError(
            sample=None, field=None, expected="at least one sample", actual="an empty batch"
        )
    if set(map(type, batch)) != _DICT:  # fast path for plain dicts; else name the culprit
        for i, s in enumerate(batch):
            if not isinstance(s, Mapping):
                raise SampleError(
                    sample=i, field=None, expected="a dict of fields", actual=type(s).__name__
                )
    ids = _column(batch, "input_ids", convert=False)
    # element counts: the lengths of 1-D token tensors (cheaper to read than shapes); a tensor of
    # another rank fails the shape check of sample 0 or the concatenation, which names it
    try:
        lengths = _numels(ids)
    except TypeError:  # a value that is not a tensor: converted (a list, an array) or named
        ids = _as_tensors(ids, "input_ids")
        lengths = _numels(ids)
    _check_lengths(lengths, ids)
    cu = np.empty(lengths.size + 1, dtype=np.int64)
    cu[0] = 0
    lengths.cumsum(out=cu[1:])
    flat = FlatBatch(
        lengths=torch.from_numpy(lengths),
        cu_seqlens=torch.from_numpy(cu),
        check_values=check_values,
    )
    next_pads = _next_pad_values(schema)
    present = batch[0].keys()
    keys = set().union(*batch)  # every sample's keys, once: what the presence checks read
    done: set[str] = set()
    for spec in _sample_keys_read(schema):
        key = _resolve_in_batch(spec, batch, present, keys)
        if key is None:
            if spec.required or not keys.isdisjoint(spec.sample_keys):
                _missing(spec, batch)
            continue
        if key in done:
            continue
        done.add(key)
        tensors = ids if key == "input_ids" else _column(batch, key)
        dtypes = set(map(_DTYPE, tensors))  # once a field: the widening and the dtype check
        tensors = _widened(tensors, spec, dtypes)
        if key == "input_ids":
            ids = tensors
        _check_token_parts(tensors, spec, key, flat, dtypes)
        # (a weak reference: the batch, its sources and this diagnosis form no cycle for the GC to
        # find)
        diagnose = functools.partial(_diagnose_token, tensors, spec, key, weakref.proxy(flat))
        flat.token[key] = TokenSource(
            parts=tensors,
            values=None,
            pad=_pad_rows(tensors[0], spec, next_pads.get(key)),
            token_dim=spec.token_dim,
            diagnose=diagnose,
            no_next=next_pads.get(key, spec.pad_value),
        )
    for spec in _sequence_and_media(schema):
        if spec.name not in present:
            if spec.required or spec.name in keys:
                _missing(spec, batch)
            continue
        tensors = _widened(_column(batch, spec.name), spec)
        target = flat.sequence if spec.role is Role.SEQUENCE else flat.media
        target[spec.name] = _join_other(tensors, spec, flat, check_values)
    return flat


def _check_contiguous_jagged(nt: torch.Tensor, key: str) -> None:
    """Only a CPU jagged nested tensor whose offsets run from 0 to the end of its values, without
    holes, is read: a strided one has no offsets, a narrowed one (holes between rows, or rows
    starting past 0) would be read wrongly from ``offsets()``/``values()`` (``nt.contiguous()``
    fixes it), and offsets past the end would index out of the values."""
    if nt.layout != torch.jagged:
        raise SampleError(
            sample=None,
            field=key,
            expected="a jagged nested tensor (layout=torch.jagged)",
            actual=f"a nested tensor of layout {nt.layout}",
            hint="build it with torch.nested.nested_tensor(..., layout=torch.jagged)",
        )
    _check_device(nt, None, key)
    holes = nt.lengths() is not None if hasattr(nt, "lengths") else False
    offsets = nt.offsets()
    start, end, rows = int(offsets[0]), int(offsets[-1]), nt.values().shape[0]
    if holes or start != 0:
        raise SampleError(
            sample=None,
            field=key,
            expected="a contiguous jagged nested tensor (offsets from 0, no holes)",
            actual=f"offsets from {start}" + (", with holes" if holes else ""),
            hint="call .contiguous() on it first",
        )
    if end != rows or bool((offsets.diff() < 0).any()):
        raise SampleError(
            sample=None,
            field=key,
            expected=f"non-decreasing offsets ending at the {rows} value rows",
            actual=f"offsets {offsets.tolist()[:8]}{'...' if offsets.numel() > 8 else ''} ending "
            f"at {end}",
        )


def _check_device(t: torch.Tensor, i: int | None, key: str) -> None:
    """The collator runs DataLoader-side: sample tensors live on the CPU (not meta, not an
    accelerator)."""
    if t.device.type != "cpu":
        raise SampleError(
            sample=i,
            field=key,
            expected="a CPU tensor (collation runs in the DataLoader)",
            actual=f"a tensor on {t.device}",
            hint="move samples to the CPU before collating",
        )


def _resolve_in_batch(spec: FieldSpec, batch: Sequence[Mapping], present, keys: set) -> str | None:
    """The sample key ``spec`` reads, the same for every sample: sample 0's first present key,
    unless another sample has a key of higher priority (``labels`` over ``input_ids``), which is an
    error rather than silently ignoring that sample's labels. ``keys``: every sample's keys."""
    key = resolve_key(spec, present)
    higher = spec.sample_keys if key is None else spec.sample_keys[: spec.sample_keys.index(key)]
    for k in higher:
        if k not in keys:
            continue
        has = next((i for i, s in enumerate(batch) if k in s), None)
        if has is not None:
            i = next(i for i, s in enumerate(batch) if k not in s)
            raise SampleError(
                sample=i,
                field=k,
                expected=f"the field in every sample of the batch (sample {has} has it)",
                actual=f"fields {sorted(batch[i].keys())}",
            )
    return key


def _flatten_nested(batch: Mapping, schema: BatchSchema, check_values: bool) -> FlatBatch:
    """verl's engine format: ``{field: torch.nested jagged tensor [B, j, *dense]}``."""
    nt = batch.get("input_ids")
    if nt is None or not getattr(nt, "is_nested", False):
        raise SampleError(
            sample=None,
            field="input_ids",
            expected="a jagged nested tensor",
            actual=type(nt).__name__ if nt is not None else "missing",
        )
    _check_contiguous_jagged(nt, "input_ids")
    offsets = nt.offsets().to(torch.int64)
    lengths = offsets.diff()
    if lengths.numel() == 0:
        raise SampleError(
            sample=None, field=None, expected="at least one sample", actual="an empty batch"
        )
    _check_lengths(lengths.numpy(), None)
    flat = FlatBatch(lengths=lengths, cu_seqlens=offsets, check_values=check_values)
    next_pads = _next_pad_values(schema)
    for spec in _sample_keys_read(schema):
        key = resolve_key(spec, batch.keys())
        if key is None:
            if spec.required:
                raise SampleError(
                    sample=None,
                    field=spec.name,
                    expected=f"one of {list(spec.sample_keys)}",
                    actual=f"fields {sorted(batch.keys())}",
                )
            continue
        if key in flat.token:
            continue
        t = batch[key]
        if not getattr(t, "is_nested", False) or not torch.equal(
            t.offsets().to(torch.int64), offsets
        ):
            raise SampleError(
                sample=None,
                field=key,
                expected="a jagged nested tensor with input_ids' offsets",
                actual="a dense tensor" if not getattr(t, "is_nested", False) else "other offsets",
            )
        _check_contiguous_jagged(t, key)
        values = t.values()
        _check_token_shape(values.shape, values.dtype, spec, key, flat, None)
        flat.token[key] = TokenSource(
            parts=None,
            values=values,
            pad=_pad_rows(values[:1], spec, next_pads.get(key)),
            token_dim=spec.token_dim,
            no_next=next_pads.get(key, spec.pad_value),
        )
    for spec in _sequence_and_media(schema):
        if spec.name in batch:
            target = flat.sequence if spec.role is Role.SEQUENCE else flat.media
            target[spec.name] = _nested_other(batch[spec.name], spec, flat, check_values)
        elif spec.required:  # as the list input: a required per-sample field may not be left out
            raise SampleError(
                sample=None,
                field=spec.name,
                expected="the field present",
                actual=f"fields {sorted(batch.keys())}",
            )
    return flat


def _nested_other(value, spec: FieldSpec, flat: FlatBatch, check_values: bool) -> torch.Tensor:
    """A SEQUENCE / MEDIA field of the nested input, held to the list input's checks: one entry per
    sample (``[B, *dense]``; a list of per-sample values is joined exactly as the list input does),
    a declared dtype, the declared dense dims, on the CPU."""
    n = flat.lengths.numel()
    if isinstance(value, torch.Tensor) and not value.is_nested:
        parts = list(value.unbind(0)) if spec.role is Role.SEQUENCE and value.ndim > 0 else None
        if spec.role is Role.SEQUENCE and (parts is None or len(parts) != n):
            raise SampleError(
                sample=None,
                field=spec.name,
                expected=f"one entry per sample: shape [{n}, *{list(spec.dense_shape)}]",
                actual=f"shape {tuple(value.shape)}",
            )
        _check_device(value, None, spec.name)
        if spec.role is Role.SEQUENCE:
            return _join_other(parts, spec, flat, check_values)
        _join_other([value], spec, flat, check_values)  # MEDIA: already [rows, *dense]; checks only
        return value
    if isinstance(value, (list, tuple, np.ndarray)) and not isinstance(value, (str, bytes)):
        if spec.role is Role.SEQUENCE and len(value) != n:
            raise SampleError(
                sample=None,
                field=spec.name,
                expected=f"one entry per sample ({n})",
                actual=f"{len(value)} entries",
            )
        return _join_other(
            [_as_tensor(v, i, spec.name) for i, v in enumerate(value)], spec, flat, check_values
        )
    raise SampleError(
        sample=None,
        field=spec.name,
        expected="a dense tensor or a list of per-sample values",
        actual="a nested tensor" if getattr(value, "is_nested", False) else type(value).__name__,
    )


# ------------------------------------------------------------------------------------------------
def _column(batch: Sequence[Mapping], key: str, convert: bool = True) -> list[torch.Tensor]:
    """``[sample[key] for sample in batch]`` as tensors; a missing or non-numeric value is named.
    ``convert=False``: the values as they are (the caller converts them with :func:`_as_tensors`
    when reading one fails)."""
    try:
        col = [s[key] for s in batch]
    except KeyError:
        i = next(i for i, s in enumerate(batch) if key not in s)
        raise SampleError(
            sample=i,
            field=key,
            expected="the field present (sample 0 has it)",
            actual=f"fields {sorted(batch[i].keys())}",
        ) from None
    return col if not convert or set(map(type, col)) == _TENSOR else _as_tensors(col, key)


def _as_tensors(col: list, key: str) -> list[torch.Tensor]:
    return [_as_tensor(v, i, key) for i, v in enumerate(col)]


_TENSOR = {torch.Tensor}
_DICT = {dict}
_DTYPE = operator.attrgetter("dtype")


def _numels(tensors: list[torch.Tensor]) -> np.ndarray:
    """int64 ``[N]``: each tensor's element count (one C-level pass; a shape costs a ``torch.Size``
    each)."""
    return np.fromiter(map(torch.Tensor.numel, tensors), np.int64, len(tensors))


_NARROW_INTS = frozenset(
    {torch.int8, torch.int16, torch.int32, torch.uint8, torch.uint16, torch.uint32}
)


def _widened(
    tensors: list[torch.Tensor], spec: FieldSpec, dtypes: set | None = None
) -> list[torch.Tensor]:
    """Narrower integer parts (int32 / uint16 ``.npy`` token ids) of a field declared int64 only,
    cast to int64, as a list from a Hugging Face column becomes; anything else unchanged (checked
    later). ``dtypes``: the parts' dtypes when known (a set, updated in place when parts are
    cast)."""
    if dtypes is None:
        dtypes = {t.dtype for t in tensors}
    if spec.dtypes != ("int64",) or dtypes.isdisjoint(_NARROW_INTS):
        return tensors
    dtypes -= _NARROW_INTS
    dtypes.add(torch.int64)
    return [t.to(torch.int64) if t.dtype in _NARROW_INTS else t for t in tensors]


def _as_tensor(value, i: int, key: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    if value is None:
        raise SampleError(sample=i, field=key, expected="a tensor", actual="missing")
    try:
        return torch.as_tensor(np.asarray(value))
    except (TypeError, ValueError) as exc:
        raise SampleError(
            sample=i,
            field=key,
            expected="a tensor, array or list of numbers",
            actual=f"{type(value).__name__} ({exc})",
        ) from None


def _check_lengths(lengths: np.ndarray, ids: list | None) -> None:
    if np.count_nonzero(lengths) == lengths.size:  # (element counts are >= 0)
        return
    i = int(np.argmin(lengths))
    shape = tuple(ids[i].shape) if ids is not None else (0,)
    raise SampleError(
        sample=i,
        field="input_ids",
        expected="a non-empty 1-D token tensor",
        actual=f"shape {shape}",
    )


def _missing(spec: FieldSpec, batch: list) -> None:
    """An absent field: an error when required, else it must be absent from every sample."""
    has = [i for i, s in enumerate(batch) if any(k in s for k in spec.sample_keys)]
    if spec.required:
        i = next(i for i, s in enumerate(batch) if not any(k in s for k in spec.sample_keys))
        raise SampleError(
            sample=i,
            field=spec.name,
            expected=f"one of {list(spec.sample_keys)}",
            actual=f"fields {sorted(batch[i].keys())}",
        )
    if has:
        raise SampleError(
            sample=0,
            field=spec.name,
            expected="the field (sample %d has it)" % has[0],
            actual="missing",
        )


def _check_token_parts(
    tensors: list, spec: FieldSpec, key: str, flat: FlatBatch, dtypes: set
) -> None:
    """Metadata-only checks of one token field over all samples (no tensor op): token-dim sizes
    equal input_ids' lengths, one dtype (``dtypes``: the parts'), equal other dims matching the
    declaration. torch.cat would promote mixed dtypes and only see the total length, so these are
    checked here."""
    first = tensors[0]
    td = spec.token_dim
    if first.ndim <= td or first.shape[td] != flat.np_lengths[0]:
        _diagnose_token(tensors, spec, key, flat)
    if key != "input_ids":
        # the token-dim sizes, as element counts: a part whose other dims differ from sample 0's
        # makes torch.cat fail, which names it, so equal counts mean equal token-dim sizes
        if not np.array_equal(
            _numels(tensors), flat.np_lengths * (first.numel() // first.shape[td])
        ):
            _diagnose_token(tensors, spec, key, flat)
    # one dtype (torch.cat would promote); other ranks, devices make torch.cat fail: diagnosed then
    if len(dtypes) != 1 or not first.is_cpu:
        for i, t in enumerate(tensors):
            _check_device(t, i, key)
        _diagnose_token(tensors, spec, key, flat)
    # other dims differing between samples make torch.cat fail; TokenSource.rows diagnoses that
    _check_token_shape(first.shape, first.dtype, spec, key, flat, tensors)


def _check_token_shape(
    shape, dtype, spec: FieldSpec, key: str, flat: FlatBatch, tensors: list | None
) -> None:
    """One representative shape/dtype against the declaration (named dims recorded in
    ``flat.dims``)."""
    declared = (*spec.leading_shape, "T", *spec.dense_shape)
    ok = len(shape) == len(declared) and dtype_name(dtype) in spec.dtypes
    if ok:
        for d, size in zip(declared, shape):
            if d == "T":
                continue
            if (
                isinstance(d, int)
                and size != d
                or isinstance(d, str)
                and flat.dims.setdefault(d, size) != size
            ):
                ok = False
    if not ok:
        if tensors is not None:
            _diagnose_token(tensors, spec, key, flat)
        raise SampleError(
            sample=None,
            field=key,
            expected=f"shape {declared} and dtype in {list(spec.dtypes)}",
            actual=f"shape {tuple(shape)} dtype {dtype_name(dtype)} (dims {flat.dims})",
        )
    flat.dtypes[key] = dtype_name(dtype)


def _diagnose_token(tensors: list, spec: FieldSpec, key: str, flat: FlatBatch) -> None:
    ids = flat.token.get("input_ids")
    if key != "input_ids" and ids is not None and ids.diagnose is not None:
        ids.diagnose()  # the lengths are input_ids' element counts: a bad input_ids is named first
    for i, t in enumerate(tensors):
        _check_device(t, i, key)
    dims = dict(flat.dims)
    lengths = flat.lengths.tolist()
    for i, t in enumerate(tensors):
        if t.ndim == 0:  # (its element count was taken for a length)
            raise SampleError(
                sample=i,
                field=key,
                actual="a 0-d tensor",
                expected="a non-empty 1-D token tensor"
                if key == "input_ids"
                else f"shape {(*spec.leading_shape, 'T', *spec.dense_shape)}",
            )
        declared = (*spec.leading_shape, lengths[i], *spec.dense_shape)
        shape = tuple(t.shape)
        bad = len(shape) != len(declared)
        for d, size in zip(declared, shape):
            bad = (
                bad
                or (isinstance(d, int) and size != d)
                or (isinstance(d, str) and dims.setdefault(d, size) != size)
            )
        if bad:
            named = {d: dims[d] for d in declared if isinstance(d, str) and d in dims}
            raise SampleError(
                sample=i,
                field=key,
                expected=f"shape {declared} {named or ''}".strip(),
                actual=f"shape {shape}",
                hint="every token field must have input_ids' length and constant dense dims",
            )
        if dtype_name(t.dtype) not in spec.dtypes:
            raise SampleError(
                sample=i,
                field=key,
                actual=dtype_name(t.dtype),
                expected=f"dtype in {list(spec.dtypes)}",
            )
        if t.dtype != tensors[0].dtype:
            raise SampleError(
                sample=i,
                field=key,
                actual=dtype_name(t.dtype),
                expected=f"the dtype of sample 0 ({dtype_name(tensors[0].dtype)}; a batch never "
                f"mixes dtypes)",
            )


def _in_unsigned_range(rows: torch.Tensor, lo, hi) -> bool:
    """Fast path for ids bounded below by 0 (teacher top-k ids): viewed as unsigned, a negative id
    is huge, so one max reduction checks both ends (about 3x cheaper than min and max of int64)."""
    if lo != 0 or rows.dtype != torch.int64 or not rows.is_contiguous() or not rows.is_cpu:
        return False
    top = int(np.maximum.reduce(rows.numpy().view(np.uint64), axis=None))  # (no .max() wrapper)
    return top <= (hi if hi is not None else _INT64_MAX)


_INT64_MAX = int(np.iinfo(np.int64).max)


@functools.lru_cache(maxsize=64)
def checked_spec(
    spec: FieldSpec, ignore_index: int, id_max: float | None = None
) -> tuple[FieldSpec, int | None, int | None] | None:
    """``(bounds to enforce, a value also refused, a value also accepted)`` on a TOKEN field's real
    rows, or None: the declared ``finite`` / ``min_value`` / ``max_value``; ``input_ids`` are
    moreover always ``>= 0`` and never the ignore index (an id of -100 would give label -100 with
    loss weight 1); a sample's own labels (a NEXT_TOKEN field) are token ids in ``[0, id_max]``
    (``input_ids``' bounds, the vocabulary) or the ignore index: a label of 99 with a vocabulary of
    10, or -5, would be trained on."""
    if spec.name == "input_ids":
        if spec.min_value is None or spec.min_value < 0:
            spec = dataclasses.replace(spec, min_value=0)
        hi = spec.max_value
        refused = (
            ignore_index
            if ignore_index >= spec.min_value and (hi is None or ignore_index <= hi)
            else None
        )
        return spec, refused, None
    if spec.source is Source.NEXT_TOKEN:
        lo = 0 if spec.min_value is None else spec.min_value
        hi = id_max if spec.max_value is None else spec.max_value
        return dataclasses.replace(spec, min_value=lo, max_value=hi), None, ignore_index
    return (spec, None, None) if spec.has_bounds else None


def check_value_bounds(
    rows: torch.Tensor,
    spec: FieldSpec,
    key: str,
    flat: FlatBatch,
    first_row: int = 0,
    refused: int | None = None,
    accepted: int | None = None,
) -> None:
    """finite / min / max declared on the spec, over real ``rows`` ``[*leading, n, *dense]`` (global
    rows ``first_row ..``), in one reduction (two when a ``refused`` value lies inside the bounds,
    one more op when an ``accepted`` value may lie outside them); on failure the first bad row names
    sample and token."""
    lo, hi = spec.min_value, spec.max_value
    if (lo is None and hi is None and not spec.finite) or rows.numel() == 0:
        return
    if (
        accepted is not None
    ):  # e.g. the ignore index among a sample's own labels: checked as an in-range value
        rows = rows.masked_fill(
            rows == accepted, lo if lo is not None else (hi if hi is not None else 0)
        )
    hit = refused is not None and bool((rows == refused).any())
    if not hit and _in_unsigned_range(rows, lo, hi):
        return
    mn, mx = torch.aminmax(
        rows.float() if rows.dtype in (torch.bool, torch.bfloat16, torch.float16) else rows
    )
    mn, mx = float(mn), float(mx)
    finite = np.isfinite(mn) and np.isfinite(mx)
    if not hit and not (
        (spec.finite and not finite)
        or (lo is not None and not mn >= lo)
        or (hi is not None and not mx <= hi)
    ):
        return
    v = rows.float().movedim(spec.token_dim, 0)
    v = v.reshape(v.shape[0], -1)
    bad = ~torch.isfinite(v) if spec.finite else torch.zeros_like(v, dtype=torch.bool)
    if lo is not None:
        bad |= ~(v >= lo)
    if hi is not None:
        bad |= ~(v <= hi)
    if refused is not None:
        bad |= v == refused
    if not bool(bad.any()):  # the fast reduction saw something the exact check does not
        return
    local = int(torch.nonzero(bad.any(1))[0])
    row = first_row + local
    i = int(torch.searchsorted(flat.cu_seqlens, row, right=True)) - 1
    value = v[local][bad[local]][0].item()
    if not rows.dtype.is_floating_point:  # an id of 99, not 99.0
        value = int(value)
    rng = f"[{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
    other = (
        f" other than {refused} (the ignore index)"
        if refused is not None
        else (f", or {accepted} (the ignore index)" if accepted is not None else "")
    )
    raise SampleError(
        sample=i,
        field=key,
        expected=f"{'finite ' if spec.finite else ''}values in {rng}{other}",
        actual=f"{value} at token {row - int(flat.cu_seqlens[i])}",
    )


def _join_other(
    tensors: list, spec: FieldSpec, flat: FlatBatch, check_values: bool
) -> torch.Tensor:
    """SEQUENCE fields are stacked to ``[N, *dense]``; MEDIA fields (``[rows, *dense]`` per sample)
    concatenated on dim 0. One dtype across the batch (torch.cat would silently promote bf16 +
    float32 to float32), and the declared dense dims (named ones recorded in ``flat.dims``)."""
    first = tensors[0].dtype
    skip = 0 if spec.role is Role.SEQUENCE else 1  # MEDIA: the leading row count is ragged
    for i, t in enumerate(tensors):
        _check_device(t, i, spec.name)
        if dtype_name(t.dtype) not in spec.dtypes or t.dtype != first:
            raise SampleError(
                sample=i,
                field=spec.name,
                expected=f"dtype in {list(spec.dtypes)}, the same as sample 0 "
                f"({dtype_name(first)})",
                actual=dtype_name(t.dtype),
            )
        trailing = tuple(t.shape[skip:])
        ok = len(trailing) == len(spec.dense_shape) and all(
            size == d if isinstance(d, int) else flat.dims.setdefault(d, size) == size
            for d, size in zip(spec.dense_shape, trailing)
        )
        if not ok:
            want = tuple(flat.dims.get(d, d) if isinstance(d, str) else d for d in spec.dense_shape)
            raise SampleError(
                sample=i,
                field=spec.name,
                expected=f"trailing dims {want}{' after the row count' if skip else ''}",
                actual=f"shape {tuple(t.shape)}",
            )
    flat.dtypes[spec.name] = dtype_name(first)
    return torch.stack(tensors) if spec.role is Role.SEQUENCE else torch.cat(tensors, 0)
