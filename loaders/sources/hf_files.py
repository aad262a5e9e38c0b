"""A local data file (``.jsonl``, ``.parquet``, ``.csv``, ...) read with ``datasets.load_dataset``:
a file it cannot read is a :class:`~prealign.schemas.errors.ConfigError`, never its traceback."""

from __future__ import annotations

import os

from prealign.schemas.errors import ConfigError


def load_data_file(builder: str, path: str, *, what: str, **kw):
    """``datasets.load_dataset(builder, data_files=path, **kw)`` (a ``DatasetDict``). A file it
    cannot read (empty, binary, not of ``builder``'s format: ``DatasetGenerationError``, a pyarrow
    error, ``StopIteration``) is a :class:`~prealign.schemas.errors.ConfigError` that starts with
    ``what`` (where the path was given) and names the format and the cause."""
    import datasets
    import pyarrow

    try:
        return datasets.load_dataset(builder, data_files=path, **kw)
    except (datasets.exceptions.DatasetGenerationError, pyarrow.ArrowException, StopIteration) as e:
        cause = e.__cause__ if isinstance(e, datasets.exceptions.DatasetGenerationError) else e
        detail = f"{type(cause).__name__}: {cause}" if cause is not None else type(e).__name__
        empty = os.path.isfile(path) and os.path.getsize(path) == 0
        raise ConfigError(
            f"{what}: expected a {builder} file load_dataset reads, with at least one row, got "
            f"{'an empty file' if empty else 'one it cannot read'} ({detail:.200})"
        ) from e


def one_split(ds, split, *, what: str):
    """``ds[split]`` of a ``DatasetDict`` (a ``Dataset`` as it is); a split it lacks or one that is
    not a ``str`` is a :class:`~prealign.schemas.errors.ConfigError` listing those it has."""
    if not hasattr(ds, "keys"):
        return ds
    if not isinstance(split, str) or split not in ds:
        raise ConfigError(f"{what}: expected a split of {sorted(ds.keys())}, got {split!r:.80}")
    return ds[split]
