"""A Megatron-style training loop that really runs on CPU: 4 processes under ``torchrun`` with gloo,
tp=2 and cp=2 from megatron-core's ``parallel_state``, ``check_startup`` on the first batch, a
checkpoint with the loader's state, and a resume that continues with exactly the batches and losses
of the uninterrupted run.

    torchrun --standalone --nproc_per_node 4 examples/megatron_torchrun.py

The model is a stand-in (an embedding and an output layer, replicated, gradients all-reduced over
the world): what is shown is the data side, which is the same with a megatron-core GPT: each rank
gets its CP shard of the same micro-batch (tp ranks of one CP rank get the same),
``to_packed_seq_params`` gives the ``PackedSeqParams`` the GPT's attention takes, and the loss
counts every real label once over the CP group.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from prealign.collate import to_packed_seq_params
from prealign.loaders import PackedLoader, ShardWriter, WebDatasetSource
from prealign.schemas import causal_lm_schema, check_startup
from prealign.schemas.parallel_state import import_megatron

VOCAB, STEPS, SAVE_AT = 256, 6, 3


def shared_folder() -> str:
    """A temporary folder made by rank 0, its path sent to every rank."""
    path = [tempfile.mkdtemp(prefix="prealign-megatron-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    return path[0]


def write_data(folder: str) -> list[str]:
    if dist.get_rank() == 0:
        rng = np.random.default_rng(0)
        with ShardWriter(os.path.join(folder, "train-%04d.tar"), max_bytes=16 << 10) as w:
            for i in range(160):
                w.write(
                    {
                        "__key__": f"s{i}",
                        "input_ids": rng.integers(1, VOCAB, int(rng.integers(5, 120))),
                    }
                )
    dist.barrier()
    return sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".tar"))


def build(shards: list[str]):
    """Model, optimizer and loader, the same on every rank (the loader reads its ranks from
    parallel_state)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 32), torch.nn.Linear(32, VOCAB))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loader = PackedLoader.from_parallel_state(
        WebDatasetSource(shards),
        schema=causal_lm_schema(vocab_size=VOCAB),
        token_budget=512,
        seed=1,
    )
    return model, optimizer, loader


def train_step(model, optimizer, batch) -> float:
    params = to_packed_seq_params(batch)  # a megatron-core GPT takes it as packed_seq_params=
    assert int(params.cu_seqlens_q_padded[-1]) == int(batch["cu_seqlens_padded"][-1])
    logits = model(batch["input_ids"][0])  # [T_local, V] (a GPT: [T_local, 1, V/tp] under TP)
    losses = F.cross_entropy(logits, batch["labels"][0], reduction="none", ignore_index=-100)
    mask = batch["loss_mask"][0]
    tokens = mask.sum().detach()
    dist.all_reduce(
        tokens
    )  # real labels over the world (each CP shard counted by its tp ranks alike)
    loss = (losses * mask).sum() / tokens
    loss.backward()
    for p in model.parameters():  # stand-in for the TP/CP/DP reductions of a real model
        dist.all_reduce(p.grad)
    optimizer.step()
    optimizer.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return float(total)


def main() -> None:
    dist.init_process_group("gloo")
    ps = import_megatron(
        "megatron.core.parallel_state"
    )  # (without its TE / Apex-absent warnings on a CPU)

    ps.initialize_model_parallel(tensor_model_parallel_size=2, context_parallel_size=2)
    rank = dist.get_rank()
    folder = shared_folder()
    shards = write_data(folder)
    ckpt = os.path.join(folder, f"ckpt-rank{rank}.pt")

    model, optimizer, loader = build(shards)
    run, seen = [], []
    for step, batch in enumerate(loader):
        if step == 0:  # every rank valid, same schema and layout, or every rank raises
            check_startup(batch, loader.schema, loader.layout)
        run.append(train_step(model, optimizer, batch))
        seen.append(batch["sample_index"].tolist())
        if step + 1 == SAVE_AT:
            torch.save(
                {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "loader": loader.state_dict(),
                },
                ckpt,
            )
        if step + 1 == STEPS:
            break

    model, optimizer, loader = build(shards)  # a restarted job
    state = torch.load(ckpt, weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    loader.load_state_dict(state["loader"])  # exact resume: refused if dp / layout / schema changed
    resumed, resumed_seen = [], []
    for batch in loader:
        resumed.append(train_step(model, optimizer, batch))
        resumed_seen.append(batch["sample_index"].tolist())
        if len(resumed) == STEPS - SAVE_AT:
            break
    assert resumed_seen == seen[SAVE_AT:], "the resumed job saw other samples"
    assert np.allclose(resumed, run[SAVE_AT:], rtol=1e-6, atol=0), (resumed, run[SAVE_AT:])
    if rank == 0:
        print(
            f"tp=2 cp=2 dp={loader.dp_size}: losses {[round(x, 4) for x in run]}; resumed at step "
            f"{SAVE_AT}: {[round(x, 4) for x in resumed]} (the same)"
        )
    dist.barrier()
    if rank == 0:
        import shutil

        shutil.rmtree(folder)
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
