"""The ``prealign`` command as people use it: a mistake is one ``prealign: error: ... (hint: ...)``
line on stderr with exit code 2 (``--debug`` adds the traceback), the causes are named when nothing
loads, ``--hf`` reads local files without the Hub, int32 / uint16 token arrays load from shards."""

from __future__ import annotations

import io
import json
import tarfile

import numpy as np
import pytest

from prealign.loaders.cli import main


def _shard(path, arrays: dict[str, np.ndarray]) -> str:
    """A webdataset tar: one ``<key>.input_ids.npy`` member per array."""
    with tarfile.open(path, "w") as tar:
        for key, a in arrays.items():
            buf = io.BytesIO()
            np.save(buf, a)
            info = tarfile.TarInfo(f"{key}.input_ids.npy")
            info.size = len(buf.getvalue())
            tar.addfile(info, io.BytesIO(buf.getvalue()))
    return str(path)


def _tokens(n: int, dtype, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        f"s{i:04d}": rng.integers(8, 250, size=int(rng.integers(20, 200))).astype(dtype)
        for i in range(n)
    }


def _error_line(capsys, argv: list[str]) -> str:
    """Run ``argv``; assert exit code 2 and exactly one stderr line in the error format; return
    it."""
    rc = main(argv)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2, err
    assert len(lines) == 1, err
    assert (
        lines[0].startswith("prealign: error: ")
        and "(hint: " in lines[0]
        and lines[0].endswith(")")
    ), lines
    return lines[0]


@pytest.mark.parametrize(
    "argv, cause",
    [
        ([], "required: command"),
        (["demo", "--tp", "0"], "--tp: expected an int >= 1, got 0"),
        (["demo", "--cp", "-2"], "--cp: expected an int >= 1, got -2"),
        (["demo", "--workers", "-1"], "--workers: expected an int >= 0"),
        (
            ["demo", "--token-budget", "3"],
            "token_budget 3 is below the smallest padded micro-batch",
        ),
        (["demo", "--tp", "two"], "invalid int value: 'two'"),
        (["demo", "--bogus"], "unrecognized arguments: --bogus"),
        (["inspect"], "inspect takes webdataset shards or --hf PATH"),
        (["inspect", "a.tar", "--hf", "b.jsonl"], "not both"),
        (["inspect", "no/such/shard-000.tar"], "no such shard: no/such/shard-000.tar"),
        (
            ["inspect", "--hf", "no/such/tok.jsonl", "--text"],
            "--hf no/such/tok.jsonl: no such file or folder",
        ),
    ],
)
def test_a_mistake_is_one_line_with_a_hint_and_exit_code_2(capsys, argv, cause):
    assert cause in _error_line(capsys, argv)


def test_out_is_checked_before_the_run(tmp_path, capsys):
    shard = _shard(tmp_path / "a.tar", _tokens(4, np.int64))
    line = _error_line(
        capsys, ["inspect", shard, "--text", "--out", str(tmp_path / "missing" / "x.png")]
    )
    assert "--out" in line and "does not exist" in line
    line = _error_line(capsys, ["inspect", shard, "--text", "--out", str(tmp_path)])
    assert "is a folder" in line


def test_compressed_shard_is_named_with_the_fix(tmp_path, capsys):
    import gzip

    shard = _shard(tmp_path / "a.tar", _tokens(4, np.int64))
    (tmp_path / "a.tar.gz").write_bytes(gzip.compress((tmp_path / "a.tar").read_bytes()))
    line = _error_line(capsys, ["inspect", shard + ".gz", "--text"])
    assert "compressed" in line and "gunzip" in line


def test_debug_shows_the_traceback(capsys):
    assert main(["demo", "--tp", "0", "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and err.rstrip().splitlines()[-1].startswith(
        "prealign: error:"
    )


def test_nothing_loaded_names_each_cause_with_an_example(tmp_path, capsys, monkeypatch):
    _shard(tmp_path / "f.tar", {k: v.astype(np.float32) for k, v in _tokens(3, np.int64).items()})
    (tmp_path / "g.tar").write_bytes(b"not a tar file " * 100)
    monkeypatch.chdir(tmp_path)  # short shard names: each example line is cut at a fixed width
    rc = main(
        [
            "inspect",
            "f.tar",
            "g.tar",
            "--text",
            "--workers",
            "0",
            "--out",
            str(tmp_path / "x.png"),
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2
    head = next(ln for ln in err.splitlines() if ln.startswith("prealign: error:"))
    assert "no usable sample in 2 webdataset shard(s)" in head and "(hint: " in head
    assert (
        "bad_sample (3)" in err
        and "f.tar:s0000: field 'input_ids': expected dtype in ['int64'], got float32" in err
    )
    assert "corrupt_shard (1)" in err and "g.tar: unreadable at byte 0" in err
    assert "got none ({" not in err  # not the bare index error


@pytest.mark.parametrize("dtype", [np.int32, np.uint16, np.int64])
def test_narrow_token_arrays_load_from_shards_as_int64(tmp_path, capsys, dtype):
    shard = _shard(tmp_path / "a.tar", _tokens(12, dtype))
    rc = main(
        [
            "inspect",
            shard,
            "--text",
            "--workers",
            "0",
            "--out",
            str(tmp_path / "x.png"),
            "--token-budget",
            "1024",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "12 sequences" in out and "skipped        none" in out
    assert "input_ids          int64" in out


def test_narrow_token_ids_become_int64_in_the_batch():
    import torch

    from prealign.collate import THDCollator
    from prealign.schemas import ParallelLayout, SampleError, causal_lm_schema

    schema = causal_lm_schema()
    coll = THDCollator(schema=schema, layout=ParallelLayout(tp=1, cp=1))
    a = coll(
        [
            {"input_ids": torch.tensor([5, 6, 7], dtype=torch.int32)},
            {"input_ids": torch.tensor([8, 9], dtype=torch.uint16)},
        ]
    )
    b = coll([{"input_ids": torch.tensor([5, 6, 7])}, {"input_ids": torch.tensor([8, 9])}])
    assert a["input_ids"].dtype == torch.int64 and all(
        torch.equal(a[k], b[k]) for k in ("input_ids", "labels")
    )
    with pytest.raises(
        SampleError
    ) as err:  # a float is still refused, and the message says only that
        coll([{"input_ids": torch.tensor([1.0, 2.0])}])
    assert "expected dtype in ['int64'], got float32" in str(
        err.value
    ) and "same as sample 0" not in str(err.value)


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "csv", "folder"])
def test_hf_takes_a_local_file_or_folder_without_the_hub(tmp_path, capsys, monkeypatch, fmt):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rows = [{"input_ids": list(range(8, 8 + 20 + 3 * i))} for i in range(15)]
    ds = datasets.Dataset.from_list(rows)
    if fmt == "jsonl":
        path = tmp_path / "tok.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "json":
        path = tmp_path / "tok.json"
        ds.to_json(str(path))
    elif fmt == "parquet":
        path = tmp_path / "tok.parquet"
        ds.to_parquet(str(path))
    elif fmt == "csv":  # a csv column holds text: ids as a space-separated string are not tokens
        path = tmp_path / "tok.csv"
        path.write_text(
            "input_ids\n" + "".join(" ".join(map(str, r["input_ids"])) + "\n" for r in rows)
        )
    else:
        path = tmp_path / "data"
        path.mkdir()
        ds.to_parquet(str(path / "train-00000.parquet"))
    argv = [
        "inspect",
        "--hf",
        str(path),
        "--text",
        "--workers",
        "0",
        "--out",
        str(tmp_path / "x.png"),
        "--cache-dir",
        str(tmp_path / "cache"),
    ]
    rc = main(argv)
    captured = capsys.readouterr()
    if fmt == "csv":  # read locally, then every row refused for what it is (text), with an example
        assert rc == 2 and "no usable sample in hf" in captured.err and "e.g." in captured.err
        return
    assert rc == 0, captured.err
    assert "15 sequences" in captured.out
    assert (tmp_path / "cache").is_dir()


def test_one_microbatch_says_so_and_times_nothing(tmp_path, capsys):
    shard = _shard(tmp_path / "a.tar", _tokens(6, np.int64))
    assert (
        main(["inspect", shard, "--text", "--workers", "0", "--out", str(tmp_path / "x.png")]) == 0
    )
    out = capsys.readouterr().out
    assert "micro-batches  1 (x 2 CP ranks)" in out and "throughput     n/a" in out
    assert "tokens/s" not in out


def test_several_microbatches_are_timed_after_the_first(tmp_path, capsys):
    shard = _shard(tmp_path / "a.tar", _tokens(40, np.int64))
    assert (
        main(
            [
                "inspect",
                shard,
                "--text",
                "--workers",
                "0",
                "--out",
                str(tmp_path / "x.png"),
                "--token-budget",
                "512",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    n = int(out.split("micro-batches  ")[1].split(" ")[0])
    assert n > 2 and "real tokens/s" in out and "after the first" in out


@pytest.mark.slow
def test_the_console_command_exits_2_with_one_line(subprocess_env):
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "prealign", "demo", "--tp", "0"],
        capture_output=True,
        text=True,
        env=subprocess_env,
        timeout=120,
    )
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.splitlines() == [
        "prealign: error: --tp: expected an int >= 1, got 0 (hint: give --tp 1 or more)"
    ]
