"""Bin packing under a hard capacity: the strategies the planner chooses from.

Sizes are *aligned* lengths ``A_i = layout.aligned_length(L_i)``; a bin is valid when
``sum(A_i) <= cap`` (the planner derives ``cap`` from the token budget so that the collator's
padded length ``layout.total_length(sum A_i)`` never exceeds the budget).

Streaming best-fit decreasing (``buffer_size = 8``, so at most 4 samples stay in open bins)::

    stream  a b c d e f g h i j ...
    window 1  [a b c d e f g h]  sorted by size, each into the open bin it fills best
              open bins: (b g) (a e f) (c h d)      8 held > 4: close the fullest
              closed -> (c h d) (a e f)             open: (b g)
    window 2  [i j k l m n]  (8 - 2 held)  fill (b g) first if they fit best, ...
    end       the samples of the still-open bins are re-packed together by best-fit decreasing

A bin also closes when it cannot take the smallest sample, after ``max_age`` windows
(which bounds how far apart in the stream two samples of one bin can be), or when it holds
``max_items`` samples (``ParallelLayout.max_seqs``: static ``cu_seqlens`` shapes).
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from itertools import repeat

import numpy as np

_SHIFT = 32  # open bins are kept as ints (rem << _SHIFT | bin_id), sorted: fullest first


class _OpenBins:
    """Open bins ordered by remaining room, then id; O(log n) best fit, O(n) first fit."""

    def __init__(self, cap: int):
        self.cap = cap
        self.keys: list[int] = []
        self.items: list[list[int]] = []
        self.load: list[int] = []
        self.born: list[int] = []

    def new(self, window: int) -> int:
        self.items.append([])
        self.load.append(0)
        self.born.append(window)
        return len(self.items) - 1

    def put(self, b: int, item: int, size: int, key: int | None) -> None:
        if key is not None:
            del self.keys[bisect_left(self.keys, key)]
        self.items[b].append(item)
        self.load[b] += size
        insort(self.keys, (self.cap - self.load[b]) << _SHIFT | b)

    def best(self, size: int) -> tuple[int, int] | None:
        i = bisect_left(self.keys, size << _SHIFT)
        if i == len(self.keys):
            return None
        key = self.keys[i]
        return key & ((1 << _SHIFT) - 1), key

    def first(self, size: int) -> tuple[int, int] | None:
        i = bisect_left(self.keys, size << _SHIFT)
        if i == len(self.keys):
            return None
        key = min(self.keys[i:], key=lambda k: k & ((1 << _SHIFT) - 1))
        return key & ((1 << _SHIFT) - 1), key

    def close(self, key: int) -> int:
        del self.keys[bisect_left(self.keys, key)]
        return key & ((1 << _SHIFT) - 1)


def stream_fit(
    sizes: np.ndarray,
    cap: int,
    *,
    buffer_size: int,
    best: bool,
    max_age: int = 4,
    max_items: int | None = None,
) -> list[list[int]]:
    """Bins (lists of positions into ``sizes``) in the order they close, every bin ``<= cap``.

    ``best=True`` is best-fit decreasing per window, ``best=False`` first-fit in arrival order.
    At most ``buffer_size`` samples are held at any time (window + open bins).

    >>> stream_fit(np.array([4, 8, 4, 12, 4]), 16, buffer_size=8, best=True)
    [[3, 0], [1, 2, 4]]
    """
    fit = StreamFit(
        sizes, cap, buffer_size=buffer_size, best=best, max_age=max_age, max_items=max_items
    )
    return fit.advance(int(sizes.shape[0])) + fit.finish()


class StreamFit:
    """:func:`stream_fit` one stretch of the stream at a time: ``advance(stop)`` packs windows until
    position ``stop`` is consumed and returns the bins closed meanwhile; ``finish()`` closes the
    rest. The bins are exactly those of one :func:`stream_fit` call, however the stream is cut."""

    def __init__(
        self,
        sizes: np.ndarray,
        cap: int,
        *,
        buffer_size: int,
        best: bool,
        max_age: int = 4,
        max_items: int | None = None,
    ):
        self.sizes, self.best, self.max_items = sizes, best, max_items
        self.buffer_size, self.max_age = buffer_size, max_age
        self.bins = _OpenBins(cap)
        self.held_limit = max(buffer_size // 2, 1)
        self.min_size = int(sizes.min()) if sizes.size else 0
        self.held = self.pos = self.window = 0

    def advance(self, stop: int) -> list[list[int]]:
        """Bins closed while the windows reach position ``stop`` (a window may run past it)."""
        bins, sizes, best = self.bins, self.sizes, self.best
        n = int(sizes.shape[0])
        closed: list[int] = []
        while self.pos < min(stop, n):
            pos, window = self.pos, self.window
            end = min(n, pos + max(self.buffer_size - self.held, 1))
            part = sizes[pos:end]
            if best:
                idx = np.argsort(-part, kind="stable")
                ranked = part[idx]
                ends = (
                    np.flatnonzero(ranked[1:] != ranked[:-1]) + 1
                )  # where each run of one size ends
                self._best_fit(
                    (idx + pos).tolist(),
                    ranked[np.r_[0, ends]].tolist(),
                    [*ends.tolist(), end - pos],
                    window,
                    closed,
                )
            else:
                for i, s in zip(range(pos, end), part.tolist()):
                    hit = bins.first(s)
                    b = bins.new(window) if hit is None else hit[0]
                    bins.put(b, i, s, None if hit is None else hit[1])
                    if (
                        self.max_items is not None and len(bins.items[b]) >= self.max_items
                    ):  # full by count
                        closed.append(bins.close((bins.cap - bins.load[b]) << _SHIFT | b))
                        self.held -= len(bins.items[b])
            self.held += end - pos
            self.pos = end
            # close what cannot grow, what is too old, then the fullest while too much is held
            for key in [
                k
                for k in bins.keys
                if (k >> _SHIFT) < self.min_size
                or bins.born[k & ((1 << _SHIFT) - 1)] <= window - self.max_age
            ]:
                b = bins.close(key)
                closed.append(b)
                self.held -= len(bins.items[b])
            while self.held > self.held_limit and bins.keys:
                b = bins.close(bins.keys[0])
                closed.append(b)
                self.held -= len(bins.items[b])
            self.window += 1
        return [bins.items[b] for b in closed]

    def _best_fit(
        self,
        positions: list[int],
        run_sizes: list[int],
        run_ends: list[int],
        window: int,
        closed: list[int],
    ) -> None:
        """One window's samples (``positions``, largest first, in runs of one size), each into the
        open bin it fills best, else a new bin; full bins (``max_items``) close. A run of equal
        sizes is placed a bin at a time: the bin that fits the first fits the next ones best too
        (its room only shrinks, and no other bin's room lies between), until it cannot take one
        more (a size past the capacity fills a new bin alone, as on the first-fit path). Aligned
        lengths take few values, so this is a step per size and bin, not per sample (a start plans
        a chunk of 16k samples this way)."""
        bins, max_items, cap, mask = self.bins, self.max_items, self.bins.cap, (1 << _SHIFT) - 1
        keys, items, load, born = bins.keys, bins.items, bins.load, bins.born
        i = 0
        for s, hi in zip(run_sizes, run_ends):  # ``positions[i:hi]``: samples of size ``s``
            while i < hi:
                j = bisect_left(keys, s << _SHIFT)
                if j == len(keys):  # no open bin has room: a new one
                    b = len(items)
                    items.append([])
                    load.append(0)
                    born.append(window)
                    room = cap
                else:  # the fullest bin with room (the lowest id among equals)
                    b = keys.pop(j) & mask
                    room = cap - load[b]
                take = min(hi - i, max(room // s, 1))  # a size past cap: a bin of its own
                if max_items is not None:
                    take = min(take, max_items - len(items[b]))
                items[b].extend(positions[i : i + take])
                load[b] += take * s
                i += take
                insort(keys, (cap - load[b]) << _SHIFT | b)
                if max_items is not None and len(items[b]) >= max_items:  # full by count
                    closed.append(bins.close((cap - load[b]) << _SHIFT | b))
                    self.held -= len(items[b])

    def finish(self) -> list[list[int]]:
        """Stream end: the samples still in open bins, re-packed together by best-fit decreasing."""
        bins = self.bins
        open_bins = [bins.items[k & ((1 << _SHIFT) - 1)] for k in bins.keys]
        held_items = [i for b in open_bins for i in b]
        rest = (
            best_fit_decreasing(self.sizes[held_items], bins.cap, self.max_items)
            if held_items
            else []
        )
        if len(rest) <= len(open_bins):  # never worse than closing the open bins as they are
            open_bins = [[held_items[j] for j in b] for b in rest]
        return open_bins


def best_fit_decreasing(
    sizes: np.ndarray, cap: int, max_items: int | None = None
) -> list[list[int]]:
    """Offline best-fit decreasing of all ``sizes`` (positions into ``sizes``), bins in creation
    order, at most ``max_items`` in a bin.

    >>> best_fit_decreasing(np.array([4, 8, 4, 12, 4]), 16)
    [[3, 0], [1, 2, 4]]
    """
    bins = _OpenBins(cap)
    for i in np.argsort(-sizes, kind="stable").tolist():
        s = int(sizes[i])
        hit = bins.best(s)
        b = bins.new(0) if hit is None else hit[0]
        bins.put(b, i, s, None if hit is None else hit[1])
        if max_items is not None and len(bins.items[b]) >= max_items:
            bins.close((cap - bins.load[b]) << _SHIFT | b)
    return bins.items


def next_fit(sizes: np.ndarray, cap: int, max_items: int | None = None) -> list[list[int]]:
    """In-order baseline: append to the current bin until a sample does not fit (or it holds
    ``max_items``), then start a new one.

    >>> next_fit(np.array([4, 8, 4, 12, 4]), 16)
    [[0, 1, 2], [3, 4]]
    """
    out: list[list[int]] = []
    cur: list[int] = []
    load = 0
    for i, s in enumerate(sizes.tolist()):
        if cur and (load + s > cap or len(cur) == max_items):
            out.append(cur)
            cur, load = [], 0
        cur.append(i)
        load += s
    if cur:
        out.append(cur)
    return out


def spread(
    bins: list[list[int]], sizes: np.ndarray, n_bins: int, cap: int, max_items: int | None = None
) -> list[list[int]]:
    """Re-pack the items of ``bins`` into exactly ``n_bins >= len(bins)`` bins as evenly as possible
    (largest first, each into the least-loaded bin that fits). When that greedy pass fails, keep
    ``bins`` and move single items out to the new bins instead (always valid). A bin stays empty
    only when there are fewer items than bins. ``O(items log n_bins + n_bins)``: the bins that can
    still take an item sit in a heap by ``(load, bin)``; the least-loaded one fits an item or none
    does.

    >>> spread([[0, 1, 2, 3]], np.array([8, 4, 4, 4]), 2, 16)
    [[0, 3], [1, 2]]
    """
    items = sorted((i for b in bins for i in b), key=lambda i: (-int(sizes[i]), i))
    out = _empty_bins(n_bins)
    # (load, bin), a heap already: the bins in order (no Python step per bin)
    open_bins = list(zip(repeat(0), range(n_bins))) if max_items != 0 else []
    for i in items:
        s = int(sizes[i])
        if not open_bins or open_bins[0][0] + s > cap:
            return _split_out(bins, sizes, n_bins)
        load, b = open_bins[0]
        out[b].append(i)
        if len(out[b]) == max_items:  # full: never a candidate again
            heapq.heappop(open_bins)
        else:
            heapq.heapreplace(open_bins, (load + s, b))
    return list(map(sorted, out))


def _split_out(bins: list[list[int]], sizes: np.ndarray, n_bins: int) -> list[list[int]]:
    """Valid fallback of :func:`spread`: move the smallest item of the fullest multi-item bin into a
    new bin. The donors sit in a heap by ``(-load, bin)``, each with its items largest first."""
    out = list(map(sorted, bins)) + _empty_bins(n_bins - len(bins))
    by_size = [sorted(b, key=lambda j: (-int(sizes[j]), -j)) for b in bins]  # smallest last
    donors = [(-sum(int(sizes[j]) for j in b), c) for c, b in enumerate(bins) if len(b) > 1]
    heapq.heapify(donors)
    moved = set()
    for target in range(len(bins), n_bins):
        if not donors:
            break
        load, c = donors[0]
        i = by_size[c].pop()
        moved.add(i)
        out[target].append(i)
        if len(by_size[c]) > 1:
            heapq.heapreplace(donors, (load + int(sizes[i]), c))
        else:
            heapq.heappop(donors)
    return [[i for i in b if i not in moved] for b in out[: len(bins)]] + out[len(bins) :]


def _empty_bins(n: int) -> list[list[int]]:
    """``n`` distinct empty lists, made without a Python step per list."""
    return list(map(list, repeat((), max(n, 0))))
