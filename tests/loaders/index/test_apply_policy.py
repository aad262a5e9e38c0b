"""One policy, one fixed-dims rule (issue #27): the same records through the pass in process, the
sidecars and the merged index give the same index and the same report, example for example, under
skip, raise and a consecutive limit; the policy's cost does not depend on the number of good
samples."""

from __future__ import annotations

import os
import tarfile

import numpy as np
import pytest

from prealign.loaders import BadDataPolicy, StreamingPackedLoader, WebDatasetSource, build_index
from prealign.loaders.index.apply_policy import FixedDims, Records, apply_policy
from prealign.loaders.index.header_pass import write_sidecars
from prealign.loaders.index.merged import merge_sidecars
from prealign.loaders.policy import BadRecord
from prealign.loaders.sources.shard_files import SUFFIX
from prealign.schemas import ParallelLayout
from prealign.schemas.errors import PrealignError
from prealign.schemas.schema import causal_lm_schema
from tests.loader_helpers import _npy, add_member, sample_lengths, token_ids, write_shards

SCHEMA = causal_lm_schema(topk="K")


def _members(lengths):
    """Top-k samples (K = 4; sample 23: K = 8, another shard than the first), samples 5, 6 and 17
    with a bad npy (5 and 6 in a row), a member without an extension after sample 11 (a skipped
    record)."""

    def extra(i, tf):
        n, k = lengths[i], (8 if i == 23 else 4)
        add_member(
            tf,
            f"{i:06d}.input_ids.npy",
            b"not an npy" if i in (5, 6, 17) else _npy(token_ids(i, n)),
        )
        add_member(tf, f"{i:06d}.teacher_topk_ids.npy", _npy(np.zeros((n, k), np.int64)))
        add_member(
            tf,
            f"{i:06d}.teacher_topk_log_probs.npy",
            _npy(np.tile(-np.arange(1, k + 1, dtype=np.float32), (n, 1))),
        )
        if i == 11:
            add_member(tf, "README", b"not a sample")
        return True

    return extra


def _three_ways(paths, policy):
    """The index (or the error) in process, from the sidecars, from the merged index."""

    def one(**kw):
        try:
            return build_index(WebDatasetSource(paths, **kw), SCHEMA, policy=policy)
        except PrealignError as exc:
            return exc

    out = [one(sidecars=False), one()]
    merge_sidecars(WebDatasetSource(paths))
    for p in paths:
        os.rename(p + SUFFIX, p + SUFFIX + ".away")
    out.append(one())
    for p in paths:
        os.rename(p + SUFFIX + ".away", p + SUFFIX)
    os.remove(os.path.join(os.path.dirname(paths[0]), "prealign-index.merged.npz"))
    return out


def _streamed(paths, policy):
    """The streaming loader's report over one epoch (or its error), its shards read in the index's
    order."""
    seed = next(
        s
        for s in range(1000)
        if np.random.default_rng([s, 0]).permutation(len(paths)).tolist() == list(range(len(paths)))
    )  # (the loader's shard order of epoch 0: the stream order of the index)
    loader = StreamingPackedLoader(
        WebDatasetSource(paths, sidecars=False),
        schema=SCHEMA,
        layout=ParallelLayout(),
        token_budget=256,
        seed=seed,
        bad_data=policy,
    )
    try:
        for _ in loader:
            pass
    except PrealignError as exc:
        return exc
    return loader.report


def _keys_of(paths) -> dict[str, str]:
    """``url@offset`` (a sample as the streaming loader and the fixed-dims rule name it) ->
    ``url:key``."""
    out = {}
    for p in paths:
        with tarfile.open(p) as tf:
            for m in tf.getmembers():
                key = m.name.split(".", 1)[0]
                out.setdefault((p, key), f"{p}@{m.offset}")
    return {at: f"{p}:{key}" for (p, key), at in out.items()}


def _named(exc) -> tuple:
    """What the policy decides of an error: its type, the sample it names and the cause it counts
    under (the decoders' wording of a bad npy differs between the full pass and the header pass)."""
    cause = getattr(exc, "__cause__", None) or exc
    return (
        type(exc),
        getattr(cause, "sample", None),
        getattr(cause, "reason", None),
        str(exc).split(":")[0],
    )


def _same(results) -> None:
    first = results[0]
    for other in results[1:]:
        if isinstance(first, Exception):
            assert _named(other) == _named(first)
        else:
            assert other.digest == first.digest and other.dims == first.dims
            assert other.report.counts == first.report.counts
            assert [(e.where, e.reason) for e in other.report.examples] == [
                (e.where, e.reason) for e in first.report.examples
            ]
            mismatch = [
                e for e in first.report.examples if e.reason == "dim_mismatch"
            ]  # the rule's own words
            assert mismatch and mismatch == [
                e for e in other.report.examples if e.reason == "dim_mismatch"
            ]


@pytest.mark.parametrize(
    "policy",
    [
        BadDataPolicy(on_error="skip", warn=False),
        BadDataPolicy(on_error="raise"),
        BadDataPolicy(on_error="skip", max_consecutive=1, warn=False),
    ],
    ids=["skip", "raise", "consecutive"],
)
def test_the_three_paths_give_one_index_and_one_report(tmp_path, policy):
    lengths = sample_lengths(30)
    paths = write_shards(str(tmp_path), lengths, num_shards=3, extra=_members(lengths))
    write_sidecars(WebDatasetSource(paths), SCHEMA)
    results = _three_ways(paths, policy)
    _same(results)
    if policy.on_error.value == "raise" or policy.max_consecutive == 1:
        assert isinstance(results[0], PrealignError)
    else:
        index = results[0]
        assert len(index) == 26 and index.dims["K"] == 4
        assert index.report.counts == {"bad_sample": 3, "dim_mismatch": 1, "ignored_member": 1}


@pytest.mark.parametrize(
    "policy",
    [
        BadDataPolicy(on_error="skip", warn=False),
        BadDataPolicy(on_error="raise"),
        BadDataPolicy(on_error="skip", max_consecutive=1, warn=False),
    ],
    ids=["skip", "raise", "consecutive"],
)
def test_the_streaming_loader_gives_the_same_records(tmp_path, policy):
    """The fourth path: the streaming loader applies the same policy and rule sample by sample; its
    report holds the same records as the index's (the same reason, sample and message; a sample
    named by its byte offset where the index names it by its key), or it raises the same error."""
    lengths = sample_lengths(30)
    paths = write_shards(str(tmp_path), lengths, num_shards=3, extra=_members(lengths))
    try:
        index = build_index(WebDatasetSource(paths, sidecars=False), SCHEMA, policy=policy)
    except PrealignError as exc:
        index = exc
    streamed = _streamed(paths, policy)
    if isinstance(index, Exception):
        assert _named(streamed) == _named(index)
        return
    keys = _keys_of(paths)

    def records(report):
        return sorted(
            (e.reason, keys.get(e.where, e.where), e.message, e.is_error) for e in report.examples
        )

    assert (
        streamed.counts
        == index.report.counts
        == {"bad_sample": 3, "dim_mismatch": 1, "ignored_member": 1}
    )
    assert records(streamed) == records(index.report)
    typed = [e for e in streamed.examples if e.is_error]
    assert [type(e.to_error()) for e in typed] == [
        type(e.to_error()) for e in index.report.examples if e.is_error
    ]


def test_fixed_dims_decide_a_signature_once_in_the_order_of_its_first_sample():
    rule = FixedDims()
    assert rule.admit({"K": 4}, "a") is None and rule.admit({"K": 4, "V": 2}, "b") is None
    err = rule.admit({"K": 8}, "c")("d")
    assert (
        err.reason == "dim_mismatch"
        and "K = 4 (fixed by the first indexed sample with it, a)" in str(err)
    )
    assert rule.dims == {"K": 4, "V": 2}


def test_the_policy_costs_per_signature_and_bad_record_not_per_sample():
    """A million good rows of one signature: one rule decision, no name built per row."""
    n = 1_000_000
    names = []
    records = Records(
        lengths=np.ones(n, np.int64),
        locations=np.zeros((n, 4), np.int64),
        shards=np.zeros(n, np.int64),
        media=np.zeros(n, bool),
        dim_ids=np.zeros(n, np.int64),
        signatures=[{"K": 4}],
        good_at=np.arange(n, dtype=np.int64) + 1,
        events=[(0, BadRecord("ignored_member", "x", "m"))],
    )
    index = apply_policy(records, None, None, where=lambda loc: names.append(loc) or "row")
    assert len(index) == n and index.report.counts == {"ignored_member": 1} and len(names) == 1
