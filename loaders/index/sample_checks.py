"""What the index pass checks of each sample: the collator's own validation, the optional fields a
sample may have, and whether it carries media."""

from __future__ import annotations

import numpy as np

from prealign.loaders.errors import BadSampleError, StaleIndexError
from prealign.loaders.policy import BadRecord
from prealign.schemas.errors import ConfigError, SampleError
from prealign.schemas.schema import BatchSchema, Role, Source


def media_keys(schema: BatchSchema) -> tuple[str, ...]:
    """Sample keys of the schema's MEDIA fields (``pixel_values``, ``image_grid_thw``, ...)."""
    return tuple(spec.name for spec in schema.of_role(Role.MEDIA))


def has_media(sample: dict, keys: tuple[str, ...]) -> bool:
    """True when a MEDIA field (``keys``, see :func:`media_keys`) of ``sample`` has at least one row
    (an image, a video, ...); a text-only VLM sample (``pixel_values [0, patch_dim]``) has none."""
    for key in keys:
        value = sample.get(key)
        if value is None:
            continue
        shape = getattr(value, "shape", None)
        shape = tuple(np.shape(value)) if shape is None else tuple(shape)
        if not shape or shape[0] > 0:
            return True
    return False


VALIDATION_CHUNK = 64


FIELDS_KEY = "fields"
"""Key of the per-sample record of which optional sample fields it has (not kept in
``SampleIndex.dims``)."""


def optional_keys(schema: BatchSchema) -> tuple[str, ...]:
    """Sample keys the collator reads that a sample may have or lack (``labels``, ``loss_mask``,
    ...):
    every sample of one index must agree on them, since a micro-batch cannot mix them."""
    from prealign.collate.samples import sample_token_keys

    keys = {k for k, _ in sample_token_keys(schema)}
    for spec in schema.of_role(Role.TOKEN):
        keys.update(spec.sample_keys)
    return tuple(sorted(keys - {"input_ids"}))


def _collate_check(samples: list[dict], schema: BatchSchema) -> tuple[list[int], dict[str, int]]:
    """Run the loader's collator on ``samples`` as one unsharded micro-batch (shapes, dtypes, value
    bounds of every row): their token lengths and what they fix for every later sample: the named
    dims (``{"K": 64}``) and each field's dtype (``{"dtype[teacher_topk_log_probs]": "bfloat16"}``;
    a batch never mixes dtypes). Raises the collator's :class:`SampleError` (or anything else)."""
    from prealign.collate.samples import flatten
    from prealign.collate.thd import THDCollator
    from prealign.schemas.layout import ParallelLayout

    THDCollator(schema=schema, layout=ParallelLayout(), cp_rank=None)(samples)
    flat = flatten(
        samples, schema, check_values=False
    )  # passed the same checks above: lengths and dims
    return flat.lengths.tolist(), {
        **flat.dims,
        **{f"dtype[{k}]": v for k, v in flat.dtypes.items()},
    }


def validated(
    samples: list[dict], schema: BatchSchema
) -> list[tuple[int, dict[str, int]] | SampleError]:
    """(token length, named dims) of each sample, or the collator's error for it. One collator call
    for the whole chunk on the happy path; one per sample (the same function) only when the chunk
    fails (or its samples' tensors differ in dtype or rank, which a concatenation could hide by
    type promotion). Samples accepted alone may still disagree on a named dim: the dims returned let
    :func:`merge_shards` hold each to the first accepted sample's."""
    import torch  # (in the functions that collate: the index pass of headers needs none)

    if not samples:
        return []
    first = samples[0]
    sig = {k: (v.dtype, v.ndim) for k, v in first.items() if isinstance(v, torch.Tensor)}
    if all(
        len(s) == len(first)
        and all(
            isinstance(s.get(k), torch.Tensor) and (s[k].dtype, s[k].ndim) == d
            for k, d in sig.items()
        )
        for s in samples
    ):
        try:
            lengths, dims = _collate_check(samples, schema)
            return [(n, dims) for n in lengths]
        except Exception:  # noqa: BLE001 - diagnosed sample by sample below
            pass
    out: list[tuple[int, dict[str, int]] | SampleError] = []
    for s in samples:
        try:
            lengths, dims = _collate_check([s], schema)
            out.append((lengths[0], dims))
        except ConfigError:
            raise
        except SampleError as exc:  # anything else the collator raises is a bug, and propagates
            out.append(exc)
    return out


def signature_verdicts(
    source,
    schema: BatchSchema,
    signatures: list,
    dim_ids: np.ndarray,
    locations: np.ndarray,
    lengths: np.ndarray,
) -> tuple[list[dict | None], dict[int, SampleError]]:
    """``(verdicts, errors)``: the data signatures of a sidecar index (``dim_ids [N]`` into
    ``signatures``, ``locations [N, 4]`` = shard, start, end, checksum, ``lengths [N]``, in stream
    order) made ``schema``'s.

    For each signature its rows are loaded in stream order (over all shards) and run through the
    collator (:func:`validated`) until one passes: its named dims, dtypes and optional fields are
    the signature's verdict. A row that fails on a value (an id past the vocabulary, a non-finite
    log-prob, a body that does not decode) is a bad record itself and the next row is tried; a row
    whose structure fails (:func:`flatten` without value checks: shape, rank, dtype, a missing
    field: what the signature fixes) condemns every row of its signature, with that error (verdict
    None). ``errors`` maps each bad row to its error, a :class:`BadSampleError` naming the sample as
    the in-process pass does (``url:key`` when it was read; the rows condemned unread by their
    location)."""
    verdicts: list[dict | None] = [None] * len(signatures)
    errors: dict[int, SampleError] = {}
    order = np.argsort(dim_ids, kind="stable")
    bounds = np.searchsorted(dim_ids[order], np.arange(len(signatures) + 1))
    left = {  # each signature's rows in stream order (an array: no Python int per row)
        k: order[bounds[k] : bounds[k + 1]]
        for k in range(len(signatures))
        if bounds[k + 1] > bounds[k]
    }
    tries = 0  # rows tried of each undecided signature (all of them start together)
    # a round: the next row of every undecided signature, validated in chunks (one collator call
    # each)
    while left:
        tried = [(k, int(rows[tries])) for k, rows in left.items()]
        tries += 1
        samples: list = []
        names: list[str] = []  # each sample named as the in-process pass names it (``url:key``)
        for _, row in tried:
            loc = tuple(int(x) for x in locations[row])
            names.append(source.where(loc))
            try:
                raw = source.read(loc)
                names[-1] = source.sample_name(raw, loc)
                samples.append(source.apply_transform(raw, loc))
            except (
                SampleError
            ) as exc:  # found bad only now (e.g. an image body, with header-only indexing)
                samples.append(exc)
        loaded = [x for x in samples if not isinstance(x, SampleError)]
        results = iter(
            [
                r
                for i in range(0, len(loaded), VALIDATION_CHUNK)
                for r in validated(loaded[i : i + VALIDATION_CHUNK], schema)
            ]
        )
        for (k, row), sample, name in zip(tried, samples, names):
            result = sample if isinstance(sample, SampleError) else next(results)
            if not isinstance(result, SampleError):
                if result[0] != int(lengths[row]):
                    raise _length_mismatch(
                        source, tuple(int(x) for x in locations[row]), int(lengths[row]), result[0]
                    )
                verdicts[k] = {
                    **result[1],
                    FIELDS_KEY: ",".join(f for f in optional_keys(schema) if f in sample),
                }
                del left[k]
                continue
            errors[row] = _named(result, name)
            if not isinstance(sample, SampleError) and _structure_error(sample, schema) is not None:
                errors.update(
                    {
                        r: _named(result, source.where(tuple(int(x) for x in locations[r])))
                        for r in left.pop(k)[tries:].tolist()
                    }
                )  # the signature's: every sample of it has it (not read)
            elif tries == len(left[k]):
                del left[k]  # every row failed, each on its own value
    return verdicts, errors


def _length_mismatch(source, loc: tuple, indexed: int, got: int) -> StaleIndexError:
    """A sample's length from its sidecar differs from this loader's transform's: the sidecars were
    built with another transform (one the key does not tell apart), named with the command that
    rebuilds them."""
    from prealign.loaders.index.hints import index_hint
    from prealign.loaders.index.sidecar import transform_name

    hint = (
        index_hint(source)
        if getattr(source, "urls", None)
        else "rebuild the index with this transform"
    )
    return StaleIndexError(
        source.where(loc),
        f"indexed with {indexed} tokens, {got} with this loader's transform "
        f"{transform_name(source.transform)}",
        hint,
    )


def _structure_error(sample: dict, schema: BatchSchema) -> SampleError | None:
    """The collator's shape / dtype / field error for ``sample`` (values not looked at), or None."""
    from prealign.collate.samples import flatten

    try:
        flatten([sample], schema, check_values=False)
    except SampleError as exc:
        return exc
    return None


def _named(err: SampleError, where: str) -> BadSampleError:
    """``err`` (the collator's, naming sample 0 of a one-sample batch) as a bad sample named
    ``where``."""
    reason = getattr(err, "reason", None)
    if isinstance(err, BadSampleError) and err.sample == where:
        return err
    return BadSampleError(
        sample=where,
        field=err.field,
        expected=err.expected,
        actual=err.actual,
        reason=reason if isinstance(reason, str) else None,
    )


def bad_row_event(err: BadSampleError) -> BadRecord:
    """The record of a sample found bad by ``err`` (naming it)."""
    return BadRecord.of_error(err)


BOUNDED = ("input_ids", "labels", "teacher_topk_ids")
"""Integer sample arrays whose values a sidecar bounds (``bounds [N, 3, 4]``), so that a loader
holds every sample to its schema's id bounds when it is built, as the in-process pass does
(:func:`bound_suspects`)."""
_BIG = int(np.iinfo(np.int64).max)
NO_VALUES = np.array([-_BIG - 1, _BIG, _BIG, -_BIG - 1], np.int64)
"""The bounds of an absent (or non-integer) array: ``max``, ``min >= 0``, ``min < 0``, ``max < 0``
of no values."""
_NONE = np.tile(NO_VALUES, (len(BOUNDED), 1))


def value_bounds(arrays: dict) -> np.ndarray:
    """``int64 [3, 4]``: for each of :data:`BOUNDED` in ``arrays`` (numpy arrays or tensors), the
    maximum, the smallest non-negative value, and the smallest and largest negative values
    (:data:`NO_VALUES` where absent).

    >>> sample = {"input_ids": np.array([5, 9, 2]), "labels": np.array([-100, 9, -100])}
    >>> value_bounds(sample)[:2].tolist()
    [[9, 2, 9223372036854775807, -9223372036854775808], [9, 9, -100, -100]]
    """
    out = _NONE.copy()
    for i, name in enumerate(BOUNDED):
        a = arrays.get(name)
        if a is None:
            continue
        a = a.detach().cpu().numpy() if hasattr(a, "detach") else np.asarray(a)
        if a.dtype.kind not in "iu" or a.size == 0:
            continue
        lo, hi = (
            int(a.min()),
            int(a.max()),
        )  # (reductions in the array's own dtype: no copy of a big member)
        out[i, 0] = min(hi, _BIG)
        if lo >= 0:
            out[i, 1] = lo
            continue
        neg = a < 0
        if not neg.all():
            out[i, 1] = int(np.min(a, where=~neg, initial=np.iinfo(a.dtype).max))
        out[i, 2], out[i, 3] = lo, int(np.max(a, where=neg, initial=np.iinfo(a.dtype).min))
    return out


def bound_suspects(schema: BatchSchema, bounds: np.ndarray) -> np.ndarray:
    """``bool [N]``: the samples whose recorded bounds (``[N, 3, 4]``, :func:`value_bounds`) may
    break the collator's value rules under ``schema``: ids in ``[0, vocab)`` (never the ignore
    index), labels in ``[0, vocab)`` or the
    ignore index, top-k ids in their declared range. A superset: each is then loaded and checked
    exactly."""
    specs = {spec.name: spec for spec in schema.fields}
    out = np.zeros(bounds.shape[0], bool)
    ids = specs.get("input_ids")
    id_max = ids.max_value if ids is not None else None
    ignore = schema.ignore_index
    for i, name in enumerate(BOUNDED):
        spec = specs.get(name)
        if spec is None:
            continue
        b = bounds[:, i]
        if (
            name == "labels" and spec.source is Source.NEXT_TOKEN
        ):  # labels, or the ids they are made from
            absent = (b == NO_VALUES).all(1)
            b = np.where(absent[:, None], bounds[:, 0], b)
        mx, lo_nonneg, neg_min, neg_max = b.T
        has_neg = neg_min <= neg_max
        lo, hi, accepted, refused = spec.min_value, spec.max_value, None, None
        if name == "input_ids":
            lo = 0 if lo is None or lo < 0 else lo
            refused = ignore if ignore >= lo and (hi is None or ignore <= hi) else None
        elif spec.source is Source.NEXT_TOKEN:
            lo, hi, accepted = (0 if lo is None else lo), (id_max if hi is None else hi), ignore
        low = np.where(has_neg, neg_min, lo_nonneg)
        if accepted is not None and accepted < 0:  # the smallest value other than the ignore index
            only = has_neg & (neg_min == accepted) & (neg_max == accepted)
            low = np.where(only, lo_nonneg, low)
        if lo is not None:
            out |= low < lo
        if hi is not None:
            out |= mx > hi
        if refused is not None:
            out |= (low <= refused) & (mx >= refused)
    return out


def bound_errors(
    source, schema: BatchSchema, rows: np.ndarray, locations: np.ndarray
) -> dict[int, BadSampleError]:
    """The samples at ``rows`` (suspects of :func:`bound_suspects`) loaded and checked by the
    collator: ``{row: error}`` of those it refuses, each named as the in-process pass names it."""
    errors: dict[int, BadSampleError] = {}
    for row in map(int, rows):
        loc = tuple(int(x) for x in locations[row])
        name = source.where(loc)
        try:
            raw = source.read(loc)
            name = source.sample_name(raw, loc)
            result = validated([source.apply_transform(raw, loc)], schema)[0]
        except SampleError as exc:
            result = exc
        if isinstance(result, SampleError):
            errors[row] = _named(result, name)
    return errors


def value_errors(
    source,
    schema: BatchSchema,
    bounds: np.ndarray,
    locations: np.ndarray,
    dim_ids: np.ndarray,
    verdicts: list,
    errors: dict,
) -> dict[int, BadSampleError]:
    """The id-bound errors of the samples a sidecar index keeps, vectorised: the rows of accepted
    signatures not already bad (``errors``) whose recorded ``bounds`` break ``schema``'s
    (:func:`bound_suspects`), each checked exactly (:func:`bound_errors`)."""
    accepted = np.asarray([v is not None for v in verdicts] + [False], bool)
    rows = np.flatnonzero(
        bound_suspects(schema, bounds) & accepted[np.minimum(dim_ids, len(verdicts))]
    )
    return bound_errors(
        source,
        schema,
        np.asarray([r for r in rows.tolist() if r not in errors], np.int64),
        locations,
    )
