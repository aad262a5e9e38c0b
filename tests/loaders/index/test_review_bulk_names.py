"""Review: the sidecars read at once refuse, as the one-by-one reader does, a sidecar naming
another shard where the shards' names differ in length but add up to the layout's width (``s-10``,
``s-9``, ``s-100``: their joined text cut into rows of 8 characters is ``s-10.tar``, ``s-9.tars``,
``-100.tar``)."""

from __future__ import annotations

import os
import shutil

from prealign.loaders import WebDatasetSource
from prealign.loaders.index.header_pass import write_sidecars
from prealign.loaders.sources.shard_files import SUFFIX
from tests.loaders.index.test_sidecar_bulk import SCHEMA, _rewrite, _start, _write


def test_names_of_other_lengths_are_not_read_as_one_fixed_width_text(tmp_path):
    data = str(tmp_path / "data")
    one = _write(str(tmp_path / "src"))[1]
    os.makedirs(data)
    names = ["s-10.tar", "s-9.tar", "s-100.tar"]
    paths = [os.path.join(data, n) for n in names]
    for p in paths:  # (the same bytes: sidecars alike but for the name)
        shutil.copy(one, p)
    index_dir = str(tmp_path / "index")
    os.makedirs(index_dir)
    write_sidecars(WebDatasetSource(paths), SCHEMA, out_dir=index_dir)
    for name, says in (("s-9.tar", "s-9.tars"), ("s-100.tar", "-100.tar")):
        _rewrite(os.path.join(index_dir, name + SUFFIX), lambda m, s=says: m.update(shard=s))
    sizes = {os.path.getsize(os.path.join(index_dir, n + SUFFIX)) for n in names}
    assert len(sizes) == 1  # (one layout: the bulk path compares them with one template)
    one_by_one = _start(paths, index_dir, bulk=False)
    assert one_by_one[0] == "error" and "s-9.tar" in one_by_one[2], one_by_one[:3]
    assert _start(paths, index_dir, bulk=True) == one_by_one
