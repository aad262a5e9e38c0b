"""Video frames -> the Qwen video processors' ``pixel_values_videos``, as arrays (no torchvision).

    frames   RGB PIL images, one size     --video_patches-->  uint8 [t*gh*gw, 3, tp, p, p]
             (the video's sampled frames) resized like the PIL image processor, the last frame
                 repeated to a multiple of tp, cut in the video processors' patch order
             --normalize_patches(table)-->  float32 [t*gh*gw, 3*tp*p*p]

The values follow transformers' PIL image processor on each frame (bicubic resize, rescale,
normalize, computed with a lookup table exactly as there); transformers' video processors resize
with torchvision instead, whose bicubic interpolation rounds differently (up to a few uint8 steps
per pixel): the grids, token counts and patch order are the same.
"""

from __future__ import annotations

import functools

import numpy as np


@functools.lru_cache(maxsize=16)
def normalize_table(
    mean: tuple[float, ...], std: tuple[float, ...], rescale_factor: float
) -> np.ndarray:
    """float32 ``[3 * 256]``: what rescale + normalize make of each uint8 value per channel, with
    transformers' own operations (float64 rescale, float32 cast, float32 ``(x - mean) / std``).

    >>> normalize_table((0.5, 0.5, 0.5), (0.5, 0.5, 0.5), 1 / 255)[[0, 255, 511]].tolist()
    [-1.0, 1.0, 1.0]
    """
    values = (np.arange(256, dtype=np.uint8).astype(np.float64) * rescale_factor).astype(np.float32)
    m, s = np.array(mean, dtype=np.float32), np.array(std, dtype=np.float32)
    return np.ascontiguousarray(((np.broadcast_to(values, (3, 256)).T - m) / s).T).reshape(-1)


def video_patches(
    frames: list,
    grid: tuple[int, int, int],
    patch_size: int,
    merge_size: int,
    temporal_patch_size: int,
) -> np.ndarray:
    """RGB PIL frames of one size -> uint8 ``[t*gh*gw, 3, tp, p, p]`` for ``grid = (t, gh, gw)``:
    each frame resized (PIL bicubic) to ``gw*p x gh*p``, the last repeated up to ``t * tp`` frames,
    patches in the video processors' order ``(t, gh/m, gw/m, m, m)``."""
    from PIL import Image

    t, gh, gw = grid
    p, m, tp = patch_size, merge_size, temporal_patch_size
    resized = np.stack(
        [np.asarray(f.resize((gw * p, gh * p), resample=Image.Resampling.BICUBIC)) for f in frames]
    )
    if resized.shape[0] < t * tp:
        resized = np.concatenate(
            (resized, np.repeat(resized[-1:], t * tp - resized.shape[0], axis=0))
        )
    # (t, tp, gh/m, m, p, gw/m, m, p, C) -> (t, gh/m, gw/m, m, m, C, tp, p, p)
    blocks = resized.reshape(t, tp, gh // m, m, p, gw // m, m, p, 3).transpose(
        0, 2, 5, 3, 6, 8, 1, 4, 7
    )
    return np.ascontiguousarray(blocks).reshape(t * gh * gw, 3, tp, p, p)


def normalize_patches(codes: np.ndarray, table: np.ndarray) -> np.ndarray:
    """uint8 ``[n, 3, tp, p, p]`` -> float32 ``[n, 3*tp*p*p]``: one lookup per value in
    :func:`normalize_table`."""
    offsets = (np.arange(3, dtype=np.uint16) * 256).reshape(1, 3, 1, 1, 1)
    return np.take(table, np.add(codes, offsets, dtype=np.uint16)).reshape(codes.shape[0], -1)


@functools.lru_cache(maxsize=16)
def fused_normalize_table(
    mean: tuple[float, ...], std: tuple[float, ...], rescale_factor: float
) -> np.ndarray:
    """float32 ``[3 * 256]``: what transformers' video processors make of each uint8 value per
    channel, their rescale fused into normalize: ``(float32(x) - mean / rescale_factor) / (std /
    rescale_factor)``, the fused mean and std computed as there (a float32 tensor times ``1 /
    rescale_factor``), in float32 torch operations.

    >>> fused_normalize_table((0.5, 0.5, 0.5), (0.5, 0.5, 0.5), 1 / 255)[[0, 255, 511]].tolist()
    [-1.0, 1.0, 1.0]
    """
    import torch

    m = torch.tensor(mean) * (1.0 / rescale_factor)
    s = torch.tensor(std) * (1.0 / rescale_factor)
    values = torch.arange(256, dtype=torch.uint8).to(torch.float32).expand(3, 256)
    return ((values - m[:, None]) / s[:, None]).numpy().reshape(-1).copy()


def patchify(
    frames: np.ndarray,
    grid: tuple[int, int, int],
    patch_size: int,
    merge_size: int,
    temporal_patch_size: int,
) -> np.ndarray:
    """uint8 ``[n, 3, gh*p, gw*p]`` resized frames -> uint8 ``[t*gh*gw, 3, tp, p, p]`` for ``grid =
    (t, gh, gw)``: the last frame repeated up to ``t * tp`` frames, patches in the video processors'
    order ``(t, gh/m, gw/m, m, m)``."""
    t, gh, gw = grid
    p, m, tp = patch_size, merge_size, temporal_patch_size
    if frames.shape[0] < t * tp:
        frames = np.concatenate((frames, np.repeat(frames[-1:], t * tp - frames.shape[0], axis=0)))
    # (t, tp, C, gh/m, m, p, gw/m, m, p) -> (t, gh/m, gw/m, m, m, C, tp, p, p)
    blocks = frames.reshape(t, tp, 3, gh // m, m, p, gw // m, m, p).transpose(
        0, 3, 6, 4, 7, 2, 1, 5, 8
    )
    return np.ascontiguousarray(blocks).reshape(t * gh * gw, 3, tp, p, p)
