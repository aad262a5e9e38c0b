"""One resume-conformance harness every stateful component must pass (torchdata.nodes style).

A *stateful component* is iterable (each ``iter()`` yields the rest of the current epoch, then the
next ``iter()`` starts the next epoch) and has ``state_dict()`` / ``load_state_dict(state)``.
:func:`assert_resumes_exactly` checks, against an uninterrupted reference run of two epochs, that a
fresh component loaded with a (JSON round-tripped) state yields exactly the reference's remaining
batches when the state was taken

1. at the initial state,
2. mid-epoch (and that taking the state does not disturb the run it was taken from),
3. at the end of an epoch (the resumed run starts the next epoch),
4. mid-way through a later epoch.

:func:`assert_resumes_elastically` checks a component that resumes under another configuration
(another DP size, number of workers...): one epoch served in segments, every rank of a segment
simulated in one process, nothing lost or repeated across them.
"""

from __future__ import annotations

import json
from collections import Counter
from itertools import islice
from typing import Callable, Sequence

import torch


class ResumeConformanceError(AssertionError):
    """A resumed run did not yield exactly what the uninterrupted run did."""


def batches_equal(a, b) -> bool:
    """Deep equality of batches: tensors by dtype, shape and values; dicts, lists and scalars by
    value."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and bool(torch.equal(a, b))
        )
    if isinstance(a, dict) or isinstance(b, dict):
        return (
            isinstance(a, dict)
            and isinstance(b, dict)
            and a.keys() == b.keys()
            and all(batches_equal(a[k], b[k]) for k in a)
        )
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return (
            isinstance(a, (list, tuple))
            and isinstance(b, (list, tuple))
            and len(a) == len(b)
            and all(batches_equal(x, y) for x, y in zip(a, b))
        )
    return a == b


def _roundtrip(state: dict) -> dict:
    return json.loads(json.dumps(state))


def _check(case: str, got: list, want: list, equal) -> None:
    if len(got) != len(want):
        raise ResumeConformanceError(
            f"{case}: resumed run yielded {len(got)} batches, expected {len(want)}"
        )
    for i, (g, w) in enumerate(zip(got, want)):
        if not equal(g, w):
            raise ResumeConformanceError(f"{case}: batch {i} differs from the uninterrupted run")


def assert_resumes_exactly(
    make: Callable[[], object],
    *,
    midpoint: int | None = None,
    equal: Callable[[object, object], bool] = batches_equal,
) -> dict:
    """Run the four resume cases (module docstring) on components built by ``make()``.

    Returns ``{"epoch_lengths": [n0, n1], "midpoint": m}`` so callers can assert the test was not
    vacuous. Raises :class:`ResumeConformanceError` on the first difference.
    """
    ref = make()
    e0, e1 = list(ref), list(ref)
    if len(e0) < 2 or len(e1) < 2:
        raise ResumeConformanceError(
            f"need epochs of >= 2 batches to test resume, got {len(e0)} and {len(e1)}"
        )
    mid = midpoint if midpoint is not None else len(e0) // 2
    mid1 = min(mid, len(e1) - 1)

    def resumed(state: dict):
        c = make()
        c.load_state_dict(_roundtrip(state))
        return c

    c = make()
    d = resumed(c.state_dict())
    _check("initial state, epoch 0", list(d), e0, equal)
    _check("initial state, epoch 1", list(d), e1, equal)

    c = make()
    it = iter(c)
    head = list(islice(it, mid))
    state = c.state_dict()
    _check("mid-epoch, the original run after state_dict()", head + list(it), e0, equal)
    d = resumed(state)
    _check(f"mid-epoch ({mid}/{len(e0)})", list(d), e0[mid:], equal)
    _check("mid-epoch, next epoch", list(d), e1, equal)

    c = make()
    list(c)
    d = resumed(c.state_dict())
    _check("end of epoch 0", list(d), e1, equal)

    c = make()
    list(c)
    it = iter(c)
    list(islice(it, mid1))
    d = resumed(c.state_dict())
    _check(f"later epoch ({mid1}/{len(e1)} of epoch 1)", list(d), e1[mid1:], equal)
    return {"epoch_lengths": [len(e0), len(e1)], "midpoint": mid}


def _padded_length(batch) -> int:
    return int(batch["cu_seqlens_padded"][-1])


def _ids(batch) -> list[int]:
    return batch["sample_index"].tolist()


def assert_resumes_elastically(
    make: Callable[[dict, int], object],
    segments: Sequence[tuple[dict, int | Callable[[object], int] | None]],
    *,
    budget: int,
    padded_length: Callable[[object], int] = _padded_length,
    sample_ids: Callable[[object], list[int]] = _ids,
) -> dict:
    """Serve one epoch in segments under other configurations and check nothing is lost or repeated.

    ``make(config, rank)`` builds rank ``rank`` of a run of ``config`` (keywords, with
    ``"dp_size"``). ``segments[i] = (config, stop)``: every rank of segment ``i`` is built, loaded
    with the (JSON round-tripped) state rank 0 of segment ``i - 1`` took, and yields ``stop``
    micro-batches (``None``: the rest of the epoch, the last segment's must be; a callable:
    ``stop(rank 0's component)`` once it loaded the state, e.g. a fraction of its ``len``). Raises
    :class:`ResumeConformanceError` unless

    1. every rank of a segment yields as many micro-batches as the others and takes the same state,
    2. the samples served across all segments and ranks are those of an uninterrupted run of the
       first configuration, each exactly once (``sample_ids(batch)``),
    3. every micro-batch is within ``budget`` (``padded_length(batch)``),
    4. the next epoch of the last segment's ranks is what a fresh run of its configuration yields
       then.

    Returns ``{"counts": [micro-batches per rank of each segment], "samples": n}`` (to check it was
    not vacuous).
    """
    if not segments or segments[-1][1] is not None:
        raise ValueError("segments: the last one must run to the end of the epoch (stop None)")
    first = segments[0][0]
    want = Counter(
        i
        for r in range(first["dp_size"])
        for b in islice(iter(make(first, r)), None)
        for i in sample_ids(b)
    )
    got: Counter = Counter()
    state, counts, epoch, last = None, [], None, []
    for s, (config, stop) in enumerate(segments):
        states, lengths = [], []
        for r in range(config["dp_size"]):
            c = make(config, r)
            if state is not None:
                c.load_state_dict(_roundtrip(state))
            if callable(stop):
                stop = stop(c)
            it = iter(c)
            batches = list(it) if stop is None else list(islice(it, stop))
            for i, b in enumerate(batches):
                if padded_length(b) > budget:
                    raise ResumeConformanceError(
                        f"segment {s} ({config}), rank {r}: micro-batch {i} is "
                        f"{padded_length(b)} tokens, over the budget {budget}"
                    )
                got.update(sample_ids(b))
            lengths.append(len(batches))
            states.append(c.state_dict())
            if stop is None:
                last.append(c)
        if len(set(lengths)) != 1:
            raise ResumeConformanceError(
                f"segment {s} ({config}): ranks yielded {lengths} micro-batches"
            )
        if any(st != states[0] for st in states):
            raise ResumeConformanceError(f"segment {s} ({config}): the ranks' states differ")
        counts.append(lengths[0])
        state = states[0]
        epoch = state["epoch"]
    repeated = sorted(i for i, n in got.items() if n > 1)
    if repeated:
        raise ResumeConformanceError(
            f"samples served more than once across the segments: {repeated[:20]}"
        )
    if got != want:
        lost = sorted((want - got).elements())
        extra = sorted((got - want).elements())
        raise ResumeConformanceError(
            f"samples lost across the segments: {lost[:20]} ({len(lost)}); served but "
            f"not in the epoch: {extra[:20]} ({len(extra)})"
        )
    config = segments[-1][0]
    for r, c in enumerate(last):
        fresh = make(config, r)
        fresh.set_epoch(epoch)
        _check(f"the epoch after the segments, rank {r}", list(c), list(fresh), batches_equal)
    return {"counts": counts, "samples": sum(got.values())}
