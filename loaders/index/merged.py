"""One index file for all the shards of a data set: their sidecars merged, so a loader starts with
one read instead of one per shard (100k shards: one file, not 100k opens and parses).

    shard-*.tar.prealign-index.npz ──prealign index --merge──► <folder>/prealign-index.merged.npz

The merged file sits in ``index_dir`` when the source has one, else in the folder of the first
shard. A loader uses it when it names exactly the source's shards, in order (else it reads the
sidecars one by one, as before). It holds what the sidecars hold, read with ``allow_pickle=False``
and checked as a whole:

===========  ============  =========================================================================
key          dtype /       meaning
             shape
===========  ============  =========================================================================
``meta``     uint8         UTF-8 JSON: ``format``, ``version`` (5), ``common`` (the sidecar meta
             ``[B]``       every shard shares: ``config``, ...), ``dims`` (distinct named-dim
                           dicts), ``events`` (``[shard, position, event]`` of each skip / bad
                           record)
``names``    uint8         the shard file names as one UTF-8 text (lone surrogates kept:
             ``[B]``       ``surrogatepass``), a newline between two (:func:`encode_names`)
``name_by``  int32         each name's length in bytes, only when a name holds a newline (what
``tes``      ``[S]``       then tells one inside a name from one between two)
``probes``   uint8         each shard's probe digest (ASCII hex, NUL-padded: ``S16``), by the
             ``[S,16]``    definition of :data:`~prealign.loaders.index.sidecar.PROBE_VERSION`
``probe_ver  uint8 ``[S]`` each probe's definition (1 or 2), only when some shard's is 1 (merged
sions``                    from a version 3 sidecar of a shard under 128 KiB)
``sizes``    int64 ``[S]`` each shard's size in bytes (``-1``: not checked)
``rows``     int32 ``[S]`` each shard's good samples (int64 past 2**31 - 1)
``spans``    int64         ``start, end, checksum`` of each good sample, shard after shard
             ``[N,3]``
``lengths``  int64         token lengths
             ``[N]``
``media``    bool ``[N]``  the sample carries media
``dim_ids``  int64         row of ``meta.dims`` each sample has
             ``[N]``
``bounds``   int64         value bounds of each sample's ids (as in the sidecars)
             [N,3,4]
===========  ============  =========================================================================

A shard's records are its good samples and its events; its ``first`` / ``last`` byte (what its
first read checks: :func:`~prealign.loaders.index.sidecar.expected_of`) is found from its samples
and events by :func:`~prealign.loaders.index.tiling.check_tiling`, as for a sidecar. The records it
gives are those the sidecars give, so the index is the same either way; each shard is still checked
against it when first read (:class:`~prealign.loaders.index.shard_checks.ShardChecks`). Anything
malformed is a :class:`~prealign.loaders.errors.StaleIndexError` naming the file.

Version 5 is version 4 whose probes hash each byte once (a shard's first and last 64 KiB; the
same digest as version 4's from 128 KiB on): ``probe_versions`` names the shards whose sidecar
(version 3) recorded the older probe, so sidecars of both versions merge into one file and each
shard is checked against the probe its sidecar recorded. Versions 2 to 4 hold the older probe, and
``merge_sidecars(..., version=4 or 3)`` writes them (for an older prealign) from sidecars whose
probes are the older one's: version 3 sidecars, and version 4 ones of shards of 128 KiB or more (or
empty); any other is refused with the command that rewrites it.

Version 4 keeps per shard only what cannot be found from the rest (at 100k shards, 4.3 MB of 18 in
place of 7.9 of 21.6: less to read, checksum and check at every start). Version 3 (what
``merge_sidecars(..., version=3)`` still writes, for an older prealign) holds ``name_bytes`` always
(int64) and a ``shards`` table int64 ``[S, 5]`` of ``size, rows, num_events, first, last`` in place
of ``sizes`` and ``rows``, its ``first`` / ``last`` checked against the samples; version 2 (version
3 with ``names`` and ``probes`` as JSON lists in ``meta``) is still read; version 1, and a version
from the future, are refused with the command that rewrites them.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json

import numpy as np

from prealign.loaders.errors import IndexMismatchError, StaleIndexError
from prealign.loaders.index import sidecar
from prealign.loaders.index.apply_policy import Records, apply_policy
from prealign.loaders.index.events import parse_event
from prealign.loaders.index.sample_checks import bad_row_event, signature_verdicts, value_errors
from prealign.loaders.index.sample_index import LazyList, SampleIndex
from prealign.loaders.index.shard_checks import ShardChecks
from prealign.loaders.index.source_index import check_meta
from prealign.loaders.index.tiling import bad_regions, check_tiling
from prealign.loaders.policy import BadDataPolicy
from prealign.loaders.sources import remote
from prealign.loaders.sources.npy import read_npz
from prealign.loaders.sources.shard_files import (
    byte_counts,
    shard_name,
    shard_names,
    url_text,
    word_columns,
    write_atomically,
)
from prealign.schemas.errors import PrealignError

FORMAT = "prealign-merged-index"
VERSION = 5
NAME = "prealign-index.merged.npz"
_READS = (2, 3, 4, 5)
_WRITES = (3, 4, 5)
_PER_SHARD = frozenset(
    {"version", "shard", "size", "hash", "probe", "dims", "events", "num_events"}
)  # (a sidecar's version: its probe's definition, per shard from merged version 5 on)
_SAMPLES = frozenset({"spans", "lengths", "media", "dim_ids", "bounds"})
_KEYS_V2 = _SAMPLES | {"meta", "shards"}
_KEYS_V3 = _KEYS_V2 | {"names", "name_bytes", "probes"}
_KEYS_V4 = _SAMPLES | {"meta", "names", "probes", "sizes", "rows"}
"""Version 4's members (and 5's); ``name_bytes`` too when a name holds a newline, and in version
5 ``probe_versions`` when a probe is of definition 1."""
_KEYS = _KEYS_V3 | _KEYS_V4 | {"name_bytes", "probe_versions"}
_MAX_FILE = 1 << 36
"""64 GiB: a merged index holds 137 bytes a sample (about 500M samples)."""
_INFLATE = 2
""":func:`merge_sidecars` stores its members uncompressed (together the file's size): a file that
inflates to more than twice its size (and 1 MiB) is not one it wrote."""


def merged_path(source) -> str:
    """Where ``source``'s merged index lives: ``index_dir/`` or the first shard's folder, then
    :data:`NAME`."""
    folder = getattr(source, "index_dir", None)
    if not folder:
        first = source.urls[0].split("?", 1)[0]
        first = first[len("file://") :] if first.startswith("file://") else first
        folder = first.rsplit("/", 1)[0] if "/" in first else "."
    return f"{folder.rstrip('/')}/{NAME}"


def merge_sidecars(source, path: str | None = None, *, version: int = VERSION) -> dict:
    """Write the sidecars of every shard of ``source`` as one merged index at ``path`` (default
    :func:`merged_path`), atomically. Every shard needs its sidecar (else :class:`StaleIndexError`:
    run ``prealign index`` first), and all of them the same configuration. ``version``: the format
    written, :data:`VERSION`, or 4 or 3 (what an older prealign reads: only from sidecars whose
    probes are of the older definition, :data:`~prealign.loaders.index.sidecar.PROBE_VERSION`; else
    :class:`StaleIndexError`). Sidecars of versions 3 and 4 may be merged together. Returns
    ``{"path", "shards", "samples"}``."""
    if version not in _WRITES:
        raise ValueError(f"version: this prealign writes versions {list(_WRITES)}, not {version!r}")
    path = path or merged_path(source)
    names, probes, table, events, dims, versions = [], [], [], [], [], []
    parts: dict[str, list] = {"spans": [], "lengths": [], "media": [], "dim_ids": [], "bounds": []}
    common = None
    for shard, url in enumerate(source.urls):
        data = sidecar.read_sidecar_bytes(source, shard)
        if data is None:
            raise StaleIndexError(
                url, "no sidecar index to merge", "run `prealign index` on every shard first"
            )
        meta, arrays = sidecar.parse_sidecar(data, shard=url)
        if meta["shard"] != shard_name(url):
            raise StaleIndexError(
                url, f"its sidecar describes shard {meta['shard']!r}", "a sidecar of another shard"
            )
        mine = {k: v for k, v in meta.items() if k not in _PER_SHARD}
        if common is None:
            common = mine
        elif mine != common:
            raise StaleIndexError(
                url,
                f"its sidecar was built with {mine}, the first shard's with {common}",
                "index every shard with one configuration before merging",
            )
        ids = np.asarray(
            [dims.index(d) if d in dims else dims.append(d) or len(dims) - 1 for d in meta["dims"]],
            np.int64,
        )
        size, probe, first, last, probe_version = sidecar.expected_of(meta, arrays["spans"])
        if not 0 < size < 2 * sidecar.PROBE:
            probe_version = sidecar.PROBE_VERSION  # (the two definitions' digests are the same)
        elif version < 5 and probe_version != 1:
            raise StaleIndexError(
                url,
                f"its sidecar (version {meta['version']}) records a probe that merged format "
                f"{version} cannot hold (each byte of a shard under 128 KiB hashed once)",
                f"merge as version {VERSION} (what this prealign reads), or index the shards "
                f"with the prealign that reads version {version}",
            )
        names.append(meta["shard"])
        probes.append(probe)
        versions.append(probe_version)
        table.append((size, len(arrays["lengths"]), meta["num_events"], first, last))
        events.extend([shard, pos, ev.to_json()] for pos, ev in meta["events"])
        for key in ("spans", "lengths", "media", "bounds"):
            parts[key].append(arrays[key])
        parts["dim_ids"].append(ids[arrays["dim_ids"]] if len(ids) else arrays["dim_ids"])
    meta = {"format": FORMAT, "version": version, "common": common, "dims": dims, "events": events}
    table = np.asarray(table, np.int64).reshape(-1, 5)
    if version == 3:
        shard_arrays = {**encode_names(names), "shards": table}
    else:  # (first / last and the record counts follow from the samples and events: not stored)
        shard_arrays = _encode_names_v4(names)
        shard_arrays["sizes"], rows = table[:, 0], table[:, 1]
        shard_arrays["rows"] = rows.astype(np.int32) if rows.max(initial=0) < 2**31 else rows
        if version == 5 and min(versions, default=2) < 2:  # (else every probe of definition 2)
            shard_arrays["probe_versions"] = np.asarray(versions, np.uint8)
    buf = io.BytesIO()
    np.savez(
        buf,
        meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8),
        probes=np.frombuffer(_probe_array(probes).tobytes(), np.uint8).reshape(-1, 16),
        **shard_arrays,
        spans=np.concatenate(parts["spans"]).reshape(-1, 3).astype(np.int64),
        lengths=np.concatenate(parts["lengths"]).astype(np.int64),
        media=np.concatenate(parts["media"]).astype(bool),
        dim_ids=np.concatenate(parts["dim_ids"]).astype(np.int64),
        bounds=np.concatenate(parts["bounds"]).reshape(-1, 3, 4).astype(np.int64),
    )
    write_atomically(path, buf.getvalue())
    return {"path": path, "shards": len(names), "samples": int(sum(t[1] for t in table))}


def encode_names(names: list[str]) -> dict[str, np.ndarray]:
    """``names`` as a merged index's ``names`` (uint8 ``[B]``: one UTF-8 text, a newline between
    two names, lone surrogates kept) and ``name_bytes`` (int64 ``[S]``: each name's length in
    bytes); :func:`decode_names` reads them back."""
    encoded = [n.encode("utf-8", "surrogatepass") for n in names]
    return {
        "names": np.frombuffer(b"\n".join(encoded), np.uint8),
        "name_bytes": np.asarray([len(b) for b in encoded], np.int64),
    }


def _encode_names_v4(names: list[str]) -> dict[str, np.ndarray]:
    """Version 4's names: :func:`encode_names`' text, and its ``name_bytes`` (as int32) only when
    some name holds a newline (else the text splits into the names at its newlines)."""
    arrays = encode_names(names)
    if byte_counts(arrays["names"], (ord("\n"),))[0] == len(names) - 1:
        return {"names": arrays["names"]}
    return {"names": arrays["names"], "name_bytes": arrays["name_bytes"].astype(np.int32)}


def decode_names(text: np.ndarray, lengths: np.ndarray) -> list[str]:
    """The names of :func:`encode_names`' arrays: a few C calls over the text (a step per name
    only when a name holds a newline). ``ValueError`` when the arrays are not such (dtype, shape,
    lengths that do not tile the text with a newline between two names, text not UTF-8)."""
    joined, starts_ends = _names_text(text, lengths)
    if starts_ends is None:
        return joined.split("\n")
    raw = text.tobytes()
    return [raw[a:b].decode("utf-8", "surrogatepass") for a, b in zip(*starts_ends)]


def _names_text(text: np.ndarray, lengths: np.ndarray) -> tuple[str, tuple | None]:
    """:func:`decode_names`' checks, and the names as one text (a newline between two), with
    ``None`` when no name holds a newline (the text then splits into them), else each name's
    ``(starts, ends)`` in bytes. No object per name."""
    if text.dtype != np.uint8 or text.ndim != 1 or lengths.dtype != np.int64 or lengths.ndim != 1:
        raise ValueError("names / name_bytes of the wrong dtype or shape")
    s, raw = len(lengths), text.tobytes()
    if not s or lengths.min() < 0 or lengths.max() > len(raw):
        raise ValueError("no names, or a name length out of bounds")
    ends = np.cumsum(lengths) + np.arange(s)  # (each name's end, exclusive; no overflow)
    if int(ends[-1]) != len(raw) or np.any(text[ends[:-1]] != ord("\n")):
        raise ValueError("name lengths do not tile the names with a newline between two")
    joined = raw.decode("utf-8", "surrogatepass")  # (UnicodeDecodeError is a ValueError)
    if raw.count(b"\n") == s - 1:  # each newline between two names: none inside one
        return joined, None
    return joined, ((ends - lengths).tolist(), ends.tolist())


def merged_names(path: str) -> list[str] | None:
    """The shard names of the local merged index at ``path``; None when it is missing or
    unreadable."""
    try:
        data = sidecar.read_regular(path, "merged index", _MAX_FILE)
        return None if data is None else _parse(data, path)[0]["names"]
    except (PrealignError, OSError):
        return None


_UNREAD = object()


def read_merged(source, schema) -> tuple[dict, dict[str, np.ndarray]] | None:
    """``(meta, arrays)`` of ``source``'s merged index, checked as a whole and against this loader's
    configuration, when there is one for exactly its shards (else None): read once, then handed to
    :func:`merged_index` and, when that falls back, :func:`merged_records` as ``found``."""
    return _read(source, schema)


def merged_index(source, schema, policy: BadDataPolicy, *, found=_UNREAD) -> SampleIndex | None:
    """The :class:`SampleIndex` of ``source`` straight from its merged index, at a cost per file,
    per data signature (its samples checked against ``schema`` as the sidecars' path checks them:
    :func:`~prealign.loaders.index.sample_checks.signature_verdicts`) and per bad record, not per
    shard or sample (the one :func:`~prealign.loaders.index.build.merge_records` makes from
    the same records: the bad-data policy applied to the recorded bad events in stream order); sets
    ``source.shard_check``. The policy and the fixed-dims rule are
    :func:`~prealign.loaders.index.apply_policy. apply_policy`'s, as on every path. None when there
    is no merged index for these shards. ``found``:
    :func:`read_merged`'s answer, when read already."""
    found = _read(source, schema) if found is _UNREAD else found
    if found is None:
        return None
    meta, a = found[0], _columns(found[1])
    shards = a["owner"]
    locations = np.empty((shards.size, 4), np.int64)
    locations[:, 0], locations[:, 1:] = shards, a["spans"]
    _install_checks(source, meta, a)  # (the samples loaded below are checked against it too)
    verdicts, errors = signature_verdicts(
        source, schema, meta["dims"], a["dim_ids"], locations, a["lengths"]
    )
    errors.update(
        value_errors(source, schema, a["bounds"], locations, a["dim_ids"], verdicts, errors)
    )
    if meta["events"]:
        first_record = np.concatenate([[0], np.cumsum(a["num_events"])])
        events = [(int(first_record[shard]) + pos, ev) for shard, pos, ev in meta["events"]]
        is_event = np.zeros(int(first_record[-1]), bool)
        is_event[[at for at, _ in events]] = True
        good_at = np.flatnonzero(~is_event)  # stream position of each row
    else:  # (every record a good sample: no count per shard needed)
        events, good_at = [], np.arange(shards.size)
    keep = np.ones(shards.size, bool)
    if errors:  # rows found bad under this schema: bad records at their places in the stream
        keep[list(errors)] = False
        events = sorted(
            [*events, *((int(good_at[row]), bad_row_event(err)) for row, err in errors.items())],
            key=lambda e: e[0],
        )
    records = Records(
        lengths=a["lengths"][keep],
        locations=locations[keep],
        shards=shards[keep],
        media=a["media"][keep],
        dim_ids=a["dim_ids"][keep],
        good_at=good_at[keep],
        events=events,
        signatures=[v or {} for v in verdicts],
    )
    index = apply_policy(records, policy, schema, where=source.where)
    sizes = LazyList(functools.partial(_sizes, source, a["sizes"]), len(a["sizes"]))
    return dataclasses.replace(index, source_shards={"names": meta["names"], "sizes": sizes})


def _columns(a: dict) -> dict:
    """``a`` with the per-shard columns ``sizes``, ``rows``, ``num_events``, ``first``, ``last``
    (int64 ``[S]``) and ``owner`` (the shard of each sample, int64 ``[N]``): as :func:`_parse` gives
    them, or from the ``shards`` table (``[S, 5]``) of the same index made from the sidecars."""
    if "owner" in a:
        return a
    table = a["shards"]
    columns = dict(zip(("sizes", "rows", "num_events", "first", "last"), table.T))
    owner = np.repeat(np.arange(len(table), dtype=np.int64), table[:, 1])
    return {**a, **columns, "owner": owner}


def _sizes(source, recorded: np.ndarray) -> list[int]:
    """Each shard's recorded size (``-1`` for a ``pipe:`` command's output: no size to check)."""
    sizes = recorded.tolist()
    schemes = getattr(source, "schemes", None)
    if "pipe" in (schemes if schemes is not None else map(remote.scheme, source.urls)):
        sizes = [-1 if remote.scheme(u) == "pipe" else n for u, n in zip(source.urls, sizes)]
    return sizes


def _regions(meta: dict, a: dict) -> dict:
    """``{shard: bad_regions(...)}`` of the shards with bad or skipped records (a cost per bad
    record)."""
    by_shard: dict[int, list] = {}
    for shard, pos, ev in meta["events"]:
        by_shard.setdefault(shard, []).append([pos, ev])
    if not by_shard:
        return {}
    starts, spans = np.concatenate([[0], np.cumsum(a["rows"])]), a["spans"]
    return {
        s: r
        for s, evs in by_shard.items()
        if (r := bad_regions(spans[starts[s] : starts[s + 1]], evs, int(a["num_events"][s])))
    }


def _install_checks(source, meta: dict, a: dict) -> None:
    """``source.shard_check``: each shard checked against the merged index at its first read."""
    source.shard_check = _checks(meta, a)


def _checks(meta: dict, a: dict) -> ShardChecks:
    checks = ShardChecks.of_arrays(
        a["sizes"], meta["probes"], a["first"], a["last"], meta["probe_versions"]
    )
    checks.regions = _regions(meta, a)
    return checks


def check_merged(source, shards=None) -> dict[str, str]:
    """What a loader would refuse of ``source``'s merged index, checked as a loader checks it
    (``prealign index --check``, so the two agree on staleness): the file itself (format, the shard
    names, the transform it was built for; under its path), then each of ``shards`` (default: all)
    as its first read checks it (size, first and last 64 KiB, the bytes around its bad records:
    :class:`ShardChecks`; under the shard's URL).
    ``{where: what differs}``, empty when it matches or there is no merged index for exactly these
    shards."""
    path = merged_path(source)
    try:
        found = _read(source, None)
    except StaleIndexError as exc:
        return {path: str(exc)}
    if found is None:
        return {}
    meta, a = found[0], _columns(found[1])
    checks = _checks(meta, a)
    problems = {}
    for shard in range(source.num_shards) if shards is None else shards:
        try:
            checks(source, shard)
        except IndexMismatchError as exc:
            problems[source.urls[shard]] = f"the merged index {path} does not match: {exc}"
    return problems


def _read(source, schema) -> tuple[dict, dict[str, np.ndarray]] | None:
    """``(meta, arrays)`` of ``source``'s merged index, checked, when there is one for exactly its
    shards."""
    if not getattr(source, "sidecars", False) or not getattr(source, "urls", None):
        return None
    if remote.scheme(source.urls[0]) == "pipe" and not getattr(source, "index_dir", None):
        return None  # a command's output has no folder: give index_dir
    path = merged_path(source)
    if remote.is_remote(path):
        data = remote.read_small(path, source.remote)
    else:
        data = sidecar.read_regular(remote.local_path(path), "merged index", _MAX_FILE)
    if data is None:
        return None
    meta, a = _parse(data, path)
    if not _same_names(meta, source, a.get("names")):
        return None  # an index of another selection of shards: the sidecars, one by one
    check_meta(
        source,
        source.urls[0],
        {**meta["common"], "shard": _first_name(meta)},
        sidecar.config_key(source, schema),
    )
    return meta, a


def _first_name(meta: dict) -> str:
    """The first shard name of a merged index (``meta``: :func:`_parse`'s), not splitting them."""
    joined = meta.get("names_text")
    if joined is None:
        return meta["names"][0]
    end = joined.find("\n")  # (not partition: that copies the rest, 100k names)
    return joined if end < 0 else joined[:end]


def _same_names(meta: dict, source, encoded: np.ndarray | None = None) -> bool:
    """The names of a merged index (``meta``: :func:`_parse`'s) are the :func:`shard_name` of each
    of the source's shards: for shards of one folder (``source.folder``), one join and one
    comparison in place of two texts (no name made per shard); for paths of one length
    (``source.url_rows()``), the columns past the folder compared with the names as stored
    (``encoded``: version 3's ``names``, uint8 ``[B]``)."""
    names, urls = meta["names"], source.urls
    if len(names) != len(urls):
        return False
    folder = getattr(source, "folder", None)
    joined = meta.get("names_text")
    rows = source.url_rows() if folder is not None and hasattr(source, "url_rows") else None
    if rows is not None and joined is not None and encoded is not None:
        return _same_columns(rows, len(folder), encoded)
    text = source.url_text() if hasattr(source, "url_text") else url_text(urls)
    if folder is not None and joined is not None:  # (no name with a newline: no list of names)
        body = joined.replace("\n", "\n" + folder)  # text is folder + body + "\n"
        return len(text) == len(folder) + len(body) + 1 and text.startswith(body, len(folder))
    if folder is not None:  # (a name with a newline or a "/" makes the texts differ)
        body = ("\n" + folder).join(names)  # text is folder + body + "\n" (no copy of text)
        return len(text) == len(folder) + len(body) + 1 and text.startswith(body, len(folder))
    return names == shard_names(urls, text)


def _same_columns(rows: np.ndarray, cut: int, encoded: np.ndarray) -> bool:
    """The columns past ``cut`` of ``rows`` (uint8 ``[S, width]``: a path and its newline a row)
    are ``encoded`` (the names, a newline between two: none inside one) and a newline: each row's
    name compared with its place in ``encoded`` as 8-byte words (the newlines then fall where the
    rows' do: ``encoded`` holds ``S - 1``), else the names' bytes copied out and compared."""
    count, width = rows.shape
    span = width - cut  # (a name and its newline)
    if encoded.size + 1 != count * span:
        return False
    if span - 1 < 8:
        return bool(np.array_equal(rows[:, cut:].reshape(-1)[:-1], encoded))
    ours = word_columns(rows.reshape(-1), count, width, cut, width - 1)
    stored = word_columns(encoded, count, span, 0, span - 1)
    return all(bool(np.array_equal(a, b)) for a, b in zip(ours, stored))


def merged_records(source, schema, *, found=_UNREAD) -> dict[int, dict] | None:
    """The sidecar records (:func:`~prealign.loaders.index.sidecar.sidecar_records`) of every shard
    of ``source`` from its merged index, each with its ``"check"``; None when there is no merged
    index, it names other shards, or the source reads no sidecars. Checked as a whole (vectorised: a
    cost per file, not per shard), and against this loader's configuration
    (:class:`StaleIndexError`). ``found``: :func:`read_merged`'s
    answer, when read already."""
    found = _read(source, schema) if found is _UNREAD else found
    if found is None:
        return None
    meta, a = found[0], _columns(found[1])
    bounds = np.concatenate([[0], np.cumsum(a["rows"])]).tolist()
    by_shard: dict[int, list] = {}
    for shard, pos, ev in meta["events"]:
        by_shard.setdefault(shard, []).append([pos, ev])
    regions = _regions(meta, a)
    out = {}
    columns = [a[k].tolist() for k in ("sizes", "num_events", "first", "last")]
    columns.append(np.broadcast_to(meta["probe_versions"], len(columns[0])).tolist())
    for s, (size, num_events, first, last, version) in enumerate(zip(*columns)):
        lo, hi = bounds[s], bounds[s + 1]
        arrays = {k: a[k][lo:hi] for k in ("spans", "lengths", "media", "dim_ids", "bounds")}
        record = sidecar.record_of(
            {
                "shard": meta["names"][s],
                "num_events": num_events,
                "dims": meta["dims"],
                "events": by_shard.get(s, []),
            },
            arrays,
            s,
        )
        out[s] = {
            **record,
            "check": (size, meta["probes"][s].decode(), first, last, version),
            "regions": regions.get(s, []),
        }
    return out


def _all_str(items: list) -> bool:
    """Every one of ``items`` a ``str`` (a join in C refuses anything else)."""
    try:
        "".join(items)
    except TypeError:
        return False
    return True


def _probes_ok(probes: list) -> bool:
    """Each of ``probes`` an ASCII string of at most 16 characters, as an ``S16`` array holds it
    (three C calls)."""
    try:
        text = "".join(probes)
    except TypeError:
        return False
    if not text.isascii():
        return False
    return max(map(len, probes), default=0) <= 16  # (so 16 a probe when they add up to 16n)


def _probe_array(probes: list[str]) -> np.ndarray:
    """``probes`` (:func:`_probes_ok`) as ``S16 [S]``: one buffer when all are 16 characters."""
    text = "".join(probes).encode()
    if len(text) == 16 * len(probes):
        return np.frombuffer(text, "S16")
    return np.asarray(probes, "S16")


def _parse(data: bytes, path: str) -> tuple[dict, dict[str, np.ndarray]]:
    """``(meta, arrays)`` of a merged index, every key, dtype, shape and bound checked (never
    unpickled)."""

    def bad(what: str) -> StaleIndexError:
        return StaleIndexError(
            path, f"merged index unreadable: {what}", "re-run `prealign index --merge`"
        )

    try:
        a = read_npz(
            data, max_bytes=_INFLATE * len(data) + (1 << 20), member=path, copy=False, names=_KEYS
        )
        meta = json.loads(a["meta"].tobytes().decode()) if a.get("meta") is not None else None
    except StaleIndexError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure to parse a crafted file is a typed error
        raise bad(f"{type(exc).__name__}: {exc}") from None
    if not (isinstance(meta, dict) and meta.get("format") == FORMAT and _SAMPLES <= set(a)):
        raise bad("not a prealign merged index")
    version = meta.get("version")
    if version not in _READS:
        raise bad(f"format version {version!r}, this prealign reads versions {list(_READS)}")
    members = {2: _KEYS_V2, 3: _KEYS_V3, 4: _KEYS_V4, 5: _KEYS_V4}[version]
    optional = {4: {"name_bytes"}, 5: {"name_bytes", "probe_versions"}}.get(version, set())
    if not members <= set(a) <= members | optional:
        raise bad(f"members {sorted(set(a))}, version {version} has {sorted(members)}")
    if version >= 4:  # (the per-shard columns first: their length is the shard count)
        for key, dtypes in (("sizes", (np.int64,)), ("rows", (np.int32, np.int64))):
            if a[key].dtype not in dtypes or a[key].ndim != 1:
                raise bad(
                    f"{key} of dtype {a[key].dtype} shape {a[key].shape}, expected 1-D "
                    f"{' or '.join(np.dtype(d).name for d in dtypes)}"
                )
    if version == 2:  # names and probes as JSON lists
        names, probes = meta.get("names"), meta.get("probes")
        if not (
            isinstance(names, list)
            and names
            and _all_str(names)  # (C loops: 100k names)
            and isinstance(probes, list)
            and len(probes) == len(names)
            and _probes_ok(probes)
        ):
            raise bad("meta names / probes malformed")
        probes = _probe_array(probes)
        meta["names_text"] = None
    else:
        names, meta["names_text"] = _stored_names(a, version, bad)
        count, probes = len(names), a["probes"]
        if probes.dtype != np.uint8 or probes.shape != (count, 16) or probes.max(initial=0) >= 128:
            raise bad(
                f"probes of dtype {probes.dtype} shape {probes.shape}, expected ASCII "
                f"uint8 {(count, 16)}"
            )
        probes = np.ascontiguousarray(probes).view("S16")[:, 0]
    meta["names"], meta["probes"] = names, probes
    meta["probe_versions"] = _probe_versions(a, version, len(names), bad)
    dims, events = meta.get("dims"), meta.get("events")
    common = meta.get("common")
    config = common.get("config") if isinstance(common, dict) else None
    if not (isinstance(config, str) and isinstance(events, list)):
        raise bad("meta common / events malformed")
    if not sidecar.dims_ok(dims):
        raise bad("meta dims is not a list of {name: size} dicts")
    s = len(names)
    n = a["lengths"].shape[0] if a["lengths"].ndim == 1 else -1
    want = {
        "spans": (np.int64, (n, 3)),
        "lengths": (np.int64, (n,)),
        "media": (np.bool_, (n,)),
        "dim_ids": (np.int64, (n,)),
        "bounds": (np.int64, (n, 3, 4)),
    }
    if version >= 4:
        want.update(sizes=(np.int64, (s,)), rows=(a["rows"].dtype, (s,)))
    else:
        want["shards"] = (np.int64, (s, 5))
    for key, (dtype, shape) in want.items():
        if a[key].dtype != dtype or a[key].shape != shape:
            raise bad(
                f"{key} of dtype {a[key].dtype} shape {a[key].shape}, expected {np.dtype(dtype)} "
                f"{shape}"
            )
    if version >= 4:  # (a shard's records: its samples and its events, counted below)
        sizes, rows, num_events = a["sizes"], a["rows"].astype(np.int64), None
    else:
        table = a["shards"]
        sizes, rows, num_events = table[:, 0], table[:, 1], table[:, 2]
    if np.any(sizes < -1):
        raise bad(f"shard sizes: {int(sizes.min())} (a size is -1 or more)")
    if (
        rows.min() < 0
        or int(rows.sum()) != n
        or (num_events is not None and (np.any(num_events < rows) or np.any(table[:, 3:] < -1)))
    ):
        raise bad("per-shard rows / events inconsistent with the samples")
    spans, owner = a["spans"], np.repeat(np.arange(s), rows)
    if n and (
        spans[:, 0].min() < 0
        or np.any(spans[:, 1] <= spans[:, 0])
        or np.any(spans[:, 1] > sizes[owner])
        or a["lengths"].min() < 0
        or a["dim_ids"].min() < 0
        or a["dim_ids"].max() >= len(dims)
    ):
        raise bad("byte ranges, lengths or dim ids out of bounds")
    parsed = []
    for e in events:  # (checked one by one: few, bad records only; each a BadRecord from here on)
        try:
            if not (
                isinstance(e, list)
                and len(e) == 3
                and all(isinstance(x, int) and not isinstance(x, bool) for x in e[:2])
                and 0 <= e[0] < s
                and 0 <= e[1]
            ):
                raise ValueError
            parsed.append([e[0], e[1], parse_event(e[2])])
        except ValueError:
            raise bad(f"malformed event {str(e)[:80]}") from None
    meta["events"] = events = parsed
    at = [(e[0], e[1]) for e in events]
    counts = np.bincount(np.asarray([e[0] for e in events], np.int64), minlength=s)
    if num_events is None:  # (version 4: a shard's records are its samples and its events)
        num_events = rows + counts
    past = [e for e in at if e[1] >= num_events[e[0]]]
    if past:
        raise bad(f"malformed event {list(past[0])} (past its shard's records)")
    if (version < 4 and np.any(rows + counts != num_events)) or any(
        b <= a for a, b in zip(at, at[1:])
    ):
        raise bad("per-shard event counts do not add up, or events out of order or given twice")
    first, last = check_tiling(spans, owner, num_events, at, bad, rows=rows)
    if version < 4 and (np.any(table[:, 3] != first) or np.any(table[:, 4] != last)):
        sh = int(np.argmax((table[:, 3] != first) | (table[:, 4] != last)))
        raise bad(
            f"shard {sh}: first / last byte {table[sh, 3:].tolist()}, its samples give "
            f"{[first[sh], last[sh]]}"
        )
    a.update(sizes=sizes, rows=rows, num_events=num_events, first=first, last=last, owner=owner)
    return meta, a


def _probe_versions(a: dict, version: int, count: int, bad) -> np.ndarray | int:
    """The definition of each probe of a merged index of ``version``
    (:data:`~prealign.loaders.index.sidecar.PROBE_VERSION`): version 5's ``probe_versions`` (uint8
    ``[S]``, each 1 or 2) when it has one, else one for all (5: 2; up to 4: 1)."""
    if version < 5:
        return 1
    found = a.get("probe_versions")
    if found is None:
        return 2
    if found.dtype != np.uint8 or found.shape != (count,) or not np.isin(found, (1, 2)).all():
        raise bad(
            f"probe_versions of dtype {found.dtype} shape {found.shape}, expected uint8 "
            f"{(count,)} of 1 and 2"
        )
    return found


def _stored_names(a: dict, version: int, bad) -> tuple[LazyList, str | None]:
    """The names of a version 3, 4 or 5 file (``names`` uint8 ``[B]``, with ``name_bytes``; from
    version 4 left out when no name holds a newline, and stored as int32), checked, and the names
    as one text when it splits into them (else None). No object per name."""
    text, lengths = a["names"], a.get("name_bytes")
    try:
        if lengths is None:  # version 4: one name between two newlines
            joined = _split_names(text, a["sizes"].shape[0])
            return LazyList(functools.partial(str.split, joined, "\n"), len(a["sizes"])), joined
        if version >= 4:
            if lengths.dtype != np.int32:
                raise ValueError(f"name_bytes of dtype {lengths.dtype}, expected int32")
            lengths = lengths.astype(np.int64)
        joined, starts_ends = _names_text(text, lengths)
    except ValueError as exc:
        raise bad(f"names: {exc}") from None
    # (a list of them made only when a name is asked for)
    names = LazyList(functools.partial(decode_names, text, lengths), len(lengths))
    return names, joined if starts_ends is None else None


def _split_names(text: np.ndarray, count: int) -> str:
    """Version 4's names text without ``name_bytes``: ``count`` names with a newline between two
    (so none holds one), as one str; ``ValueError`` when it is not such a UTF-8 text."""
    if text.dtype != np.uint8 or text.ndim != 1:
        raise ValueError("names of the wrong dtype or shape")
    found = byte_counts(text, (ord("\n"),))[0] + 1
    if not count or found != count:
        raise ValueError(f"{found} names for {count} shards")
    return text.tobytes().decode("utf-8", "surrogatepass")  # (UnicodeDecodeError: a ValueError)
