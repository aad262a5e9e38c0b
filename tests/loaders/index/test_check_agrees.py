"""``prealign index --check`` and the loader agree on a merged index (issue #31): a merged index
left stale by a shard re-indexed on its own (its sidecar up to date, the merged file not) is what a
loader reads first and refuses, so ``--check`` reports it too instead of "2/2 shard(s) match"."""

from __future__ import annotations

import pytest

from prealign.loaders import PackedLoader, WebDatasetSource
from prealign.loaders.cli.main import main
from prealign.loaders.errors import ChangedShardError
from prealign.loaders.index.header_pass import write_sidecars
from prealign.loaders.index.merged import merged_path
from prealign.schemas import ParallelLayout
from prealign.schemas.schema import causal_lm_schema
from tests.loader_helpers import sample_lengths, write_shards


def test_index_check_refuses_the_stale_merged_index_the_loader_refuses(tmp_path, capsys):
    paths = write_shards(str(tmp_path), sample_lengths(40), num_shards=2)
    assert main(["index", *paths, "--text", "--merge"]) == 0
    capsys.readouterr()
    assert main(["index", *paths, "--text", "--check"]) == 0  # fresh: both agree it is fine
    assert "2/2 shard(s) match" in capsys.readouterr().err
    write_shards(str(tmp_path), sample_lengths(40, seed=5), num_shards=2)  # other data, same names
    write_sidecars(WebDatasetSource(paths), causal_lm_schema(), force=True)  # the sidecars only
    loader = PackedLoader(
        WebDatasetSource(paths),
        schema=causal_lm_schema(),
        layout=ParallelLayout(),
        token_budget=256,
    )
    with pytest.raises(ChangedShardError):
        list(loader)
    assert main(["index", *paths, "--text", "--check"]) == 1
    err = capsys.readouterr().err
    assert "2/2 shard(s) match their sidecars" in err and "merged index is stale" in err
    assert merged_path(WebDatasetSource(paths)) in err and paths[0] + ": " in err
    assert main(["index", *paths, "--text", "--merge"]) == 0  # the command it names fixes it
    assert main(["index", *paths, "--text", "--check"]) == 0
    assert (
        len(
            list(
                PackedLoader(
                    WebDatasetSource(paths),
                    schema=causal_lm_schema(),
                    layout=ParallelLayout(),
                    token_budget=256,
                )
            )
        )
        > 0
    )
