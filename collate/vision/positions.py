"""Multi-axis rotary positions (mRoPE) of a flat batch of sequences, for every Qwen vision family.

Semantics (those of each family's transformers ``get_rope_index``), per sequence, with a running
position ``p`` starting at 0, tokens grouped in runs of one type (0 text, 1 image, 2 video):

- a text token gets ``(p, p, p)`` and advances ``p`` by 1;
- a vision run with grid ``(t, h, w)`` (``h' = h/m``, ``w' = w/m``, ``m`` the merge size) holds
  ``t*h'*w'`` tokens in (t, row, column) order; token ``(i, j, k)`` gets
  ``(p + floor(i * s), p + j, p + k)`` where ``s`` is the run's temporal step (1 for images and for
  Qwen2-VL / Qwen3-VL / Qwen3.5 video, ``tokens_per_second * second_per_grid_ts`` for Qwen2.5-VL
  video, computed in float32 as transformers does); afterwards ``p`` advances by ``max(h', w')``.

Image runs take ``image_grid_thw`` rows in order, video runs the family's video run grids in order
(Qwen3-VL / Qwen3.5 split each video into ``t`` runs of one frame, separated by timestamp text).

Vectorised: a fixed number of NumPy operations per batch (no loop over tokens, runs or sequences):
text tokens add 1 to ``p``, each run adds ``max(h', w')`` on its last token, an exclusive cumulative
sum restarted per sequence gives ``p`` everywhere, and vision tokens add their offsets.
"""

from __future__ import annotations

import numpy as np

from prealign.schemas.checks import int_at_least
from prealign.schemas.errors import ArgumentError, SampleError

TEXT, IMAGE, VIDEO = 0, 1, 2


def rope_positions(
    types: np.ndarray,
    cu_seqlens: np.ndarray,
    image_grid: np.ndarray,
    video_grid: np.ndarray,
    video_step: np.ndarray | None,
    merge: int,
    *,
    grids_per_sample: np.ndarray | None = None,
) -> np.ndarray:
    """int64 ``[3, T]`` positions restarting at 0 in every sequence.

    Args:
        types: int ``[T]`` token types (0 text, 1 image, 2 video), all sequences concatenated.
        cu_seqlens: int ``[N+1]`` sequence offsets (every length > 0).
        image_grid: int ``[num_images, 3]``; video_grid: int ``[num_video_runs, 3]`` (one row per
            run of video tokens, in order).
        video_step: float ``[num_video_runs]`` temporal step per video run, or ``None`` (all 1).
        merge: the spatial merge size ``m``.
        grids_per_sample: optional int ``[N, 2]`` (images, video runs) per sample, or a function
            returning it (called only to name the sample in an error).

    Raises:
        SampleError naming the sample when a run's length is not its grid's ``t*h*w / m**2``, the
        runs do not match the grids in number, or a token type is not 0, 1 or 2.

    >>> t = np.array([0, 0, 1, 1, 1, 1, 1, 1, 0, 0])
    >>> grids = np.array([[1, 4, 6]])
    >>> rope_positions(t, np.array([0, 10]), grids, np.zeros((0, 3)), None, 2).tolist()
    [[0, 1, 2, 2, 2, 2, 2, 2, 5, 6], [0, 1, 2, 2, 2, 3, 3, 3, 5, 6], [0, 1, 2, 3, 4, 2, 3, 4, 5, 6]]
    """
    merge = int_at_least("spatial_merge_size", merge, 1, ArgumentError, expected="a positive int")
    types = np.asarray(types).reshape(-1)
    cu = np.asarray(cu_seqlens, dtype=np.int64).reshape(-1)
    total = types.size
    if int(cu[-1]) != total:
        raise SampleError(
            sample=None,
            field="mm_token_type_ids",
            expected=f"{int(cu[-1])} tokens (cu_seqlens[-1])",
            actual=f"{total}",
        )
    bad = (types != TEXT) & (types != IMAGE) & (types != VIDEO)
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        i = _sample_of(cu, row)
        raise SampleError(
            sample=i,
            field="mm_token_type_ids",
            expected="0 (text), 1 (image) or 2 (video)",
            actual=f"{int(types[row])} at token {row - int(cu[i])}",
        )
    is_vis = types != TEXT
    boundary = np.zeros(total + 1, dtype=bool)
    boundary[cu] = True  # a run never crosses a sequence boundary
    change = boundary.copy()
    change[1:-1] |= types[1:] != types[:-1]
    run_start = is_vis & change[:-1]
    run_end = is_vis & change[1:]
    starts, ends = np.flatnonzero(run_start), np.flatnonzero(run_end)
    run_type = types[starts]
    grid = _run_grids(
        run_type,
        starts,
        cu,
        grid_rows(image_grid, "image_grid_thw"),
        grid_rows(video_grid, "video_grid_thw"),
        merge,
        grids_per_sample,
    )
    need = grid.prod(-1) // merge**2
    got = ends - starts + 1
    wrong = np.flatnonzero(got != need)
    if wrong.size:
        k = int(wrong[0])
        kind = "image" if run_type[k] == IMAGE else "video"
        raise SampleError(
            sample=_sample_of(cu, int(starts[k])),
            field="mm_token_type_ids",
            actual=f"{int(got[k])} {kind} tokens",
            expected=f"{int(need[k])} {kind} tokens for grid {grid[k].tolist()} (t*h*w / "
            f"{merge}**2)",
        )
    hh, ww = grid[:, 1] // merge, grid[:, 2] // merge
    advance = (~is_vis).astype(np.int64)
    advance[ends] = np.maximum(hh, ww)
    before = np.cumsum(advance) - advance  # running position before each token, batch-wide
    base = before - np.repeat(before[cu[:-1]], np.diff(cu))  # ... restarted per sequence
    out = np.repeat(base[None, :], 3, axis=0)
    rows = np.flatnonzero(is_vis)
    if rows.size:
        run = np.repeat(np.arange(starts.size), got)  # the run each vision token belongs to
        q = rows - starts[run]  # index inside its run, (t, row, column) order
        w_run, hw_run = ww[run], (hh * ww)[run]
        frame = q // hw_run
        if video_step is not None and (run_type == VIDEO).any():
            step = np.ones(starts.size, dtype=np.asarray(video_step).dtype)
            step[run_type == VIDEO] = video_step
            frame = (frame.astype(step.dtype) * step[run]).astype(
                np.int64
            )  # truncation, as torch's .long()
        out[:, rows] += np.stack((frame, (q % hw_run) // w_run, q % w_run))
    return out


def _sample_of(cu: np.ndarray, row: int) -> int:
    return int(np.searchsorted(cu, row, side="right")) - 1


def _run_grids(
    run_type, starts, cu, image_grid, video_grid, merge: int, grids_per_sample
) -> np.ndarray:
    """One grid per run: image runs take ``image_grid`` rows in order, video runs ``video_grid``
    rows."""
    is_image = run_type == IMAGE
    counts = (int(is_image.sum()), int((~is_image).sum()))
    if counts != (image_grid.shape[0], video_grid.shape[0]):
        if grids_per_sample is not None:
            if callable(grids_per_sample):
                grids_per_sample = grids_per_sample()
            sample = np.searchsorted(cu, starts, side="right") - 1
            n = cu.size - 1
            runs = np.stack(
                (
                    np.bincount(sample[is_image], minlength=n),
                    np.bincount(sample[~is_image], minlength=n),
                ),
                1,
            )
            wrong = np.flatnonzero((runs != np.asarray(grids_per_sample)).any(1))
            if wrong.size:
                i = int(wrong[0])
                raise SampleError(
                    sample=i,
                    field="mm_token_type_ids",
                    expected=_runs(*grids_per_sample[i])
                    + " (one per image_grid_thw row, one per video_grid_thw row or per frame "
                    "group)",
                    actual=_runs(*runs[i]),
                )
        raise SampleError(
            sample=None,
            field="mm_token_type_ids",
            actual=_runs(*counts),
            expected=_runs(image_grid.shape[0], video_grid.shape[0]) + " (one per grid row)",
        )
    grid = np.empty((run_type.size, 3), dtype=np.int64)
    grid[is_image] = image_grid
    grid[~is_image] = video_grid
    for bad, expected in (
        ((grid < 1).any(1), "positive t, h and w"),
        ((grid[:, 1:] % merge != 0).any(1), f"h and w multiples of spatial_merge_size {merge}"),
    ):
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            raise SampleError(
                sample=_sample_of(cu, int(starts[k])),
                field="image_grid_thw" if is_image[k] else "video_grid_thw",
                actual=f"{grid[k].tolist()}",
                expected=expected,
            )
    return grid


def grid_rows(grid, field: str, sample: int | None = None) -> np.ndarray:
    """int64 ``[num, 3]`` rows of ``grid`` (``[num, 3]``, or a 1-D run of whole rows), or a
    :class:`SampleError` naming ``sample`` (None: the batch) and ``field`` when it is not numbers,
    has a fraction (a float grid is truncated by the cast) or does not make rows of three."""
    what = "rows of (t, h, w) ints"
    try:
        array = np.asarray(grid)
        if array.dtype.kind == "f" and not np.array_equal(array, np.trunc(array)):
            raise TypeError("a fraction")
        if array.dtype.kind not in "iuf" and array.size:
            raise TypeError(f"dtype {array.dtype}")
        array = array.astype(np.int64)
    except (TypeError, ValueError, OverflowError) as exc:
        dtype = getattr(grid, "dtype", None)
        raise SampleError(
            sample=sample,
            field=field,
            expected=f"{what}: [num, 3]",
            actual=f"{type(grid).__name__ if dtype is None else dtype} ({exc})",
        ) from None
    if array.size % 3 or array.ndim > 2 or (array.ndim == 2 and array.shape[1] != 3):
        raise SampleError(
            sample=sample,
            field=field,
            expected="rows of (t, h, w): [num, 3]",
            actual=f"shape {tuple(array.shape)}",
        )
    return array.reshape(-1, 3)


def _runs(images: int, videos: int) -> str:
    return f"{int(images)} runs of image tokens and {int(videos)} runs of video tokens"
