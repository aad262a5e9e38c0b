"""Your Hugging Face dataset (prompt / response rows, or chat messages) to Megatron batches with SFT
labels.

    rows ──ds.map(tokenize)──► input_ids + labels (-100 on the prompt) ──HFSource──► PackedLoader
         ──► THD micro-batches for tp=2, cp=2 (this CP rank's zigzag shard) ──► PackedSeqParams

The tokenizer here is built in memory (a word-level ``tokenizers`` model, no download); with yours,
use ``AutoTokenizer.from_pretrained(path)`` and, for chat rows, ``tokenizer.apply_chat_template``.
Run:

    python examples/hf_sft.py
"""

from __future__ import annotations

import datasets
import torch

from prealign.collate import to_packed_seq_params
from prealign.loaders import HFSource, PackedLoader
from prealign.schemas import ParallelLayout, causal_lm_schema, validate_batch

ROWS = {
    "prompt": [
        "What colour is the sky?",
        "What is two and two?",
        "Name a prime number.",
        "Say hello.",
    ]
    * 8,
    "response": ["The sky is blue.", "Two and two is four.", "Seven is a prime number.", "Hello!"]
    * 8,
}


def local_tokenizer(texts: list[str]):
    """A word-level Hugging Face tokenizer over the words of ``texts`` (stands in for your own)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pre = pre_tokenizers.Whitespace()
    words = sorted({w for t in texts for w, _ in pre.pre_tokenize_str(t)})
    model = models.WordLevel(
        {w: i for i, w in enumerate(["<pad>", "<unk>", "</s>", *words])}, unk_token="<unk>"
    )
    tok = Tokenizer(model)
    tok.pre_tokenizer = pre
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="</s>"
    )


def sft_tokenize(tokenizer):
    """Row -> ``input_ids`` (prompt + response + eos) and ``labels``: the same ids with -100 on the
    prompt, so only the response is trained on (prealign shifts labels to the next token)."""

    def tokenize(row: dict) -> dict:
        prompt = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        response = tokenizer(row["response"], add_special_tokens=False)["input_ids"] + [
            tokenizer.eos_token_id
        ]
        return {"input_ids": prompt + response, "labels": [-100] * len(prompt) + response}

    return tokenize


def main() -> list[dict]:
    datasets.disable_progress_bars()
    tokenizer = local_tokenizer(ROWS["prompt"] + ROWS["response"])
    rows = datasets.Dataset.from_dict(ROWS)
    ds = rows.map(sft_tokenize(tokenizer), remove_columns=rows.column_names)

    layout = ParallelLayout(tp=2, cp=2)
    schema = causal_lm_schema(pad_token_id=tokenizer.pad_token_id, vocab_size=len(tokenizer))
    loaders = [
        PackedLoader(
            HFSource(ds), schema=schema, layout=layout, token_budget=128, cp_rank=r, seed=0
        )
        for r in range(layout.cp)
    ]  # in training: one per process, PackedLoader.from_parallel_state(...)
    batches = []
    for step, per_cp_rank in enumerate(zip(*loaders)):
        for batch in per_cp_rank:
            validate_batch(batch, schema, layout)  # the Megatron/TE constraints, checked
            params = to_packed_seq_params(batch)  # megatron-core PackedSeqParams(qkv_format="thd")
            assert params.cu_seqlens_q_padded[-1] == batch["cu_seqlens_padded"][-1]
        whole = per_cp_rank[0]
        trained = sum(int(r.sum()) for r in (b["loss_mask"] for b in per_cp_rank))
        prompts = sum(
            len(ds[i]["labels"]) - sum(x != -100 for x in ds[i]["labels"])
            for i in whole["sample_index"].tolist()
        )
        answers = sum(
            sum(x != -100 for x in ds[i]["labels"]) for i in whole["sample_index"].tolist()
        )
        assert trained == answers, (
            trained,
            answers,
        )  # every response token is a label; no prompt token is
        batches.append(
            {
                "step": step,
                "samples": len(whole["sample_index"]),
                "T_local": whole["input_ids"].shape[1],
                "prompt_tokens": prompts,
                "trained_tokens": trained,
            }
        )
    assert sum(b["samples"] for b in batches) == len(ds)
    return batches


if __name__ == "__main__":
    torch.manual_seed(0)
    for row in main():
        print(row)
