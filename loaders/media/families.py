"""Each vision family's transform and batch schema, chosen from the model's config: what the CLI
(``prealign inspect / index``) and the mixture file (:mod:`prealign.loaders.mixture_file`) build.

    model config --vision_family--> family
        family.transform set (Gemma 3, LLaVA-OneVision, Mistral3, SmolVLM, ...) --own_transform-->
            that class, the HF tokenizer as given (it wraps it)
        else (the Qwen families, InternVL, GLM-4V) --> VLMSampleTransform, the tokenizer wrapped
            with the family's token names (chat_tokenizer)
    transform --transform_schema--> the BatchSchema its samples collate to
    {component: transform} --common_schema--> the one schema they all collate to, else
        MixedFamiliesError naming two components that differ
"""

from __future__ import annotations

from prealign.schemas.errors import ConfigError


class MixedFamiliesError(ConfigError):
    """Two transforms whose samples collate to different batch schemas (different families, or one
    family with different settings) asked to share batches."""


def chat_tokenizer(hf, family):
    """A Hugging Face tokenizer as :class:`~prealign.loaders.media.vlm.VLMSampleTransform`'s chat
    tokenizer, with ``family``'s token names (InternVL's ``<img>`` ... ; GLM's; else Qwen's), as the
    transform wraps its processor's tokenizer."""
    from prealign.loaders.media import glm4v, internvl
    from prealign.loaders.media.chat_tokenizer import HFChatTokenizer

    model_type = getattr(family, "model_type", "") or ""
    if model_type == "internvl":
        return internvl.internvl_chat_tokenizer(hf)
    return HFChatTokenizer(hf, **(glm4v.TOKEN_NAMES if model_type.startswith("glm4v") else {}))


def own_transform(family, model_config, tokenizer, topk, processor_dir):
    """The transform ``family.transform`` names (its class path), built from the model's config;
    ``processor_dir``: the model's ``preprocessor_config.json`` read into the transform's own image
    processor class (its PIL backend: transformers' auto class may want torchvision), else the
    family's default."""
    import dataclasses
    import importlib

    module, _, name = family.transform.rpartition(".")
    transform = getattr(importlib.import_module(module), name)(
        model_config=model_config, tokenizer=tokenizer, topk=topk
    )
    if not processor_dir:
        return transform
    kind = type(transform.image_processor)
    try:
        processor = kind.from_pretrained(processor_dir, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"--processor {processor_dir}: no {kind.__name__} read from it "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        ) from None
    return dataclasses.replace(transform, processor=processor)  # checked against the config again


def transform_schema(transform, topk):
    """The batch schema ``transform``'s samples collate to: the family's own (Gemma 3: whole images;
    the families with a ``batch_schema``: theirs), else :func:`~prealign.schemas.vlm.vlm_schema`
    (Qwen's grids)."""
    from prealign.schemas.vlm import image_tokens_schema, vlm_schema

    tok, family = transform.tokenizer, getattr(transform, "family", None)
    common = dict(topk=topk, vocab_size=tok.vocab_size, pad_token_id=tok.pad_token_id)
    model_type = getattr(family, "model_type", None)
    if model_type == "gemma3":
        return image_tokens_schema(image_size=family.image_size, **common)
    if hasattr(
        family, "batch_schema"
    ):  # InternVL, LLaVA-OneVision, Mistral3 / Pixtral, SmolVLM / Idefics3
        return family.batch_schema(**common)
    return vlm_schema(**common)


def common_schema(transforms: dict, topk=None):
    """The one batch schema the VLM ``transforms`` (``{name: transform}``; entries whose transform
    has no tokenizer, text, are left out) collate to, or None where there is none; two that differ
    (another family, vocabulary, pad id or geometry) are a :class:`MixedFamiliesError` naming
    both and each one's family."""
    first, out = None, None
    for name, transform in transforms.items():
        if not hasattr(transform, "tokenizer"):
            continue
        schema = transform_schema(transform, topk)
        if first is None:
            first, out = (name, transform), schema
        elif schema != out:
            raise MixedFamiliesError(
                f"mixture components {first[0]!r} ({_family_name(first[1])}) and {name!r} "
                f"({_family_name(transform)}) collate to different batch schemas "
                f"({_difference(out, schema)}), so their samples cannot share a batch; give "
                "them one model config (one family, tokenizer and vision settings), or train "
                "them as separate runs"
            )
    return out


def _difference(a, b) -> str:
    """The first way schema ``b`` differs from ``a``, in words."""
    fa, fb = ({f.name: f for f in s.fields} for s in (a, b))
    if list(fa) != list(fb):
        only = [n for n in fa if n not in fb], [n for n in fb if n not in fa]
        return f"{a.name} fields {list(fa)} vs {b.name} fields {list(fb)}; only in one: {only}"
    for n, spec in fa.items():
        if spec != fb[n]:
            diff = [
                f"{k} {getattr(spec, k)!r} vs {getattr(fb[n], k)!r}"
                for k in spec.__dataclass_fields__
                if getattr(spec, k) != getattr(fb[n], k)
            ]
            return f"field {n!r}: {', '.join(diff)}"
    return f"{a.name} vs {b.name}"


def _family_name(transform) -> str:
    family = getattr(transform, "family", None)
    return getattr(family, "model_type", None) or type(transform).__name__
