"""Sidecars describe the data (issue #20, item 1): one `prealign index --text` serves loaders with
other schemas, layouts and budgets from the sidecars alone; values are checked at load under the
bad-data policy; a sidecar of another transform or an older format is refused with a command that,
followed, fixes it."""

from __future__ import annotations

import os
import re
import shlex

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prealign.loaders import BadDataPolicy, PackedLoader, WebDatasetSource
from prealign.loaders.cli.main import main
from prealign.loaders.errors import StaleIndexError
from prealign.loaders.index.sidecar import VERSION
from prealign.loaders.sources.shard_files import SUFFIX
from prealign.schemas import ParallelLayout
from prealign.schemas.errors import SampleError
from prealign.schemas.schema import causal_lm_schema
from tests.loader_helpers import add_member, sample_lengths, token_ids, write_shards

CONFIGS = [  # (schema, layout, token budget, cp_rank): three trainers reading one index
    (causal_lm_schema(), ParallelLayout(), 128, None),
    (
        causal_lm_schema(pad_token_id=151643, vocab_size=20_000, ignore_index=-1),
        ParallelLayout(tp=2, sp=True),
        256,
        None,
    ),
    (causal_lm_schema(pad_token_id=2, vocab_size=50_000), ParallelLayout(cp=2), 512, 1),
]


def _loader(paths, schema, layout, budget, cp_rank=None, **kw):
    kw = {"dp_size": 2, "dp_rank": 0, "seed": 1, **kw}
    return PackedLoader(
        WebDatasetSource(paths),
        schema=schema,
        layout=layout,
        token_budget=budget,
        cp_rank=cp_rank,
        **kw,
    )


def _no_scan(self, shard):
    raise AssertionError(
        f"scanned shard {shard}: the loader re-indexed instead of reading the sidecar"
    )


def test_one_text_index_serves_three_schemas_layouts_and_budgets(tmp_path, monkeypatch):
    paths = write_shards(str(tmp_path), sample_lengths(90), num_shards=3)
    assert main(["index", "--text", *paths]) == 0
    stamps = {p: os.stat(p + SUFFIX).st_mtime_ns for p in paths}
    monkeypatch.setattr(WebDatasetSource, "scan", _no_scan)
    firsts = []
    for schema, layout, budget, cp_rank in CONFIGS:
        loader = _loader(paths, schema, layout, budget, cp_rank)
        batch = next(iter(loader))
        assert batch["input_ids"].numel() > 0 and len(loader.index) == 90
        assert int(batch["input_ids"].shape[-1]) <= budget
        firsts.append(batch)
    pads = [
        int(b["input_ids"][..., -1]) if b["padding_mask"][..., -1].any() else None for b in firsts
    ]
    assert pads[1] in (None, 151643)  # each loader pads with its own schema's pad id
    assert {p: os.stat(p + SUFFIX).st_mtime_ns for p in paths} == stamps  # no sidecar rewritten


def _big_id(i, tf, at=7):
    """Sample ``at`` (7) carries an id of 15,000: in range for one vocabulary, not for another."""
    if i != at:
        return False
    ids = token_ids(i, 9)
    ids[3] = 15_000
    import io

    buf = io.BytesIO()
    np.save(buf, ids)
    add_member(tf, f"{i:06d}.input_ids.npy", buf.getvalue())
    add_member(tf, f"{i:06d}.json", b'{"id": %d}' % i)  # the same members as every other sample
    return True


def test_values_are_checked_at_load_under_the_policy(tmp_path):
    paths = write_shards(str(tmp_path), sample_lengths(30), num_shards=2, extra=_big_id)
    assert main(["index", "--text", *paths]) == 0
    layout = ParallelLayout()
    ok = _loader(paths, causal_lm_schema(vocab_size=20_000), layout, 4096, dp_size=1)
    assert (
        sum(len(b["sample_index"]) for b in ok) == 30
    )  # a vocabulary of 20,000 takes every sample
    small = causal_lm_schema(vocab_size=12_000)
    with pytest.raises(
        SampleError, match="shard-000.tar.*input_ids.*got 15000"
    ):  # the default policy raises, naming the sample
        list(_loader(paths, small, layout, 4096, dp_size=1))
    skip = _loader(paths, small, layout, 4096, dp_size=1, bad_data=BadDataPolicy(on_error="skip"))
    with pytest.warns(Warning, match="15000"):
        served = sum(len(b["sample_index"]) for b in skip)
    assert served == 29 and sum(skip.report.counts.values()) == 1  # counted, not dropped silently


def _hint_command(message: str) -> list[str]:
    """The ``prealign index ...`` command an error tells the user to run, as argv for ``main``."""
    cmd = re.search(r"`(prealign index [^`]*)`", message)
    assert cmd, message
    return shlex.split(cmd.group(1))[1:]


def _doubled(sample):
    """A text transform whose lengths differ from numpy_fields' (each id twice)."""
    return {"input_ids": np.repeat(np.asarray(sample["input_ids.npy"]), 2)}


def test_another_transform_names_the_field_and_its_command_fixes_it(tmp_path, monkeypatch):
    paths = write_shards(str(tmp_path), sample_lengths(20), num_shards=2)
    from prealign.loaders.index.header_pass import write_sidecars

    write_sidecars(
        WebDatasetSource(paths, transform=_doubled), causal_lm_schema()
    )  # no header rule: the transform
    lengths = sample_lengths(
        20
    )  # pass runs it on every sample; its sidecars serve a loader with that transform
    with monkeypatch.context() as m:
        m.setattr(WebDatasetSource, "scan", _no_scan)
        doubled = PackedLoader(
            WebDatasetSource(paths, transform=_doubled),
            schema=causal_lm_schema(),
            layout=ParallelLayout(),
            token_budget=4096,
        ).prepare()
    assert sorted(doubled.index.lengths.tolist()) == sorted(2 * n for n in lengths)
    with pytest.raises(
        StaleIndexError,
        match=r"transform: indexed with '.*_doubled', this loader has "
        r"'numpy_fields'",
    ) as exc:
        next(iter(_loader(paths, *CONFIGS[0])))
    argv = _hint_command(str(exc.value))
    assert argv[:3] == ["index", "--text", "--force"]
    assert main(argv) == 0  # the hint, followed
    assert next(iter(_loader(paths, *CONFIGS[0])))["input_ids"].numel() > 0


def test_a_version_1_sidecar_is_refused_by_version_and_the_hint_rebuilds_it(tmp_path):
    paths = write_shards(str(tmp_path), sample_lengths(20), num_shards=1)
    assert main(["index", "--text", *paths]) == 0
    side = paths[0] + SUFFIX
    with np.load(side) as z:
        arrays = dict(z)
    arrays["meta"] = np.frombuffer(
        bytes(arrays["meta"]).replace(f'"version": {VERSION}'.encode(), b'"version": 1'), np.uint8
    )
    with open(side, "wb") as f:
        np.savez(f, **arrays)
    with pytest.raises(
        StaleIndexError, match="version 1.*run `prealign index --text --force "
    ) as exc:
        next(iter(_loader(paths, *CONFIGS[0])))
    command = re.search(r"run `(prealign index [^`]*)`", str(exc.value)).group(1)
    assert (
        main(shlex.split(command)[1:]) == 0
    )  # the hint, followed as printed (its transform's flag, the shards)
    assert next(iter(_loader(paths, *CONFIGS[0])))["input_ids"].numel() > 0


def _tiny_tokenizer_dir(path) -> str:
    """A word-level Hugging Face tokenizer with Qwen2-VL's special tokens, saved as a local
    folder."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = [
        "<unk>",
        "<|im_start|>",
        "<|im_end|>",
        "<|vision_start|>",
        "<|vision_end|>",
        "<|image_pad|>",
    ]
    words = ["user", "assistant", "\n", " ", "look", "at", "this", "Fine", ".", "?"]
    tok = Tokenizer(
        models.WordLevel({w: i for i, w in enumerate(specials + words)}, unk_token="<unk>")
    )
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\n|[.?]| +"), behavior="isolated")
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", additional_special_tokens=specials[1:]
    )
    hf.save_pretrained(str(path))
    return str(path)


def test_vlm_sidecars_of_another_tokenizer_name_it_and_the_command_with_tokenizer_fixes_it(
    tmp_path, capsys, monkeypatch
):
    from transformers import AutoTokenizer

    from prealign.loaders.cli.demo_data import build_demo_dataset
    from prealign.loaders.media.chat_tokenizer import HFChatTokenizer
    from prealign.loaders.media.vlm import VLMSampleTransform
    from prealign.schemas.vlm import vlm_schema

    shards = list(
        build_demo_dataset(
            str(tmp_path / "data"), num_samples=24, samples_per_shard=12, topk=4
        ).shards
    )
    tok_dir = _tiny_tokenizer_dir(tmp_path / "tok")
    assert main(["index", "--topk", "4", *shards]) == 0  # the demo byte tokenizer
    tok = HFChatTokenizer(AutoTokenizer.from_pretrained(tok_dir, local_files_only=True))

    def loader():
        src = WebDatasetSource(shards, transform=VLMSampleTransform(tokenizer=tok), image="bytes")
        return PackedLoader(
            src,
            schema=vlm_schema(),
            layout=ParallelLayout(),
            token_budget=8192,
            bad_data=BadDataPolicy(on_error="skip", warn=False),
        )

    with pytest.raises(StaleIndexError, match="tokenizer: indexed with '.*ByteTokenizer'") as exc:
        loader().prepare()
    argv = _hint_command(str(exc.value))
    assert argv[:4] == ["index", "--tokenizer", tok_dir, "--force"]
    assert main(argv) == 0  # the hint, followed
    capsys.readouterr()
    with monkeypatch.context() as m:
        m.setattr(WebDatasetSource, "scan", _no_scan)
        assert next(iter(loader()))["input_ids"].numel() > 0
    assert main(
        [
            "inspect",
            "--tokenizer",
            tok_dir,
            "--tp",
            "1",
            "--cp",
            "1",
            "--workers",
            "0",
            "--out",
            str(tmp_path / "p.png"),
            *shards,
        ]
    ) in (0, 1)
    err = capsys.readouterr().err
    assert f"tokenizer: {tok_dir} (" in err and "2 from sidecars, 0 scanned" in err


def test_a_bad_value_in_the_checked_sample_condemns_that_sample_not_its_signature(tmp_path):
    def first_bad(i, tf):
        return _big_id(
            i, tf, at=0
        )  # sample 0, the first of the one data signature, has an id of 15,000

    paths = write_shards(str(tmp_path), sample_lengths(30), num_shards=1, extra=first_bad)
    assert main(["index", "--text", *paths]) == 0
    skip = _loader(
        paths,
        causal_lm_schema(vocab_size=12_000),
        ParallelLayout(),
        4096,
        dp_size=1,
        bad_data=BadDataPolicy(on_error="skip", warn=False),
    )
    assert len(skip.prepare().index) == 29 and skip.report.counts == {"bad_sample": 1}
    assert sum(len(b["sample_index"]) for b in skip) == 29
    with pytest.raises(SampleError, match="15000"):  # the default policy: raised, naming the sample
        _loader(
            paths, causal_lm_schema(vocab_size=12_000), ParallelLayout(), 4096, dp_size=1
        ).prepare()


def test_inspect_uses_sidecars_when_present_and_shows_scan_progress_otherwise(tmp_path, capsys):
    paths = write_shards(str(tmp_path), sample_lengths(40), num_shards=4)
    argv = [
        "inspect",
        "--text",
        "--tp",
        "1",
        "--cp",
        "1",
        "--workers",
        "0",
        "--out",
        str(tmp_path / "p.png"),
        *paths,
    ]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert (
        "0 from sidecars, 4 scanned" in err
        and "scanned shards: 4/4" in err
        and "tokenizer: none" in err
    )
    assert main(["index", "--text", *paths]) == 0
    capsys.readouterr()
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "4 from sidecars, 0 scanned" in err and "scanned shards" not in err


def test_processor_folder_settings_key_the_vlm_sidecars(tmp_path, monkeypatch, capsys):
    import json

    from prealign.loaders.cli.demo_data import build_demo_dataset
    from prealign.loaders.cli.demo_tokenizer import ByteTokenizer
    from prealign.loaders.media.vlm import VLMSampleTransform
    from prealign.schemas.vlm import vlm_schema

    shards = list(
        build_demo_dataset(
            str(tmp_path / "data"), num_samples=12, samples_per_shard=12, topk=2
        ).shards
    )
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "preprocessor_config.json").write_text(
        json.dumps({"max_pixels": 200704, "unrelated": 1})
    )
    assert main(["index", "--topk", "2", "--processor", str(proc), *shards]) == 0

    def loader(options):
        src = WebDatasetSource(
            shards,
            transform=VLMSampleTransform(
                tokenizer=ByteTokenizer(), topk=2, processor_options=options
            ),
            image="bytes",
        )
        return PackedLoader(
            src,
            schema=vlm_schema(topk=2),
            layout=ParallelLayout(),
            token_budget=8192,
            bad_data=BadDataPolicy(on_error="skip", warn=False),
        )

    with monkeypatch.context() as m:
        m.setattr(WebDatasetSource, "scan", _no_scan)
        assert (
            next(iter(loader({"max_pixels": 200704})))["pixel_values"].shape[0] > 0
        )  # the folder's settings
    with pytest.raises(StaleIndexError, match=r"processor: indexed with .*200704") as exc:
        loader({}).prepare()  # the processor's defaults: another transform
    assert (
        main(_hint_command(str(exc.value))) == 0
    )  # the hint (the defaults: no --processor), followed
    assert len(loader({}).prepare().index) > 0
    assert main(["index", "--tokenizer", str(tmp_path / "nowhere"), *shards]) == 2
    assert "not a local Hugging Face tokenizer folder" in capsys.readouterr().err


@pytest.fixture(scope="module")
def indexed_once(tmp_path_factory):
    """Shards with labels on every third sample (the others are then bad data: a micro-batch cannot
    mix samples with and without a field), indexed once by `prealign index --text`."""
    from tests.loader_helpers import _npy

    def labelled(i, tf):
        if i % 3:
            return False
        ids = token_ids(i, 5 + i % 17)
        labels = ids.copy()
        labels[: len(ids) // 2] = -100
        add_member(tf, f"{i:06d}.input_ids.npy", _npy(ids))
        add_member(tf, f"{i:06d}.labels.npy", _npy(labels))
        return True

    root = tmp_path_factory.mktemp("indexed")
    paths = write_shards(str(root), sample_lengths(60, seed=4), num_shards=3, extra=labelled)
    assert main(["index", "--text", *paths]) == 0
    return paths


@pytest.mark.slow
@settings(max_examples=12, deadline=None)
@given(
    pad=st.integers(0, 200_000),
    ignore=st.sampled_from([-100, -1]),
    extra_vocab=st.integers(0, 100_000),
    tp=st.sampled_from([1, 2]),
    cp=st.sampled_from([1, 2]),
    budget=st.sampled_from([256, 512, 2048]),
    dp=st.integers(1, 3),
)
def test_sidecars_give_the_in_process_plan_under_any_schema(
    indexed_once, pad, ignore, extra_vocab, tp, cp, budget, dp
):
    """Differential: whatever the pad id, ignore index, vocabulary (holding every id), layout,
    budget and DP size, a loader from the sidecars plans exactly the micro-batches of the in-process
    index pass, and counts the same bad samples."""
    schema = causal_lm_schema(
        pad_token_id=pad, ignore_index=ignore, vocab_size=10_060 + extra_vocab
    )
    layout = ParallelLayout(tp=tp, cp=cp)

    def plan(sidecars: bool):
        loader = PackedLoader(
            WebDatasetSource(indexed_once, sidecars=sidecars),
            schema=schema,
            layout=layout,
            token_budget=budget,
            dp_size=dp,
            dp_rank=dp - 1,
            seed=5,
            bad_data=BadDataPolicy(on_error="skip", warn=False, max_consecutive=1000),
        )
        return loader.prepare().index.digest, loader.epoch_samples(0), loader.report.counts

    from_sidecars = plan(True)
    assert (
        from_sidecars == plan(False) and sum(from_sidecars[2].values()) > 0
    )  # (bad samples among them)


def test_the_same_tokenizer_from_another_folder_reads_the_sidecars(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    from prealign.loaders.cli.demo_data import build_demo_dataset
    from prealign.loaders.media.chat_tokenizer import HFChatTokenizer
    from prealign.loaders.media.vlm import VLMSampleTransform
    from prealign.schemas.vlm import vlm_schema

    shards = list(
        build_demo_dataset(
            str(tmp_path / "data"), num_samples=12, samples_per_shard=12, topk=2
        ).shards
    )
    assert main(["index", "--tokenizer", _tiny_tokenizer_dir(tmp_path / "here"), *shards]) == 0
    elsewhere = HFChatTokenizer(
        AutoTokenizer.from_pretrained(
            _tiny_tokenizer_dir(tmp_path / "there"), local_files_only=True
        )
    )
    monkeypatch.setattr(WebDatasetSource, "scan", _no_scan)
    src = WebDatasetSource(shards, transform=VLMSampleTransform(tokenizer=elsewhere), image="bytes")
    loader = PackedLoader(
        src,
        schema=vlm_schema(),
        layout=ParallelLayout(),
        token_budget=8192,
        bad_data=BadDataPolicy(on_error="skip", warn=False),
    )
    assert next(iter(loader))["input_ids"].numel() > 0
