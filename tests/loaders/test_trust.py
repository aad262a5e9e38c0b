"""Issue #31, third trust pass: one URL once, empty samples as bad data, max_seqs in BSHD, unknown
tar members counted, ShardWriter refusals, typed errors for crafted configs and folder paths."""

from __future__ import annotations

import os

import pytest

from prealign.loaders import WebDatasetSource
from tests.loader_helpers import sample_lengths, write_shards


# ---- one URL once (issue #31: a shard listed twice was served twice, 30 samples per epoch, 20
# distinct) -------
@pytest.mark.parametrize(
    "twice",
    [
        lambda p: p,
        lambda p: "file://" + p,
        lambda p: os.path.join(os.path.dirname(p), ".", os.path.basename(p)),
    ],
)
def test_a_shard_listed_twice_is_refused_naming_both_positions(tmp_path, twice):
    from prealign.loaders import PackedLoader
    from prealign.schemas import ParallelLayout, causal_lm_schema
    from prealign.schemas.errors import ConfigError

    a, b = write_shards(str(tmp_path), sample_lengths(20), num_shards=2)
    with pytest.raises(ConfigError, match=r"\(position 0\) and .* \(position 2\) are one shard"):
        source = WebDatasetSource([a, b, twice(a)])
        next(
            iter(
                PackedLoader(
                    source, schema=causal_lm_schema(), layout=ParallelLayout(), token_budget=4096
                )
            )
        )
    assert len(WebDatasetSource([a, b]).urls) == 2


# ---- empty (0-token) samples are bad data (issue #31: one stopped the run under `skip`)
# ---------------------
def _with_empty(tmp_path, row: int = 5) -> list[str]:
    import numpy as np

    from tests.loader_helpers import _npy, add_member

    def extra(i, tf):
        if i == row:
            add_member(tf, f"{i:06d}.input_ids.npy", _npy(np.zeros(0, np.int64)))
            return True
        return False

    return write_shards(str(tmp_path), sample_lengths(12, seed=1), num_shards=2, extra=extra)


@pytest.mark.parametrize("indexed", ["in process", "sidecars"])
def test_an_empty_sample_is_counted_under_skip_and_typed_under_raise(tmp_path, indexed):
    import warnings

    from prealign.loaders import BadDataPolicy, PackedLoader
    from prealign.loaders.cli.main import main
    from prealign.loaders.errors import BadSampleError
    from prealign.schemas import ParallelLayout, causal_lm_schema

    paths = _with_empty(tmp_path)
    if indexed == "sidecars":
        assert main(["index", "--text", *paths]) == 0

    def loader(policy):
        return PackedLoader(
            WebDatasetSource(paths),
            schema=causal_lm_schema(),
            layout=ParallelLayout(),
            token_budget=4096,
            bad_data=BadDataPolicy(on_error=policy),
        )

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        skipping = loader("skip")
        served = sorted(i for b in skipping for i in b["sample_index"].tolist())
    assert len(served) == 11 and skipping.report.counts == {"bad_sample": 1}
    assert "000005" in skipping.report.examples[0].where
    with pytest.raises(
        BadSampleError,
        match=r"sample .*shard-000\.tar:000005, field 'input_ids': expected a "
        r"non-empty 1-D token tensor, got shape \(0,\)",
    ):
        next(iter(loader("raise")))


def test_bshd_honours_max_seqs_as_thd_does():
    """Issue #31: THDCollator refused a 5-row batch under max_seqs=4, BSHDCollator served it."""
    import torch

    from prealign.collate import BSHDCollator, THDCollator
    from prealign.schemas import ParallelLayout, causal_lm_schema
    from prealign.schemas.errors import BucketOverflowError

    layout = ParallelLayout(max_seqs=4)
    rows = [{"input_ids": torch.arange(1, 4 + i)} for i in range(5)]
    for collator in (THDCollator, BSHDCollator):
        coll = collator(schema=causal_lm_schema(), layout=layout)
        with pytest.raises(
            BucketOverflowError, match="5 sequences exceeds the layout's max_seqs = 4"
        ):
            coll(rows)
        assert coll(rows[:4])["input_ids"].numel() > 0


@pytest.mark.parametrize(
    "typeflag, kind", [(b"5", "directory"), (b"S", "GNU sparse"), (b"Z", "typeflag b'Z'")]
)
def test_tar_members_of_unknown_type_are_counted_never_dropped(tmp_path, typeflag, kind):
    """Issue #31: a sample member of an unknown type vanished with no count."""
    import io
    import tarfile

    from prealign.loaders import BadDataPolicy, build_index
    from prealign.loaders.errors import BadSampleError
    from prealign.schemas import causal_lm_schema
    from tests.loader_helpers import _npy, token_ids

    path = str(tmp_path / "odd.tar")
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tf:
        for i in range(3):
            data = _npy(token_ids(i, 5))
            info = tarfile.TarInfo(f"{i:06d}.input_ids.npy")
            info.size = len(data)
            if i == 1:
                info.type = typeflag
            tf.addfile(info, io.BytesIO(data))
    with pytest.raises(BadSampleError, match=f"unknown_member|a {kind} member") as exc:
        build_index(WebDatasetSource([path]), causal_lm_schema())
    assert exc.value.reason == "unknown_member" and "000001" in str(exc.value)
    index = build_index(
        WebDatasetSource([path]),
        causal_lm_schema(),
        policy=BadDataPolicy(on_error="skip", warn=False),
    )
    assert len(index) == 2 and index.report.counts == {"unknown_member": 1}


@pytest.mark.parametrize(
    "sample, message",
    [
        ({"input_ids": [1, 2], "txt": "a", "TXT": "b"}, "differ in more than case"),
        ({"input_ids": [1, 2], "__url__": "x"}, "reserved"),
        ({"input_ids": [1, 2], "__shard__": b"3"}, "reserved"),
        ({"input_ids": 7}, "token ids are 1-D"),
        ({"input_ids": [1, 2], 3: b"x"}, "not a plain name"),
        ({"input_ids": [1, 2], "meta": {"a": {1, 2}}}, "not JSON"),
        ({"input_ids": [1, 2], "meta": [float("nan")]}, "not JSON"),
    ],
)
def test_shard_writer_refuses_samples_that_cannot_load(tmp_path, sample, message):
    """Issue #31: ShardWriter accepted members that can never load and a 0-d input_ids, or raised a
    bare TypeError."""
    import numpy as np

    from prealign.loaders import ShardWriter
    from prealign.schemas.errors import ConfigError

    sample = {
        k: np.asarray(v)
        if k == "input_ids" or (isinstance(k, str) and k.startswith("input_ids"))
        else v
        for k, v in sample.items()
    }
    with ShardWriter(str(tmp_path / "s-%03d.tar")) as w:
        with pytest.raises(ConfigError, match=message):
            w.write(sample)
        w.write({"input_ids": np.arange(1, 5)})
    assert w.count == 1


@pytest.mark.parametrize(
    "change",
    [
        {"hidden_size": "abc"},
        {"hidden_size": None},
        {"hidden_size": float("inf")},
        {"num_attention_heads": 0},
        {"vocab_size": [3]},
    ],
)
def test_crafted_hf_configs_are_plan_errors(change):
    """Issue #31: crafted configs raised a bare TypeError / OverflowError / ZeroDivisionError."""
    from types import SimpleNamespace

    from prealign.loaders.errors import PlanError
    from prealign.loaders.plan.cost import CostModel

    base = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=100,
        hidden_act="silu",
    )
    CostModel.from_hf_config(SimpleNamespace(**base))
    with pytest.raises(PlanError, match="from_hf_config"):
        CostModel.from_hf_config(SimpleNamespace(**{**base, **change}))


_FULL_DISK = """
import resource, signal, sys
from prealign.loaders.cli.main import main
# a write past the limit fails with EFBIG, as on a full disk
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
try:
    rc = main(["index", "--text", "--out", sys.argv[1], *sys.argv[2:]])
except OSError as exc:
    rc = f"OSError {exc.errno}"
print(rc)
"""


@pytest.mark.slow  # a child process (end to end)
def test_a_failed_index_write_leaves_no_part_file(tmp_path):
    """Issue #31: disk full during `prealign index --out` left a .part file behind."""
    import subprocess
    import sys

    paths = write_shards(str(tmp_path / "data"), sample_lengths(200), num_shards=2)
    out = tmp_path / "index"
    run = subprocess.run(
        [sys.executable, "-c", _FULL_DISK, str(out), *paths],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.stdout.strip() not in ("0", ""), (run.stdout, run.stderr[-2000:])  # it did fail
    left = [p for p in os.listdir(out)] if out.exists() else []
    assert not [p for p in left if p.endswith(".part")], left


def test_a_sidecar_path_that_is_a_folder_is_a_typed_error(tmp_path, capsys):
    """Issue #31: a folder where a sidecar is read or written was a bare IsADirectoryError."""
    from prealign.loaders import PackedLoader
    from prealign.loaders.cli.main import main
    from prealign.loaders.errors import StaleIndexError
    from prealign.schemas import ParallelLayout, causal_lm_schema
    from prealign.schemas.errors import ConfigError

    paths = write_shards(str(tmp_path), sample_lengths(20), num_shards=2)
    os.makedirs(paths[0] + ".prealign-index.npz")
    with pytest.raises(StaleIndexError, match="sidecar is not a regular file \\(a folder\\)"):
        next(
            iter(
                PackedLoader(
                    WebDatasetSource(paths),
                    schema=causal_lm_schema(),
                    layout=ParallelLayout(),
                    token_budget=4096,
                )
            )
        )
    capsys.readouterr()
    assert main(["index", "--text", *paths]) == 2  # the CLI's one-line error
    assert "is a folder, where an index file is written" in capsys.readouterr().err
    from prealign.loaders.sources.shard_files import write_atomically

    with pytest.raises(ConfigError, match="is a folder"):
        write_atomically(paths[0] + ".prealign-index.npz", b"x")


def test_an_oversize_sample_is_named_by_index_row_and_location(tmp_path):
    """Issue #31: the oversize error named the sample's position in the shuffled epoch (11), not row
    5."""
    from prealign.loaders import PackedLoader
    from prealign.loaders.errors import OversizeSampleError
    from prealign.schemas import ParallelLayout, causal_lm_schema

    lengths = sample_lengths(12, seed=1)
    lengths[5] = 500
    paths = write_shards(str(tmp_path), lengths, num_shards=2)
    with pytest.raises(
        OversizeSampleError, match=r"sample .*shard-000\.tar@\d+ \(index row 5\), field 'input_ids'"
    ):
        next(
            iter(
                PackedLoader(
                    WebDatasetSource(paths),
                    schema=causal_lm_schema(),
                    layout=ParallelLayout(),
                    token_budget=128,
                )
            )
        )
