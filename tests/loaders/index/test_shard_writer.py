"""``ShardWriter`` (issue #20, item 2): samples -> webdataset shards of a target size with their
sidecars, in one call; write -> index -> load gives back the samples; hostile names are refused and
nothing is overwritten."""

from __future__ import annotations

import io
import json
import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prealign.loaders import PackedLoader, ShardWriter, WebDatasetSource, build_index
from prealign.loaders.index.sidecar import parse_sidecar
from prealign.loaders.sources.shard_files import SUFFIX
from prealign.schemas import ParallelLayout
from prealign.schemas.errors import ConfigError
from prealign.schemas.schema import causal_lm_schema


def _samples(n: int, seed: int = 0, topk: int | None = None) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        ids = rng.integers(1, 1000, int(rng.integers(3, 80))).astype(np.int64)
        labels = ids.copy()
        labels[: len(ids) // 3] = -100
        sample = {
            "__key__": f"s{i:05d}",
            "input_ids": ids,
            "labels": torch.from_numpy(labels),
            "json": {"id": i},
        }
        if topk:
            sample["teacher_topk_log_probs"] = -rng.random((len(ids), topk)).astype(np.float32)
            sample["teacher_topk_ids"] = rng.integers(0, 1000, (len(ids), topk))
        out.append(sample)
    return out


def _no_scan(self, shard):
    raise AssertionError("scanned a shard: its sidecar was not used")


def test_write_index_load_gives_back_the_samples(tmp_path, monkeypatch):
    samples = _samples(120, topk=4)
    with ShardWriter(str(tmp_path / "shard-%06d.tar"), max_bytes=32 << 10) as w:
        for s in samples:
            w.write(s)
    assert len(w.shards) > 3 and w.count == 120
    for (
        path
    ) in w.shards:  # about the target size: a shard closes before a sample that would take it past
        assert os.path.getsize(path) <= (32 << 10) + 10240 and os.path.exists(path + SUFFIX)
        meta, _ = parse_sidecar(open(path + SUFFIX, "rb").read(), shard=path)
        assert meta["size"] == os.path.getsize(path)
    monkeypatch.setattr(WebDatasetSource, "scan", _no_scan)
    src = WebDatasetSource(w.shards)
    index = build_index(src, causal_lm_schema(topk=4))
    assert len(index) == 120
    by_key = {s["__key__"]: s for s in samples}
    for loc in index.locations:
        got = src.load(tuple(loc.tolist()))
        want = by_key[got["__key__"]]
        assert torch.equal(got["input_ids"], torch.from_numpy(want["input_ids"]))
        assert torch.equal(got["labels"], want["labels"])
        assert torch.equal(
            got["teacher_topk_log_probs"], torch.from_numpy(want["teacher_topk_log_probs"])
        )
        assert (
            json.loads(got["json"]) == want["json"]
            if isinstance(got["json"], (str, bytes))
            else got["json"] == want["json"]
        )
    loader = PackedLoader(
        src, schema=causal_lm_schema(topk=4), layout=ParallelLayout(), token_budget=4096
    )
    assert sum(len(b["sample_index"]) for b in loader) == 120  # every sample, from the sidecars


@settings(max_examples=15, deadline=None)
@given(lengths=st.lists(st.integers(1, 300), min_size=1, max_size=40), max_kb=st.integers(2, 16))
def test_every_sample_lands_in_exactly_one_shard_in_order(tmp_path_factory, lengths, max_kb):
    out = tmp_path_factory.mktemp("w")
    with ShardWriter(str(out / "s-%04d.tar"), max_bytes=max_kb << 10) as w:
        for i, n in enumerate(lengths):
            w.write({"__key__": f"k{i}", "input_ids": np.arange(1, n + 1, dtype=np.int32)})
    index = build_index(WebDatasetSource(w.shards), causal_lm_schema())
    assert (
        index.lengths.tolist() == lengths
    )  # canonical order: shard by shard, written order inside


def test_vlm_samples_with_images_round_trip_with_the_transform(tmp_path, monkeypatch):
    from PIL import Image

    from prealign.loaders.cli.demo_tokenizer import ByteTokenizer
    from prealign.loaders.media.vlm import VLMSampleTransform
    from prealign.schemas.vlm import vlm_schema

    transform = VLMSampleTransform(tokenizer=ByteTokenizer())
    rng = np.random.default_rng(0)
    with ShardWriter(str(tmp_path / "vlm-%03d.tar"), max_bytes=64 << 10, transform=transform) as w:
        for i in range(12):
            img = Image.fromarray(rng.integers(0, 255, (56 + 8 * i, 64, 3), dtype=np.uint8))
            chat = {
                "messages": [
                    {"role": "user", "content": "<image>\nwhat is it?"},
                    {"role": "assistant", "content": "a picture."},
                ],
                "images": ["0.png"],
            }
            w.write({"__key__": f"v{i}", "json": chat, "0.png": img})
    monkeypatch.setattr(WebDatasetSource, "scan", _no_scan)
    src = WebDatasetSource(w.shards, transform=transform, image="bytes")
    batches = list(
        PackedLoader(
            src,
            schema=vlm_schema(vocab_size=ByteTokenizer().vocab_size),
            layout=ParallelLayout(),
            token_budget=8192,
        )
    )
    assert sum(len(b["sample_index"]) for b in batches) == 12
    assert sum(int(b["image_grid_thw"].shape[0]) for b in batches) == 12


@pytest.mark.parametrize(
    "sample",
    [
        {"__key__": "../escape", "input_ids": np.arange(3)},
        {"__key__": "a/b", "input_ids": np.arange(3)},
        {"__key__": "has.dot", "input_ids": np.arange(3)},
        {"__key__": "ok", "../x": b"1"},
        {"__key__": "ok", ".hidden": b"1"},
        {"__key__": "ok", "a/b.txt": b"1"},
        {"__key__": "ok", "bad\nname": b"1"},
        {"__key__": "ok", "input_ids": np.array([object()])},
        {"__key__": "ok", "thing": object()},
        {"__key__": "ok"},
    ],
)
def test_hostile_names_and_values_are_refused_and_nothing_escapes(tmp_path, sample):
    inner = tmp_path / "inner"
    with pytest.raises(ConfigError):
        with ShardWriter(str(inner / "s-%03d.tar")) as w:
            w.write(sample)
    assert not (tmp_path / "escape").exists() and not (tmp_path / "x").exists()


def test_an_existing_shard_is_never_overwritten(tmp_path):
    path = tmp_path / "s-000.tar"
    path.write_bytes(b"precious")
    with pytest.raises(ConfigError, match="exists"):
        with ShardWriter(str(tmp_path / "s-%03d.tar")) as w:
            w.write({"input_ids": np.arange(1, 4)})
    assert path.read_bytes() == b"precious"


def test_members_are_stored_as_the_format_page_says(tmp_path):
    import tarfile

    from PIL import Image

    with ShardWriter(str(tmp_path / "s-%03d.tar"), sidecars=False) as w:
        w.write(
            {
                "__key__": "a",
                "input_ids": np.arange(1, 5, dtype=np.int32),
                "json": {"x": 1},
                "txt": "hi",
                "0.jpg": b"\xff\xd8raw",
                "frame": Image.new("RGB", (4, 4)),
                "video": np.zeros((2, 4, 4, 3), np.uint8),
            }
        )
    with tarfile.open(w.shards[0]) as tf:
        names = tf.getnames()
        assert names == [
            "a.input_ids.npy",
            "a.json",
            "a.txt",
            "a.0.jpg",
            "a.frame.png",
            "a.video.npy",
        ]
        assert np.load(io.BytesIO(tf.extractfile("a.input_ids.npy").read())).tolist() == [
            1,
            2,
            3,
            4,
        ]
        assert json.loads(tf.extractfile("a.json").read()) == {"x": 1}
        assert tf.extractfile("a.0.jpg").read() == b"\xff\xd8raw"


def _load(paths, **kw) -> int:
    loader = PackedLoader(
        WebDatasetSource(paths, **kw),
        schema=causal_lm_schema(),
        layout=ParallelLayout(),
        token_budget=4096,
    )
    return len(loader.prepare().index)


def test_a_with_block_that_fails_leaves_its_shard_as_part_with_no_sidecar(tmp_path):
    with pytest.raises(RuntimeError, match="tokenizer crashed"):
        with ShardWriter(str(tmp_path / "s-%03d.tar"), max_samples=10) as w:
            for i in range(15):
                w.write({"input_ids": np.arange(1, 9)})
            raise RuntimeError("tokenizer crashed")
    assert sorted(os.listdir(tmp_path)) == ["s-000.tar", "s-000.tar" + SUFFIX, "s-001.tar.part"]
    assert (
        w.shards == [str(tmp_path / "s-000.tar")] and _load(w.shards) == 10
    )  # the closed shard, whole


def test_a_shard_being_written_never_has_its_final_name(tmp_path):
    w = ShardWriter(str(tmp_path / "s-%03d.tar"))
    w.write({"input_ids": np.arange(1, 9)})
    assert os.listdir(tmp_path) == [
        "s-000.tar.part"
    ]  # killed here: no truncated s-000.tar for a loader to read
    w.close()
    assert sorted(os.listdir(tmp_path)) == ["s-000.tar", "s-000.tar" + SUFFIX]


@pytest.mark.parametrize(
    "sample, match",
    [
        (
            {
                "__key__": "k" * 80,
                "input_ids": np.arange(1, 9),
                "teacher_topk_log_probs": -np.ones((8, 2), np.float32),
            },
            "k{80}.teacher_topk_log_probs.npy is 107 bytes.*at most 100",
        ),
        (
            {"__key__": "s1", "input_ids": np.arange(1, 9), "input_ids.npy": np.arange(1, 5)},
            "'s1': entries 'input_ids' and 'input_ids.npy' are both member s1.input_ids.npy",
        ),
    ],
)
def test_a_bad_sample_is_refused_whole_before_any_member_is_written(tmp_path, sample, match):
    w = ShardWriter(str(tmp_path / "s-%03d.tar"))
    w.write({"__key__": "s0", "input_ids": np.arange(1, 9)})
    with pytest.raises(ConfigError, match=match):
        w.write(sample)
    w.close()
    import tarfile

    with tarfile.open(w.shards[0]) as tf:
        assert tf.getnames() == ["s0.input_ids.npy"]
    assert _load(w.shards) == 1


def test_a_sidecar_of_another_data_set_in_a_shared_index_dir_is_never_overwritten(tmp_path):
    index_dir = str(tmp_path / "index")
    with ShardWriter(str(tmp_path / "one" / "shard-%03d.tar"), index_dir=index_dir) as one:
        one.write({"input_ids": np.arange(1, 9)})
    theirs = open(os.path.join(index_dir, "shard-000.tar" + SUFFIX), "rb").read()
    with pytest.raises(ConfigError, match="a sidecar is there already"):
        with ShardWriter(str(tmp_path / "two" / "shard-%03d.tar"), index_dir=index_dir) as two:
            two.write({"input_ids": np.arange(1, 30)})
    assert open(os.path.join(index_dir, "shard-000.tar" + SUFFIX), "rb").read() == theirs
    assert _load(one.shards, index_dir=index_dir) == 1


@pytest.mark.parametrize("max_samples", [0, -1, 2.0, True])
def test_max_samples_is_a_positive_int(tmp_path, max_samples):
    with pytest.raises(ConfigError, match="max_samples"):
        ShardWriter(str(tmp_path / "s-%03d.tar"), max_samples=max_samples)


def test_pre_tokenized_vlm_samples_load_their_own_ids_from_sidecars_and_in_process(tmp_path):
    from PIL import Image

    from prealign.loaders import BadDataPolicy
    from prealign.loaders.cli.demo_tokenizer import ByteTokenizer
    from prealign.loaders.media.vlm import VLMSampleTransform
    from prealign.schemas.vlm import vlm_schema

    transform = VLMSampleTransform(tokenizer=ByteTokenizer())
    png = io.BytesIO()
    Image.fromarray(np.full((56, 56, 3), 60, np.uint8)).save(png, format="PNG")
    written = []
    with ShardWriter(str(tmp_path / "v-%03d.tar"), transform=transform) as w:
        for i in range(4):
            chat = {
                "messages": [
                    {"role": "user", "content": "<image>\nwhat?"},
                    {"role": "assistant", "content": "x" * (5 + i)},
                ],
                "images": ["0.png"],
            }
            ids = transform({"__key__": "k", "json": chat, "0.png": png.getvalue()})[
                "input_ids"
            ].numpy()
            written.append(ids)  # the ids are the sample (its text member says nothing of them)
            w.write(
                {
                    "__key__": f"s{i}",
                    "input_ids": ids,
                    "json": {"text": "<image>\n", "images": ["0.png"]},
                    "0.png": png.getvalue(),
                }
            )
    for sidecars in (True, False):
        loader = PackedLoader(
            WebDatasetSource(w.shards, transform=transform, image="bytes", sidecars=sidecars),
            schema=vlm_schema(),
            layout=ParallelLayout(),
            token_budget=8192,
            bad_data=BadDataPolicy(on_error="skip", warn=False),
        )
        batch = next(iter(loader))
        assert sorted(batch["input_ids"].reshape(-1).tolist()) == sorted(
            np.concatenate(written).tolist()
        ), sidecars
