"""Every argument the ``prealign`` command cannot use is one ``prealign: error: ... (hint: ...)``
line and exit code 2, before any work: no traceback, no run until killed, no exit 0 with every
sample marked bad."""

from __future__ import annotations

import pytest

from prealign.loaders.cli.main import main


@pytest.mark.parametrize(
    "argv,words",
    [
        (["demo", "--seed", "-1"], "--seed: expected an int >= 0"),
        (["demo", "--seed", str(2**64)], "--seed: expected an int <="),
        (["demo", "--topk", str(10**9)], "--topk: expected an int <="),
        (["demo", "--samples", str(10**12)], "--samples: expected an int <="),
        (
            ["inspect", "--text", "--vocab-size", "-1", "x.tar"],
            "--vocab-size: expected an int >= 1",
        ),
        (
            ["inspect", "--text", "--vocab-size", "10", "--topk", "11", "x.tar"],
            "--topk: expected an int <= 10",
        ),
        (["index", "--text", "--vocab-size", "-1", "x.tar"], "--vocab-size: expected an int >= 1"),
        (["index", "--workers", "0", "x.tar"], "--workers: expected an int >= 1"),
        (["index", "--debug", "--text", "no-such-shard.tar"], "no such shard: no-such-shard.tar"),
        (["inspect", "ftp://host/shard.tar"], "shards are not read over ftp://"),
        (["index", "--text", "ftp://host/shard.tar"], "shards are not read over ftp://"),
    ],
)
def test_an_unusable_argument_is_one_error_line_and_exit_2(
    argv, words, capsys, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("prealign: error: ")]
    assert len(lines) == 1 and words in lines[0] and "(hint: " in lines[0], err
    if "--debug" not in argv:
        assert "Traceback" not in err


def test_debug_adds_the_traceback_to_the_index_command(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["index", "--debug", "--text", "no-such-shard.tar"]) == 2
    assert "Traceback" in capsys.readouterr().err


def test_s3_without_credentials_is_named_before_any_read(capsys, tmp_path, monkeypatch):
    pytest.importorskip("s3fs")
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.chdir(tmp_path)
    assert main(["inspect", "--text", "s3://bucket/shard.tar"]) == 2
    assert "no AWS credentials found" in capsys.readouterr().err


def test_gs_without_its_backend_names_the_package(capsys, tmp_path, monkeypatch):
    import importlib.util

    if importlib.util.find_spec("gcsfs") is not None:
        pytest.skip("platform: gcsfs is installed here, so the missing-backend message cannot show")
    monkeypatch.chdir(tmp_path)
    assert main(["inspect", "gs://bucket/shard.tar"]) == 2
    assert "needs the package gcsfs" in capsys.readouterr().err


def test_a_fifo_or_a_device_as_a_shard_is_refused_without_reading(tmp_path, capsys, monkeypatch):
    import os

    monkeypatch.chdir(tmp_path)
    os.mkfifo(tmp_path / "fifo.tar")
    for shard in (str(tmp_path / "fifo.tar"), "/dev/zero"):
        for command in (["inspect", "--text"], ["index", "--text"]):
            assert main([*command, shard]) == 2
            assert "not a regular file" in capsys.readouterr().err
