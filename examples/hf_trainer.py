"""A Hugging Face ``Trainer`` fed by a prealign collator:
``data_collator=HFCollator(collator=THDCollator(...))``.

Each step's batch is one packed ``[1, T]`` row laid out for the given ``ParallelLayout`` (here tp=2,
cp=2 padding, so the same batches would feed a Megatron run) and handed to the model as
``to_hf_kwargs`` builds it: ids, positions restarting per sequence, HF-convention labels,
``attention_mask=None`` (eager / sdpa see the packing from the positions; pass
``attention=HFAttention.VARLEN`` for a flash-attention model). Runs on CPU in seconds with a tiny
randomly initialised model:

    python examples/hf_trainer.py
"""

from __future__ import annotations

import tempfile

import torch


def train(output_dir: str, *, max_steps: int = 3, attn: str = "sdpa") -> list[dict]:
    """Train a tiny Qwen2 for ``max_steps`` steps on random packed samples; returns the Trainer's
    log history."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Trainer, TrainingArguments

    from prealign.collate import HFAttention, HFCollator, THDCollator
    from prealign.schemas import ParallelLayout, causal_lm_schema

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            attn_implementation=attn,
        )
    )
    g = torch.Generator().manual_seed(0)
    dataset = [
        {
            "input_ids": torch.randint(1, 128, (int(n),), generator=g),
            "loss_mask": (torch.arange(int(n)) >= int(n) // 3).float(),
        }  # train on the last 2/3 ("replies")
        for n in torch.randint(4, 64, (32,), generator=g)
    ]
    collator = HFCollator(
        collator=THDCollator(
            schema=causal_lm_schema(vocab_size=128), layout=ParallelLayout(tp=2, cp=2)
        ),
        attention=HFAttention.POSITIONS,
    )
    args = TrainingArguments(
        output_dir=output_dir,
        max_steps=max_steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        remove_unused_columns=False,  # keep the samples' loss_mask for the collator
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=collator)
    trainer.train()
    return trainer.state.log_history


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        for row in train(tmp):
            print(row)
