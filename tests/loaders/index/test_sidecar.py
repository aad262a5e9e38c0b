"""Sidecar indexes and the header pass (issue #7, items 1 and 2): the same index and plan from
sidecars, a saved SampleIndex or the in-process pass; every mismatch with the data raises before any
batch."""

from __future__ import annotations

import io
import os
import shutil

import numpy as np
import pytest

from prealign.loaders import (
    BadDataPolicy,
    IndexOptions,
    PackedLoader,
    SourceChangedError,
    WebDatasetSource,
    build_index,
)
from prealign.loaders.errors import (
    ChangedShardError,
    ExtraShardError,
    MissingShardError,
    StaleIndexError,
)
from prealign.loaders.index.build import index_shard
from prealign.loaders.index.header_pass import header_index_shard, write_sidecars
from prealign.loaders.index.sidecar import parse_sidecar
from prealign.loaders.sources.shard_files import SUFFIX, sidecar_path
from prealign.schemas import ParallelLayout
from prealign.schemas.errors import ConfigError, SampleError
from prealign.schemas.schema import causal_lm_schema
from tests.loader_helpers import add_member, sample_lengths, token_ids, write_shards

SCHEMA = causal_lm_schema()
SKIP = BadDataPolicy(on_error="skip", max_consecutive=50)
LAYOUT = ParallelLayout()


def _loader(src, index=None, **kw):
    """A prepared loader (the index pass, or the prebuilt ``index`` checked against ``src``, has
    run)."""
    return PackedLoader(
        src,
        schema=SCHEMA,
        layout=LAYOUT,
        token_budget=128,
        dp_size=2,
        dp_rank=1,
        seed=3,
        indexing=IndexOptions(prebuilt=index),
        **kw,
    ).prepare()


def _bad_members(i, tf):
    """Sample 4: bad JSON; sample 9: no input_ids; sample 15: token rows that disagree (labels)."""
    if i == 4:
        add_member(tf, f"{i:06d}.input_ids.npy", _npy(token_ids(i, 5)))
        add_member(tf, f"{i:06d}.json", b"{not json")
        return True
    if i == 9:
        add_member(tf, f"{i:06d}.json", b"{}")
        return True
    if i == 15:
        add_member(tf, f"{i:06d}.input_ids.npy", _npy(token_ids(i, 6)))
        add_member(tf, f"{i:06d}.labels.npy", _npy(token_ids(i, 5)))
        return True
    return False


def _npy(a) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def test_header_pass_equals_the_full_pass_and_sidecars_give_the_same_plan(tmp_path):
    paths = write_shards(str(tmp_path), sample_lengths(60), num_shards=3, extra=_bad_members)
    src = WebDatasetSource(paths, sidecars=False)
    for shard in range(
        3
    ):  # record by record: the header pass (data alone) keeps every sample the full pass
        head, fp = header_index_shard(
            src, SCHEMA, shard
        )  # keeps, with its length; the schema's verdicts
        full = index_shard(
            src, SCHEMA, shard
        )  # (sample 15's labels) are the loader's, when it reads the sidecar
        kept = dict(zip(map(tuple, head["locations"]), head["lengths"]))
        assert all(kept[tuple(loc)] == n for loc, n in zip(full["locations"], full["lengths"]))
        assert len(head["events"]) == len(full["events"])
        assert all(h is None or f is not None for h, f in zip(head["events"], full["events"]))
        assert fp["size"] == os.path.getsize(paths[shard])
    in_process = build_index(src, SCHEMA, policy=SKIP)
    assert write_sidecars(WebDatasetSource(paths), SCHEMA)["indexed"] == 3
    from_sidecars = build_index(WebDatasetSource(paths), SCHEMA, policy=SKIP)
    assert from_sidecars.digest == in_process.digest and len(in_process) == 57
    os.rename(paths[1] + SUFFIX, str(tmp_path / "aside"))  # some shards from sidecars, one scanned
    assert build_index(WebDatasetSource(paths), SCHEMA, policy=SKIP).digest == in_process.digest
    os.rename(str(tmp_path / "aside"), paths[1] + SUFFIX)
    assert (
        from_sidecars.report.counts
        == in_process.report.counts
        == {"bad_sample": 2, "missing_member": 1}
        or from_sidecars.report.counts == in_process.report.counts
    )
    in_process.save(str(tmp_path / "d.index"))  # exactly this path (issue #7: not d.index.npz)
    assert not os.path.exists(tmp_path / "d.index.npz")
    plans = [
        _loader(WebDatasetSource(paths, sidecars=False), bad_data=SKIP).epoch_samples(e)
        for e in (0, 1)
    ]
    assert plans == [
        _loader(WebDatasetSource(paths), bad_data=SKIP).epoch_samples(e) for e in (0, 1)
    ]
    assert plans == [
        _loader(WebDatasetSource(paths), index=str(tmp_path / "d.index")).epoch_samples(e)
        for e in (0, 1)
    ]
    assert sum(len(mb) for mb in plans[0]) > 0


@pytest.mark.slow
def test_loader_from_sidecars_touches_no_sample(tmp_path, monkeypatch):
    paths = write_shards(str(tmp_path), sample_lengths(30), num_shards=2)
    write_sidecars(WebDatasetSource(paths), SCHEMA, workers=2)
    assert all(os.path.exists(p + SUFFIX) for p in paths)

    def no_scan(self, shard):
        raise AssertionError("scanned a shard that has a sidecar")

    monkeypatch.setattr(WebDatasetSource, "scan", no_scan)
    loader = _loader(WebDatasetSource(paths))
    batch = next(iter(loader))
    assert batch["input_ids"].numel() > 0


def test_second_run_indexes_only_new_or_changed_shards(tmp_path):
    paths = write_shards(str(tmp_path), sample_lengths(30), num_shards=3)
    out = str(tmp_path / "idx")
    assert write_sidecars(WebDatasetSource(paths), SCHEMA, out_dir=out) == {
        "indexed": 3,
        "up_to_date": 0,
        "samples": 30,
    }
    assert write_sidecars(WebDatasetSource(paths), SCHEMA, out_dir=out)["indexed"] == 0
    write_shards(
        str(tmp_path), sample_lengths(33), num_shards=3
    )  # every shard rewritten, only the last longer
    stats = write_sidecars(WebDatasetSource(paths), SCHEMA, out_dir=out)
    assert stats["indexed"] >= 1 and stats["up_to_date"] + stats["indexed"] == 3
    idx = build_index(WebDatasetSource(paths, index_dir=out), SCHEMA)
    assert len(idx) == 33


def test_missing_shard_or_brace_typo_is_a_config_error_under_skip(tmp_path):
    write_shards(str(tmp_path), sample_lengths(20), num_shards=2)
    pattern = str(tmp_path / "shard-{000..003}.tar")  # 4 named, 2 exist
    with pytest.raises(MissingShardError, match="shard-002.tar") as exc:
        _loader(WebDatasetSource(pattern), bad_data=SKIP)
    assert isinstance(exc.value, ConfigError)


def test_changed_extra_and_foreign_indexes_raise_before_any_batch(tmp_path):
    paths = write_shards(str(tmp_path / "a"), sample_lengths(30), num_shards=2)
    write_sidecars(WebDatasetSource(paths), SCHEMA)
    idx = build_index(WebDatasetSource(paths), SCHEMA)
    idx.save(str(tmp_path / "two.index"))
    with pytest.raises(
        ExtraShardError, match="shard-001.tar|2 shard"
    ):  # an index of 2 shards, 1 given
        _loader(WebDatasetSource(paths[:1]), index=str(tmp_path / "two.index"), bad_data=SKIP)
    # shards rewritten with other data: other bytes in the first 64 KiB (shard 0), another size
    # (shard 1) (a shard is checked at its first read: before any of its samples is served, never
    # counted as bad data)
    write_shards(str(tmp_path / "a"), sample_lengths(30, seed=1), num_shards=2)
    with pytest.raises(ChangedShardError, match="shard-000.tar.*64 KiB differ"):
        list(_loader(WebDatasetSource(paths), bad_data=SKIP))
    write_shards(str(tmp_path / "a"), sample_lengths(30), num_shards=2)
    with open(paths[1], "ab") as f:
        f.write(bytes(10240))
    with pytest.raises(ChangedShardError, match="shard-001.tar.*bytes now"):
        list(_loader(WebDatasetSource(paths), bad_data=SKIP))
    with pytest.raises(
        ChangedShardError, match="shard-001.tar"
    ):  # a saved index: also at the first read
        list(
            _loader(
                WebDatasetSource(paths, sidecars=False),
                index=str(tmp_path / "two.index"),
                bad_data=SKIP,
            )
        )
    # a sidecar of another shard, and one of another schema
    paths_b = write_shards(str(tmp_path / "b"), sample_lengths(30), num_shards=2)
    shutil.copy(paths_b[0], paths_b[1])
    write_sidecars(WebDatasetSource(paths_b), SCHEMA)
    shutil.copy(paths_b[0] + SUFFIX, paths_b[1] + SUFFIX)
    with pytest.raises(StaleIndexError, match="shard-001.tar.*another shard"):
        _loader(WebDatasetSource(paths_b))
    write_sidecars(WebDatasetSource(paths_b), causal_lm_schema(topk=4), force=True)
    _loader(WebDatasetSource(paths_b))  # a sidecar describes the data: any schema reads it
    with pytest.raises(StaleIndexError, match="another transform \\(required: "):
        _loader(WebDatasetSource(paths_b, required=("input_ids.npy",)))


@pytest.mark.parametrize(
    "craft",
    [
        "garbage",
        "pickle",
        "wrong_dtype",
        "bad_ranges",
        "version",
        "flipped_byte",
        "short_data",
        "fortran_pickle",
        "deep_meta",
    ],
)
def test_crafted_sidecars_are_typed_config_errors(tmp_path, craft):
    paths = write_shards(str(tmp_path), sample_lengths(10), num_shards=1)
    write_sidecars(WebDatasetSource(paths), SCHEMA)
    path = sidecar_path(paths[0])
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    if craft == "garbage":
        data = b"PK\x03\x04 not a zip"
    else:
        if craft == "pickle":
            arrays["lengths"] = np.array([object()] * 10, dtype=object)
        elif craft == "wrong_dtype":
            arrays["lengths"] = arrays["lengths"].astype(np.float32)
        elif craft == "bad_ranges":
            arrays["spans"][0, 1] = 1 << 40
        elif craft == "version":
            arrays["meta"] = np.frombuffer(
                bytes(arrays["meta"]).replace(b'"version": 4', b'"version": 9'), np.uint8
            )
        elif craft == "deep_meta":  # JSON nested past Python's recursion limit (a RecursionError)
            arrays["meta"] = np.frombuffer(
                bytes(arrays["meta"]).replace(b'"version": 4', b'"version": ' + b"[" * 100_000),
                np.uint8,
            )
        elif (
            craft == "fortran_pickle"
        ):  # a header the fast reader does not take: numpy's reader refuses it
            arrays["lengths"] = np.asfortranarray(np.array([[object()]] * 10, dtype=object))
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        data = buf.getvalue()
        lengths_at = (
            data.index(arrays["lengths"].tobytes())
            if craft in ("flipped_byte", "short_data")
            else 0
        )
        if (
            craft == "flipped_byte"
        ):  # a byte of the data changed: the member's crc32 no longer matches
            data = data[:lengths_at] + bytes([data[lengths_at] ^ 1]) + data[lengths_at + 1 :]
        elif craft == "short_data":  # the npy header promises more rows than the member holds
            data = data.replace(b"'shape': (10,), }", b"'shape': (11,), }", 1)
    with open(path, "wb") as f:
        f.write(data)
    with pytest.raises(StaleIndexError, match="shard-000.tar"):
        parse_sidecar(data, shard=paths[0])
    with pytest.raises(StaleIndexError):
        _loader(WebDatasetSource(paths), bad_data=SKIP)


def test_byte_changed_in_place_is_source_changed(tmp_path):
    paths = write_shards(str(tmp_path), [20] * 12, num_shards=1)
    write_sidecars(WebDatasetSource(paths), SCHEMA)
    loader = PackedLoader(
        WebDatasetSource(paths), schema=SCHEMA, layout=LAYOUT, token_budget=128
    ).prepare()
    raw = bytearray(open(paths[0], "rb").read())
    at = raw.index(b"\x93NUMPY", 0) + 128 + 8  # inside the first sample's token data
    raw[at] ^= 0x55
    next(
        iter(loader)
    )  # the shard checked against its sidecar (size, first and last 64 KiB) at its first read
    with open(paths[0], "wb") as f:
        f.write(raw)  # same size, changed after that check: caught per sample
    loader.set_epoch(1)
    with pytest.raises(SourceChangedError, match="checksum"):
        for _ in loader:
            pass


def test_vlm_header_index_equals_the_full_pass_on_the_demo_set(tmp_path):
    from prealign.loaders.cli.demo_data import build_demo_dataset
    from prealign.loaders.cli.demo_tokenizer import ByteTokenizer
    from prealign.loaders.media.vlm import VLMSampleTransform
    from prealign.schemas.vlm import vlm_schema

    ds = build_demo_dataset(str(tmp_path), num_samples=90, samples_per_shard=30, topk=4)
    transform = VLMSampleTransform(tokenizer=ByteTokenizer(), topk=4)
    schema = vlm_schema(topk=4, vocab_size=ds.vocab_size)
    with pytest.warns(Warning):
        full = build_index(
            WebDatasetSource(list(ds.shards), transform=transform, image="bytes", sidecars=False),
            schema,
            policy=SKIP,
        )
    write_sidecars(WebDatasetSource(list(ds.shards), transform=transform, image="bytes"), schema)
    with pytest.warns(Warning):
        side = build_index(
            WebDatasetSource(list(ds.shards), transform=transform, image="bytes"),
            schema,
            policy=SKIP,
        )
    assert len(full) == len(side) == 90 - len(ds.bad)
    assert (
        full.lengths.tolist() == side.lengths.tolist()
        and full.media.tolist() == side.media.tolist()
    )
    assert full.digest == side.digest and full.dims == side.dims
    assert side.report.counts == full.report.counts == {k: 1 for k in ds.bad.values()}


def test_sample_bad_only_at_load_time_is_counted_under_skip(tmp_path):
    """A sidecar bounds the ids, not every value: a positive teacher log-prob in sample 7 (not the
    first of its signature) is found when loaded; under the skip policy it is left out of its
    micro-batch and counted (under the default policy the first bad record raises). An id past the
    vocabulary in sample 11 is found when the
    loader is built, from the ids' recorded bounds, as the in-process pass finds it."""
    from prealign.loaders.policy import BadSampleWarning

    def extra(i, tf):
        ids = token_ids(i, 12) % 1000  # vocab_size bounds input_ids too (main: ids < vocab_size)
        top = np.stack([ids % 1000, ids % 1000 + 1], axis=1).astype(np.int64)
        log_probs = np.tile(np.float32([-0.5, -2.0]), (12, 1))
        if i == 7:
            log_probs[3, 0] = 0.5  # a log-prob above 0; the header shows only the shape [12, 2]
        if i == 11:
            top[3, 1] = 99_999  # past vocab_size: bounded in the sidecar
        add_member(tf, f"{i:06d}.input_ids.npy", _npy(ids))
        add_member(tf, f"{i:06d}.teacher_topk_ids.npy", _npy(top))
        add_member(tf, f"{i:06d}.teacher_topk_log_probs.npy", _npy(log_probs))
        return True

    schema = causal_lm_schema(topk=2, vocab_size=1001)
    paths = write_shards(str(tmp_path), [12] * 30, num_shards=1, extra=extra)
    write_sidecars(WebDatasetSource(paths), schema)
    with pytest.warns(BadSampleWarning, match="000011"):
        side = build_index(WebDatasetSource(paths), schema, policy=SKIP)
    with pytest.warns(BadSampleWarning):
        full = build_index(WebDatasetSource(paths, sidecars=False), schema, policy=SKIP)
    assert (
        len(side) == 29 and len(full) == 28
    )  # the sidecars' index keeps sample 7; the full pass does not
    loader = PackedLoader(
        WebDatasetSource(paths), schema=schema, layout=LAYOUT, token_budget=64, bad_data=SKIP
    )
    with pytest.warns(BadSampleWarning, match="index row 7. at load time"):
        rows = [int(i) for b in loader for i in b["sample_index"]]
    assert sorted(rows) == [
        r for r in range(29) if r != 7
    ]  # (index row 7 is sample 7; sample 11 is not in it)
    assert loader.report.counts == {"bad_sample": 2}
    with pytest.raises(
        SampleError, match="000011"
    ):  # the default policy: the first bad id, when it is built
        list(PackedLoader(WebDatasetSource(paths), schema=schema, layout=LAYOUT, token_budget=64))


def test_saved_index_path_that_is_not_an_index_is_a_config_error(tmp_path):
    paths = write_shards(str(tmp_path), sample_lengths(10), num_shards=1)
    (tmp_path / "junk.index").write_bytes(b"not an index")
    for path in (str(tmp_path / "missing.index"), str(tmp_path / "junk.index")):
        with pytest.raises(StaleIndexError, match=os.path.basename(path)):
            _loader(WebDatasetSource(paths), index=path)


def test_vlm_header_only_index_finds_corrupt_pixels_at_load_time(tmp_path):
    """``prealign index --header-only``: no pixel decode; the planted corrupt image body passes the
    header pass, and is then left out and counted (``corrupt_image``) when loaded under the skip
    policy."""
    from prealign.loaders.cli.demo_data import build_demo_dataset
    from prealign.loaders.cli.demo_tokenizer import ByteTokenizer
    from prealign.loaders.media.vlm import VLMSampleTransform
    from prealign.schemas.vlm import vlm_schema

    ds = build_demo_dataset(str(tmp_path), num_samples=90, samples_per_shard=30, topk=4)
    transform = VLMSampleTransform(tokenizer=ByteTokenizer(), topk=4)
    schema = vlm_schema(topk=4, vocab_size=ds.vocab_size)
    src = WebDatasetSource(list(ds.shards), transform=transform, image="bytes")
    write_sidecars(src, schema, verify_images=False)
    with pytest.warns(Warning):
        full = build_index(
            WebDatasetSource(list(ds.shards), transform=transform, image="bytes", sidecars=False),
            schema,
            policy=SKIP,
        )
        side = build_index(src, schema, policy=SKIP)
    assert len(side) == len(full) + 1 and "corrupt_image" not in side.report.counts
    common = {tuple(r): n for r, n in zip(side.locations.tolist(), side.lengths.tolist())}
    assert all(
        common[tuple(r)] == n for r, n in zip(full.locations.tolist(), full.lengths.tolist())
    )
    loader = PackedLoader(src, schema=schema, layout=LAYOUT, token_budget=4096, bad_data=SKIP)
    with pytest.warns(Warning):
        rows = [int(i) for b in loader for i in b["sample_index"]]
    assert len(rows) == len(full) and loader.report.counts == {k: 1 for k in ds.bad.values()}


def test_shards_of_one_file_name_never_share_a_sidecar_in_an_index_folder(tmp_path):
    """``train/s-0.tar`` and ``val/s-0.tar`` in one index folder would overwrite each other's
    sidecar (and every re-index would too): refused up front, naming both."""
    a = write_shards(str(tmp_path / "train"), sample_lengths(10), num_shards=1)
    b = write_shards(str(tmp_path / "val"), sample_lengths(12, seed=1), num_shards=1)
    assert os.path.basename(a[0]) == os.path.basename(b[0])
    both = WebDatasetSource([a[0], b[0]])
    with pytest.raises(ConfigError, match="same file name"):
        write_sidecars(both, SCHEMA, out_dir=str(tmp_path / "idx"))
    assert not os.path.exists(tmp_path / "idx")
    with pytest.raises(ConfigError, match="train.*val"):
        WebDatasetSource([a[0], b[0]], index_dir=str(tmp_path / "idx"))
    write_sidecars(both, SCHEMA)  # beside the shards: no clash
    assert os.path.exists(sidecar_path(a[0])) and os.path.exists(sidecar_path(b[0]))


def test_the_sidecar_key_looks_through_shared_media_and_reads_index_key():
    """Wrapping the transform for CP sharing changes no length: the same key (and the header rule);
    a custom transform's ``index_key()`` separates configurations that change lengths."""
    from prealign.loaders.cli.demo_tokenizer import ByteTokenizer
    from prealign.loaders.handoff.media_share import SharedMediaTransform
    from prealign.loaders.index.sidecar import describe_transform
    from prealign.loaders.media.vlm import VLMSampleTransform

    bare = VLMSampleTransform(tokenizer=ByteTokenizer(), topk=4)
    shared = SharedMediaTransform(transform=bare, run="r", cp_rank=0, cp_size=2)
    other = SharedMediaTransform(
        transform=VLMSampleTransform(tokenizer=ByteTokenizer(), topk=8),
        run="r",
        cp_rank=0,
        cp_size=2,
    )
    assert describe_transform(shared) == describe_transform(bare) != describe_transform(other)

    class Trunc:
        def __init__(self, n):
            self.n = n

        def index_key(self):
            return f"n={self.n}"

        def __call__(self, raw):
            return raw

    assert describe_transform(Trunc(10)) != describe_transform(Trunc(99))
    assert describe_transform(Trunc(10)) == describe_transform(Trunc(10))


def test_sidecar_fast_reader_equals_numpy_and_takes_compressed_sidecars(tmp_path):
    from prealign.loaders.sources.npy import read_npz

    paths = write_shards(str(tmp_path), sample_lengths(50), num_shards=1)
    write_sidecars(WebDatasetSource(paths), SCHEMA)
    data = open(sidecar_path(paths[0]), "rb").read()
    with np.load(io.BytesIO(data)) as z:
        want = {k: z[k] for k in z.files}
    fast = read_npz(data, max_bytes=len(data), copy=False)
    assert sorted(fast) == sorted(want) and all(
        np.array_equal(fast[k], want[k]) and fast[k].dtype == want[k].dtype for k in want
    )
    buf = io.BytesIO()
    np.savez_compressed(buf, **want)  # compressed members: inflated within their directory sizes
    meta, arrays = parse_sidecar(buf.getvalue(), shard=paths[0])
    assert np.array_equal(arrays["lengths"], want["lengths"]) and meta["shard"] == "shard-000.tar"
