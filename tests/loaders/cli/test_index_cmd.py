"""``prealign index`` (issue #7): sidecars written, a second run indexes only new or changed shards,
ranks split the shards, a missing shard is reported before any work."""

from __future__ import annotations

import os

import pytest

from prealign.loaders import WebDatasetSource, build_index
from prealign.loaders.cli.main import main
from prealign.loaders.sources.shard_files import SUFFIX
from prealign.schemas.schema import causal_lm_schema
from tests.loader_helpers import sample_lengths, write_shards


def test_index_command_writes_sidecars_once(tmp_path, capsys):
    paths = write_shards(str(tmp_path), sample_lengths(40), num_shards=4)
    pattern = str(tmp_path / "shard-{000..003}.tar")
    assert main(["index", pattern, "--text", "--workers", "2"]) == 0
    err = capsys.readouterr().err
    assert "4/4 shards" in err and "4 shard(s) indexed (40 samples" in err
    assert all(os.path.exists(p + SUFFIX) for p in paths)
    assert main(["index", pattern, "--text"]) == 0
    assert "0 shard(s) indexed" in capsys.readouterr().err
    with open(paths[2], "ab") as f:  # one shard changed
        f.write(bytes(10240))
    assert main(["index", pattern, "--text"]) == 0
    err = capsys.readouterr().err
    assert "1 shard(s) indexed" in err and "3 up to date" in err
    idx = build_index(WebDatasetSource(paths), causal_lm_schema())
    assert len(idx) == 40


@pytest.mark.slow
def test_index_workers_in_a_pool_write_the_sidecars_one_process_writes(tmp_path, monkeypatch):
    import numpy as np

    from prealign.loaders.index import header_pass

    paths = write_shards(str(tmp_path), sample_lengths(40), num_shards=4)
    header_pass.write_sidecars(WebDatasetSource(paths), causal_lm_schema())
    one = [np.load(p + SUFFIX)["lengths"].tolist() for p in paths]
    monkeypatch.setattr(
        header_pass, "_POOL_MIN", 0
    )  # (small data runs in process: the pool costs a torch import)
    started = []
    monkeypatch.setattr(
        header_pass,
        "_pool",
        lambda mp, n, pool=header_pass._pool, **kw: started.append(n) or pool(mp, n, **kw),
    )
    stats = header_pass.write_sidecars(
        WebDatasetSource(paths), causal_lm_schema(), workers=2, force=True
    )
    assert started == [2] and stats == {"indexed": 4, "up_to_date": 0, "samples": 40}
    assert [np.load(p + SUFFIX)["lengths"].tolist() for p in paths] == one
    monkeypatch.setattr(header_pass, "_POOL_MIN", 1)  # the threshold is on the bytes left to index
    stats = header_pass.write_sidecars(WebDatasetSource(paths), causal_lm_schema(), workers=2)
    assert started == [2] and stats == {
        "indexed": 0,
        "up_to_date": 4,
        "samples": 0,
    }  # all up to date: no pool
    with open(paths[1], "ab") as f:
        f.write(b"\0" * 1024)  # one shard changed: indexed in this process
    stats = header_pass.write_sidecars(WebDatasetSource(paths), causal_lm_schema(), workers=2)
    assert started == [2] and stats == {"indexed": 1, "up_to_date": 3, "samples": 10}
    for p in paths[2:]:
        with open(p, "ab") as f:
            f.write(b"\0" * 1024)
    stats = header_pass.write_sidecars(WebDatasetSource(paths), causal_lm_schema(), workers=2)
    assert started == [2, 2] and stats == {"indexed": 2, "up_to_date": 2, "samples": 20}


def test_index_command_out_dir_ranks_and_missing_shards(tmp_path, capsys, monkeypatch):
    paths = write_shards(str(tmp_path), sample_lengths(40), num_shards=4)
    out = str(tmp_path / "idx")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["index", *paths, "--text", "--out", out]) == 0
    assert sorted(os.listdir(out)) == [f"shard-00{i}.tar{SUFFIX}" for i in (1, 3)]
    monkeypatch.setenv("RANK", "0")
    assert main(["index", *paths, "--text", "--out", out]) == 0
    assert len(os.listdir(out)) == 4 and not any(os.path.exists(p + SUFFIX) for p in paths)
    capsys.readouterr()
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert main(["index", str(tmp_path / "shard-{000..005}.tar"), "--text", "--out", out]) == 2
    err = capsys.readouterr().err
    assert (
        "no such shards:" in err
        and "shard-004.tar" in err
        and "shard-005.tar" in err
        and "samples" not in err
    )


def _index_rank(rank: int, port: int, paths: list[str], out: str, log: str) -> None:
    import torch.distributed as dist

    os.environ.pop("RANK", None), os.environ.pop("WORLD_SIZE", None)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(["index", *paths, "--text", "--out", out, "--merge"])
    with open(f"{log}-{rank}", "w") as f:
        f.write(f"{rc}\n{err.getvalue()}")
    dist.destroy_process_group()


@pytest.mark.slow
def test_index_command_splits_shards_over_gloo_ranks(tmp_path):
    import multiprocessing as mp
    import socket

    paths = write_shards(str(tmp_path), sample_lengths(50), num_shards=5)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out, log = str(tmp_path / "idx"), str(tmp_path / "log")
    procs = [
        mp.get_context("fork").Process(target=_index_rank, args=(r, port, paths, out, log))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    logs = [open(f"{log}-{r}").read() for r in range(2)]
    assert [s.split("\n", 1)[0] for s in logs] == ["0", "0"]
    assert (
        "(rank 0/2)" in logs[0]
        and "3 shard(s) indexed" in logs[0]
        and "2 shard(s) indexed" in logs[1]
    )
    assert (
        "merged index of 5 shard(s), 50 samples" in logs[0] and "merged" not in logs[1]
    )  # rank 0, after both
    assert len(os.listdir(out)) == 6
    for name in os.listdir(
        out
    ):  # the loader reads the merged file alone: the same index as in process
        if name.endswith(SUFFIX):
            os.remove(os.path.join(out, name))
    merged = build_index(WebDatasetSource(paths, index_dir=out), causal_lm_schema())
    assert (
        merged.digest
        == build_index(WebDatasetSource(paths, sidecars=False), causal_lm_schema()).digest
    )


def test_index_check_finds_a_byte_changed_in_place_that_the_start_checks_cannot(tmp_path, capsys):
    """Same size, first and last 64 KiB untouched: only the whole-file hash recorded in the sidecar
    sees it."""
    paths = write_shards(str(tmp_path), sample_lengths(3000, low=40, high=60), num_shards=2)
    assert os.path.getsize(paths[1]) > 3 * 65536
    assert main(["index", *paths, "--text"]) == 0
    capsys.readouterr()
    assert main(["index", *paths, "--text", "--check"]) == 0
    assert "2/2 shard(s) match" in capsys.readouterr().err
    middle = os.path.getsize(paths[1]) // 2
    with open(paths[1], "r+b") as f:
        f.seek(middle)
        byte = f.read(1)
        f.seek(middle)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert main(["index", *paths, "--text", "--check"]) == 1
    err = capsys.readouterr().err
    assert f"{paths[1]}: " in err and "re-run prealign index" in err and paths[0] + ":" not in err
    os.remove(paths[0] + SUFFIX)
    assert main(["index", *paths, "--text", "--check"]) == 1
    assert "no sidecar" in capsys.readouterr().err


def _doubled(sample: dict) -> dict:
    import numpy as np

    return {"input_ids": np.repeat(np.asarray(sample["input_ids.npy"]), 2)}


def _follow_the_printed_command(source, cwd) -> str:
    """Load ``source`` (its sidecars are of another transform), run the command the error prints
    through a real shell in ``cwd`` (``prealign`` being this interpreter's) and return the rest of
    the hint."""
    import re
    import subprocess
    import sys

    import pytest

    from prealign.loaders import PackedLoader
    from prealign.loaders.errors import StaleIndexError
    from prealign.schemas import ParallelLayout

    with pytest.raises(StaleIndexError, match="another transform") as exc:
        PackedLoader(
            source, schema=causal_lm_schema(), layout=ParallelLayout(), token_budget=4096
        ).prepare()
    command, rest = re.search(r"run `(prealign index [^`]*)`(.*)$", str(exc.value)).groups()
    done = subprocess.run(
        ["bash", "-c", f'prealign() {{ "{sys.executable}" -m prealign "$@"; }}; {command}'],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, (command, done.stderr)
    return rest


def test_the_printed_index_command_runs_with_spaces_in_paths(tmp_path):
    from prealign.loaders import PackedLoader
    from prealign.loaders.index.header_pass import write_sidecars
    from prealign.schemas import ParallelLayout

    paths = write_shards(str(tmp_path / "data dir"), sample_lengths(20), num_shards=3)
    index_dir = str(tmp_path / "my index")
    os.makedirs(index_dir)
    write_sidecars(
        WebDatasetSource(paths, transform=_doubled), causal_lm_schema(), out_dir=index_dir
    )
    _follow_the_printed_command(WebDatasetSource(paths, index_dir=index_dir), cwd=str(tmp_path))
    loader = PackedLoader(
        WebDatasetSource(paths, index_dir=index_dir),
        schema=causal_lm_schema(),
        layout=ParallelLayout(),
        token_budget=4096,
    )
    assert len(loader.prepare().index) == 20


def test_the_printed_index_command_runs_for_http_shards_with_sidecars_beside_them(tmp_path):
    import functools
    import http.server
    import threading

    from prealign.loaders import PackedLoader
    from prealign.loaders.index.header_pass import write_sidecars
    from prealign.schemas import ParallelLayout

    served = tmp_path / "served"
    paths = write_shards(str(served), sample_lengths(20), num_shards=3)
    write_sidecars(
        WebDatasetSource(paths, transform=_doubled), causal_lm_schema()
    )  # beside them, stale
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(served))
    handler.log_message = lambda *a: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        urls = [f"http://127.0.0.1:{server.server_port}/{os.path.basename(p)}" for p in paths]
        rest = _follow_the_printed_command(WebDatasetSource(urls), cwd=str(tmp_path))
        assert "index_dir='prealign-index'" in rest
        source = WebDatasetSource(
            urls, index_dir=str(tmp_path / "prealign-index")
        )  # the rest of the hint, followed
        loader = PackedLoader(
            source, schema=causal_lm_schema(), layout=ParallelLayout(), token_budget=4096
        )
        assert len(loader.prepare().index) == 20
    finally:
        server.shutdown()
        server.server_close()


def _launch_rank(rank: int, port: int, args: list[str], cwd: str):
    """``python -m prealign.loaders.cli.index_cmd ARGS`` as ``torchrun`` starts rank ``rank`` of 2:
    the environment variables only, no process group."""
    import subprocess
    import sys

    env = {
        **os.environ,
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    return subprocess.Popen(
        [sys.executable, "-m", "prealign.loaders.cli.index_cmd", *args],
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
def test_index_merge_under_torchrun_waits_for_every_rank(tmp_path):
    import socket
    import time

    paths = write_shards(str(tmp_path), sample_lengths(50), num_shards=5)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "idx")
    os.mkdir(out)
    args = [*paths, "--text", "--out", out, "--merge"]
    first = _launch_rank(0, port, args, str(tmp_path))
    deadline = time.monotonic() + 120
    while len(os.listdir(out)) < 3 and first.poll() is None and time.monotonic() < deadline:
        time.sleep(
            0.05
        )  # rank 1 starts only once rank 0 wrote its 3 sidecars: rank 0 must wait for it
    time.sleep(0.5)
    second = _launch_rank(1, port, args, str(tmp_path))
    logs = [p.communicate(timeout=120) for p in (first, second)]
    assert [first.returncode, second.returncode] == [0, 0], logs
    assert "merged index of 5 shard(s), 50 samples" in logs[0][1] and "merged" not in logs[1][1]
    assert "prealign-index.merged.npz" in os.listdir(out) and len(os.listdir(out)) == 6


def test_index_of_some_shards_leaves_the_merged_index_of_all(tmp_path, capsys, monkeypatch):
    from prealign.loaders.index.merged import merged_names

    monkeypatch.setenv("WORLD_SIZE", "1")
    paths = write_shards(str(tmp_path), sample_lengths(50), num_shards=4)
    assert main(["index", *paths, "--text", "--merge"]) == 0
    merged = str(tmp_path / "prealign-index.merged.npz")
    names = [os.path.basename(p) for p in paths]
    assert merged_names(merged) == names
    capsys.readouterr()
    assert (
        main(["index", paths[0], "--text", "--force"]) == 0
    )  # one shard re-indexed: the merged file kept
    assert merged_names(merged) == names and "left as it is" in capsys.readouterr().err
    assert (
        main(["index", *paths, "--text", "--force"]) == 0
    )  # the same shards: kept in step, no --merge needed
    assert merged_names(merged) == names and "merged index of 4 shard(s)" in capsys.readouterr().err
    assert (
        main(["index", paths[0], "--text", "--merge"]) == 0
    )  # asked for: a merged index of that one shard
    assert merged_names(merged) == names[:1]


def test_index_merge_with_ranks_split_by_hand_is_refused(tmp_path, capsys, monkeypatch):
    """``RANK`` / ``WORLD_SIZE`` without ``MASTER_ADDR``: no rank can wait for the others, so no
    ``--merge``."""
    paths = write_shards(str(tmp_path), sample_lengths(20), num_shards=2)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["index", *paths, "--text", "--merge"]) == 2
    assert "--merge with WORLD_SIZE=2 but no MASTER_ADDR" in capsys.readouterr().err
    assert not os.path.exists(paths[0] + SUFFIX)  # refused before any work
