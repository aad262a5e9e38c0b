"""One loader core under both loaders (issue #16): the same options, validation, state format,
worker path for typed errors and dead workers, surface (set_epoch, from_parallel_state, one live
iterator), a state_dict that touches no file, and infrastructure errors never counted as bad
data."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from unittest import mock

import pytest
import torch
from torch.utils.data import DataLoader

from prealign.loaders import (
    BadDataPolicy,
    BadSampleError,
    IndexOptions,
    LoaderUsageError,
    LoadingOptions,
    PackedLoader,
    PlanError,
    PlannerConfig,
    ResumeError,
    ShardTimeoutError,
    StreamingPackedLoader,
    WebDatasetSource,
    WorkerError,
    build_index,
)
from prealign.loaders.conformance import batches_equal
from prealign.loaders.sources.remote import RemoteReadError
from prealign.loaders.sources.webdataset import numpy_fields
from prealign.schemas import ConfigError, ParallelLayout, causal_lm_schema
from tests.loader_helpers import sample_lengths, write_shards

SCHEMA = causal_lm_schema()
LAYOUT = ParallelLayout()
BUDGET = 128
SKIP = BadDataPolicy(on_error="skip", warn=False)
KINDS = ["packed", "streaming"]


def _make(kind: str, src, **kw):
    kw = {"schema": SCHEMA, "layout": LAYOUT, "token_budget": BUDGET, **kw}
    if kind == "streaming":
        kw.setdefault("planner", PlannerConfig(buffer_size=16))
        return StreamingPackedLoader(src, **kw)
    return PackedLoader(src, **kw)


def _ids(batch) -> list[int]:
    return batch["sample_index"].tolist()


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_shards(
        str(tmp_path_factory.mktemp("core")), sample_lengths(48, seed=3), num_shards=4
    )


# ---- 1, 2: one set of options, one validation
# ---------------------------------------------------------
@pytest.mark.parametrize(
    "bad",
    [
        {"token_budget": 4096.7},
        {"token_budget": True},
        {"token_budget": "128"},
        {"seed": -1},
        {"seed": True},
        {"seed": 2.5},
        {"dp_rank": 2, "dp_size": 2},
        {"dp_rank": True},
        {"dp_size": 0},
        {"num_workers": -1},
        {"num_workers": 1.0},
        {"cp_rank": -1},
        {"loading": {"timeout": 1}},
        {"bad_data": "skip"},
        {"planner": {"buffer_size": 8}},
    ],
)
def test_both_loaders_refuse_the_same_bad_values_with_the_same_error(shards, bad):
    errors = []
    for kind in KINDS:
        with pytest.raises(PlanError) as err:
            _make(kind, WebDatasetSource(shards), **bad)
        assert isinstance(err.value, ConfigError)
        errors.append((type(err.value), str(err.value)))
    assert errors[0] == errors[1]


def test_streaming_takes_buffer_size_and_oversize_from_the_planner_like_packed(shards):
    src = WebDatasetSource(shards)
    legacy = StreamingPackedLoader(
        src, schema=SCHEMA, layout=LAYOUT, token_budget=BUDGET, buffer_size=16, oversize="truncate"
    )
    planned = _make("streaming", src, planner=PlannerConfig(buffer_size=16, oversize="truncate"))
    assert legacy.planner == planned.planner == PlannerConfig(buffer_size=16, oversize="truncate")
    assert all(batches_equal(a, b) for a, b in zip(legacy, planned))
    with pytest.raises(PlanError, match="buffer_size: given twice"):
        _make("streaming", src, planner=PlannerConfig(buffer_size=16), buffer_size=32)
    with pytest.raises(PlanError, match="strategy.*does not apply"):
        _make("streaming", src, planner=PlannerConfig(strategy="first_fit"))
    assert legacy.workers == planned.workers and legacy.workers.num_workers == 0


def test_one_state_format_for_both_loaders(shards):
    states = {}
    for kind in KINDS:
        loader = _make(kind, WebDatasetSource(shards))
        it = iter(loader)
        next(it), next(it)
        states[kind] = json.loads(json.dumps(loader.state_dict()))
        del it
    keys = {k: sorted(s) for k, s in states.items()}
    assert (
        keys["packed"]
        == keys["streaming"]
        == ["config", "data", "epoch", "kind", "position", "version"]
    )
    assert states["packed"]["version"] == states["streaming"]["version"]
    assert states["streaming"]["kind"] == "prealign.StreamingPackedLoader"
    assert (states["streaming"]["epoch"], states["streaming"]["position"]) == (0, 2)
    assert set(states["streaming"]["data"]) >= {"source", "digest"}
    for kind in KINDS:  # the same strict parse: the same message for the same edit
        with pytest.raises(ResumeError, match="'epoch': expected an int >= 0, got 2.7"):
            _make(kind, WebDatasetSource(shards)).load_state_dict({**states[kind], "epoch": 2.7})
        other = states["streaming" if kind == "packed" else "packed"]
        with pytest.raises(ResumeError, match="key 'kind'"):
            _make(kind, WebDatasetSource(shards)).load_state_dict(other)


def test_a_streaming_state_of_other_data_is_refused(shards, tmp_path):
    state = _make("streaming", WebDatasetSource(shards)).state_dict()
    other = write_shards(str(tmp_path), sample_lengths(30, seed=9), num_shards=4)
    with pytest.raises(ResumeError, match="data digest"):
        _make("streaming", WebDatasetSource(other)).load_state_dict(state)


# ---- 3: one worker path for typed errors and dead workers
# --------------------------------------------
class _FailOn:
    """numpy_fields, but sample ``key`` raises ``make()`` once the file ``flag`` exists (after
    indexing); in workers, writes its pid to ``pids/`` and sleeps ``delay``."""

    def __init__(
        self,
        flag: str,
        key: str = "000005",
        error: str = "value",
        delay: float = 0.0,
        pids: str = "",
    ):
        self.flag, self.key, self.error, self.delay, self.pids = flag, key, error, delay, pids

    def __call__(self, sample):
        from torch.utils.data import get_worker_info

        if get_worker_info() is not None:
            if self.pids:
                open(os.path.join(self.pids, str(os.getpid())), "w").close()
            time.sleep(self.delay)
        if sample["__key__"] == self.key and os.path.exists(self.flag):
            if self.error == "value":
                raise ValueError("no such token")
            if self.error == "remote":
                raise RemoteReadError("http://host/shard.tar", "503 after 5 retries")
            if self.error == "timeout":
                raise ShardTimeoutError("http://host/shard.tar", 512, "no progress in 120 s")
            if self.error == "config":
                raise ConfigError("tokenizer: not configured")
            raise OSError(5, "Input/output error")
        return numpy_fields(sample)


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("kind", KINDS)
def test_a_bad_sample_reaches_the_caller_as_its_own_type(kind, workers, shards, tmp_path):
    flag = tmp_path / "changed"
    loader = _make(
        kind, WebDatasetSource(shards, transform=_FailOn(str(flag))), num_workers=workers
    )
    loader.prepare()
    flag.write_text("")
    with pytest.raises(BadSampleError, match="transform to succeed") as exc:
        list(loader)
    assert type(exc.value) is BadSampleError and exc.value.field is None
    assert "000005" in exc.value.sample and exc.value.actual == "ValueError: no such token"
    assert "Caught" not in str(exc.value)


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("kind", KINDS)
def test_another_prealign_error_keeps_its_type_and_attributes(kind, workers, shards, tmp_path):
    flag = tmp_path / "changed"
    loader = _make(
        kind,
        WebDatasetSource(shards, transform=_FailOn(str(flag), error="remote")),
        num_workers=workers,
        bad_data=SKIP,
    )
    loader.prepare()
    flag.write_text("")
    with pytest.raises(RemoteReadError) as exc:  # under skip too: not bad data
        list(loader)
    assert type(exc.value) is RemoteReadError and exc.value.url == "http://host/shard.tar"


def _wait_for_pids(folder, n: int, timeout: float = 30.0) -> list[int]:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        pids = [int(p) for p in os.listdir(folder)]
        if len(pids) >= n:
            return pids
        time.sleep(0.01)
    raise AssertionError(f"no {n} worker pids in {timeout} s")


@pytest.mark.slow
def test_a_streaming_worker_killed_with_sigkill_is_a_worker_error_and_the_loader_continues(
    shards, tmp_path
):
    pids = tmp_path / "pids"
    pids.mkdir()
    ref = _make("streaming", WebDatasetSource(shards), num_workers=2)
    expected = [_ids(b) for b in ref]
    assert len(expected) >= 6
    loader = _make(
        "streaming",
        WebDatasetSource(shards, transform=_FailOn("/nonexistent", delay=0.02, pids=str(pids))),
        num_workers=2,
    )
    it = iter(loader)
    got = [_ids(next(it))]
    with pytest.raises(WorkerError, match="iterate the loader again"):
        # torch's SIGCHLD handler can raise in whatever the main thread runs when the worker dies
        try:
            os.kill(_wait_for_pids(pids, 2)[0], signal.SIGKILL)
        except RuntimeError:
            pass
        for b in it:
            got.append(_ids(b))
    assert loader.state_dict()["position"] == len(got) < len(expected)
    _let_torch_report_the_killed_worker()
    got += [_ids(b) for b in loader]  # fresh readers, the rest of epoch 0
    assert got == expected


def _let_torch_report_the_killed_worker() -> None:
    """torch's SIGCHLD handler raises ``RuntimeError`` wherever the main thread is when it learns of
    the killed worker, which can be after the loader already reported it (then inside pytest's own
    frames): let it, here."""
    for _ in range(10):
        try:
            time.sleep(0.05)
        except RuntimeError:
            return


# ---- 4: the same surface
# ------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_set_epoch_from_parallel_state_and_one_live_iterator(kind, shards):
    ref = _make(kind, WebDatasetSource(shards))
    epochs = [[_ids(b) for b in ref] for _ in range(2)]
    loader = _make(kind, WebDatasetSource(shards))
    loader.set_epoch(1)
    assert loader.epoch == 1 and [_ids(b) for b in loader] == epochs[1]
    with pytest.raises(PlanError, match="epoch"):
        loader.set_epoch(-1)
    cls = type(loader)
    one = cls.from_parallel_state(WebDatasetSource(shards), schema=SCHEMA, token_budget=BUDGET)
    assert one.dp_size == 1 and one.dp_rank == 0 and one.cp_rank is None
    loader = _make(kind, WebDatasetSource(shards))
    first = iter(loader)
    next(first)
    second = iter(loader)
    next(second)
    with pytest.raises(LoaderUsageError, match="newer iterator"):
        next(first)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_a_superseded_iterator_takes_no_batch_of_the_new_one_with_persistent_workers(kind, shards):
    """The two loops share the persistent workers: the superseded one stops before asking them for a
    batch, so the new loop gets every micro-batch of the epoch, in order, none lost."""
    ref = [_ids(b) for b in _make(kind, WebDatasetSource(shards))]
    loader = _make(
        kind,
        WebDatasetSource(shards),
        num_workers=1,
        loading=LoadingOptions(persistent_workers=True),
    )
    first = iter(loader)
    got = [_ids(next(first))]
    second = iter(loader)
    got.append(_ids(next(second)))
    with pytest.raises(LoaderUsageError, match="newer iterator"):
        next(first)
    got += [_ids(b) for b in second]
    assert got == ref if kind == "packed" else sorted(map(tuple, got)) == sorted(map(tuple, ref))


@pytest.mark.parametrize("kind", KINDS)
def test_load_state_dict_under_a_live_iterator_is_refused(kind, shards):
    loader = _make(kind, WebDatasetSource(shards))
    state = loader.state_dict()
    it = iter(loader)
    next(it)
    with pytest.raises(LoaderUsageError, match="live iterator"):
        loader.load_state_dict(state)
    it.close()
    loader.load_state_dict(state)  # closed: allowed
    assert loader.state_dict()["position"] == 0


# ---- 5: state_dict touches no file
# --------------------------------------------------------------------
class _FileCalls:
    """Counts os.stat / os.lstat calls and ``open`` audit events while active (the real calls still
    run)."""

    hooked = False
    active: "_FileCalls | None" = None

    def __init__(self):
        self.calls: list[str] = []

    @classmethod
    def _hook(cls, event, args):
        if cls.active is not None and event in ("open", "os.listdir", "os.scandir"):
            cls.active.calls.append(event)

    def __enter__(self):
        if not _FileCalls.hooked:
            sys.addaudithook(_FileCalls._hook)
            _FileCalls.hooked = True
        real_stat, real_lstat = os.stat, os.lstat

        def stat(*a, **k):
            self.calls.append("stat")
            return real_stat(*a, **k)

        def lstat(*a, **k):
            self.calls.append("lstat")
            return real_lstat(*a, **k)

        self._patches = [mock.patch("os.stat", stat), mock.patch("os.lstat", lstat)]
        for p in self._patches:
            p.start()
        _FileCalls.active = self
        return self

    def __exit__(self, *exc):
        _FileCalls.active = None
        for p in self._patches:
            p.stop()


@pytest.fixture(scope="module")
def many_shards(tmp_path_factory):
    return write_shards(
        str(tmp_path_factory.mktemp("many")), sample_lengths(400, seed=1), num_shards=200
    )


def test_the_counter_counts(many_shards):
    with _FileCalls() as fc:
        WebDatasetSource(many_shards).describe()
        open(many_shards[0], "rb").close()
    assert fc.calls.count("stat") >= 200 and "open" in fc.calls


@pytest.mark.parametrize("kind", KINDS)
def test_state_dict_touches_no_file(kind, many_shards):
    loader = (
        _make(kind, WebDatasetSource(many_shards), indexing=IndexOptions(distributed=False))
        if kind == "packed"
        else _make(kind, WebDatasetSource(many_shards))
    )
    it = iter(loader)
    next(it)
    loader.state_dict()  # (the first may prepare)
    with _FileCalls() as fc:
        for _ in range(3):
            state = loader.state_dict()
    assert len(fc.calls) <= 5, fc.calls[:10]
    assert state["position"] == 1
    it.close()


# ---- 6: only SampleErrors count as bad data
# ------------------------------------------------------------
INFRA = {
    "remote": RemoteReadError,
    "timeout": ShardTimeoutError,
    "config": ConfigError,
    "os": OSError,
}


@pytest.mark.parametrize("error", sorted(INFRA))
def test_an_infrastructure_error_in_a_transform_propagates_in_the_index_pass(
    error, shards, tmp_path
):
    flag = tmp_path / "on"
    flag.write_text("")
    src = WebDatasetSource(shards, transform=_FailOn(str(flag), error=error))
    with pytest.raises(INFRA[error]):
        build_index(src, SCHEMA, policy=SKIP)
    with pytest.raises(INFRA[error]):
        list(_make("streaming", src, bad_data=SKIP))
    counted = build_index(
        WebDatasetSource(shards, transform=_FailOn(str(flag))), SCHEMA, policy=SKIP
    )
    assert counted.report.counts == {"bad_sample": 1}  # a plain ValueError stays bad data


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("error", sorted(INFRA))
def test_an_infrastructure_error_at_load_time_propagates_under_skip(
    error, workers, shards, tmp_path
):
    flag = tmp_path / "on"
    loader = _make(
        "packed",
        WebDatasetSource(shards, transform=_FailOn(str(flag), error=error)),
        bad_data=SKIP,
        num_workers=workers,
    )
    loader.prepare()
    flag.write_text("")
    with pytest.raises(INFRA[error]):
        list(loader)
    assert "bad_sample" not in loader.report.counts


# ---- 7: torch internals checked, never assumed
# ----------------------------------------------------------
class _Wrapped:
    """An iterator of a torch whose multi-process iterator lacks ``_workers``."""

    def __init__(self, inner):
        self._inner = inner

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._inner)


class _OtherTorchLoader(DataLoader):
    def __iter__(self):
        return _Wrapped(super().__iter__())


class _NoIteratorSlot(DataLoader):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        del self._iterator


@pytest.mark.slow
def test_missing_torch_internals_fail_loudly_naming_the_version():
    from prealign.loaders.errors import UnsupportedTorchError
    from prealign.loaders.serve.workers import worker_batches

    data = list(range(4))
    with pytest.raises(
        UnsupportedTorchError, match=re.escape(f"torch {torch.__version__}") + ".*_workers"
    ):
        list(worker_batches(_OtherTorchLoader(data, num_workers=1)))
    with pytest.raises(UnsupportedTorchError, match="_iterator"):
        list(worker_batches(_NoIteratorSlot(data, num_workers=1, persistent_workers=True)))
    assert [
        int(x) for x in worker_batches(DataLoader(data, num_workers=1))
    ] == data  # the real one passes
    assert [
        int(x) for x in worker_batches(_OtherTorchLoader(data, num_workers=0))
    ] == data  # no workers: nothing needed
