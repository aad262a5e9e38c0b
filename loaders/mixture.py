"""``Mixture``: one source over many datasets, weighted by tokens (default) or samples.

    Mixture({"web": (web, 0.6), "code": (code, 0.3), "math": Component(math, weight=0.1)},
            by="tokens")
        │ index pass: each component's own (its transform, its bad-data policy), merged: global ids
        ▼   0..N_web-1 | N_web..N_web+N_code-1 | ...
    per epoch (:mod:`prealign.loaders.plan.mixing`): each component's stream of whole reshuffled
    passes, its first n_c draws (its weight of the epoch's tokens), interleaved by virtual finish
    time
        ▼
    the planner packs the interleave step by step (``PackStrategy.STEP_FIT``): each global step's
    tokens hold the weights locally; batches carry ``sample_component`` int64 [N]

A ``Mixture`` is a :class:`~prealign.loaders.sources.source.Source` (``scan``/``read``/``load``
dispatch to the component; a location is ``(component, width, *its location, 0...)``), so every tool
taking a source takes it; :class:`~prealign.loaders.loader.PackedLoader` plans it as a mixture.
``docs/mixtures.md`` has the semantics side by side with Megatron's, Energon's, MosaicML's and HF's.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from prealign.loaders.errors import BadSampleError, IndexFileError, ResumeError
from prealign.loaders.index.build import build_index
from prealign.loaders.index.sample_index import SampleIndex
from prealign.loaders.plan.elastic import Segment, rest_of_epoch
from prealign.loaders.plan.mixing import LENGTHS, MixSpec, StreamMix, mixed_order
from prealign.loaders.plan.schedule import Schedule, epoch_order
from prealign.loaders.policy import BadDataPolicy, BadDataReport
from prealign.loaders.sources.source import Location, Source
from prealign.loaders.sources.webdataset import WebDatasetSource
from prealign.schemas.errors import ConfigError, SampleError
from prealign.schemas.schema import BatchSchema

SCAN_WIDTH = 4
"""Location ints of a component sample when the mixture is scanned as one source
(``build_index(mixture)``; a loader indexes each component on its own): every location is padded to
``(component, width, *4 ints)``."""


@dataclass(frozen=True)
class Component:
    """One dataset of a mixture: its ``source`` (with its own transform) and either a ``weight`` (a
    share of the epoch's tokens or samples) or ``repeat`` (exact passes per epoch, Energon's
    ``blend_epochized``; ``0.5``: a deterministic half, another each epoch). ``policy``: its own
    bad-data policy (default: the loader's). ``index``: a prebuilt :class:`SampleIndex` (or its
    path) of this source."""

    source: Source
    weight: float | None = None
    repeat: float | None = None
    policy: BadDataPolicy | None = None
    index: SampleIndex | str | os.PathLike | None = None


def _component(name: str, value) -> Component:
    if isinstance(value, Component):
        comp = value
    elif isinstance(value, tuple) and len(value) == 2:
        comp = Component(value[0], weight=value[1])
    elif isinstance(value, Source):
        comp = Component(value, weight=1.0)
    else:
        raise ConfigError(
            f"mixture component {name!r}: expected (source, weight), a Component or a Source, got "
            f"{type(value).__name__}"
        )
    if not isinstance(comp.source, Source):
        raise ConfigError(
            f"mixture component {name!r}: expected a Source, got {type(comp.source).__name__}"
        )
    for field, value, kinds, want in (
        ("policy", comp.policy, (BadDataPolicy,), "a BadDataPolicy"),
        ("index", comp.index, (SampleIndex, str, os.PathLike), "a SampleIndex, its path"),
    ):
        if value is not None and not isinstance(value, kinds):
            raise ConfigError(
                f"mixture component {name!r}: {field}: expected {want} or None, got "
                f"{type(value).__name__}"
            )
    if isinstance(comp.source, Mixture):
        raise ConfigError(
            f"mixture component {name!r}: a Mixture inside a Mixture; list its components instead"
        )
    return comp


class Mixture(Source):
    """Named components mixed by weight (see the module docstring and ``docs/mixtures.md``).

    ``by``: ``"tokens"`` (weights are shares of the epoch's tokens) or ``"samples"``. ``length``:
    the epoch's tokens (or samples) of the weighted components, or ``"total"`` (their sizes summed:
    each seen once on average, at its weight), ``"all_exhausted"`` (every one seen whole at least
    once), ``"first_exhausted"`` (none repeated). ``pack_within_component``: every micro-batch holds
    samples of one component only. ``on_component_change``: a state saved with other component names
    is a :class:`~prealign.loaders.errors.ResumeError` (``"error"``), or resumes at the start of the
    next epoch (``"next_epoch"``). Changed weights (same names) always resume: what was served stays
    served and the rest of the epoch follows the new weights.
    """

    sequential = False

    def __init__(
        self,
        components: dict,
        *,
        by: str = "tokens",
        length: int | str = "total",
        pack_within_component: bool = False,
        on_component_change: str = "error",
    ):
        if not isinstance(components, dict) or not components:
            raise ConfigError(
                f"components: expected a non-empty dict name -> (source, weight), got "
                f"{components!r}"
            )
        self.components = {str(k): _component(str(k), v) for k, v in components.items()}
        if len(self.components) != len(components):  # 1 and "1": one name, a component lost
            raise ConfigError(
                f"components: expected distinct names, got {list(components)!r:.200} (names "
                f"are compared as str)"
            )
        self.spec = MixSpec(
            names=tuple(self.components),
            weights=tuple(c.weight for c in self.components.values()),
            repeats=tuple(c.repeat for c in self.components.values()),
            by=by,
            length=length,
        )
        if not isinstance(pack_within_component, bool):
            raise ConfigError(
                f"pack_within_component: expected a bool, got {pack_within_component!r}"
            )
        if on_component_change not in ("error", "next_epoch"):
            raise ConfigError(
                f"on_component_change: expected 'error' or 'next_epoch', got "
                f"{on_component_change!r}"
            )
        self.pack_within_component, self.on_component_change = (
            pack_within_component,
            on_component_change,
        )
        self._sources = [c.source for c in self.components.values()]
        self._shard_starts = None
        self.parts: list[SampleIndex] | None = None
        """Each component's index (set by :meth:`build_index`)."""

    names = property(lambda self: self.spec.names)

    # ---- Source
    # ------------------------------------------------------------------------------------
    @property
    def num_shards(self) -> int:
        return sum(s.num_shards for s in self._sources)

    def _starts(self) -> np.ndarray:
        """int64 ``[C + 1]``: the mixture shard each component's first shard is (made once)."""
        if self._shard_starts is None:
            self._shard_starts = np.cumsum([0] + [s.num_shards for s in self._sources])
        return self._shard_starts

    def _shard(self, shard: int) -> tuple[int, int]:
        starts = self._starts()
        c = int(np.searchsorted(starts, shard, side="right") - 1)
        return c, shard - int(starts[c])

    def scan(self, shard: int):
        c, local = self._shard(shard)
        for loc, raw in self._sources[c].scan(local):
            if loc is not None and len(loc) > SCAN_WIDTH:
                raise ConfigError(
                    f"mixture component {self.names[c]!r}: locations of {len(loc)} ints; a mixture "
                    f"scanned as one source holds at most {SCAN_WIDTH}"
                )
            yield _wrapped(c, loc), raw

    def scan_after(self, shard: int, ordinal: int, location: Location, *, seek=None):
        """The component's :meth:`~prealign.loaders.sources.source.Source.scan_after` (a
        webdataset's reads the members before ``location`` without decoding them; ``seek``: a
        consumed sample's location, where it opens the shard), locations wrapped as :meth:`scan`'s.
        """
        c, local = self._shard(shard)
        source, loc = self._split(location)
        seeks = seek is not None and isinstance(source, WebDatasetSource)
        kw = {"seek": self._split(seek)[1]} if seeks else {}
        for loc, raw in source.scan_after(local, ordinal, loc, **kw):
            yield _wrapped(c, loc), raw

    def _split(self, location: Location) -> tuple[Source, Location]:
        c, width = int(location[0]), int(location[1])
        return self._sources[c], tuple(int(x) for x in location[2 : 2 + width])

    def check_locations(self, locations) -> None:
        """Rows ``(component, width, *its location, 0...)``: a component in range, each component's
        rows of one width and its source's (its own ``check_locations``)."""
        locs = np.asarray(locations)
        if locs.ndim != 2 or locs.shape[1] < 3:
            raise IndexFileError(
                f"mixture locations: expected [N, 2 + a component's width], got {list(locs.shape)}"
            )
        comp, width = locs[:, 0], locs[:, 1]
        if len(locs) and not (
            0 <= comp.min()
            and comp.max() < len(self._sources)
            and 1 <= width.min()
            and width.max() <= locs.shape[1] - 2
        ):
            raise IndexFileError(
                f"mixture locations: components in [{comp.min()}, {comp.max()}] of widths in "
                f"[{width.min()}, {width.max()}]; expected components in [0, "
                f"{len(self._sources)}) of widths in [1, {locs.shape[1] - 2}]"
            )
        for c in np.unique(comp).tolist():
            rows = locs[comp == c]
            w = int(rows[0, 1])
            try:
                if (rows[:, 1] != w).any():
                    raise IndexFileError(f"locations of widths {sorted(set(rows[:, 1].tolist()))}")
                self._sources[c].check_locations(rows[:, 2 : 2 + w])
            except IndexFileError as exc:
                raise IndexFileError(f"mixture component {self.names[c]!r}: {exc}") from None

    def shard_of(self, location: Location) -> int | None:
        """The mixture shard a (checked) location lies in where its component's locations name
        their shard (:meth:`~prealign.loaders.sources.source.Source.shard_of`), else None."""
        source, loc = self._split(location)
        shard = source.shard_of(loc)
        return None if shard is None else int(self._starts()[int(location[0])]) + shard

    def read(self, location: Location) -> dict:
        source, loc = self._split(location)
        return source.read(loc)

    def apply_transform(self, raw: dict, location: Location) -> dict:
        source, loc = self._split(location)
        return source.apply_transform(raw, loc)

    def where(self, location: Location) -> str:
        source, loc = self._split(location)
        return f"{self.names[int(location[0])]}:{source.where(loc)}"

    def describe(self) -> dict:
        return {
            "kind": "mixture",
            "by": self.spec.by,
            "length": self.spec.length,
            "components": {n: s.describe() for n, s in zip(self.names, self._sources)},
        }

    # ---- streams (StreamingPackedLoader)
    # -----------------------------------------------------------
    def shards_by_component(self, order: Sequence[int]) -> list[list[int]]:
        """The shard ids of ``order`` (a permutation of the mixture's shards) split by component, in
        order."""
        starts = np.cumsum([0] + [s.num_shards for s in self._sources])
        comp = np.searchsorted(starts, np.asarray(order, np.int64), side="right") - 1
        return [[int(s) for s, k in zip(order, comp) if k == c] for c in range(len(self._sources))]

    def stream_mix(self, state: dict | None = None) -> StreamMix:
        """The interleave of the components' streams in a reader (:class:`~prealign.loaders.plan.
        mixing.StreamMix`): by weight (a ``repeat=`` component's repeat as its weight), in units of
        :attr:`spec` ``by``; from ``state`` (a cursor's) when given. Every item is read once (the
        epoch is every sample once: streams' sizes are not known, so a ``length`` other than
        ``"total"`` or a ``repeat`` other than 1 is refused,
        :func:`~prealign.loaders.streaming.check_streamed_mixture`)."""
        weights = [w if w is not None else r for w, r in zip(self.spec.weights, self.spec.repeats)]
        return StreamMix(weights, self.spec.by, state)

    # ---- the index
    # ---------------------------------------------------------------------------------
    def build_index(
        self,
        schema: BatchSchema,
        *,
        policy: BadDataPolicy | None = None,
        num_workers: int = 0,
        distributed: bool = False,
        group=None,
    ) -> SampleIndex:
        """Each component's index (its own policy, or ``policy``), merged; sets :attr:`parts`. A
        component whose samples do not fit ``schema``, or that is empty or all bad, raises naming
        the component."""
        parts = []
        for name, comp in self.components.items():
            try:
                if comp.index is not None:
                    part = (
                        comp.index
                        if isinstance(comp.index, SampleIndex)
                        else SampleIndex.load(os.fspath(comp.index))
                    )
                else:
                    part = build_index(
                        comp.source,
                        schema,
                        policy=comp.policy or policy,
                        num_workers=num_workers,
                        distributed=distributed,
                        group=group,
                    )
            except SampleError as exc:
                raise _named(exc, name) from exc
            if len(part) == 0:
                raise BadSampleError(
                    sample=None,
                    field=None,
                    expected=f"at least one good sample in mixture component {name!r}",
                    actual=f"none ({part.report.to_dict()['counts']})",
                )
            parts.append(part)
        return self.merged(parts)

    def merged(self, parts: Sequence[SampleIndex]) -> SampleIndex:
        """One index of the components' ``parts`` (global ids in component order); sets
        :attr:`parts`."""
        if len(parts) != len(self.names):
            raise ConfigError(f"mixture: {len(parts)} indexes for {len(self.names)} components")
        dims: dict = {}
        for name, part in zip(self.names, parts):
            for key, size in (part.dims or {}).items():
                if dims.setdefault(key, (size, name))[0] != size:
                    raise ConfigError(
                        f"mixture component {name!r}: field dim {key}={size}, component "
                        f"{dims[key][1]!r} has {key}={dims[key][0]}; one batch cannot hold both"
                    )
        width = 2 + max(p.locations.shape[1] for p in parts)
        locs = np.zeros((sum(len(p) for p in parts), width), np.int64)  # filled in place
        shards, report, shard0, at = [], BadDataReport(), 0, 0
        for c, (name, part) in enumerate(zip(self.names, parts)):
            n, w = len(part), part.locations.shape[1]
            loc = locs[at : at + n]
            loc[:, 0], loc[:, 1], loc[:, 2 : 2 + w] = c, w, part.locations
            at += n
            shards.append(np.asarray(part.shards, np.int64) + shard0)
            shard0 += self._sources[c].num_shards
            for reason, count in part.report.counts.items():
                report.counts[reason] = report.counts.get(reason, 0) + count
            report.examples.extend(
                dataclasses.replace(e, where=f"{name}:{e.where}") for e in part.report.examples
            )
        media = (
            None
            if any(p.media is None for p in parts)
            else np.concatenate([p.media for p in parts])
        )
        self.parts = list(parts)
        return SampleIndex(
            lengths=np.concatenate([p.lengths for p in parts]).astype(np.int64, copy=False),
            locations=locs,
            shards=np.concatenate(shards),
            report=report,
            media=media,
            dims={k: v[0] for k, v in dims.items()} or None,
        )

    def adopt(self, index: SampleIndex) -> SampleIndex:
        """Set :attr:`parts` from ``index``, a merged index of this mixture built elsewhere
        (``build_index`` of the mixture as one source, or a saved one): its rows must be in
        component order."""
        if self.parts is not None and sum(len(p) for p in self.parts) == len(index):
            return index
        comp = np.asarray(index.locations[:, 0]) if len(index) else np.zeros(0, np.int64)
        if np.any(np.diff(comp) < 0) or (
            comp.size and not 0 <= comp.min() <= comp.max() < len(self.names)
        ):
            raise ConfigError(
                "mixture: the index given is not one of this mixture's (rows not in component "
                "order)"
            )
        bounds = np.searchsorted(comp, np.arange(len(self.names) + 1))
        parts, shard0 = [], 0
        for c, name in enumerate(self.names):
            lo, hi = int(bounds[c]), int(bounds[c + 1])
            if lo == hi:
                raise BadSampleError(
                    sample=None,
                    field=None,
                    expected=f"at least one good sample in mixture component {name!r}",
                    actual="none in the index",
                )
            w = int(index.locations[lo, 1])
            parts.append(
                SampleIndex(
                    lengths=index.lengths[lo:hi],
                    locations=index.locations[lo:hi, 2 : 2 + w],
                    shards=np.asarray(index.shards[lo:hi]) - shard0,
                    report=BadDataReport(),
                    media=None if index.media is None else index.media[lo:hi],
                    dims=index.dims,
                )
            )
            shard0 += self._sources[c].num_shards
        self.parts = parts
        return index

    def component_of(self) -> np.ndarray:
        """int64 ``[N]``: the component of each global sample id (after :meth:`build_index`)."""
        return np.repeat(
            np.arange(len(self.parts), dtype=np.int64), [len(p) for p in self._checked_parts()]
        )

    def _checked_parts(self) -> list[SampleIndex]:
        if self.parts is None:
            raise ConfigError("mixture: build_index (or a loader's prepare) first")
        return self.parts

    # ---- accounting
    # --------------------------------------------------------------------------------
    def accounting(self, planned: np.ndarray, served: np.ndarray) -> dict:
        """Per component: samples and tokens ``planned`` and ``served`` (int64 global ids, repeats
        counted), the realized share (of tokens or samples, as :attr:`spec` ``by``) against the
        weight, and the bad samples of its index pass with their reasons. JSON-friendly."""
        parts = self._checked_parts()
        comp_of = self.component_of()
        lengths = np.concatenate([p.lengths for p in parts]).astype(np.int64)
        out, C = {}, len(parts)
        sums = {}
        for what, ids in (
            ("planned", np.asarray(planned, np.int64)),
            ("served", np.asarray(served, np.int64)),
        ):
            comp = comp_of[ids]
            sums[what] = (
                np.bincount(comp, minlength=C),
                np.bincount(comp, weights=lengths[ids], minlength=C),
            )
        units = 1 if self.spec.by == "tokens" else 0
        shares = self.spec.shares
        for c, name in enumerate(self.names):
            entry = {
                "weight": self.spec.weights[c],
                "repeat": self.spec.repeats[c],
                "weight_share": float(shares[c]) if self.spec.repeats[c] is None else None,
            }
            for what, (n, tok) in sums.items():
                total = (tok if units else n).sum()
                entry[f"samples_{what}"] = int(n[c])
                entry[f"tokens_{what}"] = int(tok[c])
                entry[f"share_{what}"] = float((tok if units else n)[c] / total) if total else 0.0
            rep = parts[c].report
            entry["bad"] = dict(rep.counts)
            entry["bad_examples"] = [e.to_json() for e in rep.examples]
            out[name] = entry
        return out

    # ---- the epoch order
    # ---------------------------------------------------------------------------
    def epoch_order(
        self,
        epoch: int,
        *,
        seed: int,
        shuffle: bool,
        window: int,
        served: Callable[[np.ndarray, Segment], np.ndarray],
        phases: Sequence[tuple[MixSpec, Sequence[Segment]]] = (),
    ) -> np.ndarray:
        """Global sample ids of ``epoch`` in mixed order
        (:func:`~prealign.loaders.plan.mixing.mixed_order`). ``phases``: earlier parts of this epoch
        served under other weights, each ``(spec, its segments)``; ``served(order, segment)`` gives
        the positions of ``order`` a segment served (the loader's planner).
        What they served is left out and the rest of the epoch follows :attr:`spec`."""
        parts = self._checked_parts()
        lengths = [np.asarray(p.lengths) for p in parts]
        orders = [self._pass_order(c, epoch, seed, shuffle, window) for c in range(len(parts))]
        done = [np.zeros(0, np.int64) for _ in parts]
        for spec, segments in phases:
            mo = mixed_order(
                spec, lengths, epoch=epoch, seed=seed, shuffle=shuffle, orders=orders, served=done
            )
            keep = rest_of_epoch(
                np.arange(mo.ids.size), segments, lambda pos, seg: served(mo.ids[pos], seg)
            )
            gone = np.ones(mo.ids.size, bool)
            gone[keep] = False
            done = [
                np.concatenate([done[c], mo.draw[gone & (mo.component == c)]])
                for c in range(len(parts))
            ]
        return mixed_order(
            self.spec, lengths, epoch=epoch, seed=seed, shuffle=shuffle, orders=orders, served=done
        ).ids

    def _pass_order(self, c: int, epoch: int, seed: int, shuffle: bool, window: int):
        """Pass ``p``'s order of component ``c``: a sequential source (tar shards, a stream) in
        shuffled shards and a bounded window (reads stay near-sequential); any other, ``None`` (a
        seeded permutation)."""
        if not (shuffle and self._sources[c].sequential):
            return None
        part = self.parts[c]
        return lambda p: epoch_order(
            part,
            epoch=epoch,
            seed=(seed * 1000003 + c * 7919 + p) % (1 << 62),
            shuffle=True,
            sequential=True,
            window=window,
        )

    # ---- state
    # -------------------------------------------------------------------------------------
    def resume_phases(
        self, saved, *, segments: Sequence[Segment], own: Segment
    ) -> tuple[str, tuple]:
        """How a state whose ``"mixture"`` entry is ``saved`` resumes here: ``("same", its phases)``
        when its weights are this mixture's; ``("changed", phases)`` with the saved run's part of
        the epoch (its earlier ``segments`` and its ``own`` segment) closed as one more phase under
        its weights; ``("next_epoch", ())`` for other component names under
        ``on_component_change="next_epoch"``, else :class:`ResumeError`."""
        if not isinstance(saved, dict) or not isinstance(saved.get("spec"), dict):
            raise ResumeError(
                "loader state: key 'mixture': missing; the state was not saved by a loader over a "
                "Mixture"
            )
        spec = _spec_of(saved["spec"], "mixture.spec")
        if spec.names != self.names:
            if self.on_component_change == "next_epoch":
                return "next_epoch", ()
            added = [n for n in self.names if n not in spec.names]
            removed = [n for n in spec.names if n not in self.names]
            raise ResumeError(
                f"loader state: key mixture.spec.names: the saved run mixed {list(spec.names)}, "
                f"this "
                f"one {list(self.names)} (added {added}, removed {removed}); what the epoch served "
                f"cannot be replayed over other components. Pass Mixture(..., "
                f"on_component_change='next_epoch') to start the next epoch with the new mixture"
            )
        phases = self.phases_of(saved)
        if spec == self.spec:
            return "same", phases
        if own.position == 0 and not segments:
            return "changed", phases
        return "changed", (*phases, (spec, (*segments, own)))

    def state_of(self, phases) -> dict:
        """The ``"mixture"`` entry of a loader state: this spec and the epoch's earlier phases,
        O(components)."""
        return {
            "spec": self.spec.to_dict(),
            "phases": [
                {"spec": s.to_dict(), "segments": [g.to_dict() for g in segs]} for s, segs in phases
            ],
        }

    def phases_of(self, saved: dict) -> tuple:
        """The phases of a state's ``"mixture"`` entry (checked)."""
        out, phases = [], saved.get("phases", [])
        if not isinstance(phases, list):
            raise ResumeError(
                f"loader state: key mixture.phases: expected a list of {{spec, segments}}, got "
                f"{str(phases)[:200]} ({type(phases).__name__})"
            )
        for i, ph in enumerate(phases):
            if not isinstance(ph, dict) or not isinstance(ph.get("segments"), list):
                raise ResumeError(
                    f"loader state: key mixture.phases[{i}]: expected {{spec, segments}}, got "
                    f"{ph!r}"
                )
            out.append(
                (
                    _spec_of(ph.get("spec"), f"mixture.phases[{i}].spec"),
                    tuple(
                        Segment.from_dict(s, f"mixture.phases[{i}].segments[{j}]")
                        for j, s in enumerate(ph["segments"])
                    ),
                )
            )
        return tuple(out)

    # ---- the declarative file
    # ----------------------------------------------------------------------
    @classmethod
    def from_file(cls, path: str, *, tokenizer=None) -> "Mixture":
        """A mixture from a JSON file (pyyaml is not a dependency)::

            {"by": "tokens", "length": "total",
             "components": {"web": {"path": "web/shard-{000..009}.tar", "weight": 0.6},
                            "chat": {"hf": "chat.arrow", "transform": "text", "weight": 0.3},
                            "video": {"path": "video/", "transform": "vlm_config/", "repeat": 2}}}

        ``path``: webdataset shards (a brace pattern, a folder of ``.tar`` or a file); ``hf``: a
        dataset saved by ``save_to_disk`` (a folder) or an ``.arrow`` / ``.parquet`` / ``.jsonl``
        file. ``transform``: none (the samples hold ``input_ids``), ``"text"`` (tokenise a ``text``
        field with ``tokenizer``) or a model config folder (its ``config.json``, processor configs
        and tokenizer: a :class:`~prealign.loaders.media.vlm.VLMSampleTransform`). Relative paths
        resolve against the file's folder."""
        from prealign.loaders.mixture_file import load_mixture_file

        return load_mixture_file(cls, Component, path, tokenizer=tokenizer)


def steps_served(schedule: Schedule, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    """(int64 sample ids in serving order, int64 ``[S + 1]`` bounds of each global step in them):
    every DP rank's micro-batches of each step of ``epoch``, step by step (for shares per step or
    per window of steps, :func:`~prealign.loaders.plan.mixing.window_shares`)."""
    ids, bounds, pos = [], [0], 0
    reqs = [list(schedule(epoch, r)) for r in range(schedule.dp_size)]
    for k in schedule.plan(epoch)[1].steps:
        for rank in reqs:
            for q in rank[pos : pos + k]:
                ids.extend(q.indices)
        pos += k
        bounds.append(len(ids))
    return np.asarray(ids, np.int64), np.asarray(bounds, np.int64)


def _wrapped(c: int, loc: Location | None) -> Location | None:
    """A component ``c``'s location as the mixture's: ``(c, width, *loc, 0...)``."""
    return None if loc is None else (c, len(loc), *loc, *(0,) * (SCAN_WIDTH - len(loc)))


def _spec_of(data, where: str) -> MixSpec:
    if not isinstance(data, dict) or set(data) != {"names", "weights", "repeats", "by", "length"}:
        raise ResumeError(
            f"loader state: key {where}: expected names, weights, repeats, by, length; got "
            f"{str(data)[:200]}"
        )
    try:
        length = data["length"] if data["length"] in LENGTHS else int(data["length"])
        return MixSpec(
            names=tuple(data["names"]),
            weights=tuple(data["weights"]),
            repeats=tuple(data["repeats"]),
            by=data["by"],
            length=length,
        )
    except (ConfigError, TypeError, ValueError) as exc:
        raise ResumeError(f"loader state: key {where}: {exc}") from None


def _named(exc: SampleError, name: str) -> SampleError:
    """``exc`` (same type and fields) with its message prefixed by the mixture component's name."""
    out = type(exc).__new__(type(exc))
    out.__dict__.update(exc.__dict__)
    out.args = (f"mixture component {name!r}: {exc}", *exc.args[1:])
    return out
