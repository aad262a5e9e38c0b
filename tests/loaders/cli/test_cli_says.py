"""What the command line tells a person is true and says what to do (issue #27): ``prealign index``
says how many samples it refused and why; a warning is one line without the library's file and
source line, also inside a progress bar; every closing hint is a fix; a bad sample's error names the
``skip`` policy."""

from __future__ import annotations

import io
import re
import warnings

import pytest

from prealign.loaders.cli import main
from prealign.loaders.cli.errors import REMEDIES, error_lines, hint_for, remedy, warning_line
from prealign.loaders.cli.index_cmd import Progress
from prealign.loaders.errors import (
    BadSampleError,
    CorruptShardError,
    RemoteStallError,
    ShardTimeoutError,
    WorkerError,
)
from prealign.loaders.policy import BadDataReport, BadRecord

pytest.importorskip("transformers")


def test_index_says_how_many_samples_it_refused_and_why(tmp_path, capsys):
    from prealign.loaders.cli.demo_data import build_demo_dataset

    ds = build_demo_dataset(str(tmp_path), num_samples=26, samples_per_shard=13, topk=4)
    assert main(["index", *ds.shards, "--topk", "4"]) == 0
    err = capsys.readouterr().err
    kept = int(re.search(r"2 shard\(s\) indexed \((\d+) samples", err).group(1))
    refused = re.search(r"(\d+) sample\(s\) refused \(([^)]*)\)", err)
    assert refused, err
    assert kept + int(refused.group(1)) == 26 and int(refused.group(1)) == len(ds.bad)
    for reason in set(ds.bad.values()):
        assert f"{reason} 1" in refused.group(2) and f"  {reason} (1): " in err
    assert "on_error='skip'" in err
    assert (
        main(["index", *ds.shards, "--topk", "4"]) == 0
    )  # up to date: still said, from the sidecars
    assert f"{len(ds.bad)} sample(s) refused" in capsys.readouterr().err


def test_a_warning_is_one_line_without_the_librarys_file(capsys):
    def cmd(args):
        bar = Progress("prealign index")
        bar(1, 3, 10)  # a bar's line left open, as while shards are indexed
        warnings.warn("an image without EXIF\nread as it is", UserWarning)
        bar(3, 3, 30)
        return 0

    import argparse

    from prealign.loaders.cli.errors import run_reporting

    parser = argparse.ArgumentParser()
    parser.set_defaults(func=cmd)
    assert run_reporting(parser, []) == 0
    err = capsys.readouterr().err
    lines = err.replace("\r", "\n").splitlines()
    assert "prealign: warning: UserWarning: an image without EXIF; read as it is" in lines, err
    assert ".py:" not in err and "warnings.warn" not in err


def test_warning_line_alone():
    out = io.StringIO()
    warning_line(UserWarning("one\ntwo"), UserWarning, "/somewhere/lib.py", 12, file=out)
    assert out.getvalue() == "prealign: warning: UserWarning: one; two\n"


def test_every_closing_hint_is_a_fix():
    report = BadDataReport()
    for reason in ("bad_sample", "bad_sample", "corrupt_shard", "some_new_reason"):
        report.add(BadRecord(reason, "s.tar:k", "m"))
    assert remedy(report) == f"{REMEDIES['bad_sample']}; {REMEDIES['corrupt_shard']}"
    only_new = BadDataReport()
    only_new.add(BadRecord("some_new_reason", "s.tar:k", "m"))
    assert "some_new_reason" in remedy(only_new)
    for text in REMEDIES.values():
        assert "causes listed below" not in text and not text.startswith("fix the causes")
    for exc in (
        RemoteStallError("http://h/s.tar", "no byte"),
        ShardTimeoutError("s.tar", 0, "stalled"),
        CorruptShardError("s.tar", 9, "truncated"),
        WorkerError("worker(s) [1] died"),
    ):
        assert "--debug" not in hint_for(exc), exc


def test_a_bad_samples_error_names_the_skip_policy():
    err = BadSampleError(sample="s.tar:k", field="input_ids", expected="int64", actual="float32")
    assert "on_error='skip'" in error_lines(err)[0]


def test_nothing_loaded_closes_with_the_fix_of_its_causes(tmp_path, capsys):
    garbage = tmp_path / "g.tar"
    garbage.write_bytes(b"not a tar file " * 100)
    assert (
        main(
            ["inspect", str(garbage), "--text", "--workers", "0", "--out", str(tmp_path / "x.png")]
        )
        == 2
    )
    head = next(
        ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("prealign: error:")
    )
    assert head.endswith(f"(hint: {REMEDIES['corrupt_shard']})"), head


def _missing_ids(i, tf):
    """Sample 4 has no input_ids member: a bad sample (counted as missing_member or bad_sample)."""
    from tests.loader_helpers import add_member

    if i == 4:
        add_member(tf, f"{i:06d}.json", b"{}")
        return True
    return False


@pytest.mark.parametrize("sidecars", [False, True])
def test_a_raised_bad_sample_names_the_skip_policy_and_the_report_stays_readable(
    tmp_path, sidecars
):
    import sys
    import traceback

    from prealign.loaders import BadDataPolicy, PackedLoader, WebDatasetSource
    from prealign.loaders.index.header_pass import write_sidecars
    from prealign.schemas import ParallelLayout, causal_lm_schema
    from prealign.schemas.errors import SampleError
    from tests.loader_helpers import sample_lengths, write_shards

    paths = write_shards(str(tmp_path), sample_lengths(20), num_shards=2, extra=_missing_ids)
    schema = causal_lm_schema()
    if sidecars:
        write_sidecars(WebDatasetSource(paths), schema)

    def loader(**kw):
        return PackedLoader(
            WebDatasetSource(paths, sidecars=sidecars),
            schema=schema,
            layout=ParallelLayout(),
            token_budget=256,
            **kw,
        )

    raising = loader()
    with pytest.raises(SampleError) as exc:
        raising.prepare()
    if sys.version_info >= (3, 11):  # (exception notes)
        assert "BadDataPolicy(on_error='skip') would count this as" in "".join(
            traceback.format_exception(exc.value)
        )
    assert raising.report.total == 0  # nothing left out: the pass stopped at the first
    too_many = loader(bad_data=BadDataPolicy(on_error="skip", warn=False, max_consecutive=1))
    with pytest.raises(Exception, match="1 bad samples in a row"):
        too_many.prepare()
    assert too_many.report.total == 1  # what it counted before it stopped, without running it again
