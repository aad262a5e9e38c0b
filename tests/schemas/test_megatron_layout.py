"""ParallelLayout.from_megatron / megatron_parallel_sizes on a real megatron-core parallel state
(4 gloo processes: tp=2 x cp=2), and the collator fed from it."""

import os

import pytest
import torch

from tests.conftest import spawn_ranks

pytestmark = pytest.mark.slow


def _worker(rank: int, world: int, port: int, results) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from prealign.collate import THDCollator
    from prealign.schemas import ParallelLayout, causal_lm_schema, validate_batch
    from prealign.schemas.parallel_state import megatron_parallel_sizes

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=__import__("datetime").timedelta(seconds=60)
    )
    try:
        ps.initialize_model_parallel(tensor_model_parallel_size=2, context_parallel_size=2)
        layout = ParallelLayout.from_megatron(fp8="fp8")
        sizes = megatron_parallel_sizes()
        coll = THDCollator(schema=causal_lm_schema(), layout=layout, cp_rank=sizes["cp_rank"])
        batch = coll([{"input_ids": torch.arange(1, 4027)}])  # the seed's B=1, 4026 tokens
        validate_batch(batch, causal_lm_schema(), layout)
        results[rank] = (
            layout.tp,
            layout.cp,
            layout.sp,
            layout.fp8.value,
            sizes["tp_rank"],
            sizes["cp_rank"],
            batch["input_ids"].shape[1],
        )
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def test_from_megatron_reads_real_parallel_state():
    world = 4
    got = spawn_ranks(_worker, world)
    assert sorted(got) == list(range(world))
    assert {v[:4] for v in got.values()} == {(2, 2, True, 16)}
    # every (tp_rank, cp_rank) pair appears once; T_local is SP- and FP8-aligned
    assert sorted(v[4:6] for v in got.values()) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for *_, t_local in got.values():
        assert t_local % 2 == 0 and t_local % 16 == 0 and t_local * 2 >= 4026
