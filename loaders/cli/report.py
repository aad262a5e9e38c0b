"""Per-micro-batch statistics and the plain-text table ``prealign demo`` / ``inspect`` print.

>>> s = BatchStats(index=0, sequences=2, images=1, real_tokens=10, padded_tokens=12,
...                local_tokens=(6, 6), violations=0)
>>> print(format_table([s], tp=2))
 mb  seqs  imgs   real  padded  pad %  T_local per CP rank  T_local % tp  valid
  0     2     1     10      12  16.7%  6, 6                 0             yes
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from prealign.collate.indices import num_sequences


@dataclass(frozen=True, kw_only=True)
class BatchStats:
    """One micro-batch, seen from all its CP ranks."""

    index: int
    sequences: int
    images: int
    real_tokens: int
    """``cu_seqlens[-1]``: tokens of the samples."""
    padded_tokens: int
    """``T = cu_seqlens_padded[-1]``: what the model computes on, all CP ranks together."""
    local_tokens: tuple[int, ...]
    """``T_local`` of every CP rank (the token dim of its ``input_ids``)."""
    violations: int
    """Schema violations found on all ranks (0 when valid)."""
    videos: int = 0
    """Videos (rows of ``video_grid_thw``)."""
    shapes: dict = field(default_factory=dict, compare=False)
    """CP rank 0's field -> (dtype name, shape)."""


def batch_stats(index: int, rank_batches: list[dict], violations: int) -> BatchStats:
    """Summarise the batches of one micro-batch, one per CP rank (rank order)."""
    b0 = rank_batches[0]
    grid = b0.get(
        "image_grid_thw", b0.get("pixel_values")
    )  # whole images (Gemma 3): one pixel_values row each
    videos = b0.get("video_grid_thw")
    token_dim = {k: v.ndim - 1 for k, v in b0.items() if isinstance(v, torch.Tensor)}
    local = tuple(int(b["input_ids"].shape[token_dim["input_ids"]]) for b in rank_batches)
    if "cp_gather_index" in b0:  # deferred CP shard: the rank keeps cp_gather_index's rows
        local = tuple(int(b["cp_gather_index"].numel()) for b in rank_batches)
    return BatchStats(
        index=index,
        sequences=num_sequences(b0["cu_seqlens_padded"]),
        images=int(grid.shape[0]) if isinstance(grid, torch.Tensor) else 0,
        real_tokens=int(b0["cu_seqlens"][-1]),
        padded_tokens=int(b0["cu_seqlens_padded"][-1]),
        local_tokens=local,
        violations=violations,
        videos=int(videos.shape[0]) if isinstance(videos, torch.Tensor) else 0,
        shapes={
            k: (str(v.dtype).removeprefix("torch."), tuple(v.shape))
            for k, v in b0.items()
            if isinstance(v, torch.Tensor)
        },
    )


_HEADER = (" mb  seqs  imgs   real  padded  pad %  T_local per CP rank  T_local % tp  valid",)


def format_table(stats: list[BatchStats], *, tp: int, max_rows: int = 10) -> str:
    """One line per micro-batch (the first ``max_rows - 1`` and the last when there are more); a
    ``vids`` column when some micro-batch holds videos."""
    rows = list(stats) if len(stats) <= max_rows else [*stats[: max_rows - 1], None, stats[-1]]
    vids = any(s.videos for s in stats)
    lines = [_HEADER[0].replace("imgs ", "imgs  vids ") if vids else _HEADER[0]]
    for s in rows:
        if s is None:
            lines.append(f"{'...':>3}")
            continue
        pad = 100.0 * (s.padded_tokens - s.real_tokens) / max(s.padded_tokens, 1)
        mods = {t % tp for t in s.local_tokens}
        media = f"{s.images:>4}  {s.videos:>4}" if vids else f"{s.images:>4}"
        lines.append(
            f"{s.index:>3}  {s.sequences:>4}  {media}  {s.real_tokens:>5}  {s.padded_tokens:>6}  "
            f"{pad:>4.1f}%  {', '.join(map(str, s.local_tokens)):<19}  "
            f"{', '.join(map(str, sorted(mods))):<12}  "
            f"{'yes' if s.violations == 0 else f'NO ({s.violations})'}"
        )
    return "\n".join(lines)


def totals(stats: list[BatchStats]) -> dict[str, int]:
    """Totals over micro-batches: count, sequences, images, real and padded tokens, violations."""
    return {
        "micro_batches": len(stats),
        "sequences": sum(s.sequences for s in stats),
        "images": sum(s.images for s in stats),
        "videos": sum(s.videos for s in stats),
        "real_tokens": sum(s.real_tokens for s in stats),
        "padded_tokens": sum(s.padded_tokens for s in stats),
        "violations": sum(s.violations for s in stats),
    }


def format_shapes(stats: BatchStats) -> str:
    """``name  dtype  [shape]`` lines of CP rank 0's batch, in the batch's order."""
    width = max(len(k) for k in stats.shapes)
    return "\n".join(
        f"  {k:<{width}}  {dtype:<8}  {list(shape)}" for k, (dtype, shape) in stats.shapes.items()
    )
