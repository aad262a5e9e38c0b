"""The header pass: a shard's index record from member headers, not decoded samples.

    tar members ─group by key─► length rule ─► (length, media, signature) per sample
                                  │ .npy token arrays: the header's shape  (numpy_fields)
                                  │ chat + images: image headers -> Qwen2-VL grid
                                  │   -> tokens per image -> render_chat (tokenizer only)
                                  │   (VLMSampleTransform)
                                  ▼
    first sample of each data signature: the full transform too (its length must equal the
    rule's, else :class:`LengthRuleError`); the signature is kept, and a loader checks one
    sample of it against its schema

What the header pass checks on every sample: the tar structure (header checksums, end marker),
member names, duplicate and required members, every ``.npy`` header (numeric dtype, token rows equal
to ``input_ids``' length), the chat JSON (renders with the tokenizer; placeholders match the
images), every image header (an allowed format, a size, an aspect ratio the processor takes; by
default the pixels are decoded too, without the processor's resize and normalisation) and the
teacher top-k shapes (``[L, K]``). No schema is involved: a sidecar serves any schema. What it
leaves to the loader: the schema's shapes, dtypes and optional fields (the samples of each data
signature tried until one passes, when the sidecar is read), array values (ids within the
vocabulary, finite and sorted log-probs, ...: when each sample is loaded, under the bad-data
policy), and, with ``VLMRule(verify_images=False)``, pixel data past the header. A sample found bad
only then raises when it is loaded (the default policy); see :mod:`prealign.loaders.index.sidecar`
for the checksum that catches changed bytes.

Any other transform has no length rule: its shards get the transform on every sample
(:func:`transform_pass`), and a sidecar still saves it the next time.
"""

from __future__ import annotations

import copy
import io
import itertools
import json
import math
import os
import stat
from typing import Callable

import numpy as np

from prealign.loaders.errors import (
    BadSampleError,
    CorruptShardError,
    MissingMemberError,
    MissingShardError,
    NotRegularFileError,
    StaleIndexError,
)
from prealign.loaders.handoff.identity import identity_digest
from prealign.loaders.index.bulk_pass import bulk_text_pass
from prealign.loaders.index.sample_checks import BOUNDED, has_media, value_bounds
from prealign.loaders.index.sidecar import (
    Fingerprint,
    indexed_transform,
    parse_sidecar,
    per_shard,
    probe_version,
    read_sidecar_bytes,
    regular_stat,
    shard_probe,
    shard_size,
    shard_sizes,
    transform_fields,
    write_sidecar,
)
from prealign.loaders.policy import BadRecord
from prealign.loaders.sources import remote
from prealign.loaders.sources.header_lengths import (
    IMAGE_FORMATS,
    HeaderError,
    image_header_size,
    npy_header,
)
from prealign.loaders.sources.npy import NpyFormatError, parse_npy_header
from prealign.loaders.sources.shard_files import (
    check_index_dir_names,
    sample_checksum,
    shard_name,
    sidecar_path,
)
from prealign.loaders.sources.tar_decode import IMAGES, decode_member, split_member_name
from prealign.loaders.sources.tar_index import Unhandled
from prealign.loaders.sources.tar_reader import TarFormatError, iter_members
from prealign.loaders.sources.webdataset import check_members, numpy_arrays, numpy_fields
from prealign.schemas.errors import ConfigError, PrealignError, SampleError
from prealign.schemas.schema import BatchSchema


class LengthRuleError(ConfigError):
    """The header rule's length differs from the transform's for a sample: the transform is not the
    one the rule describes (index with the full pass instead)."""


def _npy_headers(members: dict[str, bytes], where: str) -> dict[str, tuple]:
    return {
        ext[:-4]: npy_header(data, field=ext, sample=where)
        for ext, data in members.items()
        if ext.endswith(".npy")
    }


MEDIA_MEMBERS = ("pixel_values", "image_grid_thw")
"""``.npy`` members that carry media (a sample with a row of one is never truncated)."""


def shape_pattern(shape: tuple, n: int) -> str:
    """A shape as a data signature keeps it: the leading dim written ``L`` when it is the token
    count ``n`` and no other dim is, so ``(6, 4)`` of a 6-token sample is ``"Lx4"`` and samples of
    any length share their signature; any other shape literally (``(4, 4)`` of a 4-token sample is
    ``"4x4"``, never ``"LxL"``, which would stand for ``(60, 60)`` too), so two distinct shapes
    never share a pattern.

    >>> shape_pattern((6, 4), 6), shape_pattern((4, 4), 4)
    ('Lx4', '4x4')
    >>> shape_pattern((3, 6), 6), shape_pattern((6,), 6)
    ('3x6', 'L')
    """
    literal = "x".join(map(str, shape))
    if not shape or shape[0] != n or n in shape[1:]:
        return literal
    return "x".join(("L", *map(str, shape[1:])))


class TextRule:
    """``numpy_fields`` samples: the length is ``input_ids.npy``'s first dim (``input_ids`` must be
    ``[L]``). Signature, of the data alone (no schema): each array's dtype and shape pattern
    (:func:`shape_pattern`) and the other member names; a schema's token dims, dtypes and optional
    fields are checked on a sample of each signature when a loader reads the sidecar."""

    def __init__(self, schema: BatchSchema | None = None):
        del schema  # (a sidecar describes the data: the schema is checked when it is read)

    def __call__(self, members: dict[str, bytes], where: str) -> tuple[int, bool, tuple, None]:
        if len(members) == 1 and "input_ids.npy" in members:  # the common pre-tokenized sample
            shape, dtype = npy_header(members["input_ids.npy"], field="input_ids.npy", sample=where)
            if len(shape) == 1:
                return shape[0], False, ((("input_ids", dtype.str, "L"),), ()), None
        heads = _npy_headers(members, where)
        if "input_ids" not in heads or len(heads["input_ids"][0]) != 1:
            raise BadSampleError(
                sample=where,
                field="input_ids",
                expected="an input_ids.npy member of shape [L]",
                actual=f"shape {list(heads['input_ids'][0])}"
                if "input_ids" in heads
                else f"members {sorted(members)}",
            )
        n = heads["input_ids"][0][0]
        sig = tuple(
            (name, dtype.str, shape_pattern(shape, n))
            for name, (shape, dtype) in sorted(heads.items())
        )
        media = any(not heads[k][0] or heads[k][0][0] > 0 for k in MEDIA_MEMBERS if k in heads)
        return n, media, (sig, tuple(sorted(e for e in members if not e.endswith(".npy")))), None


class VLMRule:
    """:class:`~prealign.loaders.media.vlm.VLMSampleTransform` samples: image headers -> Qwen2-VL
    grids -> tokens per image -> the chat rendered by the tokenizer alone (or a pre-tokenized
    ``input_ids.npy`` header)."""

    def __init__(self, transform, schema: BatchSchema, *, verify_images: bool = True):

        self.t, self.verify_images = transform, verify_images
        """``verify_images``: decode each image's pixels too (no resize, no processor), so a corrupt
        image body is found here as the full pass finds it; False: headers only (found when
        loaded)."""
        # (the processor and the config agree: checked before the first shard)
        transform.spatial_merge_size

    def __call__(self, members: dict[str, bytes], where: str) -> tuple[int, bool, tuple, object]:
        from prealign.loaders.media.teacher_topk import IDS, LOG_PROBS
        from prealign.loaders.media.vlm import sample_metadata

        key = where
        raw = {"__key__": key, **{e: d for e, d in members.items() if not e.endswith(".npy")}}
        raw.update({e[:-4]: None for e in members if e.endswith(".npy")})  # presence only
        meta = sample_metadata(raw, self.t.text_key, key)
        ids, media = self._render(raw, meta, key, pretokenized="input_ids.npy" in members)
        heads = _npy_headers(members, where)
        if "input_ids" in heads:  # the rendered ids: a pre-tokenized sample's are its member's
            shape = heads["input_ids"][0]
            n = 1
            for d in shape:
                n *= d
        else:
            n = int(ids.shape[0])
        sig = [media, "input_ids" in heads]
        if self.t.topk is not None:
            for name in (LOG_PROBS, IDS):
                if name not in heads:
                    raise BadSampleError(
                        sample=key,
                        field=name,
                        expected=f"a member {name}.npy",
                        actual=f"members {sorted(members)}",
                    )
                shape, dtype = heads[name]
                if len(shape) != 2 or shape[0] != n or shape[1] != self.t.topk:
                    raise BadSampleError(
                        sample=key,
                        field=name,
                        expected=f"shape [L={n}, K={self.t.topk}]",
                        actual=f"shape {list(shape)}",
                        hint="one row per token, constant K",
                    )
                sig.append((name, dtype.str))
        return n, media, tuple(sig), None if "input_ids" in heads else ids

    def _render(
        self, raw: dict, meta: dict, key, *, pretokenized: bool
    ) -> tuple[np.ndarray | None, bool]:
        """(the chat's ids, or None for a pre-tokenized sample; whether it has media): image headers
        -> Qwen2-VL grids -> tokens per image, the videos' ids, the chat rendered by the tokenizer
        alone."""
        from prealign.loaders.media.vlm import image_members, render_chat

        tokens = []
        for name, data in image_members(raw, meta, key):
            w, h = self._size(name, data, key)
            tokens.append(self.t.header_image_tokens(w, h, sample=key, field=name))
        videos = self.t.header_video_ids(
            raw, meta, key, lambda name, data: self._size(name, data, key)
        )
        ids = (
            None
            if pretokenized
            else render_chat(
                meta,
                self.t.tokenizer,
                tokens,
                sample=key,
                videos=videos,
                system=self.t.system_prompt,
                frame=getattr(self.t, "frame", None),
            )[0]
        )
        return ids, bool(tokens or videos)

    def _size(self, name: str, data, key) -> tuple[int, int]:
        """``(width, height)`` of an image or video frame member, from its header (decoded too with
        ``verify_images``); an unreadable one is a ``corrupt_image``."""
        from prealign.loaders.media.vlm import MediaError, MediaProblem

        try:
            return (
                _verified_size(data, name, key)
                if self.verify_images
                else image_header_size(data, field=name, sample=key)
            )
        except HeaderError as exc:
            raise MediaError.from_check(
                MediaProblem.CORRUPT_IMAGE, exc, sample=key, field=name
            ) from None


class OwnTransformRule(VLMRule):
    """A family's own transform (Gemma 3, LLaVA-OneVision, the
    :class:`~prealign.loaders.media.sized_images.SizedImagesTransform` families): read and checked
    as :class:`VLMRule` reads a sample, its ids from the subclass's ``_render``; no Qwen merge size
    to check at the start."""

    def __init__(self, transform, schema: BatchSchema, *, verify_images: bool = True):
        self.t, self.verify_images = transform, verify_images


class ImageTokensRule(OwnTransformRule):
    """:class:`~prealign.loaders.media.gemma3.Gemma3SampleTransform` samples: a fixed block per
    image, so the length is the chat's with the images counted (each image's header read, and its
    pixels with ``verify_images``, so a corrupt one is found as in the full pass)."""

    def _render(
        self, raw: dict, meta: dict, key, *, pretokenized: bool
    ) -> tuple[np.ndarray | None, bool]:
        from prealign.loaders.media.chat_tokenizer import encode_segments
        from prealign.loaders.media.vlm import image_members

        images = image_members(raw, meta, key)
        for name, data in images:
            self._size(name, data, key)
        ids = (
            None
            if pretokenized
            else encode_segments(self.t.tokenizer, self.t.segments(meta, len(images), sample=key))[
                0
            ]
        )
        return ids, bool(images)


class AnyResRule(OwnTransformRule):
    """:class:`~prealign.loaders.media.llava_onevision.LlavaOnevisionSampleTransform` samples: each
    image's header size and the number of images give its AnyRes token count, each video's frame
    count its tokens, then the chat (image pixels verified with ``verify_images``, as in the full
    pass)."""

    def _render(
        self, raw: dict, meta: dict, key, *, pretokenized: bool
    ) -> tuple[np.ndarray | None, bool]:
        from prealign.loaders.media.vlm import image_members

        sizes = [self._size(name, data, key)[::-1] for name, data in image_members(raw, meta, key)]
        return self.t.header_ids(raw, sizes)[0], bool(sizes or self.t.video_frames(raw, meta, key))


class ImageSizesRule(OwnTransformRule):
    """Transforms whose lengths follow from the text and each image's size
    (:class:`~prealign.loaders.media. mistral3.Mistral3SampleTransform`,
    :class:`~prealign.loaders.media.idefics3.Idefics3SampleTransform`,
    :class:`~prealign.loaders.media.gemma4.Gemma4SampleTransform`): ``header_ids(raw, size_of)``
    with each image's header size (and its pixels decoded with ``verify_images``)."""

    def _render(
        self, raw: dict, meta: dict, key, *, pretokenized: bool
    ) -> tuple[np.ndarray | None, bool]:
        from prealign.loaders.media.vlm import image_members

        images = image_members(raw, meta, key)
        sizes = {name: self._size(name, data, key) for name, data in images}
        ids = None if pretokenized else self.t.header_ids(raw, lambda name, _: sizes[name])[0]
        return ids, bool(images)


def _as_bad_sample(exc: SampleError, where: str) -> BadSampleError:
    """``exc`` as the :class:`BadSampleError` a record of sample ``where`` keeps: itself when it is
    one, else its field, expected and actual naming ``where``."""
    if isinstance(exc, BadSampleError):
        return exc
    return BadSampleError(sample=where, field=exc.field, expected=exc.expected, actual=exc.actual)


def _verified_size(data: bytes, name: str, key) -> tuple[int, int]:
    """``(width, height)`` of an image whose pixel data decodes to the end (one open: the header,
    then the whole entropy-coded stream; a JPEG's inverse DCT at 1/8 scale, which finds the same
    truncation and corruption at a fraction of the cost). Formats limited to
    :data:`IMAGE_FORMATS`."""
    import warnings

    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data), formats=list(IMAGE_FORMATS)) as img:
                size = int(img.size[0]), int(img.size[1])
                if img.format == "JPEG":
                    img.draft(img.mode, (max(1, size[0] // 8), max(1, size[1] // 8)))
                img.load()
                return size
    except (
        UnidentifiedImageError,
        Image.DecompressionBombError,
        OSError,
        ValueError,
        SyntaxError,
    ) as exc:
        raise HeaderError(
            sample=key,
            field=name,
            expected="a decodable image",
            actual=f"{len(data)} bytes ({type(exc).__name__}: {exc})",
        ) from None


def signature_record(sig) -> dict[str, str]:
    """A data signature as a sidecar keeps it (``meta.dims``): ``{"signature": JSON}``."""
    return {"signature": json.dumps(sig, default=str)}


def transformed_length(sample: dict, where: str) -> int:
    """Token count of a transformed sample: its ``input_ids``' last dim."""
    ids = sample.get("input_ids") if isinstance(sample, dict) else None
    if ids is None or not hasattr(ids, "shape") or len(ids.shape) < 1:
        raise BadSampleError(
            sample=where,
            field="input_ids",
            expected="an input_ids array from the transform",
            actual="none" if ids is None else type(ids).__name__,
        )
    return int(ids.shape[-1])


def _transformed_signature(sample: dict, n: int) -> tuple:
    """Data signature of a transformed sample (the full pass of a transform with no header rule):
    each array's dtype and shape pattern, and the other keys."""
    arrays = tuple(
        sorted(
            (k, str(v.dtype), shape_pattern(tuple(v.shape), n))
            for k, v in sample.items()
            if hasattr(v, "shape") and hasattr(v, "dtype")
        )
    )
    return arrays, tuple(
        sorted(k for k, v in sample.items() if not (hasattr(v, "shape") and hasattr(v, "dtype")))
    )


def transform_pass(source, shard: int) -> dict:
    """A shard's data-only record from the full transform (no header rule, no schema): locations,
    lengths, media flags (:data:`MEDIA_MEMBERS` with a row), the data signature of each sample and
    data-level bad records (decode or transform errors)."""
    locations, lengths, media, events, dims, dim_ids, value_rows = [], [], [], [], [], [], []
    for loc, item in source.scan(shard):
        if isinstance(item, BadRecord):  # (a member that is not a sample: counted)
            events.append(item)
            continue
        where = (
            item.sample
            if isinstance(item, SampleError) and isinstance(item.sample, str)
            else source.sample_name(item, loc)
            if loc is not None
            else f"shard {shard}"
        )
        try:
            if isinstance(item, Exception):
                raise item
            sample = source.apply_transform(item, loc)
            n = transformed_length(sample, where)
        except SampleError as exc:
            events.append(BadRecord.of_error(_as_bad_sample(exc, where), where))
            continue
        except PrealignError as exc:  # e.g. a corrupt shard
            events.append(BadRecord.of_error(exc, where))
            continue
        sig = signature_record(_transformed_signature(sample, n))
        if sig not in dims:
            dims.append(sig)
        locations.append(list(loc))
        lengths.append(n)
        media.append(has_media(sample, MEDIA_MEMBERS))
        dim_ids.append(dims.index(sig))
        value_rows.append(value_bounds(sample))
        events.append(None)
    return {
        "shard": shard,
        "locations": locations,
        "lengths": lengths,
        "media": media,
        "dims": dims,
        "dim_ids": dim_ids,
        "events": events,
        "bounds": _stacked(value_rows),
    }


def length_rule(source, schema: BatchSchema, *, verify_images: bool = True) -> Callable | None:
    """The header rule for ``source``'s transform, or None (no rule: the full pass). The VLM
    transforms are imported here, after the text check: ``prealign index --text`` imports no
    torch."""
    transform = indexed_transform(source.transform)
    if transform is numpy_fields:
        return TextRule(schema)
    from prealign.loaders.media.gemma3 import Gemma3SampleTransform
    from prealign.loaders.media.gemma4 import Gemma4SampleTransform
    from prealign.loaders.media.idefics3 import Idefics3SampleTransform
    from prealign.loaders.media.llava_onevision import LlavaOnevisionSampleTransform
    from prealign.loaders.media.mistral3 import Mistral3SampleTransform
    from prealign.loaders.media.vlm import VLMSampleTransform

    if isinstance(transform, VLMSampleTransform):
        return VLMRule(transform, schema, verify_images=verify_images)
    if isinstance(transform, Gemma3SampleTransform):
        return ImageTokensRule(transform, schema, verify_images=verify_images)
    if isinstance(transform, LlavaOnevisionSampleTransform):
        return AnyResRule(transform, schema, verify_images=verify_images)
    if isinstance(
        transform, (Mistral3SampleTransform, Idefics3SampleTransform, Gemma4SampleTransform)
    ):
        return ImageSizesRule(transform, schema, verify_images=verify_images)
    return None


def header_index_shard(
    source, schema: BatchSchema, shard: int, *, full: bool = False, verify_images: bool = True
) -> tuple[dict, dict]:
    """``(record, fingerprint)`` of one shard of a
    :class:`~prealign.loaders.sources.webdataset.WebDatasetSource`: what a sidecar keeps, of the
    data alone (locations, lengths, media flags, data signatures in ``dims``, data-level bad
    records), from headers; ``fingerprint`` is ``{"size", "hash"}`` of the bytes read. ``full=True``
    (or no rule for the transform) runs the transform on every sample instead
    (:func:`transform_pass`). ``schema`` only chooses nothing: it is kept for callers; the schema's
    checks run when a loader reads the sidecar
    (:func:`~prealign.loaders.index.build.resolve_signatures`)."""

    url = source.urls[shard]
    rule = None if full else length_rule(source, schema, verify_images=verify_images)
    f = open_shard(url, source.remote)
    try:
        if rule is None:
            record = transform_pass(source, shard)
            return record, f.finish()
        if isinstance(
            rule, TextRule
        ):  # blocks walked in bulk; a shard it does not parse exactly: below
            records = ShardPass(source, shard, rule)
            try:
                bulk_text_pass(records, f)
                return records.record(), f.finish()
            except (Unhandled, TarFormatError, EOFError):  # (a read error, an OSError, propagates)
                close = getattr(f.f, "close", None)
                if close:
                    close()
                f = open_shard(url, source.remote)
        # streamed: one sample's members in memory at a time, hashed as they are read
        return _header_pass(source, schema, shard, rule, f), f.finish()
    finally:
        close = getattr(f.f, "close", None)
        if close:
            close()


def open_shard(url: str, opts=None) -> Fingerprint:
    """A :class:`Fingerprint` reading shard ``url`` front to back. A local shard must be a regular
    file (a device such as ``/dev/zero``, a FIFO or a socket is a :class:`NotRegularFileError`,
    checked before the open, so a FIFO never blocks, and again on the opened file); its size bounds
    what is read."""

    local = not remote.is_remote(url)
    if local and regular_stat(remote.local_path(url), "shard") is None:
        raise MissingShardError(url, "no such shard")
    f = remote.open_stream(url, opts)
    length = None
    if local:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            f.close()
            raise NotRegularFileError(url, "shard is not a regular file", "give a plain file")
        if not remote.is_sequential(url):  # (a .tar.gz: the bytes read are more than the file's)
            length = st.st_size
    return Fingerprint(f, length, url)


class ShardPass:
    """What the header pass keeps of one shard, sample by sample, in stream order: :meth:`sample`
    judges one sample from its members (the reference, whatever walked the tar), :meth:`add_rows`
    appends samples a bulk pass judged the same way in arrays
    (:mod:`~prealign.loaders.index.bulk_pass`), :meth:`record` is the
    shard's record."""

    def __init__(self, source, shard: int, rule):
        self.source, self.shard, self.rule, self.url = source, shard, rule, source.urls[shard]
        self.locations, self.lengths, self.media, self.dim_ids, self.events = [], [], [], [], []
        self.dims: list = []
        self.by_sig: dict[tuple, int] = {}
        self.bounds: list[np.ndarray] = []  # [k, 3, 4] parts
        self.checker = source.for_indexing()  # (video files sized from their headers, not decoded)
        if self.checker.transform is numpy_fields:  # its checks and lengths, without torch
            self.checker = copy.copy(self.checker)
            self.checker.transform = numpy_arrays

    def sample(
        self, key: str, start: int, end: int, members: list[tuple[str, bytes, str]], duplicate: bool
    ) -> None:
        source, shard, events = self.source, self.shard, self.events
        where = f"{self.url}:{key}"
        loc = (shard, start, end, sample_checksum(members))
        try:
            check_members(where, key, members, duplicate)
            exts = {ext: data for ext, data, _ in members}
            if len(exts) != len(members):
                raise MissingMemberError(
                    sample=where,
                    field=next(e for e in exts if [m[0] for m in members].count(e) > 1),
                    expected="one member per extension",
                    actual="a duplicate member",
                )
            missing = [r for r in source.required if r not in exts]
            if missing:
                raise MissingMemberError(
                    sample=where,
                    field=missing[0],
                    expected=f"members {list(source.required)}",
                    actual=f"members {sorted(exts)}",
                )
            for (
                ext,
                data,
                _,
            ) in members:  # small members decoded as the full pass does (JSON, text, refusals)
                if not ext.endswith(".npy") and ext.rpartition(".")[2] not in IMAGES:
                    decode_member(
                        where,
                        ext,
                        data,
                        image=source.image,
                        extra=source.decoders,
                        limits=source.limits,
                    )
            n, has_media, sig, rendered = self.rule(exts, where)
            bounds = value_bounds(
                {**_bounded_members(exts), **({} if rendered is None else {"input_ids": rendered})}
            )
        except SampleError as exc:
            events.append(BadRecord.of_error(_as_bad_sample(exc, where), where))
            return
        except (ValueError, UnicodeDecodeError) as exc:  # e.g. JSON that is not text
            err = BadSampleError(
                sample=where,
                field=None,
                expected="a readable sample",
                actual=f"{type(exc).__name__}: {exc}",
            )
            events.append(BadRecord.of_error(err, where))
            return
        if (
            sig not in self.by_sig
        ):  # the first of its kind: the full transform, its length compared with the rule's
            raw = source._sample(shard, key, members)
            try:
                if isinstance(raw, Exception):
                    raise raw
                got = transformed_length(self.checker.apply_transform(raw, loc), where)
            except SampleError as exc:
                err = (
                    exc
                    if isinstance(exc, BadSampleError) and exc.sample == where
                    else BadSampleError(
                        sample=where,
                        field=exc.field,
                        expected=exc.expected,
                        actual=exc.actual,
                        reason=getattr(exc, "reason", None)
                        if isinstance(getattr(exc, "reason", None), str)
                        else None,
                    )
                )
                events.append(BadRecord.of_error(err, where))
                return
            if got != n:
                raise LengthRuleError(
                    f"{where}: the header rule gives {n} tokens, the transform {got}; "
                    f"index this data with the full pass (prealign index --full)"
                )
            self.by_sig[sig] = len(self.dims)
            self.dims.append(signature_record(sig))
        self.locations.append(list(loc))
        self.lengths.append(n)
        self.media.append(has_media)
        self.dim_ids.append(self.by_sig[sig])
        self.bounds.append(bounds[None])
        events.append(None)

    def add_rows(self, locations: list, lengths: list, dim_ids: list, bounds: np.ndarray) -> None:
        """Append accepted samples without media: ``locations`` (lists ``[shard, start, end,
        checksum]``), ``lengths`` and ``dim_ids`` (ints), ``bounds int64 [k, 3, 4]``."""
        self.locations += locations
        self.lengths += lengths
        self.media += [False] * len(lengths)
        self.dim_ids += dim_ids
        self.bounds.append(bounds)
        self.events += [None] * len(lengths)

    def record(self) -> dict:
        bounds = (
            np.concatenate(self.bounds) if self.bounds else np.zeros((0, len(BOUNDED), 4), np.int64)
        )
        return {
            "shard": self.shard,
            "locations": self.locations,
            "lengths": self.lengths,
            "media": self.media,
            "dims": self.dims,
            "dim_ids": self.dim_ids,
            "events": self.events,
            "bounds": bounds,
        }


class MemberRuns:
    """Tar members grouped into samples as the reference tar reader meets them, into ``records`` (a
    :class:`ShardPass`): a run of members of one key is a sample, judged by :meth:`ShardPass.sample`
    when the run ends; a member without an extension is an ``ignored_member`` record. A key seen
    before is a duplicate (its sample judged so). State: the run in progress (``key``, its ``start``
    and ``end`` bytes, ``members``) and the keys ``seen``."""

    def __init__(self, records: ShardPass):
        self.records = records
        self.key: str | None = None
        self.start = self.end = 0
        self.members: list[tuple[str, bytes, str]] = []
        self.seen: set[str] = set()

    def add(self, m) -> None:
        """One member (a :class:`~prealign.loaders.sources.tar_reader.Member`), in archive order."""
        split = split_member_name(m.name)
        if split is None:
            self.records.events.append(
                BadRecord(
                    "ignored_member",
                    f"{self.records.url}:{m.name}",
                    f"tar {m.kind} member without an extension",
                )
            )
            return
        if split[0] != self.key:
            self._judge(m.offset)
            self.key, self.start = split[0], m.offset
        self.members.append((split[1], m.data, m.kind))
        self.end = m.end

    def lost(self, exc: Exception) -> None:
        """The archive unreadable from here on (``exc``: a truncated or garbled tar): a
        ``corrupt_shard`` record, the run in progress lost with the rest."""
        rec = self.records
        lost = f"; sample {self.key!r} lost with the rest of the shard" if self.members else ""
        err = CorruptShardError(rec.url, getattr(exc, "offset", 0), f"{exc}{lost}")
        rec.events.append(BadRecord.of_error(err, f"shard {rec.shard}"))
        self.members = []

    def finish(self) -> None:
        """The end of the archive: the last run judged."""
        self._judge(self.end)

    def _judge(self, end: int) -> None:
        if self.members:
            self.records.sample(self.key, self.start, end, self.members, self.key in self.seen)
            self.seen.add(self.key)
            self.members = []


def _header_pass(source, schema, shard: int, rule, f) -> dict:
    """The header pass of one shard read member by member with the reference tar reader. A truncated
    or garbled tar is a ``corrupt_shard`` record; a read error of the file (an ``OSError``)
    propagates."""
    records = ShardPass(source, shard, rule)
    runs = MemberRuns(records)
    try:
        for m in iter_members(f):
            runs.add(m)
    except (TarFormatError, EOFError) as exc:
        runs.lost(exc)
    runs.finish()
    return records.record()


def _bounded_members(exts: dict[str, bytes]) -> dict[str, np.ndarray]:
    """The :data:`~prealign.loaders.index.sample_checks.BOUNDED` ``.npy`` members of a sample, as
    views of their bytes (no copy; never unpickled; their headers were checked by the rule). An
    integer member whose data is shorter than its header says is left out (the full pass refuses it
    when it loads)."""
    out = {}
    for name in BOUNDED:
        data = exts.get(f"{name}.npy")
        if data is None:
            continue
        try:
            head = parse_npy_header(data, member=f"{name}.npy")
        except NpyFormatError:
            continue
        count = math.prod(head.shape)
        if head.dtype.kind in "iu" and head.offset + count * head.dtype.itemsize <= len(data):
            out[name] = np.frombuffer(data, dtype=head.dtype, count=count, offset=head.offset)
    return out


def _stacked(rows: list) -> np.ndarray:
    return np.stack(rows) if rows else np.zeros((0, len(BOUNDED), 4), np.int64)


# ---- writing sidecars
# ------------------------------------------------------------------------------
def sidecar_key(source) -> tuple[str, dict[str, str]]:
    """``(config, transform fields)`` a sidecar of ``source`` records: computed once per
    ``write_sidecars`` call, not per shard (a transform's identity digests its code, globals and
    state)."""
    fields = transform_fields(source)
    return identity_digest(fields), fields


def _up_to_date(source, schema, shard: int, out_dir: str | None, key: tuple | None = None) -> bool:
    """True when shard ``shard`` has a readable sidecar of its current size and this configuration
    (``key``: :func:`sidecar_key`, computed here when not given) whose probe matches the shard's by
    the sidecar's own version's definition (a version 3 sidecar is kept: the only difference is its
    probe, rewriting it would read the whole shard again)."""

    src = source if out_dir is None else _with_index_dir(source, out_dir)
    size = shard_size(source, shard)
    try:
        data = read_sidecar_bytes(src, shard, size)
        if data is None:
            return False
        meta, _ = parse_sidecar(data, shard=source.urls[shard])
    except (StaleIndexError, OSError):
        return False
    config = (key or sidecar_key(source))[0]
    return (
        meta["size"] == size
        and meta["config"] == config
        and meta.get("probe", "")
        == shard_probe(source, shard, size, probe_version(meta["version"]))
    )


def verify_shards(
    source, shards=None, *, out_dir: str | None = None, progress=None
) -> dict[str, str]:
    """Read each shard of ``source`` that has a sidecar whole and compare it with the sidecar's
    recorded size and hash (blake2b-128 of every byte): ``{shard url: what differs}`` for those that
    do not match (a byte changed in place, a shard rewritten with another sidecar left beside it),
    empty when all match. Shards without a sidecar are reported as such. The loaders check size and
    the first and last 64 KiB at start and each sample's crc32 when read; this is the whole-file
    check, run on demand (``prealign index --check``)."""
    src = source if out_dir is None else _with_index_dir(source, out_dir)
    todo = list(range(source.num_shards)) if shards is None else list(shards)
    problems: dict[str, str] = {}
    for done, shard in enumerate(todo, 1):
        url = source.urls[shard]
        data = read_sidecar_bytes(src, shard, shard_size(source, shard))
        if data is None:
            problems[url] = "no sidecar"
        else:
            meta, _ = parse_sidecar(data, shard=url)
            f = open_shard(url, source.remote)
            try:
                got = f.finish()
            finally:
                close = getattr(f.f, "close", None)
                if close:
                    close()
            if (got["size"], got["hash"]) != (meta["size"], meta["hash"]):
                problems[url] = (
                    f"{got['size']} bytes hashing to {got['hash']}, the sidecar recorded "
                    f"{meta['size']} bytes hashing to {meta['hash']}: re-run prealign index"
                )
        if progress is not None:
            progress(done, len(todo), 0)
    return problems


def _with_index_dir(source, out_dir: str):
    import copy

    src = copy.copy(source)
    src.index_dir = out_dir
    return src


def index_one(
    source,
    schema: BatchSchema,
    shard: int,
    *,
    out_dir: str | None = None,
    full: bool = False,
    force: bool = False,
    verify_images: bool = True,
    key: tuple | None = None,
) -> tuple[int, str, int, dict]:
    """Write the sidecar of one shard unless it is up to date (``force``: always); ``key``:
    :func:`sidecar_key` of ``source`` (computed here when not given). Returns ``(shard, "indexed" |
    "up to date", samples, {reason: bad samples recorded})``."""

    url = source.urls[shard]
    key = key or sidecar_key(source)
    if not force and _up_to_date(source, schema, shard, out_dir, key):
        return shard, "up to date", 0, {}
    path = sidecar_path(url, out_dir)
    if remote.is_remote(path):
        raise ConfigError(
            f"{url}: a sidecar cannot be written beside a remote shard; give --out DIR "
            f"(and index_dir=DIR to WebDatasetSource)"
        )
    record, fingerprint = header_index_shard(
        source, schema, shard, full=full, verify_images=verify_images
    )
    write_sidecar(
        path,
        record,
        shard=shard_name(url),
        fingerprint=fingerprint,
        config=key[0],
        extra={"probe": shard_probe(source, shard, fingerprint["size"]), "transform": key[1]},
    )
    bad: dict[str, int] = {}
    for event in record["events"]:
        if event is not None:
            bad[event.reason] = bad.get(event.reason, 0) + 1
    return shard, "indexed", len(record["lengths"]), bad


def _index_task(args):
    source, schema, shard, out_dir, full, force, verify, key = args
    return index_one(
        source,
        schema,
        shard,
        out_dir=out_dir,
        full=full,
        force=force,
        verify_images=verify,
        key=key,
    )


def write_sidecars(
    source,
    schema: BatchSchema,
    *,
    out_dir: str | None = None,
    workers: int = 1,
    full: bool = False,
    force: bool = False,
    shards: list[int] | None = None,
    verify_images: bool = True,
    progress: Callable[[int, int, int], None] | None = None,
) -> dict:
    """Index ``shards`` (default: all) of ``source`` into sidecars with ``workers`` local processes.
    ``progress(done, total, samples)`` is called after each shard. ``verify_images=False``: image
    headers only (no pixel decode; a corrupt image body is then found, and counted, when its sample
    is loaded). Returns ``{"indexed", "up_to_date",
    "samples"}`` counts, and ``"bad": {reason: samples}`` when bad samples were recorded in the
    sidecars."""
    import multiprocessing as mp

    todo = list(range(source.num_shards)) if shards is None else list(shards)
    sizes = shard_sizes(source, todo)  # missing shards or a brace typo, all named: before any work
    for s in (
        todo
    ):  # a device, a FIFO: refused before any work (never read without end, never waited on)
        if not remote.is_remote(source.urls[s]):
            regular_stat(remote.local_path(source.urls[s]), "shard")
    if out_dir:
        import os

        check_index_dir_names(source.urls[s] for s in todo)
        os.makedirs(out_dir, exist_ok=True)
    stats = {"indexed": 0, "up_to_date": 0, "samples": 0}
    key = sidecar_key(source)  # once, for every shard
    threshold = _POOL_MIN_FULL if full else _POOL_MIN
    if workers > 1 and len(todo) > 1 and not force and sum(max(n, 0) for n in sizes) >= threshold:
        # the pool pays off only for the bytes left to index: shards already up to date are found
        # here first
        fresh = per_shard(
            source, lambda s: _up_to_date(source, schema, s, out_dir, key), todo, threads=8
        )
        done = [(s, "up to date", 0, {}) for s, ok in zip(todo, fresh) if ok]
        todo, sizes = (
            [s for s, ok in zip(todo, fresh) if not ok],
            [n for n, ok in zip(sizes, fresh) if not ok],
        )
        force = True  # (the rest were just found out of date)
    else:
        done = []
    tasks = [(source, schema, s, out_dir, full, force, verify_images, key) for s in todo]
    total = len(done) + len(tasks)
    if workers > 1 and len(tasks) > 1 and sum(max(n, 0) for n in sizes) >= threshold:
        needs_torch = full or indexed_transform(source.transform) is not numpy_fields
        with _pool(mp, min(workers, len(tasks)), torch=needs_torch) as pool:
            _collect(
                itertools.chain(done, pool.imap_unordered(_index_task, tasks)),
                stats,
                total,
                progress,
            )
    else:
        _collect(itertools.chain(done, map(_index_task, tasks)), stats, total, progress)
    return stats


_POOL_MIN = 192 << 20
"""Shard bytes below which the header pass runs in this process even when given workers: a pool
costs about a second to start where the work needs torch (its import), the header pass reads ~100 MB
of text shards a second."""
_POOL_MIN_FULL = 16 << 20
"""The same for the full pass (``full=True``: every sample transformed and collated, ~10x slower a
byte)."""


def _pool(mp, n: int, *, torch: bool = True):
    """``n`` worker processes forked from a forkserver that imported this module once, and torch
    when the work needs it (``torch``: a VLM transform or the full pass; the header pass of text
    shards imports none) (``spawn``, where there is no forkserver): no child re-imports them
    (``spawn`` made the pool slower than one process below ~300k samples), and none is forked from
    this process, whose torch / PIL threads may hold locks. With torch, each child runs it on one
    thread: ``n`` processes, not ``n`` x cores threads (the text pass's numpy calls are
    single-threaded: no BLAS). The pool's processes end with it; the forkserver (one idle process,
    ~300 MB with torch) stays alive until this process exits, as ``multiprocessing`` keeps it, and
    serves the next pool of this process (its preload is the first pool's: a child imports what
    else its tasks need)."""
    try:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", __name__] if torch else [__name__])
    except ValueError:
        ctx = mp.get_context("spawn")
    return ctx.Pool(n, initializer=_one_thread if torch else None)


def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)


def _collect(results, stats: dict, total: int, progress) -> None:
    for done, (_, what, n, bad) in enumerate(results, 1):
        stats["indexed" if what == "indexed" else "up_to_date"] += 1
        stats["samples"] += n
        for (
            reason,
            count,
        ) in bad.items():  # "bad": {reason: samples}, present when some were recorded
            stats.setdefault("bad", {})[reason] = stats.get("bad", {}).get(reason, 0) + count
        if progress:
            progress(done, total, stats["samples"])
