"""Elastic resume costs work linear in the earlier segments (issue #31: a 64-segment state over 200k
samples took minutes): each segment's replay plans one chunk, whatever the segments before it;
counted, not timed."""

from __future__ import annotations

import numpy as np

from prealign.loaders import PlannerConfig
from prealign.loaders.index.sample_index import SampleIndex
from prealign.loaders.plan import planner as planner_module
from prealign.loaders.plan.elastic import Segment
from prealign.loaders.plan.schedule import Schedule
from prealign.loaders.policy import BadDataReport
from prealign.schemas import ParallelLayout

CHUNK = 400


def _work(num_segments: int, n: int, monkeypatch) -> dict:
    """Chunks planned and samples packed to serve the first micro-batch after ``num_segments``
    earlier segments of one micro-batch each, alternating DP 2 / 3 (the hostile state of issue
    #31)."""
    counts = {"chunks": 0, "packed": 0}
    plan_chunk, advance = planner_module.ChunkedPlan._plan_chunk, planner_module.StreamFit.advance

    def counted_chunk(self, c):
        counts["chunks"] += 1
        return plan_chunk(self, c)

    def counted_advance(self, stop):
        before = self.pos
        out = advance(self, stop)
        counts["packed"] += self.pos - before
        return out

    monkeypatch.setattr(planner_module.ChunkedPlan, "_plan_chunk", counted_chunk)
    monkeypatch.setattr(planner_module.StreamFit, "advance", counted_advance)
    lengths = np.random.default_rng(0).integers(3, 60, n).astype(np.int64)
    index = SampleIndex(
        lengths=lengths,
        locations=np.arange(n, dtype=np.int64)[:, None],
        shards=np.zeros(n, np.int64),
        report=BadDataReport(),
    )
    schedule = Schedule(
        index,
        layout=ParallelLayout(cp=2),
        token_budget=128,
        dp_size=4,
        planner=PlannerConfig(chunk_size=CHUNK),
        seed=3,
        shuffle=True,
        sequential=False,
        window=None,
    )
    schedule.resized = (
        0,
        tuple(Segment(dp_size=2 + i % 2, position=1) for i in range(num_segments)),
    )
    requests = schedule(0, 0)
    next(iter(requests))
    monkeypatch.undo()
    return counts


def test_resume_work_is_linear_in_segments_and_flat_in_data(monkeypatch):
    per_segment = []
    for n in (16 * CHUNK, 64 * CHUNK):
        small, large = _work(8, n, monkeypatch), _work(16, n, monkeypatch)
        assert large["chunks"] - small["chunks"] == 8  # one chunk per earlier segment
        per_segment.append((large["packed"] - small["packed"]) / 8)
    # a chunk and the packing window past it, never the rest of the epoch: the same for 4x the data
    assert per_segment[0] == per_segment[1] <= CHUNK + PlannerConfig().buffer_size
