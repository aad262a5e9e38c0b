"""Shard checks off the loader's start (issue #22): a shard is checked against its sidecar at its
first read, in the process that reads it, before any of its samples is served; one merged index file
stands for the sidecars."""

from __future__ import annotations

import os

import numpy as np
import pytest

from prealign.loaders import BadDataPolicy, PackedLoader, WebDatasetSource, build_index
from prealign.loaders.errors import ChangedShardError, MissingShardError, StaleIndexError
from prealign.loaders.index.build import merge_records, resolve_signatures
from prealign.loaders.index.header_pass import write_sidecars
from prealign.loaders.index.merged import merge_sidecars, merged_path, merged_records
from prealign.loaders.sources.shard_files import SUFFIX
from prealign.schemas import ParallelLayout
from prealign.schemas.schema import causal_lm_schema
from tests.loader_helpers import sample_lengths, write_shards
from tests.loaders.index.test_sidecar import _bad_members

SCHEMA = causal_lm_schema()
SKIP = BadDataPolicy(on_error="skip", max_consecutive=50)


def _loader(paths, **kw) -> PackedLoader:
    return PackedLoader(
        WebDatasetSource(paths),
        schema=SCHEMA,
        layout=ParallelLayout(),
        token_budget=128,
        seed=1,
        bad_data=SKIP,
        **kw,
    )


def _shards(tmp_path, n=3, extra=None):
    paths = write_shards(str(tmp_path), sample_lengths(60), num_shards=n, extra=extra)
    write_sidecars(WebDatasetSource(paths), SCHEMA)
    return paths


def _served_shards(loader, batches) -> set[int]:
    return {int(s) for b in batches for s in loader.index.shards[b["sample_index"].numpy()]}


def _change(path: str) -> None:
    """Other bytes in the first 64 KiB, same size."""
    raw = bytearray(open(path, "rb").read())
    raw[raw.index(b"\x93NUMPY") + 130] ^= 0x55
    with open(path, "wb") as f:
        f.write(raw)


@pytest.mark.parametrize("workers", [0, 1])
@pytest.mark.parametrize("how", ["changed", "missing"])
def test_a_changed_or_missing_shard_raises_at_its_first_read_never_as_bad_data(
    tmp_path, workers, how
):
    paths = _shards(tmp_path)
    if how == "changed":
        _change(paths[1])
    else:
        os.remove(paths[1])
    loader = _loader(
        paths, num_workers=workers
    ).prepare()  # the start reads no shard: nothing raised yet
    served = []
    err = ChangedShardError if how == "changed" else MissingShardError
    with pytest.raises(err, match="shard-001.tar") as exc:
        for batch in loader:
            served.append(batch)
    assert type(exc.value) is err  # its own type out of a worker, not a WorkerError
    assert 1 not in _served_shards(loader, served)  # no sample of the shard was served
    assert loader.report.to_dict()["counts"] == {}  # not bad data, even under the skip policy
    with pytest.raises(err, match="shard-001.tar"):
        _loader(paths).verify_shards()


def test_verify_shards_checks_every_shard_at_once(tmp_path):
    paths = _shards(tmp_path)
    loader = _loader(paths)
    assert loader.verify_shards() == 3
    _change(paths[2])
    with pytest.raises(ChangedShardError, match="shard-002.tar.*64 KiB"):
        loader.verify_shards()
    plain = PackedLoader(
        WebDatasetSource(paths, sidecars=False),
        schema=SCHEMA,
        layout=ParallelLayout(),
        token_budget=128,
    )
    assert plain.verify_shards() == 0  # indexed in process: nothing recorded to check against


def test_the_merged_index_gives_the_sidecars_index_and_is_checked(tmp_path):
    paths = _shards(
        tmp_path, n=4, extra=_bad_members
    )  # 3 bad samples in shard 0: the policy applied alike
    expected = _loader(paths).index
    assert sum(expected.report.to_dict()["counts"].values()) == 3
    with pytest.raises(
        Exception
    ) as from_sidecars:  # the default policy raises the first bad sample
        build_index(WebDatasetSource(paths), SCHEMA)
    done = merge_sidecars(
        WebDatasetSource(paths)
    )  # the data's samples, as the sidecars hold them: sample 15
    # (labels one row short) is one of them, bad only under a schema that reads labels
    assert done == {
        "path": merged_path(WebDatasetSource(paths)),
        "shards": 4,
        "samples": len(expected) + 1,
    }
    for p in paths:  # the loader reads the merged file alone
        os.rename(p + SUFFIX, p + SUFFIX + ".away")
    merged = _loader(paths).index
    assert merged.digest == expected.digest and merged.report.to_dict() == expected.report.to_dict()
    np.testing.assert_array_equal(merged.locations, expected.locations)
    np.testing.assert_array_equal(merged.media, expected.media)
    assert merged.dims == expected.dims and merged.source_shards == expected.source_shards
    tight = BadDataPolicy(on_error="skip", max_consecutive=2)  # 3 bad samples, never 2 in a row
    assert build_index(WebDatasetSource(paths), SCHEMA, policy=tight).digest == expected.digest
    with pytest.raises(type(from_sidecars.value)) as from_merged:
        build_index(WebDatasetSource(paths), SCHEMA)
    assert str(from_merged.value) == str(from_sidecars.value)
    records = merged_records(
        WebDatasetSource(paths), SCHEMA
    )  # the per-shard path (shards' dims disagree),
    records = resolve_signatures(
        records, WebDatasetSource(paths), SCHEMA
    )  # the records made this schema's
    per_sample = merge_records(
        list(records.values()), SKIP, where=WebDatasetSource(paths).where, schema=SCHEMA
    )
    assert (
        per_sample.digest == expected.digest
        and per_sample.report.to_dict() == expected.report.to_dict()
    )
    subset = _loader(
        paths[:2]
    )  # another selection of shards: not this merged file; the sidecars (gone here)
    assert len(subset.index) < len(expected) and subset.verify_shards() == 0
    for p in paths:
        os.rename(p + SUFFIX + ".away", p + SUFFIX)
    _change(paths[3])  # shards are still checked against it at their first read
    with pytest.raises(ChangedShardError, match="shard-003.tar"):
        list(_loader(paths))
    with open(done["path"], "r+b") as f:
        f.seek(os.path.getsize(done["path"]) // 2)
        f.write(b"\xff" * 64)
    with pytest.raises(StaleIndexError, match="merged index"):
        _loader(paths).prepare()


def _doubled(sample: dict) -> dict:
    return {"input_ids": np.repeat(np.asarray(sample["input_ids.npy"]), 2)}


def test_a_merged_index_of_another_transform_is_stale(tmp_path):
    paths = _shards(
        tmp_path
    )  # (a sidecar describes the data: another schema reads it, another transform cannot)
    write_sidecars(WebDatasetSource(paths, transform=_doubled), SCHEMA, force=True)
    merge_sidecars(WebDatasetSource(paths, transform=_doubled))
    with pytest.raises(StaleIndexError, match="another transform"):
        _loader(paths).prepare()


def test_sidecar_reads_go_on_threads_only_when_the_file_system_is_slow(tmp_path):
    import threading
    import time

    from prealign.loaders.index.sidecar import per_shard

    src = WebDatasetSource([str(tmp_path / f"s-{i}.tar") for i in range(100)])
    threads: set = set()

    def read(shard, delay=0.0):
        threads.add(threading.current_thread().name)
        time.sleep(delay)
        return shard

    assert (
        per_shard(src, read, threads=8) == list(range(100)) and len(threads) == 1
    )  # a local disk: in a row
    threads.clear()
    assert (
        per_shard(src, lambda s: read(s, 0.002), threads=8) == list(range(100)) and len(threads) > 1
    )
    assert per_shard(src, lambda s: read(s, 0.002)) == list(
        range(100)
    )  # no threads asked: in a row

    def fail(shard):
        time.sleep(0.002)
        if shard in (40, 70):
            raise MissingShardError(f"s-{shard}.tar", "gone")
        return shard

    with pytest.raises(MissingShardError, match="s-40.tar"):  # the first failure in shard order
        per_shard(src, fail, threads=8)


def test_an_index_cannot_be_edited_in_place_under_its_cached_digest(tmp_path):
    import dataclasses

    index = _loader(_shards(tmp_path)).prepare().index
    digest = index.digest
    for a in (index.lengths, index.locations, index.shards, index.media):
        with pytest.raises(ValueError, match="read-only"):
            a[0] += 1
    assert index.digest == digest == dataclasses.replace(index).digest


def test_a_checked_shard_deleted_after_its_first_read_is_missing_never_bad_data(tmp_path):
    """Before its first read a deleted shard is a MissingShardError (the first-read check); after it
    (its file closed by ``max_open_files=1`` and opened again) the same, never a skipped bad
    sample."""
    paths = write_shards(str(tmp_path), sample_lengths(300), num_shards=3)
    write_sidecars(WebDatasetSource(paths), SCHEMA)
    loader = PackedLoader(
        WebDatasetSource(paths, max_open_files=1),
        schema=SCHEMA,
        layout=ParallelLayout(),
        token_budget=128,
        seed=1,
        bad_data=SKIP,
    ).prepare()
    it = iter(loader)
    first = [next(it) for _ in range(3)]
    assert 1 in _served_shards(loader, first)  # shard 1 read (and checked) before it goes
    os.remove(paths[1])
    with pytest.raises(MissingShardError, match="shard-001.tar"):
        for _ in it:
            pass
    assert loader.report.to_dict()["counts"] == {}


def test_the_merged_index_is_read_once_when_the_per_shard_path_takes_over(tmp_path, monkeypatch):
    """Shards that disagree on which optional fields they have: ``merged_index`` falls back to the
    per-shard records, from the merged file already read (one read, not two)."""
    from prealign.loaders.index import sidecar
    from tests.loader_helpers import _npy, add_member, token_ids

    lengths = sample_lengths(60)

    def labelled(i, tf):  # shard 0's samples carry labels, the others' do not
        if i < 20:
            add_member(tf, f"{i:06d}.labels.npy", _npy(token_ids(i, lengths[i])))
        return False

    paths = write_shards(str(tmp_path), lengths, num_shards=3, extra=labelled)
    write_sidecars(WebDatasetSource(paths), SCHEMA)
    expected = build_index(WebDatasetSource(paths), SCHEMA, policy=SKIP)
    merge_sidecars(WebDatasetSource(paths))
    reads, read = [], sidecar.read_regular
    monkeypatch.setattr(
        sidecar, "read_regular", lambda p, what, lim: reads.append(what) or read(p, what, lim)
    )
    assert build_index(WebDatasetSource(paths), SCHEMA, policy=SKIP).digest == expected.digest
    assert reads.count("merged index") == 1, reads
