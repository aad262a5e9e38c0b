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
``meta``     uint8         UTF-8 JSON: ``format``, ``version`` (3), ``common`` (the sidecar meta
             ``[B]``       every shard shares: ``config``, ...), ``dims`` (distinct named-dim
                           dicts), ``events`` (``[shard, position, event]`` of each skip / bad
                           record)
``names``    uint8         the shard file names as one UTF-8 text (lone surrogates kept:
             ``[B]``       ``surrogatepass``), a newline between two (:func:`encode_names`)
``name_by``  int64         each name's length in bytes: what tells a newline inside a name from
``tes``      ``[S]``       one between two
``probes``   uint8         each shard's probe digest (ASCII hex, NUL-padded: ``S16``)
             ``[S,16]``
``shards``   int64         ``size, rows, num_events, first, last`` of each shard (``first`` /
             ``[S,5]``     ``last``: see :func:`~prealign.loaders.index.sidecar.expected_of`)
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

The records it gives are those the sidecars give, so the index is the same either way; each shard is
still checked against it when first read (:class:`~prealign.loaders.index.sidecar.ShardChecks`).
Anything malformed is a :class:`~prealign.loaders.errors.StaleIndexError` naming the file.

Version 3 stores the names and probes as arrays (read in a few C calls; compared with the source's
paths as one text); version 2 (the same, with ``names`` and ``probes`` as JSON lists in ``meta``) is
still read; version 1 is refused with the command that rewrites it.
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
    shard_name,
    shard_names,
    url_text,
    write_atomically,
)
from prealign.schemas.errors import PrealignError

FORMAT = "prealign-merged-index"
VERSION = 3
NAME = "prealign-index.merged.npz"
_READS = (2, 3)
_PER_SHARD = frozenset({"shard", "size", "hash", "probe", "dims", "events", "num_events"})
_KEYS_V2 = frozenset({"meta", "shards", "spans", "lengths", "media", "dim_ids", "bounds"})
_KEYS = _KEYS_V2 | {"names", "name_bytes", "probes"}
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


def merge_sidecars(source, path: str | None = None) -> dict:
    """Write the sidecars of every shard of ``source`` as one merged index at ``path`` (default
    :func:`merged_path`), atomically. Every shard needs its sidecar (else :class:`StaleIndexError`:
    run ``prealign index`` first), and all of them the same configuration. Returns ``{"path",
    "shards", "samples"}``."""
    path = path or merged_path(source)
    names, probes, table, events, dims = [], [], [], [], []
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
        size, probe, first, last = sidecar.expected_of(meta, arrays["spans"])
        names.append(meta["shard"])
        probes.append(probe)
        table.append((size, len(arrays["lengths"]), meta["num_events"], first, last))
        events.extend([shard, pos, ev.to_json()] for pos, ev in meta["events"])
        for key in ("spans", "lengths", "media", "bounds"):
            parts[key].append(arrays[key])
        parts["dim_ids"].append(ids[arrays["dim_ids"]] if len(ids) else arrays["dim_ids"])
    meta = {"format": FORMAT, "version": VERSION, "common": common, "dims": dims, "events": events}
    buf = io.BytesIO()
    np.savez(
        buf,
        meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8),
        **encode_names(names),
        probes=np.frombuffer(_probe_array(probes).tobytes(), np.uint8).reshape(-1, 16),
        shards=np.asarray(table, np.int64).reshape(-1, 5),
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
    meta, a = found
    table = a["shards"]
    shards = np.repeat(np.arange(len(table), dtype=np.int64), table[:, 1])
    locations = np.empty((shards.size, 4), np.int64)
    locations[:, 0], locations[:, 1:] = shards, a["spans"]
    _install_checks(source, meta, a, table)  # (the samples loaded below are checked against it too)
    verdicts, errors = signature_verdicts(
        source, schema, meta["dims"], a["dim_ids"], locations, a["lengths"]
    )
    errors.update(
        value_errors(source, schema, a["bounds"], locations, a["dim_ids"], verdicts, errors)
    )
    first_record = np.concatenate([[0], np.cumsum(table[:, 2])])
    events = [(int(first_record[shard]) + pos, ev) for shard, pos, ev in meta["events"]]
    is_event = np.zeros(int(first_record[-1]), bool)
    is_event[[at for at, _ in events]] = True
    good_at = np.flatnonzero(~is_event)  # stream position of each row
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
    sizes = LazyList(functools.partial(_sizes, source, table), len(table))
    return dataclasses.replace(index, source_shards={"names": meta["names"], "sizes": sizes})


def _sizes(source, table: np.ndarray) -> list[int]:
    """Each shard's recorded size (``-1`` for a ``pipe:`` command's output: no size to check)."""
    sizes = table[:, 0].tolist()
    if not getattr(source, "local_only", False) and any(
        u[:5].lower() == "pipe:" for u in source.urls
    ):
        sizes = [-1 if remote.scheme(u) == "pipe" else n for u, n in zip(source.urls, sizes)]
    return sizes


def _regions(meta: dict, spans: np.ndarray, table: np.ndarray) -> dict:
    """``{shard: bad_regions(...)}`` of the shards with bad or skipped records (a cost per bad
    record)."""
    by_shard: dict[int, list] = {}
    for shard, pos, ev in meta["events"]:
        by_shard.setdefault(shard, []).append([pos, ev])
    if not by_shard:
        return {}
    starts = np.concatenate([[0], np.cumsum(table[:, 1])])
    return {
        s: r
        for s, evs in by_shard.items()
        if (r := bad_regions(spans[starts[s] : starts[s + 1]], evs, int(table[s, 2])))
    }


def _install_checks(source, meta: dict, a: dict, table: np.ndarray) -> None:
    """``source.shard_check``: each shard checked against the merged index at its first read."""
    source.shard_check = _checks(meta, a, table)


def _checks(meta: dict, a: dict, table: np.ndarray) -> ShardChecks:
    checks = ShardChecks.of_arrays(table[:, 0], meta["probes"], table[:, 3], table[:, 4])
    checks.regions = _regions(meta, a["spans"], table)
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
    meta, a = found
    checks = _checks(meta, a, a["shards"])
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
    return meta["names"][0] if joined is None else joined.partition("\n")[0]


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
        names_and_newlines = rows[:, len(folder) :].reshape(-1)  # (a copy: the names' bytes)
        return bool(np.array_equal(names_and_newlines[:-1], encoded))
    text = source.url_text() if hasattr(source, "url_text") else url_text(urls)
    if folder is not None and joined is not None:  # (no name with a newline: no list of names)
        body = joined.replace("\n", "\n" + folder)  # text is folder + body + "\n"
        return len(text) == len(folder) + len(body) + 1 and text.startswith(body, len(folder))
    if folder is not None:  # (a name with a newline or a "/" makes the texts differ)
        body = ("\n" + folder).join(names)  # text is folder + body + "\n" (no copy of text)
        return len(text) == len(folder) + len(body) + 1 and text.startswith(body, len(folder))
    return names == shard_names(urls, text)


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
    meta, a = found
    table = a["shards"]
    bounds = np.concatenate([[0], np.cumsum(table[:, 1])]).tolist()
    by_shard: dict[int, list] = {}
    for shard, pos, ev in meta["events"]:
        by_shard.setdefault(shard, []).append([pos, ev])
    regions = _regions(meta, a["spans"], table)
    out = {}
    for s, (size, _, num_events, first, last) in enumerate(table.tolist()):
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
            "check": (size, meta["probes"][s].decode(), first, last),
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
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or not _KEYS_V2 <= set(a):
        raise bad("not a prealign merged index")
    version = meta.get("version")
    if version not in _READS:
        raise bad(f"format version {version!r}, this prealign reads versions {list(_READS)}")
    if set(a) != (_KEYS_V2 if version == 2 else _KEYS):
        raise bad(f"members {sorted(set(a))}, version {version} has {sorted(_KEYS)}")
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
        try:
            joined, starts_ends = _names_text(a["names"], a["name_bytes"])
        except ValueError as exc:
            raise bad(f"names: {exc}") from None
        count = len(a["name_bytes"])  # (a list of them made only when a name is asked for)
        names = LazyList(functools.partial(decode_names, a["names"], a["name_bytes"]), count)
        meta["names_text"] = joined if starts_ends is None else None
        probes = a["probes"]
        if probes.dtype != np.uint8 or probes.shape != (count, 16) or probes.max(initial=0) >= 128:
            raise bad(
                f"probes of dtype {probes.dtype} shape {probes.shape}, expected ASCII "
                f"uint8 {(count, 16)}"
            )
        probes = np.ascontiguousarray(probes).view("S16")[:, 0]
    meta["names"], meta["probes"] = names, probes
    dims, events = meta.get("dims"), meta.get("events")
    if not (isinstance(meta.get("common"), dict) and isinstance(events, list)):
        raise bad("meta common / events malformed")
    if not sidecar.dims_ok(dims):
        raise bad("meta dims is not a list of {name: size} dicts")
    s, table = len(names), a["shards"]
    n = a["lengths"].shape[0] if a["lengths"].ndim == 1 else -1
    want = {
        "shards": (np.int64, (s, 5)),
        "spans": (np.int64, (n, 3)),
        "lengths": (np.int64, (n,)),
        "media": (np.bool_, (n,)),
        "dim_ids": (np.int64, (n,)),
        "bounds": (np.int64, (n, 3, 4)),
    }
    for key, (dtype, shape) in want.items():
        if a[key].dtype != dtype or a[key].shape != shape:
            raise bad(
                f"{key} of dtype {a[key].dtype} shape {a[key].shape}, expected {np.dtype(dtype)} "
                f"{shape}"
            )
    sizes, rows, num_events = table[:, 0], table[:, 1], table[:, 2]
    if np.any(sizes < -1):
        raise bad(f"shard sizes: {int(sizes.min())} (a size is -1 or more)")
    if (
        rows.min() < 0
        or int(rows.sum()) != n
        or np.any(num_events < rows)
        or np.any(table[:, 3:] < -1)
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
                and 0 <= e[1] < num_events[e[0]]
            ):
                raise ValueError
            parsed.append([e[0], e[1], parse_event(e[2])])
        except ValueError:
            raise bad(f"malformed event {str(e)[:80]}") from None
    meta["events"] = events = parsed
    at = [(e[0], e[1]) for e in events]
    if np.any(rows + np.bincount([e[0] for e in events], minlength=s) != num_events) or any(
        b <= a for a, b in zip(at, at[1:])
    ):
        raise bad("per-shard event counts do not add up, or events out of order or given twice")
    first, last = check_tiling(spans, owner, num_events, at, bad)
    if np.any(table[:, 3] != first) or np.any(table[:, 4] != last):
        sh = int(np.argmax((table[:, 3] != first) | (table[:, 4] != last)))
        raise bad(
            f"shard {sh}: first / last byte {table[sh, 3:].tolist()}, its samples give "
            f"{[first[sh], last[sh]]}"
        )
    return meta, a
