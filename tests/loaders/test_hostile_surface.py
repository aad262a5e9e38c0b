"""A hostile pass over the loaders' public surface: constructor arguments and options of every
public loader object, mixture weights and names, and the ``prealign`` command's ``--hf`` files, as
a careless user or a broken file would give them. Each case asserts a typed error (a
``ConfigError``, the argument it names, what was expected and what came), never an untyped
exception, a traceback or a silent coercion."""

from __future__ import annotations

import io
import json
import os
import pathlib
import re
import tarfile

import datasets
import numpy as np
import PIL.Image
import pytest

from prealign.loaders import (
    BadDataPolicy,
    Component,
    HFSource,
    LoadingOptions,
    Mixture,
    PackedLoader,
    RemoteOptions,
    StreamingPackedLoader,
    VLMSampleTransform,
    WebDatasetSource,
    plan_microbatches,
)
from prealign.loaders.cli.demo_tokenizer import ByteTokenizer
from prealign.loaders.cli.main import main
from prealign.loaders.errors import BadSampleError, PlanError
from prealign.loaders.media.vlm import image_processor
from prealign.schemas import ParallelLayout, causal_lm_schema
from prealign.schemas.errors import ConfigError
from tests.loader_helpers import hf_rows, sample_lengths, write_shards

SCHEMA, LAYOUT = causal_lm_schema(), ParallelLayout()


# ---- prealign inspect --hf FILE: a data file load_dataset cannot read ---------------------------
@pytest.mark.parametrize(
    "name,content",
    [
        ("empty.jsonl", b""),
        ("empty.json", b""),
        ("binary.jsonl", bytes(range(256)) * 8),
        ("binary.csv", bytes(range(256)) * 8),
        ("binary.parquet", bytes(range(256)) * 8),
        ("empty.parquet", b""),
        ("binary.arrow", bytes(range(256)) * 8),
    ],
)
def test_an_unreadable_hf_data_file_is_one_error_line(name, content, tmp_path, capsys):
    path = tmp_path / name
    path.write_bytes(content)
    argv = ["inspect", "--text", "--hf", str(path), "--workers", "0"]
    argv += ["--out", str(tmp_path / "o.png"), "--cache-dir", str(tmp_path / "cache")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("prealign: error: ")]
    assert len(lines) == 1 and err.strip().splitlines()[-1] == lines[0], err  # (datasets logs)
    assert f"--hf {path}" in lines[0] and "(hint: " in lines[0], lines[0]
    assert os.path.splitext(name)[1][1:].replace("jsonl", "json") in lines[0]


# ---- Mixture: names and weights ----------------------------------------------------------------
def _hf(n: int = 10, seed: int = 0) -> HFSource:
    return HFSource(datasets.Dataset.from_dict(hf_rows(sample_lengths(n, seed=seed))))


def test_mixture_names_equal_as_str_are_refused_not_merged():
    with pytest.raises(ConfigError, match=r"components: expected distinct names, got \[1, '1'\]"):
        Mixture({1: (_hf(), 1.0), "1": (_hf(seed=1), 2.0)})


def test_mixture_weights_whose_sum_overflows_are_refused_not_an_empty_epoch():
    mix = {"a": (_hf(), 1e308), "b": (_hf(seed=1), 1e308)}
    with pytest.raises(PlanError, match=r"mixture weights: expected a finite sum .* got inf"):
        Mixture(mix)
    mix = Mixture({"a": (_hf(), 1e307), "b": (_hf(seed=1), 1e307)})  # (a finite sum: served)
    loader = PackedLoader(mix, schema=SCHEMA, layout=LAYOUT, token_budget=256)
    assert sum(len(b["sample_index"]) for b in loader) == 20


# ---- sources: constructor arguments ------------------------------------------------------------
@pytest.mark.parametrize("value", [0, -1, True, 2.5, "4", None, float("inf"), float("nan")])
@pytest.mark.parametrize("name", ["rows_per_shard", "lookback"])
def test_hf_source_counts_are_ints_at_least_one_not_coerced(name, value):
    ds = datasets.Dataset.from_dict(hf_rows(sample_lengths(20)))
    with pytest.raises(ConfigError, match=rf"HFSource.{name}: expected an int >= 1, got"):
        HFSource(ds, **{name: value})
    assert HFSource(ds, rows_per_shard=np.int64(7)).num_shards == 3  # (a numpy int is one)


@pytest.mark.parametrize(
    "kw,words",
    [
        ({"name": 3}, "name: expected a str or None, got int"),
        ({"media_root": 3}, "media_root: expected a folder path or None, got int"),
    ],
)
def test_hf_source_name_and_media_root_of_another_type(kw, words):
    ds = datasets.Dataset.from_dict(hf_rows(sample_lengths(4)))
    with pytest.raises(ConfigError, match=words):
        HFSource(ds, **kw)


@pytest.mark.parametrize(
    "kw,words",
    [
        ({"required": "txt"}, r"required: expected a list or tuple of member extensions"),
        ({"required": None}, r"required: expected a list or tuple .* got NoneType"),
        ({"required": ["npy", 3]}, r"required: expected member extensions \(str\), got 3"),
        ({"decoders": 3}, r"decoders: expected a mapping extension \(str\) -> callable"),
        ({"decoders": "ab"}, r"decoders: expected a mapping"),
        ({"decoders": {"x": 3}}, r"decoders: expected a mapping"),
        ({"remote": {"timeout": 3}}, r"remote: expected a RemoteOptions or None, got dict"),
        ({"cache_dir": 3}, r"cache_dir: expected a folder path or None, got int"),
        ({"index_dir": [1]}, r"index_dir: expected a folder path or None, got list"),
        ({"max_open_files": 0}, r"max_open_files: expected an int >= 1, got 0"),
        ({"max_open_files": None}, r"max_open_files: expected an int >= 1, got None"),
        ({"max_open_files": float("inf")}, r"max_open_files: expected an int >= 1, got inf"),
        ({"cache_limit": -1}, r"RemoteOptions.cache_limit: expected an int >= 0, got -1"),
        ({"cache_limit": float("nan")}, r"RemoteOptions.cache_limit: expected an int >= 0"),
        ({"read_timeout": float("inf")}, r"read_timeout: expected seconds > 0 and <= 9.2\d*e\+09"),
        ({"read_timeout": 1e300}, r"read_timeout: .* or None \(no deadline\), got 1e\+300"),
    ],
)
def test_webdataset_source_arguments_of_another_type(kw, words, tmp_path):
    paths = write_shards(str(tmp_path), sample_lengths(6), num_shards=2)
    with pytest.raises(ConfigError, match=words):
        WebDatasetSource(paths, **kw)
    assert WebDatasetSource(paths, required=("input_ids.npy",)).required == ("input_ids.npy",)


@pytest.mark.parametrize(
    "urls,words",
    [
        (3, r"urls: expected a shard path or URL, or a list of them, got int"),
        ({"a.tar": 1}, r"urls: expected .* got dict"),
        (b"a.tar", r"urls: expected .* got bytes"),
        (["a.tar", 1], r"urls\[1\]: expected a shard path or URL \(a str\), got int 1"),
        (["a.tar", None], r"urls\[1\]: expected .* got NoneType None"),
    ],
)
def test_webdataset_urls_of_another_type_are_refused_not_made_str(urls, words):
    with pytest.raises(ConfigError, match=words):
        WebDatasetSource(urls)


def test_webdataset_urls_may_be_path_objects(tmp_path):
    paths = write_shards(str(tmp_path), sample_lengths(6), num_shards=2)
    assert WebDatasetSource([pathlib.Path(p) for p in paths]).urls == paths


@pytest.mark.parametrize(
    "kw,words",
    [
        ({"block_size": 0}, r"block_size: expected an int >= 1, got 0"),  # (start // 0 at a read)
        ({"retries": -1}, r"retries: expected an int >= 0, got -1"),  # (no attempt at all)
        ({"retries": True}, r"retries: expected an int >= 0, got True"),
        ({"cache_limit": 2.5}, r"cache_limit: expected an int >= 0, got 2.5"),
        ({"stream_shards": 0}, r"stream_shards: expected an int >= 1, got 0"),
        ({"timeout": 0}, r"timeout: expected a number of seconds > 0"),
        ({"timeout": float("nan")}, r"timeout: expected a number of seconds > 0 .* got nan"),
        ({"timeout": 1e300}, r"timeout: expected .* and <= 9\.2\d*e\+09, got 1e\+300"),
        ({"timeout": "30"}, r"timeout: expected a number of seconds"),
        ({"request_deadline": -1.0}, r"request_deadline: expected a number of seconds > 0"),
        ({"backoff": float("inf")}, r"backoff: expected a number of seconds >= 0"),
        ({"min_rate": float("nan")}, r"min_rate: expected a number >= 0, got nan"),
        ({"cache_dir": 3}, r"cache_dir: expected a folder path or None, got int"),
        ({"storage_options": "anon"}, r"storage_options: expected a dict or None, got str"),
    ],
)
def test_remote_options_out_of_range_are_a_config_error(kw, words):
    with pytest.raises(ConfigError, match=r"RemoteOptions\." + words):
        RemoteOptions(**kw)
    assert RemoteOptions(retries=0, min_rate=0, cache_limit=0).retries == 0  # (still valid)


# ---- sizes that make the plan unbounded ---------------------------------------------------------
@pytest.mark.parametrize("dp_size", [2**20 + 1, 2**40, 10**30])
def test_a_dp_size_past_the_bound_is_a_plan_error_not_out_of_memory(dp_size):
    with pytest.raises(PlanError, match=r"dp_size: expected an int <= 1,048,576 \(DP ranks\)"):
        PackedLoader(_hf(), schema=SCHEMA, layout=LAYOUT, token_budget=256, dp_size=dp_size)
    with pytest.raises(PlanError, match=r"dp_size: expected an int <= 1,048,576"):
        plan_microbatches([5, 6, 7], layout=LAYOUT, token_budget=256, dp_size=dp_size)
    assert plan_microbatches([5, 6], layout=LAYOUT, token_budget=256, dp_size=4).dp_size == 4


@pytest.mark.parametrize(
    "kw,words",
    [
        ({"length": 2**40}, r"'a': .*length 1099511627776.*expected at most 2,147,483,648 draws"),
        ({"length": 10**30}, r"'a': .*expected at most 2,147,483,648 draws"),
        ({"by": "samples", "length": 2**32}, r"'a': .*expected at most 2,147,483,648 draws"),
    ],
)
def test_a_mixture_epoch_past_the_draw_bound_is_a_plan_error_not_a_hang(kw, words):
    loader = PackedLoader(
        Mixture({"a": (_hf(), 1.0)}, **kw), schema=SCHEMA, layout=LAYOUT, token_budget=256
    )
    with pytest.raises(PlanError, match=words):
        loader.prepare()


def test_a_mixture_repeat_past_the_draw_bound_is_a_plan_error_not_a_hang():
    mix = Mixture({"a": Component(_hf(), repeat=1e9)})
    loader = PackedLoader(mix, schema=SCHEMA, layout=LAYOUT, token_budget=256)
    with pytest.raises(PlanError, match=r"'a': repeat 1000000000.0 asks for .*expected at most"):
        loader.prepare()


# ---- the loaders' and a mixture component's arguments of another type -------------------------
@pytest.mark.parametrize("loader_cls", [PackedLoader, StreamingPackedLoader])
@pytest.mark.parametrize(
    "kw,words",
    [
        ({"source": "data/*.tar"}, r"source: expected a Source, got str"),
        ({"source": None}, r"source: expected a Source, got NoneType"),
        ({"schema": "causal_lm"}, r"schema: expected a BatchSchema, got str"),
        ({"schema": None}, r"schema: expected a BatchSchema, got NoneType"),
        ({"layout": {"tp": 2}}, r"layout: expected a ParallelLayout, got dict"),
        ({"collator": 3}, r"collator: expected a callable .* got int"),
    ],
)
def test_a_loader_argument_of_another_type_is_named(loader_cls, kw, words, tmp_path):
    paths = write_shards(str(tmp_path), sample_lengths(6), num_shards=2)
    args = {"source": WebDatasetSource(paths), "schema": SCHEMA, "layout": LAYOUT, **kw}
    with pytest.raises(PlanError, match=words):
        loader_cls(args.pop("source"), token_budget=256, **args)


@pytest.mark.parametrize(
    "kw,words",
    [
        ({"policy": "skip"}, r"'a': policy: expected a BadDataPolicy or None, got str"),
        ({"index": 3}, r"'a': index: expected a SampleIndex, its path or None, got int"),
    ],
)
def test_a_mixture_component_policy_or_index_of_another_type_is_named(kw, words):
    with pytest.raises(ConfigError, match=words):
        Mixture({"a": Component(_hf(), weight=1.0, **kw)})


# ---- Mixture.from_file: a mixture file as a careless user writes it ---------------------------
def _mixture_file(tmp_path, text: str) -> str:
    write_shards(str(tmp_path / "w"), sample_lengths(6), num_shards=2)
    datasets.Dataset.from_dict(hf_rows(sample_lengths(5))).to_json(str(tmp_path / "h.jsonl"))
    (tmp_path / "empty.jsonl").write_bytes(b"")
    (tmp_path / "m.json").write_text(text)
    return str(tmp_path / "m.json")


def _comp(**entry) -> str:
    return json.dumps({"components": {"a": {"weight": 1, **entry}}})


@pytest.mark.parametrize(
    "text,words",
    [
        ("[" * 100_000 + "]" * 100_000, r"m.json: maximum recursion depth exceeded"),
        (
            '{"components": {"a": {"path": "w", "weight": 1}, "a": {"path": "w", "weight": 2}}}',
            r"m.json: expected each key once in an object, got \['a'\] more than once",
        ),
        (_comp(path=3), r"component 'a': key path: expected a path \(a non-empty str\), got 3"),
        (_comp(path=["w"]), r"component 'a': key path: expected a path .* got \['w'\]"),
        (_comp(hf=None), r"component 'a': key hf: expected a path .* got None"),
        (_comp(hf="empty.jsonl"), r"component 'a': hf .*empty.jsonl: expected a json file .* an "),
        (_comp(hf="h.jsonl", split=3), r"component 'a': key split: expected a str, got 3"),
        (_comp(hf="h.jsonl", split="test"), r"split: expected a split of \['train'\], got 'test'"),
        (
            '{"components": {"a": {"path": "w", "weight": 1' + "0" * 400 + "}}}",
            r"component 'a': weight must be a finite number > 0, got 10{79}$",
        ),
    ],
)
def test_a_hostile_mixture_file_is_a_config_error_naming_what_is_wrong(text, words, tmp_path):
    with pytest.raises(ConfigError, match=words):
        Mixture.from_file(_mixture_file(tmp_path, text))


def test_a_valid_mixture_file_still_loads(tmp_path):
    mix = Mixture.from_file(_mixture_file(tmp_path, _comp(hf="h.jsonl")))
    assert mix.names == ("a",) and mix.spec.weights == (1,)


# ---- LoadingOptions: values torch cannot wait or prefetch with --------------------------------
@pytest.mark.parametrize("timeout", [float("inf"), 2147484.0, 1e10, 1e300])
def test_a_loading_timeout_past_timeout_max_is_a_plan_error_not_an_overflow(timeout):
    with pytest.raises(PlanError, match=r"LoadingOptions.timeout: expected seconds >= 0 and <= "):
        LoadingOptions(timeout=timeout)
    assert LoadingOptions(timeout=2147483.647).timeout == 2147483.647


@pytest.mark.parametrize("factor", [4097, 10**8])
def test_a_prefetch_factor_past_the_bound_is_a_plan_error_not_minutes_of_cpu(factor):
    with pytest.raises(PlanError, match=r"prefetch_factor: expected an int <= 4096 .* got"):
        LoadingOptions(prefetch_factor=factor)
    assert LoadingOptions(prefetch_factor=4096).prefetch_factor == 4096


def test_a_loader_with_a_long_timeout_loads(tmp_path):
    """(What the bound is for: inf and 2147484 were an OverflowError at the first batch.)"""
    loader = PackedLoader(
        _hf(),
        schema=SCHEMA,
        layout=LAYOUT,
        token_budget=128,
        num_workers=1,
        loading=LoadingOptions(timeout=2147483.647),
    )
    assert sum(len(b["sample_index"]) for b in loader) == 10


@pytest.mark.parametrize("value", [float("inf"), 1e300, float("nan"), 0])
def test_a_collective_timeout_a_timedelta_cannot_hold_is_a_plan_error(value, tmp_path):
    """(inf, 1e300: an OverflowError at the first all_reduce of a DP group, ``timedelta``'s.)"""
    paths = write_shards(str(tmp_path), sample_lengths(6), num_shards=2)
    with pytest.raises(PlanError, match=r"collective_timeout: expected seconds > 0 and <= 8.6"):
        StreamingPackedLoader(
            WebDatasetSource(paths),
            schema=SCHEMA,
            layout=LAYOUT,
            token_budget=128,
            collective_timeout=value,
        )


# ---- HF rows naming media files ---------------------------------------------------------------
def test_a_media_path_with_a_nul_byte_is_a_bad_sample_not_a_value_error(tmp_path):
    (tmp_path / "ok.png").write_bytes(b"x")
    ds = datasets.Dataset.from_dict(
        {"input_ids": [[1, 2, 3], [4, 5, 6]], "images": [["a\x00b.png"], []]}
    )
    source = HFSource(ds, media_root=str(tmp_path))
    with pytest.raises(BadSampleError, match=r"missing_image: sample .* a path with a NUL byte"):
        source.read((0,))
    skip = BadDataPolicy(on_error="skip", warn=False)
    loader = PackedLoader(source, schema=SCHEMA, layout=LAYOUT, token_budget=64, bad_data=skip)
    assert sum(len(b["sample_index"]) for b in loader) == 1
    assert loader.report.counts == {"missing_image": 1}


# ---- prealign index --processor / --model-config / --tokenizer: hostile local config files -----
def _vlm_shard(tmp_path) -> str:
    image = io.BytesIO()
    PIL.Image.new("RGB", (32, 32)).save(image, "PNG")
    chat = {"messages": [{"role": "user", "content": "<image>hi"}]}
    chat["messages"].append({"role": "assistant", "content": "yo"})
    path = tmp_path / "v.tar"
    with tarfile.open(path, "w") as tf:
        for name, data in (("a.json", json.dumps(chat).encode()), ("a.png", image.getvalue())):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return str(path)


@pytest.mark.parametrize(
    "option,files,words",
    [
        (
            "--processor",
            {"preprocessor_config.json": "[" * 100_000 + "]" * 100_000},
            r"no readable preprocessor_config.json \(RecursionError\)",
        ),
        (
            "--processor",
            {"preprocessor_config.json": "[1, 2]"},
            r"preprocessor_config.json: expected a JSON object of settings, got list",
        ),
        (
            "--model-config",
            {"config.json": "[" * 100_000 + "]" * 100_000},
            r"no readable config.json of a model \(RecursionError",
        ),
        (
            "--tokenizer",
            {"tokenizer_config.json": '{"tokenizer_class": 3}'},
            r"not a local Hugging Face tokenizer folder \(",
        ),
    ],
)
def test_a_hostile_local_config_folder_is_one_error_line(option, files, words, tmp_path, capsys):
    folder = tmp_path / "cfg"
    folder.mkdir()
    for name, text in files.items():
        (folder / name).write_text(text)
    argv = ["index", option, str(folder), _vlm_shard(tmp_path), "--out", str(tmp_path / "idx")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("prealign: error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert f"{option} {folder}" in lines[0] and re.search(words, lines[0]), lines[0]


def test_a_real_preprocessor_config_with_list_means_indexes(tmp_path, capsys):
    """Qwen2-VL's own preprocessor_config.json writes image_mean / image_std as lists: they were
    a TypeError (unhashable list) in the image processor's cache."""
    folder = tmp_path / "proc"
    folder.mkdir()
    config = {"image_mean": [0.48145466, 0.4578275, 0.40821073], "min_pixels": 3136}
    config["image_std"] = [0.26862954, 0.26130258, 0.27577711]
    (folder / "preprocessor_config.json").write_text(json.dumps(config))
    argv = ["index", "--processor", str(folder), _vlm_shard(tmp_path)]
    assert main(argv + ["--out", str(tmp_path / "idx")]) == 0, capsys.readouterr().err


@pytest.mark.parametrize(
    "options,words",
    [
        ({"min_pixels": "abc"}, r"\['min_pixels'\]: expected an int >= 1, got 'abc'"),
        ({"max_pixels": float("inf")}, r"\['max_pixels'\]: expected an int >= 1, got inf"),
        ({"temporal_patch_size": [1]}, r"\['temporal_patch_size'\]: expected an int >= 1"),
        ({"rescale_factor": None}, r"\['rescale_factor'\]: expected a finite number > 0"),
        ({"image_mean": "x"}, r"\['image_mean'\]: expected a number or a list of numbers"),
        ({"do_resize": 1}, r"\['do_resize'\]: expected True or False, got 1"),
        ([("min_pixels", 1)], r": expected a dict, got list"),
    ],
)
def test_vlm_processor_options_of_another_type_are_named(options, words):
    with pytest.raises(ConfigError, match=r"VLMSampleTransform.processor_options" + words):
        VLMSampleTransform(tokenizer=ByteTokenizer(), processor_options=options)


def test_an_unhashable_image_processor_option_is_a_config_error():
    with pytest.raises(ConfigError, match=r"image processor options \['size'\]: .* got dict"):
        image_processor(size={"shortest_edge": 3136, "longest_edge": 1003520})
    assert list(image_processor(image_mean=[0.5, 0.5, 0.5]).image_mean) == [0.5, 0.5, 0.5]
