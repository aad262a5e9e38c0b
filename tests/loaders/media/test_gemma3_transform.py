"""Gemma3SampleTransform against transformers' own Gemma3Processor and apply_chat_template (a
byte-level BPE tokenizer with Gemma 3's special tokens built here, a chat template written after
Gemma 3's: bos, turns as ``<start_of_turn>{role}\\n``, assistant written ``model``, content trimmed,
a system turn's text opening the first user turn): ``input_ids``, ``token_type_ids`` and pixels
equal on random conversations; lengths from headers
alone equal the full pass; packed transformed samples give the logits of each alone in a tiny
model."""

from __future__ import annotations

import functools
import io
import re

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from prealign.loaders.media.gemma3 import Gemma3SampleTransform
from prealign.loaders.media.vlm import MediaError
from prealign.schemas.errors import ConfigError
from tests.conftest import examples
from tests.consumers.models import tiny_text_config
from tests.families import chat_samples

transformers = pytest.importorskip("transformers")
SPECIALS = [
    "<pad>",
    "<eos>",
    "<bos>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
]
TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set prefix = "
    "messages[0]['content'] + '\n\n' %}"
    "{% set turns = messages[1:] %}{% else %}{% set prefix = '' %}{% set turns = messages %}{% "
    "endif %}"
    "{% for message in turns %}{% if message['role'] == 'assistant' %}{% set role = 'model' %}{% "
    "else %}{% set role = message['role'] %}{% endif %}<start_of_turn>{{ role }}\n{{ prefix if "
    "loop.first else '' }}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}{% else %}{% for item in "
    "message['content'] %}"
    "{% if item['type'] == 'image' %}<start_of_image>{% elif item['type'] == 'text' %}{{ "
    "item['text'] | trim }}{% endif %}{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
)
TOKENS, SIZE = 4, 16


@functools.lru_cache(maxsize=None)
def tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\s*[\r\n]+|\s+(?!\S)|\s+|[^\s]+"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    corpus = ["user\n\nhello\n\n\nworld", "model\n ab. \n\n", "a b\n\n c ? \n \n"] * 50
    tok.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=SPECIALS,
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        extra_special_tokens={
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        },
    )


def tid(name: str) -> int:
    return tokenizer().convert_tokens_to_ids(name)


def config(attn: str = "sdpa"):
    text = tiny_text_config(
        len(tokenizer()),
        head_dim=8,
        max_position_embeddings=512,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=8,
        pad_token_id=tid("<pad>"),
        bos_token_id=tid("<bos>"),
        eos_token_id=tid("<eos>"),
    )
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=SIZE,
        patch_size=4,
        num_channels=3,
    )
    return transformers.Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=TOKENS,
        boi_token_index=tid("<start_of_image>"),
        eoi_token_index=tid("<end_of_image>"),
        image_token_index=tid("<image_soft_token>"),
        initializer_range=0.3,
        attn_implementation=attn,
    )


def processor():
    try:
        from transformers import Gemma3ImageProcessorPil as image_cls
    except ImportError:
        from transformers import Gemma3ImageProcessor as image_cls
    return transformers.Gemma3Processor(
        image_processor=image_cls(size={"height": SIZE, "width": SIZE}),
        tokenizer=tokenizer(),
        chat_template=TEMPLATE,
        image_seq_length=TOKENS,
    )


def transform() -> Gemma3SampleTransform:
    return Gemma3SampleTransform(model_config=config(), tokenizer=tokenizer())


def png(seed: int) -> bytes:
    return chat_samples.png(seed, 8, 70)


def reference(messages: list[dict], images: list[bytes]) -> dict:
    from PIL import Image

    def items(text):
        parts = re.split("(<image>)", text)
        return [
            {"type": "image"} if p == "<image>" else {"type": "text", "text": p} for p in parts if p
        ]

    chat = [
        m if m["role"] == "system" else {"role": m["role"], "content": items(m["content"])}
        for m in messages
    ]
    text = tokenizer().apply_chat_template(chat, tokenize=False, chat_template=TEMPLATE)
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    return processor()(
        text=[text], images=[pil] if pil else None, return_tensors="pt", add_special_tokens=False
    )


def raw_sample(messages, images) -> dict:
    return chat_samples.raw_sample(messages, images, key="g")


TEXT = chat_samples.CHAT_TEXT


@pytest.mark.slow
@given(
    contents=st.lists(TEXT, min_size=1, max_size=4), system=st.booleans(), seed=st.integers(0, 99)
)
@examples(100)
def test_ids_token_types_and_pixels_equal_the_processor(contents, system, seed):
    roles = (["system"] if system else []) + ["user", "assistant"] * 3
    messages = [{"role": r, "content": c} for r, c in zip(roles, contents)]
    assume(not (system and "<image>" in contents[0]))
    n = sum(m["content"].count("<image>") for m in messages)
    assume(n <= 3)
    images = [png(seed + i) for i in range(n)]
    ours = transform()(raw_sample(messages, images))
    want = reference(messages, images)
    assert ours["input_ids"].tolist() == want["input_ids"][0].tolist()
    assert ours["mm_token_type_ids"].tolist() == want["token_type_ids"][0].tolist()
    if n:
        assert torch.equal(ours["pixel_values"], want["pixel_values"].to(torch.float32))
    assert (
        transform().header_ids(raw_sample(messages, images))[0].tolist()
        == ours["input_ids"].tolist()
    )
    ends = (ours["input_ids"] == tid("<end_of_turn>")) & (ours["loss_mask"] > 0)
    assert int(ends.sum()) == sum(m["role"] == "assistant" for m in messages)


def test_golden_sample():
    messages = [
        {"role": "user", "content": "\nlook <image>?"},
        {"role": "assistant", "content": " a "},
    ]
    ours = transform()(raw_sample(messages, [png(1)]))
    text = tokenizer().decode(ours["input_ids"].tolist())
    assert text == (
        "<bos><start_of_turn>user\nlook\n\n<start_of_image>"
        + "<image_soft_token>" * TOKENS
        + "<end_of_image>\n\n?<end_of_turn>\n<start_of_turn>model\na<end_of_turn>\n"
    )
    trained = tokenizer().decode(ours["input_ids"][ours["loss_mask"] > 0].tolist())
    assert trained == "a<end_of_turn>" and ours["pixel_values"].shape == (1, 3, SIZE, SIZE)


def test_bad_samples_are_typed_errors():
    with pytest.raises(MediaError, match="placeholder"):
        transform()(raw_sample([{"role": "user", "content": "<image> <image>"}], [png(1)]))
    with pytest.raises(ConfigError, match="gemma3"):
        Gemma3SampleTransform(model_config=transformers.Qwen2VLConfig(), tokenizer=tokenizer())
    from prealign.loaders.media.vlm import VLMSampleTransform

    with pytest.raises(ConfigError, match="Gemma3SampleTransform"):  # the Qwen transform refuses it
        VLMSampleTransform(tokenizer=tokenizer(), model_config=config())
    with pytest.raises(ConfigError, match="pan-and-scan"):
        Gemma3SampleTransform(
            model_config=config(),
            tokenizer=tokenizer(),
            processor=transformers.Gemma3ImageProcessorPil(do_pan_and_scan=True)
            if hasattr(transformers, "Gemma3ImageProcessorPil")
            else transformers.Gemma3ImageProcessor(do_pan_and_scan=True),
        )


@pytest.mark.slow
def test_transformed_samples_pack_exactly():
    """Samples from the transform, packed THD (tp=2, cp=2, unsharded) with the emitted masks: the
    logits at every real token equal each sample alone (the model building its own masks from
    token_type_ids)."""
    from prealign.collate import THDCollator, to_hf_kwargs
    from prealign.schemas import BatchSchema, FieldSpec, PadPolicy, ParallelLayout
    from prealign.schemas.schema import core_token_fields
    from tests.consumers.models import real_slots

    conversations = [
        [
            {"role": "user", "content": "hello <image> world\n\n"},
            {"role": "assistant", "content": "ab"},
        ],
        [{"role": "user", "content": "a b"}, {"role": "assistant", "content": "\n\nhello ."}],
        [
            {"role": "user", "content": "<image><image> ? "},
            {"role": "assistant", "content": "world"},
        ],
    ]
    samples = [
        transform()(raw_sample(m, [png(7 + i) for i in range(m[0]["content"].count("<image>"))]))
        for m in conversations
    ]
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config()).to(torch.float64).eval()
    schema = BatchSchema(
        name="gemma3",
        ignore_index=-100,
        fields=(
            *core_token_fields(tid("<pad>"), -100, len(tokenizer())),
            FieldSpec(
                name="mm_token_type_ids", dtypes=("int64",), pad_value=0, min_value=0, max_value=1
            ),
        ),
    )
    layout = ParallelLayout(tp=2, cp=2, pad_policy=PadPolicy.PER_SEQUENCE)
    batch = THDCollator(schema=schema, layout=layout)(
        [{k: s[k] for k in ("input_ids", "loss_mask", "mm_token_type_ids")} for s in samples]
    )
    kwargs = to_hf_kwargs(
        batch, attention="mask", model_config=config(), mask_dtype=torch.float64, labels=False
    )
    kwargs["pixel_values"] = torch.cat([s["pixel_values"] for s in samples]).to(torch.float64)
    with torch.no_grad():
        out = model(**kwargs).logits[0]
        worst = 0.0
        for slots, s in zip(real_slots(batch), samples, strict=True):
            kw = {
                "input_ids": s["input_ids"][None],
                "token_type_ids": s["mm_token_type_ids"][None],
                "use_cache": False,
            }
            if s["pixel_values"].shape[0]:
                kw["pixel_values"] = s["pixel_values"].to(torch.float64)
            worst = max(worst, float((out[slots] - model(**kw).logits[0]).abs().max()))
    assert worst < 1e-6, worst


@pytest.mark.slow
def test_demo_command_with_gemma3(tmp_path, capsys):
    """``prealign demo --model gemma3``: every batch on every CP rank valid against the image-tokens
    schema, the synthetic teacher rows as long as the transform's ids (its chat), whole images in
    pixel_values."""
    from tests.families.header_index import run_demo

    out = run_demo(tmp_path, capsys, "gemma3", token_budget=2048)
    assert "image_tokens_topk" in out
    assert re.search(r"pixel_values +float32 +\[\d+, 3, 224, 224\]", out)


def test_header_index_equals_the_full_pass(tmp_path):
    """``prealign demo --model gemma3`` data: the header-only index (image headers counted, the chat
    rendered by the tokenizer alone) gives every sample the length and media flag the full transform
    gives; a corrupt image is found by both."""
    from prealign.loaders.index.header_pass import ImageTokensRule
    from prealign.schemas import image_tokens_schema
    from tests.families.header_index import assert_header_index_equals_full_pass

    def schema(t, vocab_size):
        return image_tokens_schema(topk=4, vocab_size=vocab_size, image_size=t.family.image_size)

    assert_header_index_equals_full_pass(
        tmp_path, "gemma3", 24, rule=ImageTokensRule, schema=schema
    )
