"""Build every TOKEN field of a schema from a :class:`FlatBatch` and a :class:`GatherPlan`.

One ``torch.cat`` and one ``index_select`` per sample-backed field (the labels of ``input_ids``:
a shifted copy of the gathered ids); derived fields (positions, padding mask, loss mask) come from
the plan itself, in numpy (a torch element-wise op on a few 10k slots costs about 3x numpy's).
Outputs have the token dim flat: ``[*leading, T_out, *dense]``. A large field sharded over CP
ranks is gathered block by block (runs of whole sequences, about :data:`BLOCK_BYTES` of input rows
each), so a block is still in the cache when it is checked and gathered, and the transient
concatenation is one block.
"""

from __future__ import annotations

import functools
import operator
from typing import Callable

import numpy as np
import torch

from prealign.schemas.errors import ArgumentError
from prealign.schemas.schema import BatchSchema, FieldSpec, Role, Source

from .indices import GatherPlan
from .samples import FlatBatch, TokenSource, check_value_bounds, checked_spec, resolve_key

BLOCK_MIN_BYTES = 4 << 20  # below this, one concatenation is cheaper than blocks
BLOCK_BYTES = 4 << 20
"""Input rows of one block: small enough that the block's concatenation is still in the cache
when its bounds are checked and its rows gathered (blocks of half the field, ~18 MiB of top-k ids
at B=256, cost ~30% more than 4 MiB ones on a 16 MiB L3), large enough that the per-block ops are
few."""


def token_fields(
    schema: BatchSchema,
    flat: FlatBatch,
    plan: GatherPlan,
    unsharded_plan: Callable[[], GatherPlan] | None = None,
) -> dict[str, torch.Tensor]:
    """name -> ``[*leading, T_out, *dense]`` for every TOKEN field the batch provides.

    ``unsharded_plan`` builds the plan of the whole padded batch, used by fields with
    ``cp_sharded=False``.
    """
    out: dict[str, torch.Tensor] = {}
    # sample key -> (plan, field gathered from its rows in one pass), for a next-token field of the
    # same key (labels of input_ids): a shifted copy of that field, see _next_of_gathered
    gathered: dict[str, tuple[GatherPlan, torch.Tensor]] = {}
    labels_spec = _labels_and_id_max(schema)[0]
    labels_from_ids = (
        labels_spec is not None and resolve_key(labels_spec, flat.token.keys()) == "input_ids"
    )
    released, dtypes = False, token_dtypes(schema)
    for spec in _build_order(schema):
        p = plan if spec.cp_sharded or unsharded_plan is None else unsharded_plan()
        if spec.source in (Source.SAMPLE, Source.NEXT_TOKEN):
            key = resolve_key(spec, flat.token.keys())
            if key is None:
                continue  # optional and absent from every sample (flatten checked that)
            # a next-token field reads the row after each slot's own (see GatherPlan)
            shift = 0 if spec.source is Source.SAMPLE else 1
            # bounds are checked on every row, not only this CP rank's: a bad token held by another
            # rank must fail here too, or this rank would go on into the next collective alone
            # labels read from input_ids were checked as input_ids; a sample's own labels are
            # checked here
            own = spec.source is Source.SAMPLE or key != "input_ids"
            checked = _checked_specs(schema).get(spec.name) if flat.check_values and own else None
            check = (
                (
                    lambda rows, first, c=checked, key=key: check_value_bounds(
                        rows, c[0], key, flat, first, *c[1:]
                    )
                )
                if checked is not None
                else None
            )
            source = flat.token[key]
            prior = gathered.get(key)
            if shift and prior is not None and prior[0] is p:
                out[spec.name] = _next_of_gathered(source.rows(), prior[1], p, source.no_next)
                continue
            out[spec.name] = gather(source, p.src, p, flat, check, shift)
            if shift:
                p.next_rows(out[spec.name], source.token_dim, source.no_next)
            elif (
                source.token_dim == 0
                and out[spec.name].dtype in _SHIFTABLE
                and _in_one_pass(source, p.src, flat)
            ):
                gathered[key] = (p, out[spec.name])
            continue
        if not released:  # the concatenated rows are no longer needed
            for source in flat.token.values():
                source.release()
            released = True
        if spec.source is Source.POSITIONS:
            pos, dtype = p.positions, dtypes[spec.name]
            out[spec.name] = pos if pos.dtype == dtype else pos.to(dtype)
        elif spec.source is Source.PADDING_MASK:
            dtype = dtypes[spec.name]
            out[spec.name] = p.is_pad if dtype == torch.bool else p.is_pad.to(dtype)
        elif spec.source is Source.LOSS_MASK:
            labels = out.get(labels_spec.name) if labels_spec is not None else None
            out[spec.name] = _loss_mask(spec, schema, flat, p, labels, labels_from_ids)
    return out


def check_cp_rank(cp_rank, layout) -> int | None:
    """A collator's ``cp_rank`` as a plain int: None (the whole batch) or a rank of the layout's CP
    group. Any integer type is accepted (``np.int64(1)``); a bool, a float or a str is not a rank.

    >>> from prealign.schemas import ParallelLayout
    >>> check_cp_rank(np.int64(1), ParallelLayout(cp=2))
    1
    """
    if cp_rank is None:
        return None
    is_bool = isinstance(cp_rank, bool) or getattr(cp_rank, "dtype", None) in (torch.bool, np.bool_)
    try:
        rank = None if is_bool else operator.index(cp_rank)
    except TypeError:
        rank = None
    if rank is None:
        raise ArgumentError(
            f"cp_rank: expected None or an int in [0, {layout.cp}), got {cp_rank!r} "
            f"({type(cp_rank).__name__}; a bool is not a rank)"
        )
    if not 0 <= rank < layout.cp:
        raise ArgumentError(
            f"cp_rank: expected None or an int in [0, {layout.cp}) (cp={layout.cp}), got {rank}"
        )
    return rank


def non_token_fields(flat: FlatBatch, schema: BatchSchema, layout, cp_rank: int | None) -> dict:
    """What every batch carries besides its token fields: SEQUENCE and MEDIA fields, the CP
    metadata (``cp_rank`` -1 when unsharded, ``cp_size``, ``cp_layout``) and ``label_source``, the
    sample key the labels were read from (``"input_ids"``: the next tokens; ``"labels"``: the
    sample's own), so that :func:`~prealign.schemas.validate_batch` knows which rule applies."""
    out = {
        **flat.sequence,
        **flat.media,
        "cp_rank": -1 if cp_rank is None else cp_rank,
        "cp_size": layout.cp,
        "cp_layout": layout.cp_layout.value,
    }
    labels_spec = _labels_and_id_max(schema)[0]
    if labels_spec is not None:
        key = resolve_key(labels_spec, flat.token.keys())
        if key is not None:
            out["label_source"] = key
    return out


@functools.lru_cache(maxsize=64)
def _labels_and_id_max(schema: BatchSchema) -> tuple[FieldSpec | None, float | None]:
    """The schema's next-token field (the labels), and ``input_ids``' declared ``max_value``."""
    tokens = schema.of_role(Role.TOKEN)
    labels = next((f for f in tokens if f.source is Source.NEXT_TOKEN), None)
    return labels, next((f.max_value for f in tokens if f.name == "input_ids"), None)


@functools.lru_cache(maxsize=64)
def token_dims(schema: BatchSchema) -> dict[str, int]:
    """TOKEN field name -> its token dim (looked up once per schema)."""
    return {f.name: f.token_dim for f in schema.of_role(Role.TOKEN)}


@functools.lru_cache(maxsize=64)
def token_dtypes(schema: BatchSchema) -> dict[str, torch.dtype]:
    """TOKEN field name -> its output dtype (``FieldSpec.dtype``, looked up once per schema)."""
    return {f.name: f.dtype for f in schema.of_role(Role.TOKEN)}


@functools.lru_cache(maxsize=64)
def _checked_specs(schema: BatchSchema) -> dict[str, tuple]:
    """field name -> :func:`checked_spec` of every TOKEN field with bounds to enforce (looked up
    once per schema: a field spec's hash costs more than the lookup)."""
    id_max = _labels_and_id_max(schema)[1]
    out = {}
    for spec in schema.of_role(Role.TOKEN):
        checked = checked_spec(spec, schema.ignore_index, id_max)
        if checked is not None:
            out[spec.name] = checked
    return out


@functools.lru_cache(maxsize=64)
def _build_order(schema: BatchSchema) -> tuple:
    """Fields read from the samples first (sample fields, then next-token fields), then the derived
    ones, once the concatenated rows are released."""
    order = {Source.SAMPLE: 0, Source.NEXT_TOKEN: 1}
    return tuple(sorted(schema.of_role(Role.TOKEN), key=lambda f: order.get(f.source, 2)))


def gather(
    source: TokenSource,
    index: torch.Tensor,
    plan: GatherPlan,
    flat: FlatBatch,
    check: Callable[[torch.Tensor, int], None] | None = None,
    shift: int = 0,
) -> torch.Tensor:
    """``source`` rows (then its two pad rows) selected by ``index + shift`` along the token dim
    (``shift=1``: the next row, for a next-token field; the index itself is never rewritten).
    ``index``: a plan's ``src`` (real rows, ``num_real`` on pads).

    ``check(rows, first_row)`` sees every real row once (all sequences, whatever ``index`` keeps).
    """
    td = source.token_dim
    if td != 0 or _in_one_pass(source, index, flat):
        rows = source.rows()
        if check is not None:
            check(rows.narrow(td, 0, flat.num_real), 0)
        if shift:
            rows = rows.narrow(td, shift, flat.num_real + 2 - shift)
        return rows.index_select(td, index)
    first = source.pad
    out = torch.empty((index.numel(), *first.shape[1:]), dtype=first.dtype)
    cu, src = flat.cu_seqlens.tolist(), index.numpy()
    blocks = plan.blocks(flat.cu_seqlens, max(BLOCK_BYTES // source.row_nbytes, 1))
    # one buffer for every block's rows: fresh memory per block would cost a page fault per 4 KiB
    buf = torch.empty(
        (max(cu[s1] - cu[s0] for s0, s1, _, _ in blocks) + 2, *first.shape[1:]), dtype=first.dtype
    )
    for s0, s1, o0, o1 in blocks:
        if o0 == o1 and check is None:
            continue
        n = cu[s1] - cu[s0]
        rows = source.block(s0, s1, cu[s0], cu[s1], out=buf[: n + 2])
        if check is not None:
            check(rows.narrow(0, 0, n), cu[s0])
        # real rows shift by the block's first row; the pad row (num_real) follows the block's
        # own rows, at n
        local = np.minimum(src[o0:o1] - cu[s0], n)
        if shift:
            rows = rows.narrow(0, shift, n + 2 - shift)
        torch.index_select(rows, 0, torch.from_numpy(local), out=out[o0:o1])
    return out


def _in_one_pass(source: TokenSource, index: torch.Tensor, flat: FlatBatch) -> bool:
    """Whether :func:`gather` reads a token-dim-0 ``source`` from all its rows concatenated at once
    (a small field, or one this rank reads most of), rather than block by block."""
    return index.numel() >= flat.num_real or flat.num_real * source.row_nbytes < BLOCK_MIN_BYTES


_SHIFTABLE = frozenset({torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8})
"""1-D fields whose next-token twin is built by :func:`_next_of_gathered` (token ids, in numpy)."""


def _next_of_gathered(
    rows: torch.Tensor, gathered: torch.Tensor, plan: GatherPlan, no_next
) -> torch.Tensor:
    """The next-token field of 1-D ``rows`` (``labels`` of ``input_ids``) from ``gathered``, the
    same rows already gathered by ``plan.src``: a real slot's next token is the next slot's value
    wherever both lie in one run of real slots, so one shifted copy, then each run's last real
    slot reads its next row from ``rows`` (the next chunk's first token may be another CP rank's),
    pads hold ``no_next`` and so does each sequence's last token (:meth:`GatherPlan.next_rows`).
    Equal to ``rows[src + 1]`` with those fixes, for a fraction of a gather's cost."""
    g, ends = gathered.numpy(), plan.run_ends
    out = np.empty_like(g)
    out[:-1] = g[1:]
    out[ends] = rows.numpy()[plan.src.numpy()[ends] + 1]
    out[plan.pad_slots] = no_next
    return torch.from_numpy(plan.next_rows(out, 0, no_next))


def _loss_mask(
    spec,
    schema: BatchSchema,
    flat: FlatBatch,
    plan: GatherPlan,
    labels: torch.Tensor | None,
    labels_from_ids: bool,
):
    """1.0 where a label is trained on (label != ignore_index, not a pad), times the sample's own
    ``loss_mask`` (aligned with its tokens, so shifted like the labels) when it has one. Sample
    weights are kept as given (0.5 stays 0.5; bool/int masks become 0.0/1.0) and must be finite
    and >= 0: anything else is a :class:`SampleError`, never a silent change."""
    sample_mask = flat.token.get("loss_mask")
    if labels_from_ids and sample_mask is None:
        # labels are the next input_ids: trained on every real slot but each sequence's last (in
        # numpy: a torch element-wise op costs about 3x numpy's on a few 10k slots)
        np_dtype = _NUMPY_FLOATS.get(token_dtypes(schema)[spec.name])
        if np_dtype is not None:
            mask = np.logical_not(plan.is_pad.numpy(), out=np.empty(plan.num_slots, np_dtype))
            mask[plan.last_slots.numpy()] = 0
            return torch.from_numpy(mask)
        mask = torch.logical_not(plan.is_pad, out=torch.empty(plan.num_slots, dtype=spec.dtype))
        return mask.index_fill_(0, plan.last_slots, 0)
    mask = ((labels != schema.ignore_index) if labels is not None else ~plan.is_pad).to(spec.dtype)
    if sample_mask is not None:
        checked = (
            checked_spec(_SAMPLE_WEIGHTS, schema.ignore_index) if flat.check_values else None
        )  # no labels
        check = (
            (lambda rows, first: check_value_bounds(rows, checked[0], "loss_mask", flat, first))
            if checked is not None
            else None
        )
        weights = gather(sample_mask, plan.src, plan, flat, check, shift=1)  # shifted as labels
        plan.next_rows(weights, sample_mask.token_dim, sample_mask.no_next)
        mask.mul_(weights.to(spec.dtype))
    return mask


_NUMPY_FLOATS = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16}
"""Loss-mask dtypes built in numpy (torch.bfloat16 has no numpy twin: built in torch)."""


_SAMPLE_WEIGHTS = FieldSpec(
    name="loss_mask", dtypes=("float32",), pad_value=0, finite=True, min_value=0
)
