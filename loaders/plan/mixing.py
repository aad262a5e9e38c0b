"""A mixture's epoch order: how many draws of each component, and in which interleave (pure,
seeded).

Each component ``c`` has a *stream* for the epoch: whole passes over its samples, each pass in a
seeded order of its own (:func:`component_stream`). The epoch takes the first ``n_c`` draws of each
stream (:func:`draw_counts`: ``n_c`` below one pass is a deterministic subset, different each epoch;
above it, whole reshuffled passes then part of one), and interleaves them by *virtual finish time*
(:func:`interleave`): draw ``i`` of component ``c`` is placed at ``(U_c[i] - u_i / 2) / s_c``, with
``U_c`` the cumulative units (tokens, or 1 per sample) of ``c``'s draws and ``s_c`` its share of the
epoch's units. Sorting every draw by that time keeps each component's share of any stretch of the
order within about one draw of its weight (weighted fair queueing), so a 5% component arrives every
20th unit, not in bursts. Everything is numpy over whole arrays: no loop per sample.

>>> mix = MixSpec(names=("a", "b"), weights=(0.75, 0.25), by="samples")
>>> lengths = [np.ones(6, np.int64), np.ones(2, np.int64)]
>>> drawn = mixed_order(mix, lengths, epoch=0, seed=0, shuffle=False)
>>> drawn.component.tolist()
[0, 0, 1, 0, 0, 0, 1, 0]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from prealign.loaders.errors import PlanError

LENGTHS = ("total", "all_exhausted", "first_exhausted")
"""Epoch lengths derived from the components (the weighted ones; ``repeat=`` components add their
counts): ``total``: the weighted components' size summed (each seen once on average, at its weight:
MosaicML's ``proportion``); ``all_exhausted``: the smallest epoch in which every weighted component
is seen whole at least once (HF ``interleave_datasets(stopping_strategy="all_exhausted")``);
``first_exhausted``: the largest in which none is repeated (HF's default)."""


_FLOAT_MAX = float(np.finfo(np.float64).max)


@dataclass(frozen=True)
class MixSpec:
    """The mixture's semantics, pure data (JSON via :meth:`to_dict`).

    ``weights[c]``: the component's share of the epoch's units, ``None`` for a ``repeat=``
    component; ``repeats[c]``: passes over the component per epoch (``1.5``: one and a half;
    ``None``: weighted); ``by``: ``"tokens"`` or ``"samples"``; ``length``: the epoch's units
    (tokens or samples) of the weighted components, or one of :data:`LENGTHS`.
    """

    names: tuple[str, ...]
    weights: tuple[float | None, ...]
    repeats: tuple[float | None, ...] = ()
    by: str = "tokens"
    length: int | str = "total"

    def __post_init__(self):
        n = len(self.names)
        if not self.repeats:
            object.__setattr__(self, "repeats", (None,) * n)
        if len(self.weights) != n or len(self.repeats) != n:
            raise PlanError(
                f"mixture: {n} names, {len(self.weights)} weights, {len(self.repeats)} repeats"
            )
        if self.by not in ("tokens", "samples"):
            raise PlanError(f"mixture by: expected 'tokens' or 'samples', got {self.by!r}")
        length = self.length
        if isinstance(length, bool) or not (
            length in LENGTHS or (isinstance(length, (int, np.integer)) and length > 0)
        ):
            raise PlanError(
                f"mixture length: expected an int > 0 ({self.by}) or one of {LENGTHS}, got "
                f"{length!r}"
            )
        for name, w, r in zip(self.names, self.weights, self.repeats):
            if (w is None) == (r is None):
                raise PlanError(
                    f"mixture component {name!r}: give a weight or a repeat, not "
                    f"{'both' if w is not None else 'neither'}"
                )
            value, what = (w, "weight") if r is None else (r, "repeat")
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not 0 < value < float("inf")
                or value > _FLOAT_MAX  # (an int past float64: no share can be made of it)
            ):
                raise PlanError(
                    f"mixture component {name!r}: {what} must be a finite number > 0, got "
                    f"{value!r:.80}"
                )
        if len(set(self.names)) != n or not n:
            raise PlanError(f"mixture: expected distinct component names, got {list(self.names)}")
        total = sum(float(w) for w in self.weights if w is not None)
        if not total < float("inf"):  # each finite, their sum not: every share would be 0
            raise PlanError(
                f"mixture weights: expected a finite sum (they are normalised by it), got "
                f"{total} from {list(self.weights)}; scale them down"
            )

    @property
    def shares(self) -> np.ndarray:
        """float64 ``[C]``: the weights normalised over the weighted components (0 for ``repeat=``
        ones)."""
        w = np.array([0.0 if x is None else float(x) for x in self.weights])
        return w / w.sum() if w.sum() > 0 else w

    def to_dict(self) -> dict:
        return {
            "names": list(self.names),
            "weights": list(self.weights),
            "repeats": list(self.repeats),
            "by": self.by,
            "length": self.length,
        }


MAX_EPOCH_DRAWS = 1 << 31
"""Draws the components of a mixture may make in one epoch, together: its plan holds int64 ids,
components and draws for each (48 GiB at the bound); a weight, ``length`` or ``repeat`` asking for
more is a :class:`PlanError` before any pass is built."""


def units_of(lengths: np.ndarray, by: str) -> np.ndarray:
    """int64 units of each sample: its tokens, or 1 (``by="samples"``)."""
    return lengths.astype(np.int64) if by == "tokens" else np.ones(lengths.shape[0], np.int64)


def component_stream(
    n: int,
    count: int,
    *,
    seed: int,
    epoch: int,
    component: int,
    shuffle: bool,
    order: Callable[[int], np.ndarray] | None = None,
) -> np.ndarray:
    """int64 ``[count]``: the local sample ids of a component's first ``count`` draws of ``epoch``:
    whole passes over its ``n`` samples, pass ``p`` in the order ``order(p)`` (default: a seeded
    permutation of its own, or ``arange(n)`` without ``shuffle``).

    >>> component_stream(3, 7, seed=0, epoch=0, component=0, shuffle=False).tolist()
    [0, 1, 2, 0, 1, 2, 0]
    """
    passes = -(-count // n) if n else 0
    parts = []
    for p in range(passes):
        if order is not None:
            parts.append(np.asarray(order(p), np.int64))
        elif shuffle:
            parts.append(np.random.default_rng([seed, epoch, component, p, 31]).permutation(n))
        else:
            parts.append(np.arange(n, dtype=np.int64))
    if len(parts) == 1:
        return parts[0][:count]
    return (np.concatenate(parts) if parts else np.zeros(0, np.int64))[:count]


def _count_for(units: np.ndarray, target: float, limit: int) -> int:
    """Draws whose units' midpoints fall below ``target`` (the nearest count to it), at most
    ``limit``."""
    if target <= 0 or not units.size:
        return 0
    mid = np.cumsum(units) - units / 2.0
    return int(min(np.searchsorted(mid, target, side="left"), limit))


def epoch_units(mix: MixSpec, sizes: np.ndarray) -> float:
    """The weighted components' units in one epoch, from ``sizes`` float64 ``[C]`` (units of one
    pass)."""
    s = mix.shares
    on = s > 0
    if isinstance(mix.length, str):
        if mix.length == "total":
            return float(sizes[on].sum())
        ratio = sizes[on] / s[on]
        return float(ratio.max() if mix.length == "all_exhausted" else ratio.min())
    return float(mix.length)


@dataclass(frozen=True)
class MixedOrder:
    """One epoch's interleave: ``ids`` int64 ``[M]`` (global sample ids, with repeats when
    up-sampled), ``component`` int64 ``[M]``, ``draw`` int64 ``[M]`` (position of the draw in its
    component's stream)."""

    ids: np.ndarray
    component: np.ndarray
    draw: np.ndarray
    targets: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """float64 ``[C]``: each component's planned units (what the weights asked for)."""


def interleave(units: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(component, draw) int64 ``[M]`` of every draw of ``units[c]`` (int64 units of component
    ``c``'s draws, in stream order), sorted by virtual finish time ``(cumsum - u/2) / share`` (ties
    by component).

    >>> interleave([np.array([1, 1, 1]), np.array([3])])[0].tolist()
    [0, 0, 1, 0]
    """
    perm = _by_finish(units)
    sizes = [u.size for u in units]
    comp = np.repeat(np.arange(len(units), dtype=np.int64), sizes)
    draw = np.concatenate([np.arange(n, dtype=np.int64) for n in sizes]) if units else comp
    return comp[perm], draw[perm]


def _by_finish(units: Sequence[np.ndarray], ones: bool = False) -> np.ndarray:
    """int64 ``[M]``: positions in the concatenation of ``units`` in :func:`interleave`'s order;
    the finish times are written into one float64 ``[M]`` in place (no per-component arrays).
    ``ones``: every unit is 1 (``by="samples"``), so each half unit is the scalar 0.5."""
    total = float(sum(int(u.sum()) for u in units))
    tags, at = np.empty(sum(u.size for u in units)), 0
    for u in units:
        if u.size:
            tag = tags[at : at + u.size]
            np.cumsum(u, dtype=np.float64, out=tag)  # exact: integer sums below 2**53
            tag -= 0.5 if ones else u / 2.0
            tag /= float(u.sum()) / total
            at += u.size
    return np.argsort(tags, kind="stable")  # timsort merges the C sorted runs; ties keep
    # component order


def _passes(targets: np.ndarray, sizes: np.ndarray, counts: list[int]) -> np.ndarray:
    """float64 ``[C]``: the whole passes of ``counts[c]`` samples (``sizes[c]`` units per pass) that
    reach ``targets[c]`` units (0 for an empty component; not finite where a pass holds no units,
    which :func:`_check_draws` refuses)."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        return np.where(np.asarray(counts) > 0, np.ceil(targets / sizes), 0.0)


def _check_draws(mix: MixSpec, passes: np.ndarray, counts: list[int]) -> None:
    """Each component's draws (``passes[c]`` whole passes of ``counts[c]`` samples,
    :func:`_passes`) sum to at most :data:`MAX_EPOCH_DRAWS`, before any pass is built."""
    draws = passes * np.asarray(counts, np.float64)
    if not np.isfinite(draws).all() or draws.sum() > MAX_EPOCH_DRAWS:
        c = int(np.argmax(np.where(np.isfinite(draws), draws, np.inf)))
        asked = (
            f"weight {mix.weights[c]} (shares {mix.shares.round(6).tolist()}, length "
            f"{mix.length!r})"
            if mix.repeats[c] is None
            else f"repeat {mix.repeats[c]}"
        )
        raise PlanError(
            f"mixture component {mix.names[c]!r}: {asked} asks for {draws[c]:.3g} draws of its "
            f"{counts[c]} samples in one epoch; expected at most {MAX_EPOCH_DRAWS:,} draws an "
            f"epoch (raise the smallest weight, lower the repeat or the length)"
        )


def mixed_order(
    mix: MixSpec,
    lengths: Sequence[np.ndarray],
    *,
    epoch: int,
    seed: int,
    shuffle: bool,
    orders: Sequence[Callable[[int], np.ndarray] | None] | None = None,
    served: Sequence[np.ndarray] | None = None,
) -> MixedOrder:
    """The epoch's :class:`MixedOrder` of components with token ``lengths[c]`` (int64 ``[N_c]``,
    index order), global ids offset by the components before. ``orders[c](p)``: pass ``p``'s order
    of component ``c`` (default: :func:`component_stream`'s). ``served[c]``: draws (stream
    positions) of ``c`` already served in this epoch under earlier weights: left out of the stream,
    and their units out of the epoch's, so the rest
    of the epoch follows ``mix``'s weights."""
    C = len(lengths)
    sizes = np.array(
        [
            float(len(x)) if mix.by == "samples" else float(units_of(np.asarray(x), mix.by).sum())
            for x in lengths
        ]
    )
    served = [
        np.zeros(0, np.int64) if served is None else np.asarray(served[c], np.int64)
        for c in range(C)
    ]
    offsets = np.concatenate([[0], np.cumsum([len(x) for x in lengths])]).astype(np.int64)
    shares = mix.shares
    done = np.zeros(C)  # units already served under earlier weights, per component
    for c in range(C):
        if served[c].size:
            head = component_stream(
                len(lengths[c]),
                int(served[c].max()) + 1,
                seed=seed,
                epoch=epoch,
                component=c,
                shuffle=shuffle,
                order=None if orders is None else orders[c],
            )
            done[c] = float(units_of(np.asarray(lengths[c])[head[served[c]]], mix.by).sum())
    weighted = np.array([r is None for r in mix.repeats])
    rest = max(epoch_units(mix, sizes) - float(done[weighted].sum()), 0.0)
    targets = np.array(
        [
            max(float(mix.repeats[c]) * sizes[c] - done[c], 0.0)
            if mix.repeats[c] is not None
            else float(shares[c]) * rest
            for c in range(C)
        ]
    )
    counts = [len(x) for x in lengths]
    passes = _passes(targets, sizes, counts)  # (no draw of the next pass reaches the target)
    _check_draws(mix, passes, counts)
    ids, units, draws = [], [], []
    for c in range(C):
        n, L = counts[c], np.asarray(lengths[c])
        want = targets[c]
        count = int(passes[c]) * n + (int(served[c].max()) + 1 if served[c].size else 0)
        stream = (
            component_stream(
                n,
                count,
                seed=seed,
                epoch=epoch,
                component=c,
                shuffle=shuffle,
                order=None if orders is None else orders[c],
            )
            if n
            else np.zeros(0, np.int64)
        )
        if served[c].size:
            keep = np.ones(stream.size, bool)
            keep[served[c][served[c] < stream.size]] = False
            pos = np.flatnonzero(keep)
        else:
            pos = np.arange(stream.size, dtype=np.int64)
        if (
            mix.by == "samples"
        ):  # (every unit 1: the count is the target rounded, no cumulative sum)
            k = min(int(np.ceil(want - 0.5)) if want > 0 else 0, pos.size)
            u = np.ones(k, np.int64)
        else:
            u = units_of(L[stream[pos]], mix.by)
            k = _count_for(u, want, u.size)
        ids.append(offsets[c] + (stream[pos[:k]] if served[c].size else stream[:k]))
        units.append(u[:k])
        draws.append(pos[:k])
    # positions in the concatenation of the components' draws, in the interleave's order
    at = _by_finish(units, ones=mix.by == "samples")
    comp = np.repeat(np.arange(C, dtype=np.int64), [u.size for u in units])
    return MixedOrder(
        ids=np.concatenate(ids)[at],
        component=comp[at],
        draw=np.concatenate(draws)[at],
        targets=targets,
    )


def window_shares(
    component: np.ndarray,
    units: np.ndarray,
    starts: np.ndarray,
    ends: np.ndarray,
    num_components: int,
) -> np.ndarray:
    """float64 ``[W, C]``: each component's share of the units in each window ``starts[w]:ends[w]``
    of a served sequence (``component``, ``units`` int64 ``[M]``), from one cumulative sum (windows
    may overlap).

    >>> components, lengths = np.array([0, 1, 1, 0]), np.array([3, 1, 1, 1])
    >>> window_shares(components, lengths, np.array([0, 1]), np.array([2, 4]), 2).tolist()
    [[0.75, 0.25], [0.3333333333333333, 0.6666666666666666]]
    """
    onehot = np.zeros((component.size + 1, num_components))
    onehot[np.arange(1, component.size + 1), component] = units
    cum = np.cumsum(onehot, axis=0)
    sums = cum[np.asarray(ends)] - cum[np.asarray(starts)]
    tot = sums.sum(axis=1, keepdims=True)
    return np.divide(sums, tot, out=np.zeros_like(sums), where=tot > 0)


def step_fit(
    sizes: np.ndarray,
    cap: int,
    per_step: int,
    max_items: int | None = None,
    groups: np.ndarray | None = None,
) -> list[list[int]]:
    """Pack a mixed stream step by step, so that each global step holds the next stretch of the
    stream: take samples in stream order until they fill ``per_step`` bins' worth (``per_step *
    cap`` units, the carry of the step before first), place them first-fit decreasing into
    ``per_step`` bins, and carry the ones that do not fit into the next step. A sample is never more
    than a step or two away from its place in the interleave, so each step keeps the mixture's
    shares (the planner's buffered best fit moves samples by many steps). ``groups`` (int ``[N]``,
    e.g. component ids): a bin takes samples of one group only (``pack_within_component``). Returns
    bins of stream positions, ``per_step`` per step (empty ones dropped).

    >>> step_fit(np.array([4, 8, 4, 12, 4, 4]), 16, 2)
    [[3, 0], [1, 2, 4], [5]]
    """
    sizes = np.asarray(sizes, np.int64)
    n, out = int(sizes.size), []
    slist = sizes.tolist()
    glist = None if groups is None else np.asarray(groups).tolist()
    limit = max_items or n + 1
    pos, carry = 0, []
    while pos < n or carry:
        group, total = [], sum(slist[i] for i in carry)
        while pos < n and total < per_step * cap:
            group.append(pos)
            total += slist[pos]
            pos += 1
        group = carry + sorted(
            group, key=lambda i: (-slist[i], i)
        )  # the carried first: none waits twice
        load, items, label = [0] * per_step, [[] for _ in range(per_step)], [None] * per_step
        carry = []
        for i in group:
            g = None if glist is None else glist[i]
            for b in range(per_step):
                if (
                    load[b] + slist[i] <= cap
                    and len(items[b]) < limit
                    and (label[b] is None or label[b] == g)
                ):
                    items[b].append(i)
                    load[b] += slist[i]
                    label[b] = g
                    break
            else:
                carry.append(i)
        carry.sort()
        placed = [b for b in items if b]
        if (
            not placed
        ):  # (cannot happen: every sample fits an empty bin) guard against a loop without progress
            raise PlanError(f"step_fit: no sample of {len(group)} placed (cap {cap})")
        out.extend(placed)
    return out


def split_bins(bins: list[list[int]], n_bins: int) -> list[list[int]]:
    """``bins`` made ``n_bins >= len(bins)`` by moving single items out of the fullest bins (by
    count) into new ones, then empty bins when every bin holds one item: no bin takes an item of
    another, so bins of one group (``pack_within_component``) stay so; every bin is a subset of one
    before, so within capacity.

    >>> split_bins([[0, 1, 2], [3]], 4)
    [[0], [3], [2], [1]]
    """
    out = [list(b) for b in bins]
    while len(out) < n_bins:
        big = max(range(len(out)), key=lambda i: (len(out[i]), -i)) if out else None
        if big is None or len(out[big]) < 2:
            out.append([])
            continue
        out.append([out[big].pop()])
    return out


class StreamMix:
    """Items of streams read forward, interleaved by weight, resumable (a :class:`~prealign.
    loaders.mixture.Mixture` in a streaming loader's reader): the next item is the stream's whose
    virtual time ``(U_c + u/2) / w_c`` is least, ``U_c`` its units so far (samples, or the tokens
    the reader sets in ``units[0]`` once it transformed each item), ``u`` its last item's units. A
    stream that ends leaves the rest. :meth:`state` writes down ``U``, ``u`` and the ended streams
    (O(streams), JSON-friendly); a :class:`StreamMix` built from it, over streams that go on where
    they stood, makes the same choices as the uninterrupted one.

    >>> mix = StreamMix((3.0, 1.0), "samples")
    >>> list(mix(["a", "b", "c", "d"], ["X", "Y"]))
    ['a', 'b', 'X', 'c', 'd', 'Y']
    >>> mix = StreamMix((3.0, 1.0), "samples")
    >>> from itertools import islice
    >>> first = list(islice(mix(["a", "b", "c", "d"], ["X", "Y"]), 3))
    >>> first + list(StreamMix((3.0, 1.0), "samples", mix.state())(["c", "d"], ["Y"]))
    ['a', 'b', 'X', 'c', 'd', 'Y']
    """

    def __init__(self, weights: Sequence[float], by: str, state: dict | None = None):
        n = len(weights)
        self.weights, self.by = tuple(float(w) for w in weights), by
        state = state or {"used": [0.0] * n, "recent": [1.0] * n, "ended": [False] * n}
        self.used = [float(x) for x in state["used"]]
        self.recent = [float(x) for x in state["recent"]]
        self.ended = [bool(x) for x in state["ended"]]
        if not len(self.used) == len(self.recent) == len(self.ended) == n:
            raise PlanError(f"stream mix state: expected {n} streams, got {str(state)[:200]}")
        self.units = [1]
        """``[units of the last item]``: set by the consumer once it knows them (tokens)."""
        self._last: int | None = None

    def __call__(self, *streams):
        live = [None if done else iter(s) for s, done in zip(streams, self.ended)]
        while any(it is not None for it in live):
            c = min(
                (c for c, it in enumerate(live) if it is not None),
                key=lambda c: ((self.used[c] + self.recent[c] / 2) / self.weights[c], c),
            )
            try:
                item = next(live[c])
            except StopIteration:
                live[c], self.ended[c] = None, True
                continue
            self.units[0], self._last = 1, c
            yield item
            self.used, self.recent = self._settled()
            self._last = None

    def _settled(self) -> tuple[list, list]:
        """``(U, u)`` with the last item's units counted."""
        used, recent, c = list(self.used), list(self.recent), self._last
        if c is not None:
            units = 1.0 if self.by == "samples" else float(self.units[0])
            used[c] += units
            recent[c] = units or recent[c]
        return used, recent

    def state(self) -> dict:
        """``{"used": U, "recent": u, "ended": [bool]}`` once the last item is counted."""
        used, recent = self._settled()
        return {"used": used, "recent": recent, "ended": list(self.ended)}
