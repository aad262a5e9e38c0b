"""``validate_batch``: check a collated batch against its schema and layout, reporting every
violation at once (path, expected, actual). Format (THD or BSHD) is read from the batch:
a THD batch has ``cu_seqlens_padded``, a BSHD batch ``attention_mask``.

The checker stands alone: what each slot must hold comes from :mod:`.slots` (the Megatron/TE
definition), the CP/SP/FP8 shares from their definitions, and nothing is imported from
``prealign.collate``, so a bug in the collator's arithmetic cannot also hide here
(``tests/collate/test_mutation.py``). Sizes claimed by the offsets are compared with the tensors
before anything of that size is built.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from typing import Mapping

import torch

from .errors import ArgumentError, BatchValidationError
from .layout import CPLayout, ParallelLayout, is_power_of_two
from .schema import BatchSchema, FieldSource, Role, dtype_name
from .slots import expected_slots


@dataclass(frozen=True)
class Violation:
    path: str
    expected: str
    actual: str

    def __str__(self) -> str:
        return f"{self.path}: expected {self.expected}, got {self.actual}"


def check_schema_layout(schema, layout) -> None:
    """A collator's ``schema`` is a :class:`BatchSchema` and ``layout`` a ``ParallelLayout``, or an
    :class:`ArgumentError` naming the one that is not (a dict read from a config, None)."""
    if not isinstance(schema, BatchSchema):
        raise ArgumentError(
            f"schema: expected a BatchSchema (BatchSchema.from_json for its JSON), got "
            f"{type(schema).__name__}"
        )
    if not isinstance(layout, ParallelLayout):
        raise ArgumentError(
            f"layout: expected a ParallelLayout (ParallelLayout.from_dict for a dict), got "
            f"{type(layout).__name__}"
        )


def validate_batch(
    batch: dict, schema: BatchSchema, layout: ParallelLayout, *, raise_on_error: bool = True
) -> list[Violation]:
    """All violations of ``batch`` (empty when valid); raises :class:`BatchValidationError` listing
    them when ``raise_on_error``. A hybrid-CP batch (one with ``local_cp_size``, a power of two
    dividing ``layout.cp``) is checked as the batch of a CP group of that size."""
    check_schema_layout(schema, layout)
    local = batch.get("local_cp_size") if isinstance(batch, Mapping) else None
    if local is not None:
        n = as_int(local)
        if n is None or not is_power_of_two(n) or layout.cp % n:
            violations = [
                Violation("local_cp_size", f"a power of two dividing cp = {layout.cp}", repr(local))
            ]
            if raise_on_error:
                raise BatchValidationError(violations)
            return violations
        layout = dataclasses.replace(layout, cp=n)
    v = _Checker(batch, schema, layout)
    v.run()
    if v.violations and raise_on_error:
        raise BatchValidationError(v.violations)
    return v.violations


class _Checker:
    def __init__(self, batch: dict, schema: BatchSchema, layout: ParallelLayout):
        self.batch, self.schema, self.layout = batch, schema, layout
        self.violations: list[Violation] = []
        self.dims: dict[str, int] = {}

    def bad(self, path: str, expected, actual) -> None:
        self.violations.append(Violation(path, str(expected), str(actual)))

    # ------------------------------------------------------------------------------------------
    def run(self) -> None:
        b = self.batch
        if not isinstance(b, Mapping):
            self.bad("batch", "a dict of fields (a collated batch)", type(b).__name__)
            return
        if "cu_seqlens_padded" in b:
            plan_shape = self.check_thd_meta()
        elif "attention_mask" in b:
            plan_shape = self.check_bshd_meta()
        else:
            self.bad(
                "batch",
                "a THD batch (cu_seqlens_padded) or a BSHD batch (attention_mask)",
                sorted(b),
            )
            return
        if plan_shape is None:
            return
        for spec in self.schema.fields:
            self.check_field(spec, plan_shape)

    def offsets(self, key: str, static: int | None = None) -> torch.Tensor | None:
        """The offsets under ``key`` (int64), checked; with ``static`` (``layout.max_seqs``) they
        must have exactly ``static + 1`` entries, the trailing ones repeating the total, and are
        returned without those."""
        cu = self.batch.get(key)
        if not isinstance(cu, torch.Tensor):
            self.bad(key, "int32 tensor [N+1]", type(cu).__name__)
            return None
        ok = True
        if cu.dtype != torch.int32 or cu.ndim != 1 or cu.numel() < 2:
            self.bad(
                key, "int32 1-D tensor [N+1], N >= 1", f"{dtype_name(cu.dtype)} {tuple(cu.shape)}"
            )
            ok = False
        elif static is not None and cu.numel() != static + 1:
            self.bad(key, f"max_seqs + 1 = {static + 1} entries (static shapes)", cu.numel())
            ok = False
        elif static is not None:  # keep the entries up to the first that holds the total
            below = torch.nonzero(cu != cu[-1]).reshape(-1)
            cu = cu[: int(below[-1]) + 2 if below.numel() else 2]
        if ok and int(cu[0]) != 0:
            self.bad(f"{key}[0]", 0, int(cu[0]))
            ok = False
        elif ok and not bool((cu.diff() > 0).all()):
            i = int(torch.nonzero(cu.diff() <= 0)[0])
            self.bad(
                key,
                "strictly increasing offsets (no empty sequence)",
                f"{int(cu[i])} -> {int(cu[i + 1])} at {i}",
            )
            ok = False
        return cu.to(torch.int64) if ok else None

    def cp_rank(self) -> int | None | bool:
        """The batch's CP rank (None: unsharded), or False after recording a violation. Its
        ``cp_size`` is the layout's ``cp`` whether sharded or not (the collator writes it)."""
        cp_rank, cp_size = self.batch.get("cp_rank", -1), self.batch.get("cp_size", self.layout.cp)
        if as_int(cp_size) != self.layout.cp:
            self.bad("cp_size", self.layout.cp, repr(cp_size))
            return False
        if cp_rank is None or as_int(cp_rank) == -1:
            return None
        rank = as_int(cp_rank)
        if rank is None or not 0 <= rank < self.layout.cp:
            self.bad("cp_rank", f"-1 (unsharded) or an int in [0, {self.layout.cp})", repr(cp_rank))
            return False
        return rank

    def check_rank_shares(self, total: int, path: str) -> None:
        """From the definitions, not the layout's derived multiples: ``total`` rows split evenly
        over the CP ranks, then over the SP ranks (``tp`` under SP), and what one SP rank holds is a
        multiple of the FP8 recipe's block (TE quantizes each rank's share)."""
        lay = self.layout
        sp = lay.tp if lay.sp else 1
        rows = total // (lay.cp * sp)
        if total % (lay.cp * sp):
            self.bad(
                path,
                f"a multiple of cp*{'tp' if lay.sp else '1'} = {lay.cp * sp} (every CP and SP rank "
                f"an equal share)",
                total,
            )
            return
        for block, name in (
            (lay.fp8.multiple, lay.fp8.name),
            (lay.token_multiple, "token_multiple"),
        ):
            if rows % block:
                self.bad(
                    path,
                    f"{rows} rows per SP rank (cp={lay.cp}, tp={lay.tp}, sp={lay.sp}) to be a "
                    f"multiple of {block} ({name})",
                    total,
                )

    def token_length(self) -> int | None:
        """Slots the batch's ``input_ids`` holds (its token dim), read before anything is
        allocated."""
        ids = self.batch.get("input_ids")
        spec = self.schema["input_ids"]
        if not isinstance(ids, torch.Tensor) or ids.ndim != len(spec.leading_shape) + 2 + len(
            spec.dense_shape
        ):
            return None
        return int(ids.shape[spec.token_dim + 1])

    def check_thd_meta(self):
        lay, b = self.layout, self.batch
        cu, cup = (self.offsets(key, lay.max_seqs) for key in ("cu_seqlens", "cu_seqlens_padded"))
        if cu is None or cup is None:
            return None
        if cu.numel() != cup.numel():
            self.bad("cu_seqlens_padded", f"{cu.numel()} offsets like cu_seqlens", cup.numel())
            return None
        lengths, padded = cu.diff(), cup.diff()
        short = torch.nonzero(padded < lengths).flatten()
        if short.numel():
            i = int(short[0])
            self.bad(
                f"cu_seqlens_padded gap {i}", f">= true length {int(lengths[i])}", int(padded[i])
            )
        m = lay.seq_multiple
        off = torch.nonzero(padded % m).flatten()
        if off.numel():
            i = int(off[0])
            self.bad(
                f"cu_seqlens_padded gap {i}",
                f"a multiple of {m} ({lay.pad_policy.value}, cp={lay.cp})",
                int(padded[i]),
            )
        elif lay.zigzag and bool(
            (padded % (2 * lay.cp)).any()
        ):  # the definition, not the policy's multiple
            i = int(torch.nonzero(padded % (2 * lay.cp))[0])
            self.bad(
                f"cu_seqlens_padded gap {i}",
                f"a multiple of 2*cp = {2 * lay.cp} (zigzag cuts 2*cp chunks)",
                int(padded[i]),
            )
        total = int(cup[-1])
        if total % lay.total_multiple:
            self.bad(
                "T (cu_seqlens_padded[-1])",
                f"a multiple of {lay.total_multiple} (T/cp a multiple of "
                f"{lay.local_multiple}: T/(cp*{lay.sp_size}) rows per SP rank a multiple of "
                f"{lay.row_multiple}; "
                f"tp={lay.tp} sp={lay.sp} fp8={lay.fp8.name} token_multiple={lay.token_multiple})",
                total,
            )
        else:  # and from the definitions, in case the derived multiple is wrong
            self.check_rank_shares(total, "T (cu_seqlens_padded[-1])")
        if total < lay.cp * lay.min_local_rows:
            self.bad(
                "T (cu_seqlens_padded[-1])",
                f">= cp * min_local_rows = {lay.cp * lay.min_local_rows}",
                total,
            )
        if lay.length_buckets and total not in lay.length_buckets:
            self.bad(
                "T (cu_seqlens_padded[-1])",
                f"one of the length buckets {list(lay.length_buckets)}",
                total,
            )
        ms, want = b.get("max_seqlen"), lay.static_length or int(padded.max())
        if (
            not isinstance(ms, torch.Tensor)
            or ms.dtype != torch.int32
            or ms.numel() != 1
            or int(ms) != want
        ):
            self.bad(
                "max_seqlen",
                f"int32 [1] == {want}" + (" (static shapes: T)" if lay.static_length else ""),
                ms if not isinstance(ms, torch.Tensor) else f"{dtype_name(ms.dtype)} {ms.tolist()}",
            )
        if self.violations:
            return None
        rank = self.cp_rank()
        if rank is False:
            return None
        # compare the claimed size with the tensors before allocating anything of size T
        held = total if rank is None else total // lay.cp
        if self.token_length() != held:
            self.bad(
                "cu_seqlens_padded[-1]",
                f"{'T' if rank is None else 'T/cp'} = {held} rows, the token dim of input_ids",
                self.token_length(),
            )
            return None
        return self.slot_table(
            lengths, padded, rank, per_sequence_contiguous=False, rows_of=lambda n: (1, n)
        )

    def slot_table(self, lengths, padded, rank, *, per_sequence_contiguous: bool, rows_of):
        lay = self.layout
        kw = dict(cp=lay.cp, zigzag=lay.zigzag, per_sequence_contiguous=per_sequence_contiguous)
        tables = {True: expected_slots(lengths, padded, rank=rank, **kw)}
        self.slots = tables[True]

        def slots_of(
            spec,
        ):  # (slots, expected shape) of a TOKEN field; cp_sharded=False: the whole batch
            sharded = spec.cp_sharded or rank is None
            if sharded not in tables:
                tables[sharded] = expected_slots(lengths, padded, rank=None, **kw)
            sl = tables[sharded]
            return sl, (*spec.leading_shape, *rows_of(sl.num_slots), *spec.dense_shape)

        return slots_of

    def check_bshd_meta(self):
        lay, b = self.layout, self.batch
        mask = b["attention_mask"]
        cu = self.offsets("cu_seqlens")
        if cu is None:
            return None
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.ndim != 2:
            self.bad(
                "attention_mask",
                "bool [B, S_local]",
                f"{getattr(mask, 'dtype', type(mask))} {tuple(getattr(mask, 'shape', ()))}",
            )
            return None
        n, s_out = mask.shape
        lengths = cu.diff()
        if lengths.numel() != n:
            self.bad("cu_seqlens", f"{n + 1} offsets (B={n})", lengths.numel() + 1)
            return None
        rank = self.cp_rank()
        if rank is False:
            return None
        s = s_out * (lay.cp if rank is not None else 1)
        multiple = lay.bshd_multiple(n)
        if s % multiple:
            self.bad(
                "S (attention_mask.shape[1] * cp)",
                f"a multiple of {multiple} (tp={lay.tp} cp={lay.cp} "
                f"sp={lay.sp} fp8={lay.fp8.name}, B={n}: B*S/(cp*{lay.sp_size}) rows per SP rank "
                f"a multiple of {lay.row_multiple})",
                s,
            )
        else:  # and from the definitions, in case the derived multiple is wrong
            if lay.zigzag and s % (2 * lay.cp):
                self.bad(
                    "S (attention_mask.shape[1] * cp)",
                    f"a multiple of 2*cp = {2 * lay.cp} (zigzag cuts 2*cp chunks)",
                    s,
                )
            if (s // lay.cp) % lay.sp_size:
                self.bad(
                    "S (attention_mask.shape[1] * cp)",
                    f"S/cp a multiple of {lay.sp_size} (the SP scatter)",
                    s,
                )
            self.check_rank_shares(n * s, "B*S")
        if int(lengths.max()) > s:
            self.bad("S", f">= the longest sequence {int(lengths.max())}", s)
        if lay.length_buckets and s not in lay.length_buckets:
            self.bad("S", f"one of the length buckets {list(lay.length_buckets)}", s)
        if self.violations:
            return None
        padded = torch.full((n,), s, dtype=torch.int64)
        slots_of = self.slot_table(
            lengths,
            padded,
            rank,
            per_sequence_contiguous=lay.cp_layout is CPLayout.CONTIGUOUS,
            rows_of=lambda num: (n, num // n),
        )
        if not torch.equal(mask.reshape(-1), ~self.slots.is_pad):
            self.bad(
                "attention_mask",
                "True exactly on real tokens",
                f"{int((mask.reshape(-1) == self.slots.is_pad).sum())} slots wrong",
            )
        return slots_of

    # ------------------------------------------------------------------------------------------
    def check_field(self, spec, slots_of) -> None:
        name, b = spec.name, self.batch
        if name not in b:
            if spec.required or spec.source not in (spec.source.SAMPLE, spec.source.NEXT_TOKEN):
                self.bad(name, "present", "missing")
            return
        t = b[name]
        if not isinstance(t, torch.Tensor):
            self.bad(name, "a tensor", type(t).__name__)
            return
        if dtype_name(t.dtype) not in spec.dtypes:
            self.bad(f"{name}.dtype", " or ".join(spec.dtypes), dtype_name(t.dtype))
        if spec.role is Role.TOKEN:
            slots, expected = slots_of(spec)
        elif spec.role is Role.SEQUENCE:
            expected = (int(self.batch["cu_seqlens"].numel()) - 1, *spec.dense_shape)
        else:
            return  # MEDIA: ragged, checked by the producer
        if t.ndim != len(expected):
            self.bad(f"{name}.shape", _shape_str(expected), tuple(t.shape))
            return
        for d, (want, got) in enumerate(zip(expected, t.shape)):
            if isinstance(want, str):
                want = self.dims.setdefault(want, got)
            if want != got:
                self.bad(
                    f"{name}.shape[{d}]",
                    f"{want} (shape {_shape_str(expected)})",
                    f"{got} (shape {tuple(t.shape)})",
                )
                return
        if spec.role is Role.TOKEN:
            self.check_token_values(spec, t, slots)

    def check_token_values(self, spec, t: torch.Tensor, slots) -> None:
        name = spec.name
        flat = t.flatten(spec.token_dim, spec.token_dim + 1).movedim(
            spec.token_dim, 0
        )  # [T_out, ...]
        if spec.source is FieldSource.POSITIONS:
            wrong = flat != slots.positions
            if bool(wrong.any()):
                k = int(torch.nonzero(wrong)[0])
                self.bad(
                    f"{name}[slot {k}]",
                    f"{int(slots.positions[k])} (position in its sequence)",
                    int(flat[k]),
                )
            return
        if spec.source is FieldSource.PADDING_MASK:
            if not torch.equal(flat.bool(), slots.is_pad):
                self.bad(
                    name,
                    "True exactly on pad slots",
                    f"{int((flat.bool() != slots.is_pad).sum())} slots wrong",
                )
            return
        pads = flat[slots.is_pad]
        if pads.numel() and not bool((pads == spec.pad_value).all()):
            self.bad(
                f"{name}[pad slots]",
                f"pad value {spec.pad_value}",
                f"{pads[pads != spec.pad_value][0].item()}",
            )
        if spec.finite or spec.min_value is not None or spec.max_value is not None:
            self.check_bounds(spec, flat, slots)
        if name == "input_ids":
            self.check_token_ids(flat, slots)
        if spec.source is FieldSource.LOSS_MASK:
            self.check_loss_mask(spec, flat)
        if spec.source is FieldSource.NEXT_TOKEN:
            wrong = slots.last & (flat != spec.pad_value)
            if bool(wrong.any()):
                k = int(torch.nonzero(wrong)[0])
                self.bad(
                    f"{name}[slot {k}]",
                    f"{spec.pad_value} on a sequence's last token (labels never cross "
                    "a sequence boundary)",
                    int(flat[k]),
                )
            self.check_labels_follow_tokens(spec, flat, slots)
            self.check_label_ids(spec, flat, slots)

    def check_bounds(self, spec, flat: torch.Tensor, slots) -> None:
        """The declared finite / min / max on the real slots (e.g. teacher log-probs finite and <=
        0)."""
        v = flat[~slots.is_pad].float()
        bad = ~torch.isfinite(v) if spec.finite else torch.zeros_like(v, dtype=torch.bool)
        if spec.min_value is not None:
            bad |= ~(v >= spec.min_value)
        if spec.max_value is not None:
            bad |= ~(v <= spec.max_value)
        if bool(bad.any()):
            k = int(
                torch.nonzero(~slots.is_pad)[
                    int(torch.nonzero(bad.reshape(v.shape[0], -1).any(1))[0])
                ]
            )
            lo = "-inf" if spec.min_value is None else spec.min_value
            hi = "inf" if spec.max_value is None else spec.max_value
            self.bad(
                f"{spec.name}[slot {k}]",
                f"{'finite ' if spec.finite else ''}values in [{lo}, {hi}] ({int(bad.sum())} bad)",
                v[bad][0].item(),
            )

    def check_label_ids(self, spec, labels: torch.Tensor, slots) -> None:
        """Real slots' labels are the ignore index or token ids: ``>= 0`` and within ``input_ids``'
        declared bounds (the vocabulary). A label outside them is trained on with weight 1 (a
        device-side assert in the loss on a GPU, or a silently wrong target)."""
        ids_spec = next((f for f in self.schema.fields if f.name == "input_ids"), None)
        lo = (
            0 if spec.min_value is None else spec.min_value
        )  # the labels' own bounds first, as the collator
        hi = (
            spec.max_value
            if spec.max_value is not None
            else None
            if ids_spec is None
            else ids_spec.max_value
        )
        v = labels[~slots.is_pad]
        wrong = (v != self.schema.ignore_index) & (
            (v < lo) | ((v > hi) if hi is not None else False)
        )
        if bool(wrong.any()):
            k = int(torch.nonzero(~slots.is_pad)[int(torch.nonzero(wrong)[0])])
            top = f"[{lo:g}, {hi:g}]" if hi is not None else f">= {lo:g}"
            self.bad(
                f"{spec.name}[slot {k}]",
                f"the ignore index {self.schema.ignore_index} or a token id in {top}",
                int(labels[k]),
            )

    def check_token_ids(self, ids: torch.Tensor, slots) -> None:
        """Real token ids are >= 0 and never the ignore index (else a label would silently
        vanish)."""
        real = ~slots.is_pad
        wrong = real & ((ids < 0) | (ids == self.schema.ignore_index))
        if bool(wrong.any()):
            k = int(torch.nonzero(wrong)[0])
            self.bad(
                f"input_ids[slot {k}]",
                f"a token id >= 0 and != the ignore index {self.schema.ignore_index}",
                int(ids[k]),
            )

    def check_loss_mask(self, spec, mask: torch.Tensor) -> None:
        """Weights finite and >= 0, and 0 wherever the label is the ignore index (a pad or a
        sequence's last token included)."""
        bad = ~torch.isfinite(mask.float()) | (mask < 0)
        if bool(bad.any()):
            k = int(torch.nonzero(bad)[0])
            self.bad(f"{spec.name}[slot {k}]", "a finite weight >= 0", mask[k].item())
        labels = next(
            (
                self.batch.get(f.name)
                for f in self.schema.fields
                if f.source is FieldSource.NEXT_TOKEN
            ),
            None,
        )
        if not isinstance(labels, torch.Tensor) or labels.numel() != mask.numel():
            return
        wrong = (labels.reshape(-1) == self.schema.ignore_index) & (mask != 0)
        if bool(wrong.any()):
            k = int(torch.nonzero(wrong)[0])
            self.bad(
                f"{spec.name}[slot {k}]",
                f"0 where the label is {self.schema.ignore_index}",
                mask[k].item(),
            )

    def check_labels_follow_tokens(self, spec, labels: torch.Tensor, slots) -> None:
        """Labels derived from ``input_ids`` (the batch's ``label_source``, the default): wherever
        the next token of a sequence is held by this rank, the label is exactly that token. A
        sample's own labels (``label_source == "labels"``) are only held to the boundary and pad
        rules."""
        ids = self.batch.get("input_ids")
        source = self.batch.get("label_source", "input_ids")
        if (
            source != "input_ids"
            or not isinstance(ids, torch.Tensor)
            or ids.numel() != labels.numel()
        ):
            if source not in spec.sample_keys:
                self.bad("label_source", f"one of {list(spec.sample_keys)}", repr(source))
            return
        ids = ids.reshape(-1)
        has = slots.next_slot >= 0
        wrong = has & (labels != ids[slots.next_slot.clamp(min=0)])
        if bool(wrong.any()):
            k = int(torch.nonzero(wrong)[0])
            self.bad(
                f"{spec.name}[slot {k}]",
                f"the next token {int(ids[int(slots.next_slot[k])])} (labels read from input_ids)",
                int(labels[k]),
            )


def validate_packed_seq_params(
    params, layout: ParallelLayout, *, raise_on_error: bool = True
) -> list[Violation]:
    """All violations of a megatron-core ``PackedSeqParams`` (read by attribute: any release)
    against the rules TE and megatron-core apply to it, each checked on its own:

    - the identity rule: ``cu_seqlens_q_padded is cu_seqlens_q`` whenever their values are equal (TE
      sets ``pad_between_seqs`` by identity and refuses FlashAttention when it is True), same for
      kv; a stated ``pad_between_seqs`` agrees with the identity;
    - ``layout.max_seqs``: every offsets tensor (true and padded) has ``max_seqs + 1`` entries, and
      under static shapes (``layout.static_length``) ``max_seqlen_q/_kv == T``;
    - ``local_cp_size``, when set: a power of two dividing ``layout.cp`` (megatron-core's hybrid-CP
      sub-groups) and a ``cp_group`` of exactly that size (a singleton for 1); ``total_tokens``,
      when set: ``cu_seqlens_q_padded[-1]``.
    """
    out: list[Violation] = []
    bad = lambda path, expected, actual: out.append(Violation(path, str(expected), str(actual)))  # noqa: E731
    if getattr(params, "qkv_format", None) != "thd":
        bad("qkv_format", "'thd'", repr(getattr(params, "qkv_format", None)))
    for side in ("q", "kv"):
        cu, cup = (
            getattr(params, f"cu_seqlens_{side}", None),
            getattr(params, f"cu_seqlens_{side}_padded", None),
        )
        if not isinstance(cu, torch.Tensor) or not isinstance(cup, torch.Tensor):
            bad(
                f"cu_seqlens_{side}(_padded)",
                "int32 tensors",
                f"{type(cu).__name__}, {type(cup).__name__}",
            )
            continue
        if cu is not cup and cu.shape == cup.shape and torch.equal(cu, cup):
            bad(
                f"cu_seqlens_{side}_padded",
                f"the same tensor object as cu_seqlens_{side} (equal offsets: no "
                "padding between sequences; TE decides pad_between_seqs by identity)",
                "an equal copy",
            )
        for name, t in ((f"cu_seqlens_{side}", cu), (f"cu_seqlens_{side}_padded", cup)):
            if layout.max_seqs is not None and t.numel() != layout.max_seqs + 1:
                bad(name, f"max_seqs + 1 = {layout.max_seqs + 1} entries", t.numel())
    pad_between = getattr(params, "pad_between_seqs", None)
    q, qp = getattr(params, "cu_seqlens_q", None), getattr(params, "cu_seqlens_q_padded", None)
    if (
        pad_between is not None
        and isinstance(q, torch.Tensor)
        and bool(pad_between) != (q is not qp)
    ):
        bad(
            "pad_between_seqs",
            f"{q is not qp} (cu_seqlens_q_padded {'is not' if q is not qp else 'is'} cu_seqlens_q)",
            pad_between,
        )
    local = getattr(params, "local_cp_size", None)
    if local is not None:
        n = as_int(local)
        if n is None or not is_power_of_two(n) or layout.cp % n:
            bad("local_cp_size", f"a power of two dividing cp = {layout.cp}", repr(local))
        group = getattr(params, "cp_group", None)
        size = group.size() if callable(getattr(group, "size", None)) else None
        if size is None or size != n:
            bad(
                "cp_group",
                f"the process group of the local_cp_size = {local!r} ranks running this batch",
                "None" if group is None else f"a group of size {size}",
            )
    if layout.static_length is not None:
        for side in ("q", "kv"):
            if getattr(params, f"max_seqlen_{side}", None) != layout.static_length:
                bad(
                    f"max_seqlen_{side}",
                    f"T = {layout.static_length} (static shapes)",
                    repr(getattr(params, f"max_seqlen_{side}", None)),
                )
    total = getattr(params, "total_tokens", None)
    if total is not None and isinstance(qp, torch.Tensor) and as_int(total) != int(qp[-1]):
        bad("total_tokens", f"cu_seqlens_q_padded[-1] = {int(qp[-1])}", repr(total))
    if out and raise_on_error:
        raise BatchValidationError(out)
    return out


def as_int(value) -> int | None:
    """An integer of any integer type (``np.int64(1)`` too) as an int; None for anything else,
    ``True`` included (a bool is not a rank or a size)."""
    if isinstance(value, bool) or getattr(value, "dtype", None) == torch.bool:
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _shape_str(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"
