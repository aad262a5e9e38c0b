"""Tiny randomly initialised Hugging Face models built from configs (no weights, no downloads) and
the per-token quantities the consumer tests compare: next-token cross-entropy, top-k distillation
KL.

Everything runs in float64 on CPU with fixed seeds, so a packed forward and a per-sample forward
agree to ~1e-12 when the batch is right; a corrupted batch differs by orders of magnitude more.
"""

from __future__ import annotations

import functools

import torch

VOCAB = 128
TOL = 1e-5  # the tolerance; correct batches agree to ~1e-12 in float64
CORRUPT = 1e-3  # a corrupted batch must move some compared value by more than this
INIT = 0.3  # weights' std: large enough that attention is sharp and every position moves the logits


@functools.lru_cache(maxsize=None)
def causal_lm(attn: str = "sdpa", family: str = "qwen2"):
    """A 2-layer causal LM (hidden 32, vocab 128, GQA 4/2 heads), float64, eval mode."""
    import transformers

    torch.manual_seed(0)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        initializer_range=INIT,
        attn_implementation=attn,
    )
    if family == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    return model.to(torch.float64).eval()


def random_samples(
    lengths, *, seed: int = 0, topk: int | None = None, loss_mask: bool = False
) -> list[dict]:
    """Text samples of random ids in ``[1, VOCAB)``; optional teacher top-k (distinct ids per row,
    log-probs of a random distribution) and a sample loss mask that drops every third token."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        s = {"input_ids": torch.randint(1, VOCAB, (n,), generator=g)}
        if topk is not None:
            s["teacher_topk_ids"] = torch.rand(n, VOCAB, generator=g).argsort(-1)[:, :topk]
            s["teacher_topk_log_probs"] = (
                torch.log_softmax(torch.randn(n, VOCAB, generator=g), -1)
                .gather(-1, s["teacher_topk_ids"])
                .to(torch.float32)
            )
        if loss_mask:
            s["loss_mask"] = (torch.arange(n) % 3 != 2).to(torch.float32)
        out.append(s)
    return out


def token_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """float ``[T, V]`` logits, int ``[T]`` next-token labels (-100 ignored) -> per-token CE ``[T]``
    (0 where ignored)."""
    return torch.nn.functional.cross_entropy(logits, labels.clamp_min(0), reduction="none") * (
        labels >= 0
    )


def topk_kl(
    logits: torch.Tensor, teacher_log_probs: torch.Tensor, teacher_ids: torch.Tensor
) -> torch.Tensor:
    """Per-token KL(teacher || student) on the teacher's top-k, the teacher renormalised over its k:
    ``[T, V]``, ``[T, K]``, ``[T, K]`` -> ``[T]``."""
    student = torch.log_softmax(logits, -1).gather(-1, teacher_ids)
    teacher = torch.log_softmax(teacher_log_probs.to(logits.dtype), -1)
    return (teacher.exp() * (teacher - student)).sum(-1)


def sample_next_token_targets(sample: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """A sample run alone: (next-token labels ``[L]``, -100 on the last; trained mask ``[L]``: a
    label exists and the sample's own mask keeps the *next* token)."""
    ids = sample["input_ids"]
    labels = torch.cat((ids[1:], torch.tensor([-100])))
    keep = sample.get("loss_mask", torch.ones(ids.numel()))
    trained = torch.cat((keep[1:], torch.zeros(1))) * (labels >= 0)
    return labels, trained


def real_slots(batch: dict) -> list[torch.Tensor]:
    """Per sequence, the packed slots of its real tokens (``cu_seqlens_padded[i] +
    arange(L_i)``)."""
    padded, true = batch["cu_seqlens_padded"].tolist(), batch["cu_seqlens"].tolist()
    return [
        torch.arange(padded[i], padded[i] + true[i + 1] - true[i]) for i in range(len(true) - 1)
    ]


@functools.lru_cache(maxsize=None)
def qwen2_vl(attn: str = "sdpa"):
    """A tiny ``Qwen2VLForConditionalGeneration`` (1-block vision tower, 2-layer LM, hidden 32)
    whose special ids are the demo byte tokenizer's, float64, eval mode."""
    import transformers

    from prealign.loaders.cli.demo_tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    torch.manual_seed(0)
    config = transformers.Qwen2VLConfig(
        text_config=dict(
            vocab_size=tok.vocab_size,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            initializer_range=INIT,
            bos_token_id=tok.eos_token_id,
            eos_token_id=tok.eos_token_id,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [2, 1, 1],
            },
        ),
        vision_config=dict(
            depth=1,
            embed_dim=32,
            hidden_size=32,
            num_heads=2,
            mlp_ratio=2,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            in_channels=3,
            initializer_range=INIT,
        ),
        image_token_id=tok.image_token_id,
        vision_start_token_id=tok.vision_start_token_id,
        vision_end_token_id=tok.vision_end_token_id,
        video_token_id=tok.vocab_size - 1,
        initializer_range=INIT,
        attn_implementation=attn,
    )
    return transformers.Qwen2VLForConditionalGeneration(config).to(torch.float64).eval()


def assert_flex_equals_dense(batch: dict, model_config) -> None:
    """Each layer type's flex ``mask_mod`` (``model_layer_masks(flex=True)``) materialised equals
    its 4-D mask."""
    from torch.nn.attention.flex_attention import create_mask

    from prealign.collate.hf import model_layer_masks

    mods = model_layer_masks(batch, model_config, flex=True)
    dense = model_layer_masks(batch, model_config)
    T = batch["input_ids"].shape[1]
    assert set(mods) == set(dense)
    for kind, mod in mods.items():
        assert torch.equal(create_mask(mod, 1, 1, T, T, device="cpu"), dense[kind])
