"""A Hugging Face ``Trainer`` whose steps are token-budgeted micro-batches from ``PackedLoader``.

The ``Trainer`` normally batches a fixed number of rows; here each step is one packed ``[1, T]`` row
of at most ``token_budget`` tokens, planned by prealign (best-fit packing, whole sequences, an exact
resume state), and handed to the model as ``to_hf_kwargs`` builds it (positions restarting per
sequence, HF-convention labels). The model is a tiny Qwen2 built from a config (no download). Run:

    python examples/hf_trainer_budget.py
"""

from __future__ import annotations

import tempfile

import datasets
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Trainer, TrainingArguments

from prealign.collate import HFAttention, to_hf_kwargs
from prealign.loaders import HFSource, PackedLoader
from prealign.schemas import ParallelLayout, causal_lm_schema

VOCAB, BUDGET = 128, 256


class PackedBatches:
    """A ``PackedLoader`` as the Trainer's dataloader: each batch as model keyword arguments."""

    def __init__(self, loader: PackedLoader):
        self.loader = loader

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        for batch in self.loader:
            yield to_hf_kwargs(batch, attention=HFAttention.POSITIONS)


class PackedTrainer(Trainer):
    """``Trainer`` that takes its training batches from a ``PackedLoader`` (``packed=``)."""

    def __init__(self, *args, packed: PackedLoader, **kwargs):
        super().__init__(*args, **kwargs)
        self.packed = packed

    def get_train_dataloader(self):
        return PackedBatches(self.packed)


def main(output_dir: str) -> list[dict]:
    datasets.disable_progress_bars()
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(8, 120, (64,), generator=g).tolist()
    rows = datasets.Dataset.from_dict(
        {"input_ids": [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in lengths]}
    )
    loader = PackedLoader(
        HFSource(rows),
        schema=causal_lm_schema(vocab_size=VOCAB),
        layout=ParallelLayout(),
        token_budget=BUDGET,
        seed=0,
    )  # cp_rank=None: whole sequences, as an HF forward needs
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            attn_implementation="sdpa",
        )
    )
    args = TrainingArguments(
        output_dir=output_dir,
        max_steps=len(loader),
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = PackedTrainer(model=model, args=args, packed=loader)
    trainer.train()
    steps = [row for row in trainer.state.log_history if "loss" in row]
    assert len(steps) == len(loader) and all(
        row["loss"] == row["loss"] for row in steps
    )  # every step, finite
    tokens = [int(b["input_ids"].shape[1]) for b in loader]
    assert max(tokens) <= BUDGET and sum(len(b["sample_index"]) for b in loader) == len(lengths)
    return steps


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        for row in main(tmp):
            print({k: row[k] for k in ("step", "loss") if k in row})
