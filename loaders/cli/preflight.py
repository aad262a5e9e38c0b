"""Checks the ``prealign`` command makes before any work: numbers in range, shards that exist and
are plain tars, an ``--out`` it can write, and what ``--hf`` names (a local file or folder, a saved
dataset, or a Hub dataset). Each mistake is a :class:`~prealign.loaders.cli.errors.UsageError`.

>>> hf_builder("data/train.jsonl"), hf_builder("data/part-0.parquet"), hf_builder("org/name")
('json', 'parquet', None)
"""

from __future__ import annotations

import os
import stat

from prealign.loaders.cli.errors import UsageError
from prealign.loaders.sources.hf_files import load_data_file, one_split
from prealign.schemas.errors import ConfigError

# load_dataset's packaged builder for a local data file, by extension
_BUILDERS = {
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
    ".csv": "csv",
    ".tsv": "csv",
    ".txt": "text",
    ".arrow": "arrow",
}


def check_int(
    name: str, value: int | None, low: int, *, high: int | None = None, optional: bool = False
) -> None:
    """``--name`` must be an int in ``[low, high]`` (or absent, when ``optional``)."""
    if value is None and optional:
        return
    if value is None or value < low:
        raise UsageError(
            f"{name}: expected an int >= {low}, got {value}",
            hint=f"give {name} {max(low, 1)} or more" if low > 0 else f"give {name} 0 or more",
        )
    if high is not None and value > high:
        raise UsageError(
            f"{name}: expected an int <= {high:,}, got {value:,}",
            hint=f"give {name} {high:,} or less",
        )


def check_topk_vocab(args) -> None:
    """``--topk`` (0: none) and ``--vocab-size`` (ids are ``< vocab_size``): a top-k larger than the
    vocabulary (the demo tokenizer's in VLM mode without ``--tokenizer``) names ids that cannot all
    differ."""
    check_int("--vocab-size", args.vocab_size, 1, optional=True)
    vocab = args.vocab_size
    if not (args.text or getattr(args, "tokenizer", None)):
        from prealign.loaders.cli.demo_tokenizer import ByteTokenizer  # (its module: torch)

        vocab = ByteTokenizer().vocab_size
    check_int("--topk", args.topk, 0, high=vocab if vocab is not None else MAX_TOPK)


MAX_TOPK = 1 << 20
"""A teacher top-k larger than any vocabulary in use (the largest are about 256k tokens)."""

REMOTE_BACKENDS = {"http": None, "https": None, "s3": "s3fs", "gs": "gcsfs", "gcs": "gcsfs"}
"""URL schemes shards are read from, and the fsspec backend each needs (also ``pipe:`` commands and
paths)."""


def check_out(path: str) -> None:
    """The PNG path can be written: its folder exists and is writable, and it is not a folder."""
    if os.path.isdir(path):
        raise UsageError(
            f"--out {path}: is a folder", hint="give a file name, e.g. --out layout.png"
        )
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise UsageError(
            f"--out {path}: folder {parent} does not exist",
            hint="create it first, or choose another --out",
        )
    if not os.access(parent, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise UsageError(f"--out {path}: not writable", hint="choose a path you can write")


def check_dir(option: str, path: str | None) -> None:
    """A folder the command will write into (created if missing): its parent must exist."""
    if path is None:
        return
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(
            f"{option} {path}: is a file, not a folder", hint=f"give {option} a folder"
        )
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise UsageError(f"{option} {path}: folder {parent} does not exist", hint="create it first")


def check_shards(urls: list[str]) -> None:
    """Every local shard exists (all missing ones named at once), is a file and is a plain
    (uncompressed) tar; a remote URL has a scheme and backend the loaders read
    (:func:`check_remote`), its shards are checked by the index pass."""
    missing = [
        url
        for url in urls
        if "://" not in url.removeprefix("file://")
        and not url.startswith("pipe:")
        and not os.path.exists(url.removeprefix("file://"))
    ]
    if missing:
        more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
        raise UsageError(
            f"no such shard{'s' if len(missing) > 1 else ''}: {', '.join(missing[:5])}{more}",
            hint="check the path; brace patterns like shard-{000..009}.tar are expanded, quote "
            "them for the shell",
        )
    checked: set[str] = set()
    for url in urls:
        path = url.removeprefix("file://")
        if path.startswith("pipe:"):
            continue
        if "://" in path:
            scheme = url.split("://", 1)[0].lower()
            if (
                scheme not in checked
            ):  # one check per scheme: 100k shards cost one credentials look-up
                check_remote(url)
                checked.add(scheme)
            continue
        if os.path.isdir(path):
            raise UsageError(
                f"{url}: is a folder, not a shard", hint=f"give the shards in it, e.g. {url}/*.tar"
            )
        if not stat.S_ISREG(
            os.stat(path).st_mode
        ):  # a FIFO would block the read below; a device never ends
            raise UsageError(
                f"{url}: not a regular file (a FIFO, a device or a socket)",
                hint="give the tar files themselves; a stream goes through pipe:CMD",
            )
        with open(path, "rb") as f:
            magic = f.read(6)
        if (
            magic[:2] == b"\x1f\x8b"
            or magic[:3] == b"BZh"
            or magic == b"\xfd7zXZ\x00"
            or magic[:4] == b"\x28\xb5\x2f\xfd"
        ):
            raise UsageError(
                f"{url}: a compressed file; shards are read by byte range from plain tars",
                hint=f"decompress it first, e.g. gunzip -k {path}",
            )


def check_remote(url: str) -> None:
    """A remote shard URL the loaders can read: a known scheme, its backend installed, and for
    ``s3://`` credentials botocore can find (the command has no way to pass others)."""
    import importlib.util

    scheme = url.split("://", 1)[0].lower()
    if scheme not in REMOTE_BACKENDS:
        raise UsageError(
            f"{url}: shards are not read over {scheme}://",
            hint=f"use one of {', '.join(s + '://' for s in REMOTE_BACKENDS)}, a path or pipe:CMD",
        )
    backend = REMOTE_BACKENDS[scheme]
    if backend is None:
        return
    for package in ("fsspec", backend):
        if importlib.util.find_spec(package) is None:
            raise UsageError(
                f"{url}: reading {scheme}:// needs the package {package}, which is not installed",
                hint="pip install 'prealign[remote]'" + (" gcsfs" if backend == "gcsfs" else ""),
            )
    if scheme == "s3" and not _has_aws_credentials():
        raise UsageError(
            f"{url}: no AWS credentials found for s3://",
            hint="set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, "
            "~/.aws/credentials)",
        )


def _has_aws_credentials() -> bool:
    try:
        import botocore.session
    except ImportError:  # s3fs without botocore cannot read s3 either: its own error says so
        return True
    return botocore.session.get_session().get_credentials() is not None


def hf_builder(path: str) -> str | None:
    """load_dataset's builder for a local data file path (``"json"`` for ``.jsonl``), or None."""
    return _BUILDERS.get(os.path.splitext(path)[1].lower())


def _looks_local(path: str) -> bool:
    return (
        path.startswith((os.sep, ".", "~"))
        or hf_builder(path) is not None
        or os.path.splitext(path)[1].lower() in (".gz", ".zst", ".bz2", ".xz")
    )


def load_hf(path: str, split: str, cache_dir: str | None):
    """``--hf PATH`` as ``load_dataset`` would take it, local first, never a Hub lookup for a local
    path:

    - a file (``.json``/``.jsonl``/``.parquet``/``.csv``/``.txt``/``.arrow``):
      ``load_dataset(builder, data_files=path)``;
    - a folder saved with ``save_to_disk`` (``dataset_info.json`` / ``dataset_dict.json``):
      ``load_from_disk``;
    - another folder: ``load_dataset(folder)`` (its data files, as ``load_dataset`` finds them);
    - anything else that does not look like a path: a Hub dataset name.
    """
    import datasets

    kw = {"cache_dir": cache_dir} if cache_dir else {}
    if os.path.isfile(path):
        builder = hf_builder(path)
        if builder is None:
            raise UsageError(
                f"--hf {path}: not a data file load_dataset reads",
                hint=f"give a {'/'.join(sorted({e[1:] for e in _BUILDERS}))} file or a folder",
            )
        try:
            ds = load_data_file(builder, path, what=f"--hf {path}", **kw)
        except ConfigError as exc:
            raise UsageError(
                str(exc), hint=f"check that {os.path.basename(path)} is {builder} data"
            ) from exc
        return _split(ds, split, path)
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, "dataset_info.json")) or os.path.exists(
            os.path.join(path, "dataset_dict.json")
        ):
            return _split(datasets.load_from_disk(path), split, path)
        return _split(datasets.load_dataset(path, **kw), split, path)
    if _looks_local(path):
        raise UsageError(
            f"--hf {path}: no such file or folder",
            hint="check the path; a Hub dataset is named like org/name",
        )
    return _split(datasets.load_dataset(path, **kw), split, path)


def _split(ds, split: str, path: str):
    """One split of a ``DatasetDict`` (a plain ``Dataset`` as it is):
    :func:`~prealign.loaders.sources.hf_files.one_split`, a split it lacks a :class:`UsageError`."""
    try:
        return one_split(ds, split, what=f"--hf {path}: --split")
    except ConfigError as exc:
        raise UsageError(str(exc), hint=f"pass --split {sorted(ds.keys())[0]}") from exc


def first_member_names(url: str, limit: int = 8) -> list[str]:
    """Names of the first ``limit`` members of a local tar shard (headers only; [] when it is not
    local or not readable as a tar: the other checks name that)."""
    import tarfile

    from prealign.loaders.sources import remote

    if remote.is_remote(url) or not os.path.isfile(remote.local_path(url)):
        return []
    names = []
    try:
        with tarfile.open(remote.local_path(url), "r:") as tf:
            while len(names) < limit and (m := tf.next()) is not None:
                if m.isfile():
                    names.append(m.name)
    except (tarfile.TarError, OSError):
        return []
    return names


def check_mode(urls: list[str], text: bool, command: str) -> None:
    """``--text`` given for chat + image shards, or forgotten for pre-tokenized ``.npy`` ones (read
    from the first shard's first members): a :class:`UsageError` saying which flag to add or
    drop."""
    names = first_member_names(urls[0]) if urls else []
    tokens = [n for n in names if n.endswith(".input_ids.npy")]
    chats = [n for n in names if n.endswith(".json")]
    images = [n for n in names if n.rsplit(".", 1)[-1].lower() in ("png", "jpg", "jpeg", "webp")]
    if not text and tokens and not images:
        raise UsageError(
            f"{urls[0]} holds pre-tokenized members ({tokens[0]}), not chat JSON + images, which "
            f"{command} reads without --text",
            hint=f"add --text: prealign {command} --text ...",
        )
    if text and not tokens and chats:
        raise UsageError(
            f"{urls[0]} holds chat JSON ({chats[0]}) and no input_ids.npy, which --text needs",
            hint=f"drop --text (chat + images use the VLM transform): prealign {command} ...",
        )
