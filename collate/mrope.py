"""Qwen2-VL 3-D rotary position ids (mRoPE), vectorised over a whole packed batch.

Semantics (those of transformers' ``Qwen2VLModel.get_rope_index``, checked against it in
``tests/test_mrope.py``), per sequence, with a running position ``p`` starting at 0:

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
from typing import Any, Callable, Sequence

import torch

from prealign.schemas.errors import SampleError
from prealign.schemas.vlm import IMAGE_TOKEN_TYPE, TEXT_TOKEN_TYPE

from .indices import lengths_to_cu_seqlens


def mrope_position_ids(mm_token_type_ids: torch.Tensor, image_grid_thw: torch.Tensor, cu_seqlens: torch.Tensor,
                       *, spatial_merge_size: int = 2, images_per_sample: torch.Tensor | None = None) -> torch.Tensor:
    """3-D positions of a flat batch of sequences.

    Args:
        mm_token_type_ids: int ``[T]``, all sequences' token types concatenated (0 text, 1 image).
        image_grid_thw: int64 ``[num_images, 3]``, the images in the order they appear in the tokens.
        cu_seqlens: int ``[N+1]`` sequence offsets into the tokens (every length > 0).
        spatial_merge_size: ``m`` above.
        images_per_sample: optional int64 ``[N]``, each sample's number of grids (for error messages).

    Returns:
        int64 ``[3, T]``: temporal, height and width positions, restarting at 0 in every sequence.

    Raises:
        SampleError naming the sample (index into the sequences) when an image run's length is not
        ``t*h*w / m**2`` of its grid, or the number of runs is not the number of grids.

    >>> types = torch.tensor([0, 0, 1, 1, 1, 1, 1, 1, 0, 0])
    >>> mrope_position_ids(types, torch.tensor([[1, 4, 6]]), torch.tensor([0, 10])).tolist()
    [[0, 1, 2, 2, 2, 2, 2, 2, 5, 6], [0, 1, 2, 2, 2, 3, 3, 3, 5, 6], [0, 1, 2, 3, 4, 2, 3, 4, 5, 6]]
    """
    types = mm_token_type_ids.reshape(-1)
    cu = cu_seqlens.to(torch.int64)
    grid = image_grid_thw.to(torch.int64).reshape(-1, 3)
    total = types.numel()
    if int(cu[-1]) != total:
        raise SampleError(sample=None, field="mm_token_type_ids", expected=f"{int(cu[-1])} tokens (cu_seqlens[-1])",
                          actual=f"{total}")
    is_img = types == IMAGE_TOKEN_TYPE
    unknown = ~is_img & (types != TEXT_TOKEN_TYPE)
    if bool(unknown.any()):
        row = int(torch.nonzero(unknown)[0])
        raise SampleError(sample=_sample_of(cu, row), field="mm_token_type_ids",
                          expected=f"{TEXT_TOKEN_TYPE} (text) or {IMAGE_TOKEN_TYPE} (image); video is not supported",
                          actual=f"{int(types[row])} at token {row - int(cu[_sample_of(cu, row)])}")
    # Runs of image tokens; a run never crosses a sequence boundary.
    seq_start = torch.zeros(total, dtype=torch.bool)
    seq_start[cu[:-1]] = True
    seq_end = torch.zeros(total, dtype=torch.bool)
    seq_end[cu[1:] - 1] = True
    run_start = is_img & (seq_start | ~torch.roll(is_img, 1))
    run_end = is_img & (seq_end | ~torch.roll(is_img, -1))
    starts, ends = torch.nonzero(run_start).flatten(), torch.nonzero(run_end).flatten()
    _check_runs(starts, ends, grid, cu, spatial_merge_size, images_per_sample)

    hh, ww = grid[:, 1] // spatial_merge_size, grid[:, 2] // spatial_merge_size
    advance = (~is_img).to(torch.int64)
    advance[ends] = torch.maximum(hh, ww)
    before = torch.cumsum(advance, 0) - advance  # running position before each token, batch-wide
    base = before - before[cu[:-1]].repeat_interleave(cu.diff())  # ... restarted per sequence
    out = base.expand(3, total).clone()
    img_rows = torch.nonzero(is_img).flatten()
    image = torch.cumsum(run_start, 0)[img_rows] - 1  # which image each image token belongs to
    q = img_rows - starts[image]  # index inside its image, (t, row, column) order
    w_img, hw_img = ww[image], (hh * ww)[image]
    offsets = torch.stack((q // hw_img, (q % hw_img) // w_img, q % w_img))
    out[:, img_rows] += offsets
    return out


def _sample_of(cu: torch.Tensor, row: int) -> int:
    return int(torch.searchsorted(cu, row, right=True)) - 1


def _check_runs(starts, ends, grid, cu, merge: int, images_per_sample) -> None:
    """Every image run must hold exactly its grid's ``t*h*w / merge**2`` tokens, one run per grid."""
    bad_geom = (grid[:, 1:] % merge != 0).any(1)
    runs_per_sample = torch.bincount(torch.searchsorted(cu, starts, right=True) - 1, minlength=cu.numel() - 1)
    if starts.numel() != grid.shape[0] or bool(bad_geom.any()):
        if images_per_sample is not None:
            wrong = torch.nonzero(runs_per_sample != images_per_sample.to(torch.int64)).flatten()
            if wrong.numel():
                i = int(wrong[0])
                raise SampleError(sample=i, field="mm_token_type_ids",
                                  expected=f"{int(images_per_sample[i])} runs of image tokens (one per image_grid_thw row)",
                                  actual=f"{int(runs_per_sample[i])} runs")
        if bool(bad_geom.any()):
            k = int(torch.nonzero(bad_geom)[0])
            raise SampleError(sample=None, field="image_grid_thw", actual=f"{grid[k].tolist()} (image {k})",
                              expected=f"h and w multiples of spatial_merge_size {merge}")
        raise SampleError(sample=None, field="mm_token_type_ids", actual=f"{starts.numel()} runs",
                          expected=f"{grid.shape[0]} runs of image tokens (one per image_grid_thw row)")
    need = grid.prod(-1) // merge ** 2
    got = ends - starts + 1
    wrong = torch.nonzero(got != need).flatten()
    if wrong.numel():
        k = int(wrong[0])
        i = _sample_of(cu, int(starts[k]))
        raise SampleError(sample=i, field="mm_token_type_ids", actual=f"{int(got[k])} image tokens",
                          expected=f"{int(need[k])} image tokens for image_grid_thw {grid[k].tolist()} "
                                   f"(t*h*w / {merge}**2), image {k} of the batch")


# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class MRoPECollator:
    """Wraps a collator (:class:`~prealign.collate.THDCollator`, :class:`~prealign.collate.BSHDCollator`) and adds the
    3-D positions before it runs, so they are padded and CP-sharded exactly like the tokens:
    ``field`` is ``[3, 1, T_out]`` in THD, ``[3, B, S_out]`` in BSHD, 0 on pads.

    Each sample needs ``input_ids`` ``[L]``, ``mm_token_type_ids`` ``[L]`` and ``image_grid_thw``
    ``[num_images, 3]`` (``[0, 3]`` for text only). Samples that all carry ``field`` already keep
    their own values; a batch where only some do is an error. Picklable; never mutates samples.

    >>> from prealign.schemas import ParallelLayout, vlm_schema
    >>> from prealign.collate import THDCollator
    >>> coll = MRoPECollator(collator=THDCollator(schema=vlm_schema(), layout=ParallelLayout(tp=2, cp=2), cp_rank=1))
    >>> s = {"input_ids": torch.tensor([5, 6, 9, 9, 7]), "mm_token_type_ids": torch.tensor([0, 0, 1, 1, 0]),
    ...      "image_grid_thw": torch.tensor([[1, 2, 4]]), "pixel_values": torch.zeros(8, 1176)}
    >>> coll([s])["mrope_position_ids"].tolist()  # P=8: rank 1 keeps slots 2..5 (chunks 1 and 2)
    [[[2, 2, 4, 0]], [[2, 2, 4, 0]], [[2, 3, 4, 0]]]
    """

    collator: Callable[[Sequence[dict]], dict]
    spatial_merge_size: int = 2
    field: str = "mrope_position_ids"

    @property
    def schema(self) -> Any:
        return getattr(self.collator, "schema", None)

    @property
    def layout(self) -> Any:
        return getattr(self.collator, "layout", None)

    def __call__(self, batch: Sequence[dict]) -> dict:
        if isinstance(batch, dict) or not isinstance(batch, Sequence) or not batch:
            raise SampleError(sample=None, field=None, expected="a non-empty list of sample dicts",
                              actual=type(batch).__name__ if batch else "an empty batch")
        has = [self.field in s for s in batch]
        grids = [_field(s, i, "image_grid_thw").reshape(-1, 3) for i, s in enumerate(batch)]
        if all(has):
            _check_pixel_rows(batch, grids)
            return _finite_pixels(self.collator(batch), batch)
        if any(has):
            i = has.index(False)
            raise SampleError(sample=i, field=self.field, expected="present in every sample or in none",
                              actual=f"missing here, present in sample {has.index(True)}")
        types = [_field(s, i, "mm_token_type_ids") for i, s in enumerate(batch)]
        lengths = torch.tensor([t.shape[-1] for t in types], dtype=torch.int64)
        for i, s in enumerate(batch):
            n_ids = torch.as_tensor(s.get("input_ids", ())).shape[-1]
            if n_ids != int(lengths[i]):
                raise SampleError(sample=i, field="mm_token_type_ids", expected=f"{n_ids} entries (input_ids' length)",
                                  actual=f"{int(lengths[i])}")
        positions = mrope_position_ids(torch.cat(types), torch.cat(grids), lengths_to_cu_seqlens(lengths, torch.int64),
                                       spatial_merge_size=self.spatial_merge_size,
                                       images_per_sample=torch.tensor([g.shape[0] for g in grids]))
        _check_pixel_rows(batch, grids)  # after the token runs: their mismatch is the more telling message
        parts = torch.split(positions, lengths.tolist(), dim=1)
        return _finite_pixels(self.collator([{**s, self.field: p} for s, p in zip(batch, parts)]), batch)


def _check_pixel_rows(batch: Sequence[dict], grids: list[torch.Tensor]) -> None:
    """Each sample's ``pixel_values`` rows are the patches its ``image_grid_thw`` declares (``sum(t*h*w)``): an
    edited grid would give the vision tower other positions than its pixels, silently."""
    patches = torch.stack([g.to(torch.int64).prod(-1).sum() for g in grids]).tolist()
    for i, (s, want) in enumerate(zip(batch, patches)):
        pixels = s.get("pixel_values")
        rows = getattr(pixels, "shape", (None,))[0] if pixels is not None else None
        if rows is not None and rows != want:
            raise SampleError(sample=i, field="pixel_values", actual=f"{rows} rows",
                              expected=f"{want} rows (the sum of t*h*w over image_grid_thw {grids[i].tolist()})")


def _finite_pixels(out: dict, batch: Sequence[dict]) -> dict:
    """The collated ``pixel_values`` are finite (one reduction; a NaN or inf image would poison the vision
    tower's activations for the whole micro-batch): else a SampleError naming the first such sample."""
    pixels = out.get("pixel_values")
    if isinstance(pixels, torch.Tensor) and pixels.is_floating_point() and pixels.numel():
        lo, hi = torch.aminmax(pixels)
        if not (torch.isfinite(lo) and torch.isfinite(hi)):
            i = next(i for i, s in enumerate(batch) if not bool(torch.isfinite(torch.as_tensor(s["pixel_values"])).all()))
            raise SampleError(sample=i, field="pixel_values", expected="finite values", actual="NaN or inf")
    return out


def _field(sample: dict, i: int, key: str) -> torch.Tensor:
    if key not in sample:
        raise SampleError(sample=i, field=key, expected="present (needed for mRoPE positions)",
                          actual=f"fields {sorted(sample)}")
    return torch.as_tensor(sample[key])
