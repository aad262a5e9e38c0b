"""3-D rotary position ids (mRoPE) of the Qwen vision-language families, vectorised over a whole
packed batch.

Semantics (those of each family's transformers ``get_rope_index``, checked against it in
``tests/collate/test_mrope.py`` and ``tests/families/test_vlm_families.py``; the family rules live
in :mod:`prealign.collate.vision`), per sequence, with a running position ``p`` starting at 0
(Qwen2-VL images shown; video runs and Qwen2.5-VL's temporal step in
:mod:`prealign.collate.vision.positions`):

- a text token gets ``(p, p, p)`` and advances ``p`` by 1;
- a run of image tokens with grid ``(t, h, w)`` (``h' = h/m``, ``w' = w/m``, ``m`` the spatial
  merge size) holds ``t*h'*w'`` tokens in (t, row, column) order; token ``(i, j, k)`` gets
  ``(p + i, p + j, p + k)``; afterwards ``p`` advances by ``max(h', w')``.

Trace, m=2, one sequence ``x <v> I I I I I I </v> y`` with one image of grid (1, 4, 6):

    token     x  <v>  I  I  I  I  I  I  </v>  y
    temporal  0  1    2  2  2  2  2  2  5     6
    height    0  1    2  2  2  3  3  3  5     6
    width     0  1    2  3  4  2  3  4  5     6

How it is vectorised (a fixed number of tensor ops per batch, no Python loop over tokens, images
or sequences): every text token contributes 1 to ``p`` and every image run contributes
``max(h', w')`` on its last token; an exclusive cumulative sum, restarted per sequence, gives
``p`` at every token (constant inside an image run), and the image tokens add their
(i, j, k) offsets computed from their index inside the run.
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from prealign.schemas.errors import ConfigError, SampleError

from .vision import VisionFamily, rope_positions, vision_family
from .vision.family import check_seconds
from .vision.glm4v import check_media
from .vision.positions import grid_rows


def mrope_position_ids(
    mm_token_type_ids: torch.Tensor,
    image_grid_thw: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    spatial_merge_size: int = 2,
    images_per_sample: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    second_per_grid_ts: torch.Tensor | None = None,
    model_config: Any = None,
) -> torch.Tensor:
    """3-D positions of a flat batch of sequences.

    Args:
        mm_token_type_ids: int ``[T]``, all sequences' token types concatenated (0 text, 1 image, 2
        video). image_grid_thw: int64 ``[num_images, 3]``, the images in the order they appear in
        the tokens. cu_seqlens: int ``[N+1]`` sequence offsets into the tokens (every length > 0).
        spatial_merge_size: ``m`` above (ignored when ``model_config`` is given: the family's is
        used). images_per_sample: optional int64 ``[N]``, each sample's number of grids (for error
        messages). video_grid_thw: optional int64 ``[num_videos, 3]``; second_per_grid_ts: optional
        float ``[num_videos]``. model_config: the HF config (or a
            :class:`~prealign.collate.vision.VisionFamily`) whose family's video rules apply;
            ``None``: Qwen2-VL's (one run per video, temporal step 1).

    Returns:
        int64 ``[3, T]``: temporal, height and width positions, restarting at 0 in every sequence.

    Raises:
        SampleError naming the sample (index into the sequences) when a vision run's length is not
        ``t*h*w / m**2`` of its grid, or the number of runs is not the number of grids.

    >>> types = torch.tensor([0, 0, 1, 1, 1, 1, 1, 1, 0, 0])
    >>> mrope_position_ids(types, torch.tensor([[1, 4, 6]]), torch.tensor([0, 10])).tolist()
    [[0, 1, 2, 2, 2, 2, 2, 2, 5, 6], [0, 1, 2, 2, 2, 3, 3, 3, 5, 6], [0, 1, 2, 3, 4, 2, 3, 4, 5, 6]]
    """
    family = None if model_config is None else vision_family(model_config)
    grids_per_sample = None
    if images_per_sample is not None:
        grids_per_sample = torch.stack(
            (
                torch.as_tensor(images_per_sample).reshape(-1),
                torch.zeros(len(images_per_sample), dtype=torch.int64),
            ),
            1,
        ).numpy()
    return _rope(
        family,
        spatial_merge_size,
        mm_token_type_ids,
        cu_seqlens,
        image_grid_thw,
        video_grid_thw,
        second_per_grid_ts,
        grids_per_sample,
    )


def _rope(
    family: VisionFamily | None,
    merge: int,
    types,
    cu,
    image_grid_thw,
    video_grid_thw,
    second_per_grid_ts,
    grids_per_sample,
) -> torch.Tensor:
    """int64 ``[3, T]``: the family's positions, or (no family) Qwen2-VL's with ``merge``."""
    if family is not None:
        return family.positions(
            types,
            cu,
            image_grid_thw=image_grid_thw,
            video_grid_thw=video_grid_thw,
            second_per_grid_ts=second_per_grid_ts,
            grids_per_sample=grids_per_sample,
        )
    videos = (
        np.zeros((0, 3), np.int64) if video_grid_thw is None else _np(video_grid_thw).reshape(-1, 3)
    )
    return torch.from_numpy(
        rope_positions(
            _np(types),
            _np(cu),
            _np(image_grid_thw),
            videos,
            None,
            merge,
            grids_per_sample=grids_per_sample,
        )
    )


def _np(value) -> np.ndarray:
    return value.numpy() if isinstance(value, torch.Tensor) else np.asarray(value)


# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class MRoPECollator:
    """Wraps a collator (:class:`~prealign.collate.THDCollator`,
    :class:`~prealign.collate.BSHDCollator`) and adds the 3-D positions before it runs, so they are
    padded and CP-sharded exactly like the tokens: ``field`` is ``[3, 1, T_out]`` in THD, ``[3, B,
    S_out]`` in BSHD, 0 on pads.

    Each sample needs ``input_ids`` ``[L]``, ``mm_token_type_ids`` ``[L]`` (0 text, 1 image, 2
    video) and ``image_grid_thw`` ``[num_images, 3]`` (``[0, 3]`` for text only); with video,
    ``video_grid_thw`` ``[num_videos, 3]`` and (Qwen2.5-VL) ``second_per_grid_ts`` float
    ``[num_videos]``. ``model_config`` (the model's HF config) picks the family
    (:func:`~prealign.collate.vision.vision_family`) and its merge size; without it, Qwen2-VL's
    rules with ``spatial_merge_size`` (default 2). Samples that all carry ``field`` already keep
    their own values; a batch where only some do is an error. Picklable; never mutates samples.

    >>> from prealign.schemas import ParallelLayout, vlm_schema
    >>> from prealign.collate import THDCollator
    >>> thd = THDCollator(schema=vlm_schema(), layout=ParallelLayout(tp=2, cp=2), cp_rank=1)
    >>> coll = MRoPECollator(collator=thd)
    >>> s = {"input_ids": torch.tensor([5, 6, 9, 9, 7]),
    ...      "mm_token_type_ids": torch.tensor([0, 0, 1, 1, 0]),
    ...      "image_grid_thw": torch.tensor([[1, 2, 4]]), "pixel_values": torch.zeros(8, 1176)}
    >>> coll([s])["mrope_position_ids"].tolist()  # P=8: rank 1 keeps slots 2..5 (chunks 1 and 2)
    [[[2, 2, 4, 0]], [[2, 2, 4, 0]], [[2, 3, 4, 0]]]
    """

    collator: Callable[[Sequence[dict]], dict]
    spatial_merge_size: int | None = None
    """Qwen2-VL's merge size when no ``model_config`` is given (``None``: 2); with one, leave unset
    or equal."""
    field: str = "mrope_position_ids"
    model_config: Any = None
    """The model's transformers config (or its dict, or a
    :class:`~prealign.collate.vision.VisionFamily`)."""
    family: VisionFamily | None = dataclass_field(
        init=False, repr=False, compare=False, default=None
    )

    def __post_init__(self):
        if self.model_config is None:
            return
        family = vision_family(self.model_config)
        if family.position_kind != "mrope":
            raise ConfigError(
                f"MRoPECollator: the {family.model_type} model has {family.position_kind!r} "
                f"positions "
                "(its contract), not mRoPE: use the THDCollator's position_ids alone"
            )
        if (
            self.spatial_merge_size is not None
            and self.spatial_merge_size != family.spatial_merge_size
        ):
            raise ConfigError(
                f"MRoPECollator: spatial_merge_size={self.spatial_merge_size} but the "
                f"{family.model_type} "
                f"config merges {family.spatial_merge_size}; leave spatial_merge_size unset"
            )
        object.__setattr__(self, "family", family)

    @property
    def merge_size(self) -> int:
        """The spatial merge size in use (the family's, else ``spatial_merge_size``, else 2)."""
        if self.family is not None:
            return self.family.spatial_merge_size
        return 2 if self.spatial_merge_size is None else self.spatial_merge_size

    @property
    def schema(self) -> Any:
        return getattr(self.collator, "schema", None)

    @property
    def layout(self) -> Any:
        return getattr(self.collator, "layout", None)

    def __call__(self, batch: Sequence[dict]) -> dict:
        if isinstance(batch, dict) or not isinstance(batch, Sequence) or not batch:
            raise SampleError(
                sample=None,
                field=None,
                expected="a non-empty list of sample dicts",
                actual=type(batch).__name__ if batch else "an empty batch",
            )
        has = [self.field in s for s in batch]
        grids = _grids(batch, "image_grid_thw")
        videos = _grids(batch, "video_grid_thw")
        if getattr(
            self.family, "one_media_kind", False
        ):  # GLM-4.1V: one forward takes images or video, not both
            check_media(self.family, torch.cat(grids), torch.cat(videos))
        if all(has):
            _check_pixel_rows(batch, grids, videos)
            return _finite_pixels(self.collator(batch), batch)
        if any(has):
            i = has.index(False)
            raise SampleError(
                sample=i,
                field=self.field,
                expected="present in every sample or in none",
                actual=f"missing here, present in sample {has.index(True)}",
            )
        types = [_field(s, i, "mm_token_type_ids") for i, s in enumerate(batch)]
        lengths = np.array([t.shape[-1] for t in types], dtype=np.int64)
        for i, s in enumerate(batch):
            n_ids = torch.as_tensor(s.get("input_ids", ())).shape[-1]
            if n_ids != int(lengths[i]):
                raise SampleError(
                    sample=i,
                    field="mm_token_type_ids",
                    expected=f"{n_ids} entries (input_ids' length)",
                    actual=f"{int(lengths[i])}",
                )
        positions = self._positions(batch, torch.cat(types), lengths, grids, videos)
        _check_pixel_rows(
            batch, grids, videos
        )  # after the token runs: their mismatch is the more telling message
        parts = torch.split(positions, lengths.tolist(), dim=1)
        return _finite_pixels(
            self.collator([{**s, self.field: p} for s, p in zip(batch, parts)]), batch
        )

    def _positions(self, batch, types, lengths, grids, videos) -> torch.Tensor:
        """One vectorised call over the whole batch (the family's
        :meth:`VisionFamily.positions`)."""
        family = self.family
        cu = np.concatenate(([0], np.cumsum(lengths)))
        video_grid = torch.cat(videos)

        def per_sample() -> np.ndarray:  # grids per sample, only to name the sample in an error
            return np.array(
                [
                    [g.shape[0], v.shape[0] if family is None else family.video_runs(v).shape[0]]
                    for g, v in zip(grids, videos)
                ],
                dtype=np.int64,
            )

        seconds = [s.get("second_per_grid_ts") for s in batch]
        second_per_grid_ts = None
        if family is not None and any(
            x is not None for x in seconds
        ):  # checked per sample, so that an error names it
            second_per_grid_ts = np.concatenate(
                [
                    np.ones(v.shape[0], np.float32)
                    if x is None
                    else check_seconds(x, v.shape[0], sample=i)
                    for i, (x, v) in enumerate(zip(seconds, videos))
                ]
            )
        return _rope(
            family,
            self.merge_size,
            types,
            cu,
            torch.cat(grids),
            video_grid,
            second_per_grid_ts,
            per_sample,
        )


def _check_pixel_rows(
    batch: Sequence[dict], grids: list[torch.Tensor], videos: list[torch.Tensor]
) -> None:
    """Each sample's ``pixel_values`` (``pixel_values_videos``) rows are the patches its
    ``image_grid_thw`` (``video_grid_thw``) declares (``sum(t*h*w)``): an edited grid would give the
    vision tower other positions than its pixels, silently."""
    for pixel_key, grid_key, per_sample in (
        ("pixel_values", "image_grid_thw", grids),
        ("pixel_values_videos", "video_grid_thw", videos),
    ):
        patches = [int(g.to(torch.int64).prod(-1).sum()) for g in per_sample]
        for i, (s, want) in enumerate(zip(batch, patches)):
            pixels = s.get(pixel_key)
            rows = getattr(pixels, "shape", (None,))[0] if pixels is not None else None
            if rows is not None and rows != want:
                raise SampleError(
                    sample=i,
                    field=pixel_key,
                    actual=f"{rows} rows",
                    expected=f"{want} rows (the sum of t*h*w over {grid_key} "
                    f"{per_sample[i].tolist()})",
                )


def _finite_pixels(out: dict, batch: Sequence[dict]) -> dict:
    """The collated ``pixel_values`` are finite (one reduction; a NaN or inf image would poison the
    vision tower's activations for the whole micro-batch): else a SampleError naming the first such
    sample."""
    for key in ("pixel_values", "pixel_values_videos"):
        pixels = out.get(key)
        if isinstance(pixels, torch.Tensor) and pixels.is_floating_point() and pixels.numel():
            lo, hi = torch.aminmax(pixels)
            if not (torch.isfinite(lo) and torch.isfinite(hi)):
                i = next(
                    i
                    for i, s in enumerate(batch)
                    if not bool(torch.isfinite(torch.as_tensor(s[key])).all())
                )
                raise SampleError(
                    sample=i, field=key, expected="finite values", actual="NaN or inf"
                )
    return out


def _field(sample: dict, i: int, key: str) -> torch.Tensor:
    if key not in sample:
        raise SampleError(
            sample=i,
            field=key,
            expected="present (needed for mRoPE positions)",
            actual=f"fields {sorted(sample)}",
        )
    return torch.as_tensor(sample[key])


_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def _grids(batch: Sequence[dict], key: str) -> list[torch.Tensor]:
    """Each sample's ``key`` grid as int ``[num, 3]`` rows of positive ints (``video_grid_thw`` may
    be missing: no rows), else a :class:`SampleError` naming the sample and the field. An int
    tensor ``[num, 3]`` is taken as it is; anything else is read by :func:`grid_rows`. The values
    are checked once for the whole batch."""
    out = []
    for i, sample in enumerate(batch):
        value = sample.get(key)
        if isinstance(value, torch.Tensor) and value.ndim == 2 and value.shape[1] == 3:
            if value.dtype in _INT_DTYPES:
                out.append(value)
                continue
        elif value is None and key == "video_grid_thw":
            out.append(torch.zeros(0, 3, dtype=torch.int64))
            continue
        elif key not in sample:
            _field(sample, i, key)  # (raises, naming it)
        out.append(torch.from_numpy(grid_rows(value, key, sample=i)))
    rows = torch.cat(out) if out else torch.zeros(0, 3, dtype=torch.int64)
    bad = torch.nonzero((rows < 1).any(1))
    if bad.numel():
        k = int(bad[0])
        i = int(np.searchsorted(np.cumsum([g.shape[0] for g in out]), k, side="right"))
        raise SampleError(
            sample=i, field=key, expected="positive t, h and w", actual=f"{rows[k].tolist()}"
        )
    return out
