"""A resume state from outside is data, not trusted (issue #28 leftovers): every key of a real saved
state (a streaming loader's cursors, plain and over a :class:`Mixture`, gathered or one rank's; a
:class:`PackedLoader`'s, plain, elastic and over a mixture) mutated to a value of another type or
out of range is a :class:`ResumeError` naming the key, or resumes exactly; never another exception,
never a silent wrong resume."""

from __future__ import annotations

import copy
import json
from functools import lru_cache
from itertools import islice

import datasets
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prealign.loaders import HFSource, Mixture, PackedLoader, WebDatasetSource
from prealign.loaders.errors import ResumeError
from prealign.loaders.index.build import build_index
from prealign.loaders.plan.planner import PlannerConfig
from prealign.loaders.sources.source import Source
from prealign.loaders.state import MAX_DEPTH, LoaderState, pack_cursor, unpack_cursor
from prealign.loaders.streaming import merge_rank_states
from prealign.schemas import ParallelLayout, causal_lm_schema
from tests.loader_helpers import hf_rows, sample_lengths, write_shards
from tests.loaders.test_stream_cursors import _make

# ---- real saved states -----------------------------------------------------------------------


def _mixture(paths) -> Mixture:
    return Mixture(
        {"short": (WebDatasetSource(paths[0]), 0.7), "long": (WebDatasetSource(paths[1]), 0.3)}
    )


@lru_cache(maxsize=1)
def _paths(root: str):
    return (
        write_shards(f"{root}/short", sample_lengths(60, seed=4), num_shards=3),
        write_shards(f"{root}/long", sample_lengths(30, seed=5, low=30, high=90), num_shards=2),
    )


def _batches(batches) -> list:
    """What a loader served, comparable with ``==``."""
    return [
        {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in b.items()} for b in batches
    ]


def _stream(root, *, mixture: bool, dp: int = 1, rank: int = 0, **kw):
    paths = _paths(root)
    if mixture:
        return _make(paths, source=_mixture, dp_size=dp, dp_rank=rank, **kw)
    return _make(list(paths[0]) + list(paths[1]), dp_size=dp, dp_rank=rank, **kw)


def _hf(n, lo, hi, seed) -> HFSource:
    return HFSource(datasets.Dataset.from_dict(hf_rows(sample_lengths(n, seed, lo, hi))))


@lru_cache(maxsize=1)
def _hf_sources():
    return _hf(80, 4, 30, 0), _hf(30, 20, 60, 1)


def _packed(root, *, mixture: bool, dp: int = 1, rank: int = 0, k: int = 1, seed: int = 1):
    a, b = _hf_sources()
    source = Mixture({"a": (a, 0.6), "b": (b, 0.4)}) if mixture else a
    return PackedLoader(
        source,
        schema=causal_lm_schema(),
        layout=ParallelLayout(),
        token_budget=128,
        cp_rank=None,
        dp_size=dp,
        dp_rank=rank,
        seed=seed,
        planner=PlannerConfig(microbatches_per_step=k, chunk_size=32),
    )


def _saved(make, stop: int, cursors=None) -> tuple[dict, list]:
    """(the state after ``stop`` micro-batches, JSON round-tripped; the rest after it)."""
    a = make()
    it = iter(a)
    list(islice(it, stop))
    state = a.state_dict() if cursors is None else a.state_dict(cursors=cursors)
    return json.loads(json.dumps(state)), _batches(it)


def _gathered(make_rank, dp: int, stop: int) -> dict:
    states = []
    for r in range(dp):
        a = make_rank(r)
        list(islice(iter(a), stop))
        states.append(a.state_dict(cursors=True))
    return json.loads(json.dumps(merge_rank_states(states)))


@lru_cache(maxsize=None)
def scenario(root: str, name: str) -> tuple[dict, object, list | None]:
    """``(state, make a loader to load it, the batches it must serve then)``; expected ``None``: the
    resume is elastic (another topology), checked by :func:`_elastic_ok`."""
    if name == "stream-mix-v4":
        make = lambda: _stream(root, mixture=True)  # noqa: E731
        state, rest = _saved(make, 4, cursors=True)
        return state, make, rest
    if name in ("stream-mix-v6", "stream-v6"):
        mixture = name == "stream-mix-v6"
        state = _gathered(lambda r: _stream(root, mixture=mixture, dp=2, rank=r), 2, 3)
        make = lambda: _stream(root, mixture=mixture, dp=2, rank=0)  # noqa: E731
        a = make()
        rest = _batches(islice(iter(a), 3, None))
        return state, make, rest
    if name == "stream-mix-v6-elastic":
        state = _gathered(lambda r: _stream(root, mixture=True, dp=2, rank=r), 2, 3)
        return state, lambda: _stream(root, mixture=True), None
    if name in ("packed-mix", "packed"):
        make = lambda: _packed(root, mixture=name == "packed-mix", dp=2)  # noqa: E731
        state, rest = _saved(make, 3)
        return state, make, rest
    if name == "packed-mix-v3":  # saved under dp 2, resumed under dp 1, saved again
        first, _ = _saved(lambda: _packed(root, mixture=True, dp=2), 2)

        def make():
            b = _packed(root, mixture=True)
            b.load_state_dict(first)
            return b

        state, rest = _saved(make, 1)
        assert state["version"] == 3
        return state, lambda: _packed(root, mixture=True), rest
    raise AssertionError(name)


SCENARIOS = (
    "stream-mix-v4",
    "stream-mix-v6",
    "stream-v6",
    "stream-mix-v6-elastic",
    "packed-mix",
    "packed",
    "packed-mix-v3",
)

# ---- mutations -------------------------------------------------------------------------------

DELETE = object()
"""A mutation that removes the key."""

HOSTILE = ("3", 2.5, -1, -7, True, False, None, [], {}, [0, 0, 0], 2**64, float("inf"), DELETE)
"""Values of other types and out of range (``-1`` is in range where it is a cursor's "nothing read
yet" ordinal, ``-7`` nowhere; ``2**64`` is past int64)."""


def paths_of(value, path=()) -> list[tuple]:
    """Every key path into ``value`` (dict keys and list indices), the value's own first."""
    out = [path] if path else []
    if isinstance(value, dict):
        for k, v in value.items():
            out += paths_of(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += paths_of(v, (*path, i))
    return out


def mutated(state: dict, path: tuple, value) -> dict | None:
    """A deep copy of ``state`` with ``path`` set to ``value`` (removed: :data:`DELETE`); ``None``
    when that is no mutation (the same value and type, or a list item removed)."""
    out = copy.deepcopy(state)
    parent = out
    for k in path[:-1]:
        parent = parent[k]
    old = parent[path[-1]]
    if value is DELETE:
        if isinstance(parent, list):
            return None
        del parent[path[-1]]
        return out
    if type(old) is type(value) and old == value:
        return None
    if type(old) is type(value) and isinstance(value, (bool, float, str)) and value != float("inf"):
        return None  # (another bool, weight or name: a value of the same type, not this test's)
    if (value == [] and isinstance(old, list)) or (value is None and path[-2:-1] == ("readers",)):
        return None  # (an empty buffer, a reader that served nothing: values a state holds)
    parent[path[-1]] = value
    return out


def check(root: str, name: str, path: tuple, value) -> str | None:
    """Load the mutated state and serve the rest: ``None`` when that is a :class:`ResumeError` or
    the exact rest; else what went wrong."""
    state, make, expected = scenario(root, name)
    bad = mutated(state, path, value)
    if bad is None:
        return None
    try:
        loader = make()
        loader.load_state_dict(bad)
        got = _batches(loader)
    except ResumeError:
        return None
    except Exception as exc:  # noqa: BLE001 (what this test is about)
        return f"{type(exc).__name__}: {exc}"[:300]
    if expected is None:
        return None if got == _elastic_rest(root, name) else "another rest of the epoch"
    return None if got == expected else "another rest of the epoch"


@lru_cache(maxsize=None)
def _elastic_rest(root: str, name: str) -> list:
    state, make, _ = scenario(root, name)
    loader = make()
    loader.load_state_dict(copy.deepcopy(state))
    return _batches(loader)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("hostile"))


@pytest.mark.slow
@pytest.mark.parametrize("name", SCENARIOS)
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_a_mutated_state_is_refused_or_resumes_exactly(root, name, data):
    """Property: one key of a real saved state set to a value of another type or out of range:
    :class:`ResumeError`, or the rest of the epoch exactly the unmutated state's."""
    state, _, _ = scenario(root, name)
    path = data.draw(st.sampled_from(paths_of(state)), label="path")
    value = data.draw(st.sampled_from(HOSTILE), label="value")
    assert check(root, name, path, value) is None


# ---- golden cases ----------------------------------------------------------------------------


def _refused(root: str, name: str, edit, says: str) -> None:
    """The scenario's state edited by ``edit`` (in place) is a ResumeError matching ``says`` when
    loaded (and served: never another exception, never a rest of the epoch)."""
    state, make, _ = scenario(root, name)
    bad = copy.deepcopy(state)
    edit(bad)
    with pytest.raises(ResumeError, match=says):
        loader = make()
        loader.load_state_dict(bad)
        list(loader)


def _v4_stream(i: int):
    return lambda s: s["cursors"]["readers"][0]["mix"]["streams"][i]


def _other_component(s):
    """Component ``long``'s cursor seeks at a location of component ``short``."""
    streams = s["cursors"]["readers"][0]["mix"]["streams"]
    streams[1]["at"][2] = list(streams[0]["at"][2])


def _past_the_shards(s):
    """Component ``long`` (2 shards) goes on at its 6th shard."""
    _v4_stream(1)(s)["at"][0] = 5


def _another_shard(s):
    """Component ``short``'s cursor at a location (a real one) of another of its shards."""
    at = _v4_stream(0)(s)["at"]
    at[2][2] = (at[2][2] + 1) % 3


@pytest.mark.parametrize(
    "edit, says",
    [
        (_other_component, r"streams\[1\].at': a location of component 'short'; expected one of "),
        (_past_the_shards, r"streams\[1\].at': shard position 5; expected one of the 2 shards"),
        (_another_shard, r"streams\[0\].at': a location in shard \d; expected one in shard \d"),
    ],
    ids=["other-component", "past-its-shards", "another-shard"],
)
def test_a_mixture_cursor_seeks_only_in_its_components_shards(root, edit, says):
    """Item 1: a component's cursor that would seek into another component's shard, past its own
    shards or into another of its shards than the position names: a ResumeError naming the key,
    what was expected and what came (it read another component's shard, or ended the component's
    stream silently)."""
    _refused(root, "stream-mix-v4", edit, "cursors.readers\\[0\\].mix." + says)


def _set(path: tuple, value):
    def edit(s):
        for k in path[:-1]:
            s = s[k]
        s[path[-1]] = value

    return edit


R0 = ("cursors", "readers", 0)


TYPES = [
    ((*R0, "gate"), "0", r"readers\[0\].gate': expected an int >= 0, got 0 \(str\)"),
    ((*R0, "k"), 1.5, r"readers\[0\].k': expected an int >= 0, got 1.5"),
    ((*R0, "done"), 0, r"readers\[0\].done': expected a bool, got 0 \(int\)"),
    ((*R0, "rule"), None, r"readers\[0\].rule': expected \["),
    ((*R0, "buffer", 0, 1), "3", r"readers\[0\].buffer': expected \[id, aligned size"),
    ((*R0, "buffer", 0, 0), -3, r"readers\[0\].buffer': expected \[id, aligned size"),
    ((*R0, "bins"), {}, r"readers\[0\].bins': expected a list of micro-batches"),
    ((*R0, "mix", "state", "used", 0), "x", r"mix.state.used': expected 2 finite numbers"),
    ((*R0, "mix", "state", "recent", 1), 0.0, r"mix.state.recent': expected 2 finite"),
    ((*R0, "mix", "state", "ended", 0), 0, r"mix.state.ended': expected 2 bools"),
    ((*R0, "mix", "state", "ended"), [False], r"mix.state.ended': expected 2 bools"),
    ((*R0, "mix", "streams", 0, "at", 1), "1", r"streams\[0\].at': expected \[shard pos"),
    ((*R0, "mix", "streams", 0, "at", 0), -1, r"streams\[0\].at': expected \[shard pos"),
    ((*R0, "mix", "streams", 1, "done"), True, r"streams\[1\].done': expected state.ended"),
    ((*R0, "mix", "streams", 1, "k"), None, r"streams\[1\].k': expected an int >= 0"),
    ((*R0, "mix", "streams", 1), None, r"streams\[1\]': expected an object with at, k"),
    (("position",), 2**63, r"'position': expected an int >= 0, got 9223372036854775808"),
    (("config", "dp_size"), 2**64, r"'config.dp_size': a non-finite number or an int past"),
    (("config", "num_workers"), None, r"'config.num_workers': expected an int >= 0"),
]


@pytest.mark.parametrize(
    "name, edit, says",
    [
        ("packed-mix-v3", _set(("segments",), None), r"'segments': a non-empty list"),
        ("packed-mix", _set(("mixture", "phases"), 2.5), r"mixture.phases: expected a list"),
        ("stream-mix-v6", _set(("stream",), None), r"'stream': an object in a version 5"),
    ],
    ids=["v3-segments-null", "mixture-phases-float", "v6-stream-null"],
)
def test_a_state_entry_of_another_type_is_refused(root, name, edit, says):
    """Item 4 (``PackedLoader`` and ``Mixture`` states): ``null`` segments of a version-3 state
    resumed as a version 2 one; ``phases`` of another type was a TypeError; a version-6 state with
    a ``null`` stream replayed."""
    _refused(root, name, edit, says)


@pytest.mark.parametrize(
    "path, value, says",
    TYPES,
    ids=[".".join(map(str, p[1:] or p)) + f"={v!r}"[:12] for p, v, _ in TYPES],
)
def test_a_cursor_of_other_types_is_refused_naming_the_key(root, path, value, says):
    """Item 2, golden: each wrong type (a str, a float, a bool, a negative, None, a list of the
    wrong length) is a ResumeError naming the key and what came (it was a TypeError, a
    ValueError, or a silent coercion: ``bool(0)``, ``float("1")``)."""
    _refused(root, "stream-mix-v4", _set(path, value), says)


def test_a_packed_cursor_holds_at_most_what_its_reader_buffers(root):
    """Item 3: a version-6 reader cursor of more samples than the reader buffers (``buffer_size``
    16 here, no samples returned by an earlier segment): a ResumeError before it is inflated (a
    60-byte cursor asked for 2**28 ints: 2 GiB), whatever its ints."""
    state, make, _ = scenario(root, "stream-v6")
    cursor = state["stream"]["ranks"][0]["readers"][0]
    rows = 17
    ints = pack_cursor({"buffer": [[0] * 6] * rows, "bins": []})["packed"]["ints"]
    bad = copy.deepcopy(state)
    packed = {"rows": rows, "width": 6, "split": [rows], "ints": ints}
    bad["stream"]["ranks"][0]["readers"][0] = {**cursor, "packed": packed}
    with pytest.raises(ResumeError, match=r"17 samples of 6 ints; expected at most 16 samples"):
        make().load_state_dict(bad)
    big = pack_cursor({"buffer": [[0] * 8] * 10**6, "bins": []})
    with pytest.raises(ResumeError, match=r"1000000 samples of 8 ints; expected at most 16"):
        unpack_cursor(big, "r", limit=16)


def test_a_cursor_at_a_record_without_location_goes_on_after_it(root):
    """A reader cursor whose last record has no location (an ignored tar member, the error that
    ended a shard: a Mixture component's stream can stand there when a round is cut) goes on after
    that record, by its ordinal: its shard is not read again from its start (that served its
    samples twice)."""
    state, make, rest = scenario(root, "stream-mix-v4")
    streams = state["cursors"]["readers"][0]["mix"]["streams"]
    assert all(s["at"][1] > 0 and s["at"][2] is not None for s in streams)
    bare = copy.deepcopy(state)
    for s in bare["cursors"]["readers"][0]["mix"]["streams"]:
        s["at"][2] = None
    loader = make()
    loader.load_state_dict(bare)
    assert _batches(loader) == rest


def _nested(depth: int, kind: type):
    """A list (or dict) nested ``depth`` levels deep."""
    value = kind()
    for _ in range(depth):
        value = [value] if kind is list else {"a": value}
    return value


@pytest.mark.parametrize("name", SCENARIOS)
@pytest.mark.parametrize("kind", [list, dict])
def test_a_state_nested_past_any_saved_one_is_refused_naming_the_key(root, name, kind):
    """A value nested 100,000 levels deep anywhere in a state (Python's recursion limit is 1,000:
    a RecursionError in the checks, the comparisons or an error's own message before): a
    ResumeError naming the key that nests too deep."""
    state, _, _ = scenario(root, name)
    for path in [("config",), ("version",), paths_of(state)[-1]]:
        _refused(root, name, _set(path, _nested(100_000, kind)), "nested more than 32 levels")


@pytest.mark.parametrize("kind", [list, dict])
def test_the_nesting_bound_is_exact(root, kind):
    """A state whose deepest list or dict sits at level ``MAX_DEPTH`` parses; one level more is
    refused, naming that key (``data.x`` at level 2, so ``MAX_DEPTH - 2`` levels inside it)."""
    state, _, _ = scenario(root, "packed")
    ok, deep = copy.deepcopy(state), copy.deepcopy(state)
    ok["data"]["x"] = _nested(MAX_DEPTH - 2, kind)
    deep["data"]["x"] = _nested(MAX_DEPTH - 1, kind)
    LoaderState.from_dict(ok)
    with pytest.raises(ResumeError, match=r"key 'data\.x(\.a|\[0\])*': nested more than 32"):
        LoaderState.from_dict(deep)


def test_shard_of_names_the_shard_a_location_lies_in(root):
    """The one place a cursor's location is told its shard: a webdataset location names its shard
    first; an HF dataset's row lies in the shard of ``rows_per_shard`` rows holding it; a
    mixture's is its component's shard after the shards of the components before it (3 + 1 here);
    a source whose locations name no shard: None."""
    short, long = _paths(root)
    web = WebDatasetSource(short)
    loc = build_index(web, causal_lm_schema()).locations[-1].tolist()
    assert web.shard_of(loc) == loc[0] == 2
    hf = HFSource(_hf_sources()[0].dataset, rows_per_shard=20)
    assert [hf.shard_of((row,)) for row in (0, 19, 20, 79)] == [0, 0, 1, 3]
    mix = Mixture({"a": (WebDatasetSource(short), 0.5), "b": (WebDatasetSource(long), 0.5)})
    assert mix.shard_of((1, len(loc), 1, *loc[1:])) == 3 + 1
    mixed = Mixture({"a": (hf, 0.5), "b": (WebDatasetSource(long), 0.5)})
    assert mixed.shard_of((0, 1, 45)) == 2
    assert mixed.shard_of((1, len(loc), 0, *loc[1:])) == hf.num_shards + 0

    class Rows(HFSource):  # (a source whose locations do not name their shard)
        def shard_of(self, location):
            return Source.shard_of(self, location)

    assert Mixture({"a": (Rows(hf.dataset), 0.5), "b": (hf, 0.5)}).shard_of((0, 1, 45)) is None


def _python_calls(fn) -> int:
    """How many Python functions ``fn()`` calls (C calls not counted)."""
    import sys

    calls = [0]

    def count(frame, event, arg):
        if event == "call":
            calls[0] += 1

    sys.setprofile(count)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls[0]


@pytest.mark.parametrize("kind", ["ints", "floats", "mixed"])
def test_a_state_is_checked_at_a_python_step_per_list_not_per_value(root, kind):
    """The depth and number checks of a state take a Python step per dict or list, and C loops over
    their values: a state holding a list of 1,000 values and one of 100,000 cost the same count of
    Python calls (a list of ints and floats both is looked at value by value, without a call
    each); a bad value is still found, by its key."""
    state, _, _ = scenario(root, "packed")

    def calls(n: int, bad: bool = False) -> int:
        values = {"ints": list(range(n)), "floats": [0.5] * n}.get(kind)
        values = [*range(n // 2), *[0.5] * (n - n // 2)] if values is None else values
        s = copy.deepcopy(state)
        s["data"]["x"] = values
        if bad:
            values[n // 2] = 2**64 if kind == "ints" else float("nan")
            with pytest.raises(ResumeError, match=rf"key 'data\.x\[{n // 2}\]': a non-finite"):
                LoaderState.from_dict(s)
            return 0
        return _python_calls(lambda: LoaderState.from_dict(s))

    assert calls(1_000) == calls(100_000)
    calls(1_000, bad=True)


def test_a_buffered_sample_located_in_another_shard_than_its_id_is_refused_naming_it(root):
    """A reader's buffered record whose location lies in another shard than its sample id names:
    a ResumeError naming the key, both shards, and the record (its index and location)."""

    def edit(s):
        reader = s["stream"]["ranks"][0]["readers"][0]
        cursor = unpack_cursor(reader, "reader")
        record = cursor["buffer"][1]
        other = ((record[0] >> 32) + 1) % 5
        record[2] = other
        reader.clear()
        reader.update(pack_cursor(cursor))

    state, _, _ = scenario(root, "stream-v6")
    shard = unpack_cursor(state["stream"]["ranks"][0]["readers"][0], "r")["buffer"][1][0] >> 32
    says = (
        rf"key 'stream.ranks\[0\].readers\[0\]': a location in shard {(shard + 1) % 5}; expected "
        rf"one in shard {shard}, its sample id's \(its location 1: \[{(shard + 1) % 5}, "
    )
    _refused(root, "stream-v6", edit, says)
