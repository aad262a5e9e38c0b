"""check_startup across real processes (gloo): agreement returns one fingerprint everywhere; a
mismatched layout or a bad batch on one rank raises StartupMismatchError on every rank, never a
hang.

One spawn of four processes runs every scenario in turn in the same process group (each scenario
either succeeds or fails on all ranks, so the group stays in step); the tests read its results.
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from prealign.collate import THDCollator
from prealign.schemas import PadPolicy, ParallelLayout, StartupMismatchError, check_startup
from prealign.schemas.distributed import layout_fingerprint
from tests.conftest import TOPK, free_port, make_samples, schema_for

WORLD = 4
SCHEMA = schema_for(TOPK)
LAYOUT = ParallelLayout(tp=2, cp=2)  # ranks 0,1 and 2,3 form the CP pairs (rank % 2 = CP rank)
DEADLINE_S = 150


def batch_for(rank: int, layout: ParallelLayout = LAYOUT) -> dict:
    samples = make_samples([5 + rank, 30, 3], topk=TOPK)
    return THDCollator(schema=SCHEMA, layout=layout, cp_rank=rank % layout.cp)(samples)


def corrupted(rank: int) -> dict:
    b = batch_for(rank)
    return {**b, "labels": b["labels"].flip(1), "position_ids": b["position_ids"] + 1}


SCENARIOS = {
    "agree": lambda rank: (batch_for(rank), LAYOUT),
    "rank 1 other layout": lambda rank: (
        (
            batch_for(rank, ParallelLayout(tp=2, cp=2, pad_policy=PadPolicy.PER_SEQUENCE)),
            ParallelLayout(tp=2, cp=2, pad_policy=PadPolicy.PER_SEQUENCE),
        )
        if rank == 1
        else (batch_for(rank), LAYOUT)
    ),
    "rank 2 corrupted batch": lambda rank: (
        corrupted(rank) if rank == 2 else batch_for(rank),
        LAYOUT,
    ),
    "rank 3 unreadable batch": lambda rank: (None if rank == 3 else batch_for(rank), LAYOUT),
    "agree again": lambda rank: (batch_for(rank), LAYOUT),
    # issue 8 item 4: a rank that calls late / never, with a short timeout; the others name it,
    # never hang
    "rank 3 late": lambda rank: (batch_for(rank), LAYOUT),
    "rank 3 absent": lambda rank: (batch_for(rank), LAYOUT),
}
SHORT_TIMEOUT_S = 3.0


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    results = {}
    for name, make in SCENARIOS.items():
        batch, layout = make(rank)
        kwargs = (
            {"timeout": SHORT_TIMEOUT_S}
            if name.startswith("rank 3 l") or name.startswith("rank 3 a")
            else {}
        )
        if rank == 3 and name == "rank 3 absent":
            results[name] = {"skipped": True}
            continue
        if rank == 3 and name == "rank 3 late":
            time.sleep(SHORT_TIMEOUT_S + 2)
        started = time.monotonic()
        try:
            results[name] = {"fingerprint": check_startup(batch, SCHEMA, layout, **kwargs)}
        except Exception as exc:  # noqa: BLE001 - the test inspects every outcome
            results[name] = {"error": type(exc).__name__, "message": str(exc)}
        results[name]["seconds"] = time.monotonic() - started
    if rank == 0:  # rank 0 hosts the store: stay until the others are done with it
        time.sleep(1.0)
    dist.destroy_process_group()
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(results, f)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, list[dict]]:
    """scenario -> per-rank outcome, from one run of ``WORLD`` processes (killed if they hang)."""
    out_dir = str(tmp_path_factory.mktemp("startup"))
    ctx = mp.spawn(_worker, args=(WORLD, free_port(), out_dir), nprocs=WORLD, join=False)
    deadline = time.monotonic() + DEADLINE_S
    try:
        while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                pytest.fail(f"check_startup processes still running after {DEADLINE_S}s (a hang)")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    per_rank = []
    for r in range(WORLD):
        with open(os.path.join(out_dir, f"{r}.json")) as f:
            per_rank.append(json.load(f))
    return {name: [per_rank[r][name] for r in range(WORLD)] for name in SCENARIOS}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["agree", "agree again"])
def test_agreeing_ranks_return_the_same_fingerprint(outcomes, name):
    assert [o.get("fingerprint") for o in outcomes[name]] == [
        layout_fingerprint(SCHEMA, LAYOUT)
    ] * WORLD


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, says",
    [
        ("rank 1 other layout", "fingerprints differ across ranks"),
        ("rank 2 corrupted batch", "rank 2: "),
        (
            "rank 3 unreadable batch",
            "rank 3: 1 violation(s): batch: expected a",
        ),  # validate_batch reports a non-dict
    ],
)
def test_one_bad_rank_fails_every_rank(outcomes, name, says):
    for rank, o in enumerate(outcomes[name]):
        assert o.get("error") == StartupMismatchError.__name__, (rank, o)
        assert says in o["message"], (rank, o["message"])


@pytest.mark.slow
def test_a_rank_that_never_calls_is_named_by_every_other_rank(outcomes):
    """Ranks 0-2 call check_startup(timeout=3 s), rank 3 never does: each of 0-2 raises
    StartupMismatchError naming rank 3 within a few seconds (the process group timeout is 60 s)."""
    seen = 0
    for rank, o in enumerate(outcomes["rank 3 absent"][:3]):
        assert o.get("error") == StartupMismatchError.__name__, (rank, o)
        assert "rank(s) [3] did not call check_startup within 3 s" in o["message"], o["message"]
        assert o["seconds"] < SHORT_TIMEOUT_S + 10, o
        seen += 1
    assert seen == 3 and outcomes["rank 3 absent"][3] == {"skipped": True}


@pytest.mark.slow
def test_a_rank_that_calls_too_late_fails_too(outcomes):
    for rank, o in enumerate(outcomes["rank 3 late"]):
        assert o.get("error") == StartupMismatchError.__name__, (rank, o)
        assert "[3]" in o["message"], o["message"]


def test_single_process_only_validates():
    assert check_startup(batch_for(0), SCHEMA, LAYOUT) == layout_fingerprint(SCHEMA, LAYOUT)
    with pytest.raises(ValueError, match="violation"):
        check_startup(corrupted(0), SCHEMA, LAYOUT)
