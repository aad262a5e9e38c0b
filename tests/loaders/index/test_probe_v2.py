"""The probe's version 2 (issue #28): a shard's first 64 KiB then its last 64 KiB not hashed
already, so each byte of a shard under 128 KiB is hashed once (read once; one range request of a
remote object), the same digest as version 1 from 128 KiB on. Sidecars of version 4 record it,
version 3 ones the older probe, merged indexes of version 5 the new one (with ``probe_versions``
where a version 3 sidecar of a small shard was merged), up to 4 the older one; each shard is checked
against the probe its index recorded, whichever path read the index, and a changed byte is caught
by both."""

from __future__ import annotations

import hashlib
import io
import json
import os

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from prealign.loaders import BadDataPolicy, PackedLoader, WebDatasetSource
from prealign.loaders.errors import ChangedShardError, StaleIndexError
from prealign.loaders.index.header_pass import _up_to_date, write_sidecars
from prealign.loaders.index.merged import _parse, merge_sidecars, merged_index, read_merged
from prealign.loaders.index.shard_checks import ShardChecks, _probe_of_file, check_all_shards
from prealign.loaders.index.sidecar import PROBE, read_probe
from prealign.loaders.index.sidecar_bulk import sidecars_merged
from prealign.loaders.index.source_index import MergedIndexWarning, check_source
from prealign.loaders.sources.remote import RemoteOptions
from prealign.loaders.sources.shard_files import SUFFIX, open_regular
from prealign.schemas import ParallelLayout
from prealign.schemas.schema import causal_lm_schema
from tests.conftest import examples
from tests.loader_helpers import sample_lengths, write_shards
from tests.loaders.index.old_sidecars import as_version_3
from tests.loaders.sources.test_remote import FAST
from tests.loaders.sources.test_remote_start import server  # noqa: F401 - a fixture

SCHEMA = causal_lm_schema()
_EDGES = sorted(
    {max(0, e + d) for e in (0, PROBE, 2 * PROBE) for d in (-512, -1, 0, 1, 512)} | {20_000}
)
_SIZES = st.one_of(st.sampled_from(_EDGES), st.integers(0, 3 * PROBE))


def definition(data: bytes, version: int) -> str:
    """The probe as the issue defines it, computed directly."""
    n, head = len(data), min(PROBE, len(data))
    tail = max(n - PROBE, head) if version == 2 else max(n - PROBE, 0)
    return hashlib.blake2b(data[:head] + data[tail:], digest_size=8).hexdigest()


@pytest.mark.slow
def test_every_way_of_reading_a_shard_gives_the_probe_of_its_definition(server, tmp_path):
    srv, base = server
    cache = str(tmp_path / "cache")

    @examples(60)
    @given(size=_SIZES, seed=st.integers(0, 2**16))
    def check(size, seed):
        data = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()
        name = f"s-{size}-{seed}.tar"
        path = os.path.join(srv.root, name)
        with open(path, "wb") as f:
            f.write(data)
        local = WebDatasetSource([path])
        far = WebDatasetSource([f"{base}/{name}"], remote=RemoteOptions(cache_dir=cache))
        assert (
            definition(data, 1)
            == hashlib.blake2b(
                data[:PROBE] + data[max(size - PROBE, 0) :], digest_size=8
            ).hexdigest()
        )  # (version 1: today's formula, the spans as read)
        if size <= 2 * PROBE:
            assert definition(data, 2) == hashlib.blake2b(data, digest_size=8).hexdigest()
        if size >= 2 * PROBE or size == 0:
            assert definition(data, 2) == definition(data, 1)
        for version in (1, 2):
            want = definition(data, version)
            with open_regular(path) as f:
                got, first, last, whole = _probe_of_file(f.fileno(), size, None, version)
                assert got == want and first == data[:PROBE]
                assert last == data[max(size - PROBE, 0) :]
                assert whole == (data if size <= 2 * PROBE else None)
                if size <= 2 * PROBE:  # (the small-shard path: the bytes read already)
                    assert _probe_of_file(f.fileno(), size, data, version)[0] == want
            assert read_probe(local, 0, size, version) == (want, first, last)
            srv.log.clear()
            assert read_probe(far, 0, size, version) == (want, first, last)
            gets = [r for m, n, r in srv.log if m == "GET"]
            if size == 0:
                assert gets == []
            elif size <= 2 * PROBE:  # one range request of the whole object
                assert gets == [f"bytes=0-{size - 1}"], gets
            else:
                assert gets == [f"bytes=0-{PROBE - 1}", f"bytes={size - PROBE}-{size - 1}"], gets
        # never through the block cache (it may hold an object's old bytes)
        assert not os.path.isdir(cache) or not [
            f for f in os.listdir(cache) if not f.startswith(".")
        ]
        os.remove(path)

    check()


@examples(40)
@given(
    size=st.sampled_from([20_000, PROBE - 1, PROBE + 700, 2 * PROBE - 1, 2 * PROBE, 3 * PROBE]),
    where=st.floats(0, 1),
    version=st.sampled_from([1, 2]),
)
def test_a_byte_changed_in_the_probed_bytes_is_a_changed_shard(
    tmp_path_factory, size, where, version
):
    root = tmp_path_factory.mktemp("c")
    path = str(root / "s.tar")
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    with open(path, "wb") as f:
        f.write(data)
    source = WebDatasetSource([path])
    checks = ShardChecks(1, {0: (size, definition(data, version), -1, -1, version)})
    with open_regular(path) as f:
        assert checks(source, 0, f) == (data if size <= 2 * PROBE else None)  # (read once)
    checks(source, 0)
    covered = size if size <= 2 * PROBE else 2 * PROBE  # anywhere, or the first and last 64 KiB
    at = min(int(where * covered), covered - 1)
    at = at if at < PROBE else size - (covered - at)
    changed = bytearray(data)
    changed[at] ^= 0x01
    with open(path, "wb") as f:
        f.write(bytes(changed))
    with open_regular(path) as f, pytest.raises(ChangedShardError, match="64 KiB differ"):
        checks(source, 0, f)
    with pytest.raises(ChangedShardError, match="64 KiB differ"):
        checks(source, 0)
    other = ShardChecks(1, {0: (size, definition(data, 3 - version), -1, -1, version)})
    if definition(data, 1) != definition(data, 2):  # the other definition's probe: refused
        with open(path, "wb") as f:
            f.write(data)
        with pytest.raises(ChangedShardError):
            other(source, 0)


def _data(tmp_path, n: int = 40, old=()) -> list[str]:
    """``n`` small shards (10 samples, about 20 KB) with sidecars, those of ``old`` version 3."""
    paths = write_shards(str(tmp_path), sample_lengths(10 * n, seed=n), num_shards=n)
    write_sidecars(WebDatasetSource(paths), SCHEMA)
    if old:
        as_version_3(WebDatasetSource(paths), sorted(old))
    assert all(os.path.getsize(p) < 2 * PROBE for p in paths)
    return paths


def _loader(paths) -> PackedLoader:
    return PackedLoader(
        WebDatasetSource(paths),
        schema=SCHEMA,
        layout=ParallelLayout(),
        token_budget=256,
        seed=1,
    )


def _batches(paths) -> list:
    return [b["sample_index"].tolist() for b in _loader(paths)]


def _flip(path: str, at: int = 600) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 1]))


def _versions(paths) -> list[int]:
    out = []
    for p in paths:
        with np.load(p + SUFFIX) as z:
            out.append(json.loads(z["meta"].tobytes())["version"])
    return out


@pytest.mark.parametrize("old", ["none", "all", "mixed"])
def test_version_3_and_4_sidecars_check_each_shard_by_its_own_probe(tmp_path, old):
    n = 40  # (>= 32 sidecars: read in bulk)
    picked = {"none": (), "all": range(n), "mixed": range(0, n, 3)}[old]
    paths = _data(tmp_path / "d", n, picked)
    assert _versions(paths) == [3 if s in picked else 4 for s in range(n)]
    want = [1 if s in picked else 2 for s in range(n)]
    reference = _batches(_data(tmp_path / "ref", n))
    assert _batches(paths) == reference
    source = WebDatasetSource(paths)  # in bulk, the form of a merged index
    found = sidecars_merged(source, SCHEMA)
    assert found is not None and found[0]["probe_versions"].tolist() == want
    merged_index(source, SCHEMA, BadDataPolicy(), found=found)
    assert source.shard_check.probe_versions.tolist() == want
    assert check_all_shards(source) == n
    one = WebDatasetSource(paths)  # one by one
    check_source(one, SCHEMA)
    assert one.shard_check.probe_versions.tolist() == want and check_all_shards(one) == n
    victim = (picked[0] if picked else 1) if old != "none" else 1
    _flip(paths[victim])
    for checked in (source, one):
        with pytest.raises(ChangedShardError, match=f"shard-{victim:03d}.tar.*64 KiB differ"):
            check_all_shards(checked)
    with pytest.raises(ChangedShardError, match=f"shard-{victim:03d}.tar.*64 KiB differ"):
        list(_loader(paths))  # (the first read, on the open file: the shard read once)


@pytest.mark.parametrize(
    "version, old",
    [(3, "all"), (4, "all"), (5, "none"), (5, "all"), (5, "mixed")],
)
def test_a_merged_index_of_each_version_checks_each_shard_by_its_probe(tmp_path, version, old):
    n = 6
    picked = {"none": (), "all": range(n), "mixed": (1, 4)}[old]
    paths = _data(tmp_path / "d", n, picked)
    reference = _batches(paths)
    path = merge_sidecars(WebDatasetSource(paths), version=version)["path"]
    with open(path, "rb") as f:
        meta, a = _parse(f.read(), path)
    assert meta["version"] == version
    assert ("probe_versions" in a) == (version == 5 and old != "none")
    want = [1 if version < 5 or s in picked else 2 for s in range(n)]
    source = WebDatasetSource(paths)
    merged_index(source, SCHEMA, BadDataPolicy(), found=read_merged(source, SCHEMA))
    assert source.shard_check.probe_versions.tolist() == want
    assert check_all_shards(source) == n
    for p in paths:  # the loader reads the merged file alone
        os.remove(p + SUFFIX)
    assert _batches(paths) == reference
    victim = picked[-1] if picked else 2
    _flip(paths[victim], os.path.getsize(paths[victim]) - 100)
    with pytest.raises(ChangedShardError, match=f"shard-{victim:03d}.tar.*64 KiB differ"):
        list(_loader(paths))


def test_old_merged_formats_refuse_a_new_probe_of_a_small_shard(tmp_path):
    paths = _data(tmp_path / "small", 3, old=(0,))
    with pytest.raises(StaleIndexError, match=r"shard-001.tar.*merged format 4.*as version 5"):
        merge_sidecars(WebDatasetSource(paths), version=4)
    big = write_shards(str(tmp_path / "big"), [40_000, 40_000], num_shards=2)  # (>= 128 KiB)
    assert all(os.path.getsize(p) >= 2 * PROBE for p in big)
    write_sidecars(WebDatasetSource(big), SCHEMA)  # version 4: the same probe as version 3's
    merge_sidecars(WebDatasetSource(big), version=4)
    source = WebDatasetSource(big)
    merged_index(source, SCHEMA, BadDataPolicy(), found=read_merged(source, SCHEMA))
    assert source.shard_check.probe_versions.tolist() == [1, 1] and check_all_shards(source) == 2


def test_a_sidecar_from_the_future_is_refused_with_the_command_that_rewrites_it(tmp_path):
    paths = _data(tmp_path, 3)
    with np.load(paths[1] + SUFFIX) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(arrays["meta"].tobytes())
    arrays["meta"] = np.frombuffer(json.dumps({**meta, "version": 5}).encode(), np.uint8)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    with open(paths[1] + SUFFIX, "wb") as f:
        f.write(buf.getvalue())
    with pytest.raises(
        StaleIndexError, match=r"shard-001.tar.*version 5.*\[3, 4\].*prealign index"
    ):
        _loader(paths).prepare()


def test_indexing_keeps_a_version_3_sidecar_whose_probe_matches(tmp_path):
    paths = _data(tmp_path, 3, old=(0, 2))
    source = WebDatasetSource(paths)
    assert all(_up_to_date(source, SCHEMA, s, None) for s in range(3))
    before = [open(p + SUFFIX, "rb").read() for p in paths]
    write_sidecars(WebDatasetSource(paths), SCHEMA)  # (nothing to do: each up to date)
    assert [open(p + SUFFIX, "rb").read() for p in paths] == before
    assert _versions(paths) == [3, 4, 3]
    _flip(paths[0])
    assert not _up_to_date(source, SCHEMA, 0, None)
    write_sidecars(WebDatasetSource(paths), SCHEMA)  # changed: indexed again, as version 4
    assert _versions(paths) == [4, 4, 3]


def test_a_remote_small_shard_is_checked_with_one_request(server):
    srv, base = server
    root = os.path.join(srv.root, "r")
    paths = _data(root, 4, old=(2,))
    names = [os.path.basename(p) for p in paths]
    source = WebDatasetSource(f"{base}/r/shard-{{000..003}}.tar", remote=FAST)
    check_source(source, SCHEMA)
    srv.log.clear()
    assert check_all_shards(source) == 4
    for name, path in zip(names, paths):
        size = os.path.getsize(path)
        mine = [(m, r) for m, n, r in srv.log if n.endswith(name)]
        assert mine == [("HEAD", None), ("GET", f"bytes=0-{size - 1}")], mine


@pytest.mark.slow
def test_a_start_over_sidecars_of_both_versions_grows_linearly(tmp_path_factory, monkeypatch):
    """Sidecars of versions 3 and 4 mixed (every third shard version 3), read in bulk and from a
    merged index of version 5 (with ``probe_versions``): the work counted at 200 and 2,000 shards
    (:mod:`tests.loaders.index.test_start_complexity`) grows as it does with one version."""
    from tests.loaders.index import test_start_complexity as counted

    data, merged = {}, {}
    for n in counted.SIZES:
        paths = counted._shards(str(tmp_path_factory.mktemp(f"s{n}")), n)
        write_sidecars(WebDatasetSource(paths), SCHEMA)
        as_version_3(WebDatasetSource(paths), range(0, n, 3))
        folder = str(tmp_path_factory.mktemp(f"m{n}"))
        merge_sidecars(WebDatasetSource(paths), os.path.join(folder, "prealign-index.merged.npz"))
        data[n], merged[n] = paths, (paths, folder)
    with pytest.warns(MergedIndexWarning):  # (the advice to merge 2,000 sidecars)
        found = counted._measure(
            data, monkeypatch, lambda paths: counted._loader(WebDatasetSource(paths))
        )
    counted._assert_linear(found, "start from mixed sidecars", calls=counted.SIDECAR_CALLS)
    found = counted._measure(
        merged,
        monkeypatch,
        lambda where: counted._loader(WebDatasetSource(where[0], index_dir=where[1])),
    )
    counted._assert_linear(found, "start from a merged index of mixed probes")
    source = WebDatasetSource(data[200], index_dir=merged[200][1])
    counted._loader(source).prepare()
    assert source.shard_check.probe_versions.tolist() == [2 - (s % 3 == 0) for s in range(200)]
