"""The block cache walks its folder when due, not at every put (issue #28: a run that caches many
small blocks, or keeps many small objects whole from a server that ignores Range, made one pass
over every block held per block put: quadratic in the blocks of a run). Its bounds still hold:
within ``limit`` after each put of one process, within ``limit + P * slack`` for ``P`` sharing the
folder, least recently used out first, nothing but its own blocks removed."""

from __future__ import annotations

import os

import pytest

from prealign.loaders.sources import remote
from prealign.loaders.sources.remote import BlockCache


def _held(folder) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if remote._BLOCK_NAME.fullmatch(p.name))


def _name(i: int) -> str:
    return f"{i:016x}-100-{i}"


@pytest.fixture
def walked(monkeypatch) -> list:
    """Counts the entries each pass over a folder looks at."""
    seen = []
    real = os.scandir

    def counted(path):
        found = list(real(path))
        seen.append(len(found))
        return iter(found)

    monkeypatch.setattr(remote.os, "scandir", counted)
    return seen


@pytest.mark.parametrize("puts", [200, 2_000])
def test_work_per_put_does_not_grow_with_the_blocks_held(tmp_path, walked, puts):
    cache = BlockCache(str(tmp_path), limit=100 * puts // 2)  # (half of what is put)
    for i in range(puts):
        cache.put(_name(i), bytes(100))
        assert _held(tmp_path) <= cache.limit
    # (a pass at most every slack bytes, over at most limit / 100 blocks: SLACK_FRACTION entries
    # a put; the pass at each put made puts / 2 a put at 2,000)
    assert sum(walked) <= (BlockCache.SLACK_FRACTION + 8) * puts, (sum(walked), len(walked))
    assert os.path.exists(tmp_path / _name(puts - 1)) and not os.path.exists(tmp_path / _name(0))


def test_a_cache_far_below_its_limit_is_walked_once_per_slack(tmp_path, walked):
    cache = BlockCache(str(tmp_path), limit=64 * 100_000)  # (slack: 100,000 bytes)
    for i in range(3_000):
        cache.put(_name(i), bytes(100))
    assert len(walked) <= 1 + 3_000 * 100 // cache.slack, len(walked)
    assert _held(tmp_path) == 300_000


def test_processes_sharing_a_folder_stay_within_limit_and_their_slack(tmp_path):
    limit = 64 * 1_000
    caches = [BlockCache(str(tmp_path), limit) for _ in range(3)]  # (three processes' views)
    for i in range(3_000):
        caches[i % 3].put(_name(i), bytes(100))
        assert _held(tmp_path) <= limit + 3 * caches[0].slack
    for cache in caches:
        cache._since = cache.slack  # (each one's next pass, due)
        cache.evict()
    assert _held(tmp_path) <= limit


def test_the_users_files_stay(tmp_path):
    (tmp_path / "notes.txt").write_bytes(b"x" * 50_000)
    os.utime(tmp_path / "notes.txt", (1, 1))  # (the oldest file there)
    cache = BlockCache(str(tmp_path), limit=10_000)
    for i in range(500):
        cache.put(_name(i), bytes(100))
    assert (tmp_path / "notes.txt").read_bytes() == b"x" * 50_000
    assert _held(tmp_path) <= 10_000
