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


def tiny_text_config(vocab_size: int, **extra) -> dict:
    """The text model of every tiny test model, as config keywords: 2 layers, hidden 32, MLP 64,
    GQA 4/2 heads, 4096 positions, weights' std :data:`INIT`; ``extra`` adds keys or overrides
    them."""
    return {
        "vocab_size": vocab_size,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "initializer_range": INIT,
        **extra,
    }


def tiny_vit_config(**extra) -> dict:
    """A 1-layer ViT tower (hidden 32, MLP 64, 2 heads, std :data:`INIT`) as config keywords, for
    the SigLIP / Idefics3 / Pixtral / InternVL towers; ``extra``: its patch and image sizes."""
    return {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "initializer_range": INIT,
        **extra,
    }


def tiny_qwen_vision_config(**extra) -> dict:
    """A 1-block Qwen-style vision tower (hidden 32, 2 heads, merge 2, temporal patch 2, std
    :data:`INIT`) as config keywords, for the Qwen and GLM-4V families; ``extra``: the family's
    own keys."""
    return {
        "depth": 1,
        "hidden_size": 32,
        "num_heads": 2,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "initializer_range": INIT,
        **extra,
    }


def seeded_model(cls, config, dtype: torch.dtype = torch.float64):
    """``cls(config)`` with weights drawn after ``torch.manual_seed(0)``, in ``dtype``, eval
    mode."""
    torch.manual_seed(0)
    return cls(config).to(dtype).eval()


@functools.lru_cache(maxsize=None)
def causal_lm(attn: str = "sdpa", family: str = "qwen2"):
    """A 2-layer causal LM (hidden 32, vocab 128, GQA 4/2 heads), float64, eval mode."""
    import transformers

    common = tiny_text_config(VOCAB, attn_implementation=attn)
    if family == "qwen2":
        return seeded_model(transformers.Qwen2ForCausalLM, transformers.Qwen2Config(**common))
    return seeded_model(transformers.LlamaForCausalLM, transformers.LlamaConfig(**common))


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
    config = transformers.Qwen2VLConfig(
        text_config=tiny_text_config(
            tok.vocab_size,
            bos_token_id=tok.eos_token_id,
            eos_token_id=tok.eos_token_id,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [2, 1, 1],
            },
        ),
        vision_config=tiny_qwen_vision_config(
            embed_dim=32, mlp_ratio=2, patch_size=14, in_channels=3
        ),
        image_token_id=tok.image_token_id,
        vision_start_token_id=tok.vision_start_token_id,
        vision_end_token_id=tok.vision_end_token_id,
        video_token_id=tok.vocab_size - 1,
        initializer_range=INIT,
        attn_implementation=attn,
    )
    return seeded_model(transformers.Qwen2VLForConditionalGeneration, config)


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
