"""Real multi-process ranks: 8 gloo processes with megatron-core's parallel_state for
DP=2 x CP=2 x TP=2, each building its PackedLoader from the process groups."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import traceback

import pytest
import torch

from prealign.schemas import ParallelLayout, causal_lm_schema
from tests.loader_helpers import sample_lengths, write_shards

WORLD, TP, CP = 8, 2, 2
BUDGET = 192


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, port: int, shards: list[str], out_dir: str) -> None:
    try:
        torch.set_num_threads(1)
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        from prealign.loaders import PackedLoader, WebDatasetSource

        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
        )
        ps.initialize_model_parallel(tensor_model_parallel_size=TP, context_parallel_size=CP)
        loader = PackedLoader.from_parallel_state(
            WebDatasetSource(shards), schema=causal_lm_schema(), token_budget=BUDGET, seed=3
        )
        batches = list(loader)
        mine = {
            "rank": rank,
            "tp_rank": ps.get_tensor_model_parallel_rank(),
            "cp_rank": ps.get_context_parallel_rank(),
            "dp_rank": ps.get_data_parallel_rank(),
            "dp_size": loader.dp_size,
            "loader_cp_rank": loader.cp_rank,
            "layout": loader.layout.to_dict(),
            "state": loader.state_dict(),
            "samples": [b["sample_index"].tolist() for b in batches],
            "input_ids": [b["input_ids"].tolist() for b in batches],
            "cu_seqlens_padded": [b["cu_seqlens_padded"].tolist() for b in batches],
        }
        gathered = [None] * WORLD
        dist.all_gather_object(gathered, mine)  # every rank reached the end of the epoch: no hang
        if rank == 0:
            with open(os.path.join(out_dir, "result.json"), "w") as f:
                json.dump(gathered, f)
        ps.destroy_model_parallel()
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(out_dir, f"error-{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise


@pytest.mark.slow
def test_dp2_cp2_tp2_with_megatron_parallel_state(tmp_path):
    lengths = sample_lengths(80, seed=11)
    shards = write_shards(str(tmp_path / "shards"), lengths, num_shards=4)
    import megatron.core.parallel_state  # noqa: F401  (imported once here, inherited by the forked ranks)

    ctx = mp.get_context("fork")  # the parent has torch imported already: much faster than spawn
    port = _free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, port, shards, str(tmp_path)), daemon=True)
        for r in range(WORLD)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    alive = [i for i, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    errors = [
        (tmp_path / f"error-{r}.txt").read_text()
        for r in range(WORLD)
        if (tmp_path / f"error-{r}.txt").exists()
    ]
    assert not errors, errors[0]
    assert not alive, f"ranks {alive} did not finish (hang?)"
    ranks = json.loads((tmp_path / "result.json").read_text())

    from prealign.collate import THDCollator, unshard_cp
    from prealign.loaders import PackedLoader, WebDatasetSource

    layout = ParallelLayout(tp=TP, cp=CP)
    assert all(
        r["layout"] == layout.to_dict()
        and r["dp_size"] == 2
        and r["loader_cp_rank"] == r["cp_rank"]
        for r in ranks
    )
    assert len({json.dumps(r["state"], sort_keys=True) for r in ranks}) == 1, (
        "the same state on every rank"
    )
    counts = {len(r["samples"]) for r in ranks}
    assert len(counts) == 1 and counts.pop() >= 2, "the same number of micro-batches on every rank"
    by = {(r["dp_rank"], r["cp_rank"], r["tp_rank"]): r for r in ranks}
    for dp in range(2):
        for cp in range(CP):
            assert by[(dp, cp, 0)]["input_ids"] == by[(dp, cp, 1)]["input_ids"], (
                "TP ranks: identical batches"
            )
        assert by[(dp, 0, 0)]["samples"] == by[(dp, 1, 0)]["samples"], (
            "CP ranks: the same micro-batches"
        )
    assert not set(sum(by[(0, 0, 0)]["samples"], [])) & set(sum(by[(1, 0, 0)]["samples"], []))
    assert sorted(sum(by[(0, 0, 0)]["samples"] + by[(1, 0, 0)]["samples"], [])) == list(
        range(len(lengths))
    )
    # CP shards are complementary: together they are the unsharded batch of the same samples
    full = PackedLoader(
        WebDatasetSource(shards),
        schema=causal_lm_schema(),
        layout=layout,
        token_budget=BUDGET,
        seed=3,
        dp_size=2,
        dp_rank=1,
    )
    for i, whole in enumerate(full):
        parts = [torch.tensor(by[(1, cp, 0)]["input_ids"][i]) for cp in range(CP)]
        back = unshard_cp(parts, cu_seqlens_padded=whole["cu_seqlens_padded"])
        assert (
            torch.equal(back, whole["input_ids"]) and int(whole["cu_seqlens_padded"][-1]) <= BUDGET
        )
    assert THDCollator  # the collator the loader used by default


class _ConfigMistakeOnRank1:
    """A transform that hits a configuration mistake on rank 1 only (a tokenizer file it cannot
    find)."""

    def __call__(self, row):
        import torch.distributed as dist

        from prealign.schemas.errors import ConfigError

        if dist.get_rank() == 1:
            raise ConfigError("tokenizer: no such file on this node")
        return {"input_ids": torch.tensor(row["input_ids"])}


def _index_rank(rank: int, port: int, out_dir: str) -> None:
    import datasets
    import torch.distributed as dist

    from prealign.loaders import HFSource, build_index
    from tests.loader_helpers import hf_rows

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    src = HFSource(
        datasets.Dataset.from_dict(hf_rows(sample_lengths(40))),
        transform=_ConfigMistakeOnRank1(),
        rows_per_shard=10,
    )
    try:
        build_index(src, causal_lm_schema(), distributed=True)
        out = {"ok": True}
    except Exception as exc:  # noqa: BLE001 - the test inspects the type
        out = {"type": type(exc).__name__, "message": str(exc)}
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


@pytest.mark.slow
def test_a_typed_error_on_one_rank_of_the_index_pass_keeps_its_type_on_every_rank(tmp_path):
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_index_rank, args=(r, port, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        if p.is_alive():
            p.kill()
            pytest.fail("index pass hung")
    outs = [json.load(open(tmp_path / f"{r}.json")) for r in range(2)]
    assert [o.get("type") for o in outs] == ["ConfigError", "ConfigError"], outs
    assert outs[0]["message"].startswith("index pass failed on rank 1: tokenizer")
