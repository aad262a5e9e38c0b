"""The fix a user is told when an index does not fit: the ``prealign index`` command that rebuilds
the sidecars of a source, every path quoted for a POSIX shell.

Built only when an error is raised, never while a healthy sidecar is read: the command names every
shard (a brace range when they are one numbered run, found by walking all their names), so building
it for each of ``S`` sidecars made a loader's start cost ``S**2`` regex matches (issue #28). Callers
hand a ``lambda`` (:func:`~prealign.loaders.index.sidecar.parse_sidecar`'s ``fix=``) or call
:func:`index_hint` in the branch that raises; the command is then kept per source, so many errors of
one source build it once.
"""

from __future__ import annotations

import re
import shlex
import weakref

from prealign.loaders.index.sidecar import describe_transform, indexed_transform
from prealign.loaders.sources import remote
from prealign.loaders.sources.shard_files import plain_local
from prealign.loaders.sources.webdataset import numpy_fields
from prealign.schemas.lazy import is_instance


def shell_shards(urls: list[str]) -> str:
    """``urls`` as shell arguments: a quoted brace range when they are one numbered run
    (``'data/shard-{000..099}.tar'``), else each quoted.

    >>> shell_shards(["d/s-008.tar", "d/s-009.tar", "d/s-010.tar"])
    "'d/s-{008..010}.tar'"
    >>> shell_shards(["a.tar", "b c.tar"])
    "a.tar 'b c.tar'"
    """
    first = re.fullmatch(r"(.*?)(\d+)(\D*)", urls[0]) if len(urls) > 2 else None
    if first is not None:  # (the run the first name starts, spelled out: one format a name)
        head, digits, tail = first.groups()
        start, stop, width = int(digits), int(digits) + len(urls) - 1, len(digits)
        if stop < 10**width and list(urls) == [
            f"{head}{n:0{width}d}{tail}" for n in range(start, stop + 1)
        ]:
            return shlex.quote(f"{head}{{{start:0{width}d}..{stop:0{width}d}}}{tail}")
    return " ".join(shlex.quote(u) for u in urls)


def index_command(source) -> str:
    """The ``prealign index`` command that writes sidecars this loader's source accepts, every path
    quoted for a POSIX shell. Remote shards with no ``index_dir`` get ``--out prealign-index`` (a
    sidecar cannot be written beside a remote object) and what to give the loader then. Built once
    per source (and shard list)."""
    key = (
        len(source.urls),
        source.urls[0] if source.urls else None,
        source.urls[-1] if source.urls else None,
        getattr(source, "index_dir", None),
        id(source.transform),
    )
    try:
        known = _COMMANDS.get(source)
    except TypeError:  # (a source that cannot be weakly referenced: built each time)
        return _command(source)
    if known is None or known[0] != key:
        known = (key, _command(source))
        _COMMANDS[source] = known
    return known[1]


_COMMANDS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def merge_command(source) -> str:
    """The ``prealign index --merge`` command that writes the one merged index of this source's
    shards (their sidecars, when up to date, are only checked)."""
    command = index_command(source)
    if not command.startswith("prealign index "):
        return "prealign index --merge (with the flags that built the sidecars) on the same shards"
    return command.replace(" --force", " --merge", 1)


def _command(source) -> str:
    transform = indexed_transform(source.transform)
    urls = shell_shards(source.urls)
    index_dir = getattr(source, "index_dir", None) or (
        REMOTE_INDEX_DIR if _remote_unindexed(source) else None
    )
    out = f" --out {shlex.quote(index_dir)}" if index_dir else ""
    if transform is numpy_fields:
        mode = "--text"
    elif is_instance(transform, "prealign.loaders.media.vlm", "VLMSampleTransform"):  # (no torch)
        path = (
            getattr(getattr(transform.tokenizer, "tokenizer", None), "name_or_path", "")
            or "TOKENIZER_DIR"
        )
        mode = (
            f"--tokenizer {shlex.quote(path)}"
            if getattr(transform.tokenizer, "tokenizer", None) is not None
            else ""
        )
        mode += (
            " --processor DIR_WITH_preprocessor_config.json" if transform.processor_options else ""
        )
        if transform.model_config is not None:  # the family (a folder with the model's config.json)
            folder = (
                getattr(transform.model_config, "name_or_path", "") or "MODEL_DIR_WITH_config.json"
            )
            mode += f" --model-config {shlex.quote(folder)}"
        mode += f" --topk {transform.topk}" if transform.topk else ""
        mode = mode.strip()
    else:
        return (
            f"write_sidecars(source, schema, force=True) from prealign.loaders.index.header_pass "
            f"with this source's transform ({describe_transform(transform)})"
            f"{f' and out_dir={index_dir!r}' if index_dir else ''}"
        )
    return f"prealign index {mode + ' ' if mode else ''}--force{out} {urls}"


REMOTE_INDEX_DIR = "prealign-index"
"""Where :func:`index_command` has the sidecars of remote shards written (relative to the working
directory)."""


def _remote_unindexed(source) -> bool:
    urls = source.urls
    return (
        not getattr(source, "index_dir", None)
        and not plain_local(urls)  # (one check in C: no question a shard)
        and any(remote.is_remote(u) for u in urls)
    )


def index_hint(source) -> str:
    """``run `<index_command>` `` and, for remote shards with no ``index_dir``, where the loader
    then finds the sidecars."""
    then = (
        (
            f", then give WebDatasetSource(..., index_dir={REMOTE_INDEX_DIR!r}) (the folder it "
            f"writes in the directory it runs in; or upload the sidecars beside the shards)"
        )
        if _remote_unindexed(source)
        else ""
    )
    return f"run `{index_command(source)}`{then}"
