"""The loader's start does not grow faster than the shard count (issue #28): the work of a start
(every function call, counted by ``cProfile``; file ``stat`` and ``open`` calls) is counted at 200
and at 2,000 shards, never timed. A fix hint built for every healthy sidecar (each one walking every
shard name with a regex) made the 2,000-shard start ~100x the 200-shard one; linear work gives
10x."""

from __future__ import annotations

import cProfile
import os
import pstats
import shlex
import sys
import threading
import warnings

import numpy as np
import pytest

from prealign.loaders import IndexOptions, PackedLoader, WebDatasetSource
from prealign.loaders.cli.main import main
from prealign.loaders.index.header_pass import write_sidecars
from prealign.loaders.index.merged import NAME, merge_sidecars, merged_path
from prealign.loaders.index.source_index import MergedIndexWarning
from prealign.loaders.sources import deadline
from prealign.schemas import ParallelLayout
from prealign.schemas.schema import causal_lm_schema

SCHEMA = causal_lm_schema()
SIZES = (200, 2000)
GROWTH = 10.5
"""Work at 2,000 shards over work at 200: linear is 10x (the fixed part of a start makes it
less)."""
SIDECAR_CALLS = 6.0
"""Function calls of a start from per-shard sidecars at 2,000 shards over 200: they are read and
checked at once (:mod:`~prealign.loaders.index.sidecar_bulk`: a few calls a layout, the file reads
made from C), 4.4x measured; one parse a sidecar made it 10x."""


def _tar_header(name: bytes, size: int) -> bytes:
    head = bytearray(512)
    head[: len(name)] = name
    head[100:108], head[108:116], head[116:124] = b"0000644\0", b"0000000\0", b"0000000\0"
    head[124:136], head[136:148], head[156] = b"%011o\0" % size, b"00000000000\0", ord("0")
    head[257:263], head[263:265] = b"ustar\0", b"00"
    head[148:156] = b" " * 8
    head[148:156] = b"%06o\0 " % sum(head)
    return bytes(head)


def _shards(root: str, n: int) -> list[str]:
    """``n`` one-sample shards of pre-tokenized ids (8..63 tokens), written as raw tar bytes
    (fast)."""
    os.makedirs(root, exist_ok=True)
    rng = np.random.default_rng(n)
    paths = []
    for s in range(n):
        ids = np.arange(int(rng.integers(8, 64)), dtype=np.int64) + s % 1000 + 1
        header = b"{'descr': '<i8', 'fortran_order': False, 'shape': (%d,), }" % ids.size
        header += b" " * (117 - len(header)) + b"\n"
        data = b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header + ids.tobytes()
        body = (
            _tar_header(b"%06d.input_ids.npy" % s, len(data))
            + data
            + bytes(-len(data) % 512)
            + bytes(1024)
        )
        path = os.path.join(root, f"s-{s:05d}.tar")
        with open(path, "wb") as f:
            f.write(body)
        paths.append(path)
    return paths


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """``{shards: paths}``: each size indexed (a sidecar per shard) and merged into
    ``<folder>/merged/``."""
    out = {}
    for n in SIZES:
        paths = _shards(str(tmp_path_factory.mktemp(f"s{n}")), n)
        write_sidecars(WebDatasetSource(paths), SCHEMA)
        out[n] = paths
    return out


def _loader(source, **kw) -> PackedLoader:
    return PackedLoader(
        source, schema=SCHEMA, layout=ParallelLayout(), token_budget=256, seed=1, **kw
    )


class _Syscalls:
    """Counts ``os.stat`` and file opens (``open``, ``os.open``), and the reads of an open file
    (``os.fstat``, ``os.lseek``, ``os.read``, ``os.pread``, ``os.preadv``) while installed."""

    READS = ("fstat", "lseek", "read", "pread", "preadv")

    def __init__(self, monkeypatch):
        self.stats = self.opens = self.reads = 0
        counted_calls = [(os, "stat", "stats"), (os, "open", "opens")]
        counted_calls += [(os, name, "reads") for name in self.READS]
        for mod, name, counter in counted_calls:
            real = getattr(mod, name)

            def counted(*a, _real=real, _counter=counter, **kw):
                setattr(self, _counter, getattr(self, _counter) + 1)
                return _real(*a, **kw)

            monkeypatch.setattr(mod, name, counted)
        real_open = open

        def counted_open(*a, **kw):
            self.opens += 1
            return real_open(*a, **kw)

        monkeypatch.setattr("builtins.open", counted_open)


def _work(run, monkeypatch) -> tuple[int, pstats.Stats, _Syscalls]:
    """Function calls (``cProfile``: Python and builtin, in this thread and every thread started
    meanwhile, e.g. the threads sidecars are read on and the read deadline's) of ``run()``, its
    profile, its stat / open counts."""
    profiles = [cProfile.Profile()]

    def in_new_thread(*_):  # a thread's first event: a profiler of its own for the rest of it
        profiles.append(cProfile.Profile())
        profiles[-1].enable()

    with monkeypatch.context() as m:
        calls = _Syscalls(m)
        # the read deadline's thread (shard opens, first-read checks, a micro-batch's reads) made
        # anew, so its calls are counted too
        m.setattr(deadline, "_caller", None)
        threading.setprofile(in_new_thread)
        profiles[0].enable()
        try:
            run()
        finally:
            profiles[0].disable()
            threading.setprofile(None)
    stats = pstats.Stats(*profiles)
    return sum(v[1] for v in stats.stats.values()), stats, calls


def _growth(small: pstats.Stats, big: pstats.Stats, growth: float = GROWTH) -> str:
    """The functions whose call counts grew most (beyond ``growth`` times): what a failure points
    at."""
    rows = []
    for fn, v in big.stats.items():
        before = small.stats.get(fn, (0, 0))[1]
        rows.append(
            (
                v[1] - growth * before,
                f"{fn[2]} ({os.path.basename(fn[0])}:{fn[1]}): {before} -> {v[1]}",
            )
        )
    return "; ".join(r for _, r in sorted(rows, reverse=True)[:6])


def _first_batch_and_resume(make):
    """A loader's first batch, then a new loader restored to the state after its second batch, its
    first."""
    loader = make()
    it = iter(loader)
    next(it)
    next(it)
    state = loader.state_dict()
    again = make()
    again.load_state_dict(state)
    next(iter(again))


def _measure(data, monkeypatch, make) -> dict:
    """``{shards: _work(...)}`` of a first batch and a resume at each size, after one unmeasured run
    at the smaller size (the imports and caches of a first start are no part of the growth)."""
    _first_batch_and_resume(lambda: make(data[SIZES[0]]))
    return {
        n: _work(lambda n=n: _first_batch_and_resume(lambda: make(data[n])), monkeypatch)
        for n in SIZES
    }


def _assert_linear(found: dict, what: str, calls: float = GROWTH) -> None:
    (small, s_stats, s_sys), (big, b_stats, b_sys) = found[SIZES[0]], found[SIZES[1]]
    assert big <= calls * small, (
        f"{what}: {big:,} calls at {SIZES[1]} shards, {small:,} at {SIZES[0]} "
        f"({big / small:.1f}x > {calls}x); grew most: {_growth(s_stats, b_stats)}"
    )
    assert b_sys.opens <= GROWTH * s_sys.opens and b_sys.stats <= GROWTH * max(s_sys.stats, 1), (
        what,
        "opens",
        s_sys.opens,
        b_sys.opens,
        "stats",
        s_sys.stats,
        b_sys.stats,
    )
    assert b_sys.reads <= GROWTH * max(s_sys.reads, 1), (what, "reads", s_sys.reads, b_sys.reads)


def _assert_no_stat_per_shard(calls: _Syscalls) -> None:
    """Two starts over 2,000 shards: the first batches read a few shards, never one ``stat`` or open
    each."""
    assert calls.opens < SIZES[1] // 20 and calls.stats < SIZES[1] // 20, (calls.opens, calls.stats)


@pytest.mark.slow
def test_a_start_from_per_shard_sidecars_grows_linearly_with_the_shards(data, monkeypatch):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        found = _measure(data, monkeypatch, lambda paths: _loader(WebDatasetSource(paths)))
    _assert_linear(found, "start from sidecars", calls=SIDECAR_CALLS)
    # each extra sidecar of the two starts (first batch, resume) costs at most an open, a seek to
    # its end and one read (its close uncounted): no stat, no second read
    (_, _, small), (_, _, big) = found[SIZES[0]], found[SIZES[1]]
    extra = 2 * (SIZES[1] - SIZES[0])
    assert big.opens + big.reads + big.stats - small.opens - small.reads - small.stats <= (
        3 * extra + 300
    ), (small.opens, small.reads, small.stats, big.opens, big.reads, big.stats)
    # three starts over 2,000 sidecars, one warning naming the command that merges them (none at
    # 200)
    advice = [str(w.message) for w in seen if issubclass(w.category, MergedIndexWarning)]
    assert len(advice) == 1 and "s-{00000..01999}.tar" in advice[0], advice
    command = advice[0].split("run `", 1)[1].split("`", 1)[0]
    assert command.startswith("prealign index --text --merge ")
    assert main(shlex.split(command)[1:]) == 0
    assert os.path.exists(merged_path(WebDatasetSource(data[SIZES[1]])))
    os.remove(merged_path(WebDatasetSource(data[SIZES[1]])))


@pytest.mark.slow
def test_a_start_from_a_merged_index_reads_one_file_and_no_shard(
    data, monkeypatch, tmp_path_factory
):
    merged = {}
    for n in SIZES:
        folder = str(tmp_path_factory.mktemp(f"merged{n}"))
        for p in data[n]:  # the sidecars in an index folder, merged there
            os.link(
                p + ".prealign-index.npz",
                os.path.join(folder, os.path.basename(p) + ".prealign-index.npz"),
            )
        source = WebDatasetSource(data[n], index_dir=folder)
        merge_sidecars(source)
        assert os.path.exists(merged_path(source))
        merged[n] = (n, folder)
    found = _measure(
        merged,
        monkeypatch,
        lambda where: _loader(WebDatasetSource(data[where[0]], index_dir=where[1])),
    )
    _assert_linear(found, "start from a merged index")
    _assert_no_stat_per_shard(found[SIZES[1]][2])
    # (the first reads' checks, in the read deadline's thread, are among the calls counted)
    assert any(fn[2] == "_probe_of_file" for fn in found[SIZES[1]][1].stats)


@pytest.mark.slow
def test_a_prebuilt_index_does_not_stat_every_shard_at_start(data, monkeypatch, tmp_path_factory):
    saved = {}
    for n in SIZES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            index = _loader(WebDatasetSource(data[n])).prepare().index
        saved[n] = (n, str(tmp_path_factory.mktemp(f"idx{n}") / "index.npz"))
        index.save(saved[n][1])
    found = _measure(
        saved,
        monkeypatch,
        lambda where: _loader(
            WebDatasetSource(data[where[0]], sidecars=False),
            indexing=IndexOptions(prebuilt=where[1]),
        ),
    )
    _assert_linear(found, "start from a prebuilt index")
    _assert_no_stat_per_shard(found[SIZES[1]][2])


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))


@pytest.mark.parametrize("n", SIZES)
def test_shard_list_check_no_call_per_shard(n, monkeypatch):
    """The shard list's duplicate check (``check_unique``, run when a source is built) makes no
    per-shard call for absolute normal paths (the 2,000 ``shard_identity`` calls were most of what a
    merged start at 2,000 shards added over 20), and still names a shard listed twice under two
    spellings."""
    from prealign.loaders.errors import ConfigError
    from prealign.loaders.sources import webdataset

    calls = []
    real = webdataset.shard_identity
    monkeypatch.setattr(webdataset, "shard_identity", lambda u: calls.append(u) or real(u))
    urls = [f"/data/text/shard-{i:06d}.tar" for i in range(n)]
    webdataset.check_unique(urls)
    assert webdataset.expand_urls(urls) == urls
    assert calls == []
    for twice in (
        urls + [urls[7]],
        urls + ["/data/text/./shard-000007.tar"],
        urls[:3] + ["file:///data/text/shard-000001.tar"],
    ):
        with pytest.raises(ConfigError, match="are one shard"):
            webdataset.check_unique(twice)


def _regrouped(paths: list[str], root: str, per_shard: int) -> list[str]:
    """The samples of the one-sample shards ``paths``, the same bytes, ``per_shard`` to a shard."""
    os.makedirs(root, exist_ok=True)
    out = []
    for k in range(0, len(paths), per_shard):
        body = b""
        for p in paths[k : k + per_shard]:
            with open(p, "rb") as f:
                body += f.read()[:-1024]  # (each ends with the archive's two zero blocks)
        out.append(os.path.join(root, f"g-{k // per_shard:05d}.tar"))
        with open(out[-1], "wb") as f:
            f.write(body + bytes(1024))
    return out


@pytest.mark.slow
def test_a_merged_start_makes_no_call_per_shard(data, monkeypatch, tmp_path_factory):
    """From a merged index, the same 2,000 samples in 2,000 shards and in 20: the start over 100x
    the shards makes fewer extra function calls than there are extra shards, and opens only the
    shards its batches read (the shard names are compared, checked for duplicates and expanded
    as whole texts; no ``stat`` or probe open per shard). A Python step per shard name (a
    ``rpartition`` per name, a regex match per URL in ``describe``) was 3 calls per shard."""
    many = data[SIZES[1]]
    few = _regrouped(many, str(tmp_path_factory.mktemp("few")), len(many) // 20)
    write_sidecars(WebDatasetSource(few), SCHEMA)  # (the 2,000 have theirs: ``data``)
    where = {}
    for paths in (few, many):  # the merged index in a folder of its own, the sidecars not there
        folder = str(tmp_path_factory.mktemp("merged"))
        merge_sidecars(WebDatasetSource(paths), os.path.join(folder, NAME))
        where[len(paths)] = (paths, folder)

    def start(n):
        paths, folder = where[n]
        _first_batch_and_resume(lambda: _loader(WebDatasetSource(paths, index_dir=folder)))

    start(len(few))  # (the imports and caches of a first start)
    found = {n: _work(lambda n=n: start(n), monkeypatch) for n in where}
    (small, s_stats, _), (big, b_stats, b_sys) = found[len(few)], found[len(many)]
    extra_shards = len(many) - len(few)
    assert big - small < extra_shards // 2, (
        f"{big:,} calls at {len(many)} shards, {small:,} at {len(few)} (same samples); grew most: "
        f"{_growth(s_stats, b_stats, 1.0)}"
    )
    # two starts: the first batches read a few dozen shards, each opened once (its check on the
    # open file), never a stat or open per shard
    assert b_sys.opens + b_sys.stats < 100, (b_sys.opens, b_sys.stats)


def test_a_start_does_not_describe_a_webdataset_source(tmp_path, monkeypatch):
    """``describe()`` lists a size per shard (a list of 100,000 at 100,000 shards); a start without
    a batch share takes only its kind, from the class (``KIND``), and still records it."""
    paths = _shards(str(tmp_path), 20)
    write_sidecars(WebDatasetSource(paths), SCHEMA)
    described = []
    real = WebDatasetSource.describe
    monkeypatch.setattr(
        WebDatasetSource, "describe", lambda self: described.append(1) or real(self)
    )
    loader = _loader(WebDatasetSource(paths))
    next(iter(loader))
    assert not described
    assert loader._fingerprint["source"] == WebDatasetSource.KIND == real(loader.source)["kind"]


def _collector_edges(root) -> int:
    """The references the garbage collector follows from ``root`` and the tracked containers it
    holds (modules, classes and functions not entered): what a young collection walks for it."""
    import gc
    import types

    seen, todo, edges = {id(root)}, [root], 0
    while todo:
        refs = gc.get_referents(todo.pop())
        edges += len(refs)
        for r in refs:
            if id(r) in seen or not gc.is_tracked(r):
                continue
            if isinstance(r, (type, types.ModuleType, types.FunctionType)):
                continue
            seen.add(id(r))
            todo.append(r)
    return edges


def test_a_source_keeps_no_object_per_shard_for_the_collector(tmp_path):
    """A source over shards of one name length keeps their names as one text (``Lines``), not a
    list the garbage collector walks in every young collection of a start (at 100k shards ~3 ms
    a walk, two in a first batch); the references it follows from the source are as many at
    2,000 shards as at 200 (a few dozen). The names read, compare and pickle as the list they
    were."""
    import pickle

    edges = {}
    for n in SIZES:
        urls = [f"{tmp_path}/shard-{i:06d}.tar" for i in range(n)]
        source = WebDatasetSource(urls)
        edges[n] = _collector_edges(source)
        assert source.urls == urls and list(source.urls) == urls and len(source.urls) == n
        assert source.urls[n - 1] == urls[-1] and source.urls[-n] == urls[0]
        assert source.urls[np.int64(5)] == urls[5] and source.urls[2:4] == urls[2:4]
        assert pickle.loads(pickle.dumps(source)).urls == urls
        again = WebDatasetSource(source.urls)  # (a source of another's shards: the same text)
        assert again.urls == urls and again.folder == source.folder == f"{tmp_path}/"
        with pytest.raises(IndexError):
            source.urls[n]
        urls.append("changed")  # (the caller's list is not the source's)
        assert len(source.urls) == n
    assert edges[SIZES[1]] < edges[SIZES[0]] + 50, edges  # (a list of the names: +1,800)
    # names of other lengths: a list of them (each a str the collector does not enter)
    mixed = WebDatasetSource([f"{tmp_path}/s-{i}.tar" for i in range(12)])
    assert isinstance(mixed.urls, list) and mixed.urls[11] == f"{tmp_path}/s-11.tar"


FIRST_READ_SIZES = (20, 200)
FIRST_READ_CALLS = 48
"""Function calls (Python and builtin, ``cProfile``) a newly touched shard adds to a micro-batch's
read-ahead, in micro-batches of 10: its open, its check against the index, its first sample's
read. 42 measured (Python 3.11); 66 when each first read asked its URL twice whether it was a
``.tar.gz``, read the shard twice and made a buffered file for it."""


def test_a_newly_touched_shard_costs_one_open_one_read_and_one_check(tmp_path_factory, monkeypatch):
    """The work a micro-batch's read-ahead adds per shard it reads first (open, check against the
    index, the first sample's bytes), counted at 20 and at 200 one-sample shards: the same at both
    sizes, and small. A shard of up to 128 KiB is opened once and read once (the check's whole
    read, of its recorded size + 1, also gives its size and the sample's bytes), one ``fstat`` (the
    open's), no ``stat``; the check runs once per shard and hashes it once."""
    from prealign.loaders import build_index
    from prealign.loaders.sources import webdataset

    found = {}
    for n in FIRST_READ_SIZES:
        paths = _shards(str(tmp_path_factory.mktemp(f"first{n}")), n)
        write_sidecars(WebDatasetSource(paths), SCHEMA)
        built = WebDatasetSource(paths)
        rows = np.asarray(build_index(built, SCHEMA).locations)
        assert sorted(rows[:, 0].tolist()) == list(range(n))  # (a row a shard)

        def read_all(paths=paths, checks=built.shard_check, rows=rows):
            source = WebDatasetSource(paths)
            source.shard_check = checks
            for k in range(0, len(rows), 10):  # micro-batches of 10 rows, each shard new
                source.read_ahead(rows[k : k + 10])
                assert len(source._local()["ahead"]) == len(rows[k : k + 10])
            source.close_files()

        read_all()  # (the imports and caches of a first run)
        with monkeypatch.context() as m:  # the calls: the read deadline's work run inline
            m.setattr(webdataset, "call_with_timeout", lambda fn, timeout: fn())
            profile = cProfile.Profile()
            profile.enable()
            read_all()
            profile.disable()
        stats = pstats.Stats(profile)
        fstats = []  # the system calls (apart: their counting makes calls of its own)
        real_fstat = os.fstat
        with monkeypatch.context() as m:
            m.setattr(os, "fstat", lambda fd: fstats.append(fd) or real_fstat(fd))
            syscalls = _work(read_all, monkeypatch)[2]
        found[n] = (sum(v[1] for v in stats.stats.values()), stats, syscalls, len(fstats))
    (small, s_stats, _, _), (big, b_stats, _, _) = (found[n] for n in FIRST_READ_SIZES)
    per_shard = (big - small) / (FIRST_READ_SIZES[1] - FIRST_READ_SIZES[0])
    assert per_shard <= FIRST_READ_CALLS, (
        f"{per_shard:.1f} calls per newly touched shard; grew most: "
        f"{_growth(s_stats, b_stats, 1.0)}"
    )
    assert big <= GROWTH * small, (big, small)
    for n, (_, stats, syscalls, fstat) in found.items():
        calls = {fn[2]: v[1] for fn, v in stats.stats.items()}
        assert calls["_probe_of_file"] == n and calls["_open"] == n, calls
        assert syscalls.opens == n and syscalls.stats == 0, (syscalls.opens, syscalls.stats)
        # per shard: the check's one pread and the open's fstat
        assert syscalls.reads == 2 * n and fstat == n, (syscalls.reads, fstat, n)
