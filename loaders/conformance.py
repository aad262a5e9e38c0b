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
"""
from __future__ import annotations

import json
from itertools import islice
from typing import Callable

import torch


class ResumeConformanceError(AssertionError):
    """A resumed run did not yield exactly what the uninterrupted run did."""


def batches_equal(a, b) -> bool:
    """Deep equality of batches: tensors by dtype, shape and values; dicts, lists and scalars by value."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and bool(torch.equal(a, b)))
    if isinstance(a, dict) or isinstance(b, dict):
        return isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys() and all(
            batches_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return (isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b)
                and all(batches_equal(x, y) for x, y in zip(a, b)))
    return a == b


def _roundtrip(state: dict) -> dict:
    return json.loads(json.dumps(state))


def _check(case: str, got: list, want: list, equal) -> None:
    if len(got) != len(want):
        raise ResumeConformanceError(f"{case}: resumed run yielded {len(got)} batches, expected {len(want)}")
    for i, (g, w) in enumerate(zip(got, want)):
        if not equal(g, w):
            raise ResumeConformanceError(f"{case}: batch {i} differs from the uninterrupted run")


def assert_resumes_exactly(make: Callable[[], object], *, midpoint: int | None = None,
                           equal: Callable[[object, object], bool] = batches_equal) -> dict:
    """Run the four resume cases (module docstring) on components built by ``make()``.

    Returns ``{"epoch_lengths": [n0, n1], "midpoint": m}`` so callers can assert the test was not
    vacuous. Raises :class:`ResumeConformanceError` on the first difference.
    """
    ref = make()
    e0, e1 = list(ref), list(ref)
    if len(e0) < 2 or len(e1) < 2:
        raise ResumeConformanceError(f"need epochs of >= 2 batches to test resume, got {len(e0)} and {len(e1)}")
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
