"""What a start over many shards leaves to the first read (issue #28): a saved index's shard sizes
are checked when each shard is first opened (not by a stat of every shard at the start, at any shard
count), and a main-process loader closes
the shard files it opened when its epoch ends."""

from __future__ import annotations

import os

import pytest

from prealign.loaders import IndexOptions, PackedLoader, WebDatasetSource, build_index
from prealign.loaders.errors import ChangedShardError
from prealign.schemas import ParallelLayout
from prealign.schemas.schema import causal_lm_schema
from tests.loader_helpers import sample_lengths, write_shards

SCHEMA = causal_lm_schema()


def _loader(source, **kw) -> PackedLoader:
    return PackedLoader(
        source, schema=SCHEMA, layout=ParallelLayout(), token_budget=256, seed=1, **kw
    )


def _open_shards(paths) -> list[str]:
    """The shard files among this process's open file descriptors."""
    wanted, found = set(map(os.path.realpath, paths)), []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target in wanted:
            found.append(target)
    return found


@pytest.mark.skipif(
    not os.path.isdir("/proc/self/fd"), reason="platform: no /proc/self/fd to list open files"
)
def test_a_main_process_loader_closes_its_shard_files_at_the_end_of_each_epoch(tmp_path):
    paths = write_shards(str(tmp_path), sample_lengths(60), num_shards=4)
    loader = _loader(WebDatasetSource(paths, max_open_files=8)).prepare()
    it = iter(loader)
    next(it)
    assert _open_shards(paths)  # open while the epoch runs (one open per shard, not per sample)
    for _ in it:
        pass
    assert _open_shards(paths) == []
    batches = list(loader)  # the next epoch opens them again, and closes them again
    assert batches and _open_shards(paths) == []
    it = iter(loader)
    next(it)
    it.close()  # an epoch left early: its files closed too
    assert _open_shards(paths) == []


@pytest.mark.parametrize("n", [3, 60])
def test_a_saved_index_checks_each_shard_size_at_its_first_read_not_at_the_start(
    tmp_path, monkeypatch, n
):
    paths = write_shards(str(tmp_path), sample_lengths(max(n, 30)), num_shards=n)
    saved = str(tmp_path / "index.npz")
    build_index(WebDatasetSource(paths, sidecars=False), SCHEMA).save(saved)
    changed = paths[min(7, n - 1)]
    with open(changed, "ab") as f:  # another size than indexed
        f.write(bytes(10240))
    stats = []
    real_stat = os.stat

    def counted(path, *a, **kw):
        stats.append(str(path))
        return real_stat(path, *a, **kw)

    with monkeypatch.context() as m:
        m.setattr(os, "stat", counted)
        loader = _loader(
            WebDatasetSource(paths, sidecars=False), indexing=IndexOptions(prebuilt=saved)
        ).prepare()
    assert [p for p in stats if p.endswith(".tar")] == []  # the start stats no shard, at 3 as at 60
    seen = []
    with pytest.raises(
        ChangedShardError, match=f"{os.path.basename(changed)}.*bytes now.*build_index"
    ):
        for batch in loader:  # before any of its samples
            seen.append(batch)
    assert len(seen) < len(list(_loader(WebDatasetSource(paths, sidecars=False))))
