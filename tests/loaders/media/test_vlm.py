"""VLM samples end to end: the Qwen2-VL image processor, placeholder expansion and its count
checks, bad media, the schema, and the seed's crash (verl PR #7702: B=1, 4026 tokens, tp=2)."""

from __future__ import annotations

import io
import json
import pickle

import numpy as np
import pytest
import torch

from prealign.collate import THDCollator, unpack_thd, unshard_cp
from prealign.collate.mrope import MRoPECollator
from prealign.loaders.cli.demo_tokenizer import ByteTokenizer
from prealign.loaders.media.vlm import (
    MediaError,
    MediaProblem,
    VLMSampleTransform,
    image_processor,
    vision_types_and_mrope,
)
from prealign.schemas import (
    BatchSchema,
    BatchValidationError,
    ParallelLayout,
    validate_vlm_batch,
    vlm_schema,
)
from prealign.schemas.vlm import media_violations

pytest.importorskip("transformers")
TOK = ByteTokenizer()
SCHEMA = vlm_schema()


def image_bytes(w: int, h: int, fmt: str = "PNG", seed: int = 0) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, format=fmt)
    return buf.getvalue()


def chat(user: str, reply: str = "Fine.", images: list[str] | None = None) -> bytes:
    meta = {
        "messages": [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    }
    if images is not None:
        meta["images"] = images
    return json.dumps(meta).encode()


def test_images_go_through_the_real_processor_and_expand_exactly():
    raw = {
        "__key__": "a",
        "json": chat("<image> and <image>?", images=["0.jpg", "1.png"]),
        "0.jpg": image_bytes(120, 90, "JPEG"),
        "1.png": image_bytes(60, 200, seed=1),
    }
    out = VLMSampleTransform(tokenizer=TOK)(raw)
    want = image_processor()(images=[_open(raw["0.jpg"]), _open(raw["1.png"])], return_tensors="pt")
    assert (
        torch.equal(out["pixel_values"], want["pixel_values"])
        and out["pixel_values"].shape[1] == 1176
    )
    assert torch.equal(out["image_grid_thw"], want["image_grid_thw"])
    per_image = (want["image_grid_thw"].prod(-1) // 4).tolist()
    ids = out["input_ids"]
    assert int((ids == TOK.image_token_id).sum()) == sum(per_image)
    text = TOK.decode(ids)
    assert text.count("<|vision_start|>") == 2 and "<image>" not in text
    assert all(f"<|image_pad|>*{n}" in text for n in per_image)
    assert torch.equal(out["mm_token_type_ids"], (ids == TOK.image_token_id).long())
    # loss only on the assistant reply "Fine." and its <|im_end|>
    assert TOK.decode(ids[out["loss_mask"].bool()]) == "Fine.<|im_end|>"


def _open(b: bytes):
    from PIL import Image

    return Image.open(io.BytesIO(b)).convert("RGB")


def test_text_only_and_hf_row_inputs():
    text_only = VLMSampleTransform(tokenizer=TOK)({"__key__": "t", "json": chat("Hello")})
    assert text_only["pixel_values"].shape == (0, 1176) and text_only["image_grid_thw"].shape == (
        0,
        3,
    )
    assert int(text_only["mm_token_type_ids"].sum()) == 0
    from PIL import Image

    row = {
        "messages": [
            {"role": "user", "content": "<image>hi"},
            {"role": "assistant", "content": "ok"},
        ],
        "images": [Image.open(io.BytesIO(image_bytes(64, 64)))],
    }
    out = VLMSampleTransform(tokenizer=TOK, pixel_dtype="bfloat16")(row)
    assert (
        out["image_grid_thw"].tolist() == [[1, 4, 4]] and int(out["mm_token_type_ids"].sum()) == 4
    )
    assert out["pixel_values"].dtype == torch.bfloat16 and out["mrope_position_ids"].shape == (
        3,
        out["input_ids"].numel(),
    )
    text_bf16 = VLMSampleTransform(tokenizer=TOK, pixel_dtype="bfloat16")(
        {"__key__": "t", "json": chat("Hello")}
    )
    batch = THDCollator(schema=SCHEMA, layout=ParallelLayout(tp=2, cp=2), cp_rank=0)(
        [out, text_bf16]
    )
    assert batch["pixel_values"].dtype == torch.bfloat16
    assert validate_vlm_batch(batch, SCHEMA, ParallelLayout(tp=2, cp=2)) == []


@pytest.mark.parametrize(
    "raw, problem, field",
    [
        (
            {"json": chat("<image>", images=["0.png"]), "0.png": image_bytes(32, 32)[:40]},
            MediaProblem.CORRUPT_IMAGE,
            "0.png",
        ),
        (
            {"json": chat("<image>", images=["0.png"]), "0.jpg": image_bytes(32, 32)},
            MediaProblem.MISSING_IMAGE,
            "0.png",
        ),
        (
            {"json": chat("<image> <image>"), "0.png": image_bytes(56, 56)},
            MediaProblem.PLACEHOLDER_MISMATCH,
            "json",
        ),
        (
            {"json": chat("no placeholder"), "png": image_bytes(56, 56)},
            MediaProblem.PLACEHOLDER_MISMATCH,
            "json",
        ),
        ({"json": b"{not json"}, MediaProblem.BAD_TEXT, "json"),
        ({"json": b"[" * 100_000}, MediaProblem.BAD_TEXT, "json"),  # (past the recursion limit)
    ],
)
def test_bad_media_raises_a_typed_error_naming_the_sample(raw, problem, field):
    with pytest.raises(MediaError) as err:
        VLMSampleTransform(tokenizer=TOK)({"__key__": "bad7", **raw})
    assert err.value.problem is problem and err.value.sample == "bad7" and err.value.field == field


def test_pretokenized_sample_is_checked_against_the_grid():
    grid = torch.tensor([[1, 4, 6]])  # 6 vision tokens
    ids = torch.tensor(
        [9, TOK.vision_start_token_id, *[TOK.image_token_id] * 6, TOK.vision_end_token_id]
    )
    assert int(vision_types_and_mrope(ids, grid, TOK.vision, sample="p", mrope=False)[0].sum()) == 6
    with pytest.raises(MediaError) as err:
        vision_types_and_mrope(ids[:-2], grid, TOK.vision, sample="p", mrope=False)
    assert err.value.problem is MediaProblem.VISION_TOKEN_MISMATCH and "runs [6]" in str(err.value)
    raw = {
        "__key__": "p",
        "input_ids": ids[:-2].numpy(),
        "png": image_bytes(56, 84),
    }  # grid (1, 4, 6)
    with pytest.raises(MediaError, match="vision_token|image token runs"):
        VLMSampleTransform(tokenizer=TOK)(raw)


def test_transform_is_picklable_and_builds_the_processor_lazily():
    import pickle

    t = pickle.loads(
        pickle.dumps(
            VLMSampleTransform(tokenizer=TOK, topk=4, processor_options={"max_pixels": 200704})
        )
    )
    assert t.topk == 4 and image_processor(max_pixels=200704) is image_processor(max_pixels=200704)


# ---- schema
# ----------------------------------------------------------------------------------------
def test_schema_round_trips_and_checks_media():
    s = vlm_schema(topk=8, vocab_size=TOK.vocab_size)
    assert BatchSchema.from_json(s.to_json()) == s and s.name == "vlm_topk"
    batch = MRoPECollator(collator=THDCollator(schema=s, layout=ParallelLayout(tp=2)))(
        [seed_sample(40, grid=(1, 4, 6), topk=8)]
    )
    assert validate_vlm_batch(batch, s, ParallelLayout(tp=2)) == []
    broken = {**batch, "pixel_values": batch["pixel_values"][:-1]}
    with pytest.raises(BatchValidationError, match="pixel_values.shape"):
        validate_vlm_batch(broken, s, ParallelLayout(tp=2))
    extra = batch["mm_token_type_ids"].clone()
    extra[0, 0] = 1
    assert any(
        v.path == "mm_token_type_ids"
        for v in media_violations({**batch, "mm_token_type_ids": extra})
    )


# ---- the seed's crash
# ------------------------------------------------------------------------------
def seed_sample(length: int, *, grid=(1, 36, 54), topk: int | None = None) -> dict:
    """One VLM sample of exactly ``length`` tokens: text, one image of ``grid`` (486 tokens),
    text."""
    n_img = grid[0] * grid[1] * grid[2] // 4
    head = 7
    tail = length - head - n_img - 2
    ids = torch.cat(
        [
            torch.arange(head) + 8,
            torch.tensor([TOK.vision_start_token_id]),
            torch.full((n_img,), TOK.image_token_id),
            torch.tensor([TOK.vision_end_token_id]),
            torch.arange(tail) % 250 + 8,
        ]
    )
    s = {
        "input_ids": ids,
        "mm_token_type_ids": (ids == TOK.image_token_id).long(),
        "image_grid_thw": torch.tensor([grid]),
        "pixel_values": torch.randn(grid[0] * grid[1] * grid[2], 1176),
    }
    if topk is not None:
        s["teacher_topk_log_probs"] = -torch.rand(length, topk)
        s["teacher_topk_ids"] = torch.randint(0, TOK.vocab_size, (length, topk))
    return s


@pytest.mark.parametrize("length", [4026, 4027])
@pytest.mark.parametrize("cp", [1, 2])
@pytest.mark.parametrize("defer", [False, True])
def test_seed_scenario_b1_4026_tokens_tp2_is_sp_aligned(length, cp, defer):
    """verl #7702: B=1, 4026 tokens, TP=2 (+ CP=2): every rank's T_local % tp == 0, on the sharded
    path and on the deferred (vision-merge-first) path, and the shards unshard to the sample."""
    tp = 2
    layout = ParallelLayout(tp=tp, cp=cp)
    sample = seed_sample(length, topk=4)
    schema = vlm_schema(topk=4)
    shards = []
    for r in range(cp):
        b = MRoPECollator(
            collator=THDCollator(schema=schema, layout=layout, cp_rank=r, defer_cp_shard=defer)
        )([sample])
        validate_vlm_batch(b, schema, layout)
        if defer:
            t = int(b["cu_seqlens_padded"][-1])
            assert (
                b["input_ids"].shape == (1, t)
                and b["pixel_values"].shape == sample["pixel_values"].shape
            )
            idx = b["cp_gather_index"]
            assert idx.numel() == t // cp and idx.numel() % tp == 0
            b = {
                k: (
                    v.index_select(schema[k].token_dim + 1, idx)
                    if k in schema and schema[k].role.value == "token"
                    else v
                )
                for k, v in b.items()
            }
        t_local = b["input_ids"].shape[1]
        assert t_local % tp == 0, "the SP scatter would assert"
        assert b["mrope_position_ids"].shape == (3, 1, t_local)
        assert b["mm_token_type_ids"].shape == b["teacher_topk_ids"].shape[:2] == (1, t_local)
        shards.append(b)
    cup = shards[0]["cu_seqlens_padded"]
    for name, dim in (("input_ids", 1), ("mm_token_type_ids", 1), ("teacher_topk_ids", 1)):
        whole = unshard_cp([b[name] for b in shards], cu_seqlens_padded=cup, dim=dim)
        (got,) = unpack_thd(
            whole, cu_seqlens=shards[0]["cu_seqlens"], cu_seqlens_padded=cup, dim=dim
        )
        assert torch.equal(got, sample[name])


# ---- a multimodal webdataset end to end
# --------------------------------------------------------------
@pytest.fixture(scope="module")
def demo_shards(tmp_path_factory):
    from prealign.loaders.cli.demo_data import build_demo_dataset

    return build_demo_dataset(
        str(tmp_path_factory.mktemp("vlm_wds")), num_samples=48, samples_per_shard=12, topk=4
    )


@pytest.mark.slow
def test_webdataset_end_to_end_two_workers_every_cp_rank(demo_shards):
    """48 samples (3 broken) in 4 shards -> WebDatasetSource -> PackedLoader(num_workers=2) on both
    CP ranks of tp=2, cp=2: every batch valid, SP-aligned, every good sample exactly once, the
    broken ones skipped and counted, and the shards all-gather back to each sample's own tensors."""
    from prealign.loaders import (
        BadDataPolicy,
        IndexOptions,
        PackedLoader,
        WebDatasetSource,
        build_index,
    )

    schema = vlm_schema(topk=4, vocab_size=TOK.vocab_size)
    layout = ParallelLayout(tp=2, cp=2)
    source = WebDatasetSource(
        list(demo_shards.shards), transform=VLMSampleTransform(tokenizer=TOK, topk=4), image="bytes"
    )
    policy = BadDataPolicy(on_error="skip", warn=False)
    index = build_index(source, schema, policy=policy, num_workers=2)
    assert len(index) == 45 and index.report.total == 3
    assert sorted(e.where.rsplit(":", 1)[-1] for e in index.report.examples) == sorted(
        demo_shards.bad
    )
    # counted by cause (MediaError.reason through the source's transform wrapping), each sample
    # named
    assert index.report.counts == {
        "corrupt_image": 1,
        "missing_image": 1,
        "placeholder_mismatch": 1,
    }
    assert sorted((e.where.rsplit(":", 1)[-1], e.reason) for e in index.report.examples) == sorted(
        demo_shards.bad.items()
    )
    from prealign.loaders.cli.main import _skips

    shown = _skips(index.report)
    assert "(corrupt_image 1, missing_image 1, placeholder_mismatch 1)" in shown[0]
    assert all(
        f"  {r} (1): " in "\n".join(shown) and f"{k}: " in "\n".join(shown)
        for k, r in demo_shards.bad.items()
    )
    loaders = [
        PackedLoader(
            source,
            schema=schema,
            layout=layout,
            token_budget=2048,
            cp_rank=r,
            num_workers=2,
            bad_data=policy,
            indexing=IndexOptions(prebuilt=index),
        )
        for r in range(2)
    ]
    seen, checked = [], 0
    for ranks in zip(*loaders):
        for b in ranks:
            validate_vlm_batch(b, schema, layout)
            assert (
                b["input_ids"].shape[1] % layout.tp == 0 and int(b["cu_seqlens_padded"][-1]) <= 2048
            )
        assert torch.equal(ranks[0]["sample_index"], ranks[1]["sample_index"])
        seen += ranks[0]["sample_index"].tolist()
        cu, cup = ranks[0]["cu_seqlens"], ranks[0]["cu_seqlens_padded"]
        wholes = {
            name: unshard_cp(
                [b[name] for b in ranks], cu_seqlens_padded=cup, dim=schema[name].token_dim + 1
            )
            for name in (
                "input_ids",
                "mrope_position_ids",
                "teacher_topk_ids",
                "teacher_topk_log_probs",
            )
        }
        for j, i in enumerate(ranks[0]["sample_index"].tolist()):
            want = source.load(tuple(index.locations[i].tolist()))
            for name, whole in wholes.items():
                got = unpack_thd(
                    whole, cu_seqlens=cu, cu_seqlens_padded=cup, dim=schema[name].token_dim + 1
                )[j]
                assert torch.equal(got, want[name]), name
                checked += 1
    assert sorted(seen) == list(range(45)) and checked == 45 * 4


def test_bad_media_under_the_raise_policy_names_the_sample(demo_shards):
    from prealign.loaders import BadDataPolicy, BadSampleError, WebDatasetSource, build_index

    source = WebDatasetSource(
        list(demo_shards.shards), transform=VLMSampleTransform(tokenizer=TOK, topk=4), image="bytes"
    )
    with pytest.raises(BadSampleError) as err:
        build_index(source, vlm_schema(topk=4), policy=BadDataPolicy(on_error="raise"))
    first = min(demo_shards.bad)
    assert first in str(err.value) and demo_shards.bad[first] in str(err.value)
    assert err.value.reason == demo_shards.bad[first]


# ---- oversize samples with media, filler micro-batches from a VLM sample
# ------------------------------
class _Samples:
    """An in-memory source of ready VLM sample dicts (no transform, no image decoding)."""

    def __new__(cls, samples: list[dict]):
        from prealign.loaders.sources.source import Source

        class ListSource(Source):
            num_shards = 1

            def scan(self, shard):
                for i, sample in enumerate(samples):
                    yield (i,), sample

            def read(self, location):
                return samples[location[0]]

            def describe(self):
                return {"kind": "list", "num_samples": len(samples)}

        return ListSource()


def vlm_sample(
    key: str, text: int, grids: tuple = ((1, 4, 6),), topk: int = 4, seed: int = 0
) -> dict:
    """A transformed VLM sample: ``text`` text tokens, then one vision-wrapped run per image
    grid."""
    from prealign.collate.mrope import mrope_position_ids

    g = torch.Generator().manual_seed(seed)
    parts = [torch.arange(text) % 250 + 8]
    for t, h, w in grids:
        parts += [
            torch.tensor([TOK.vision_start_token_id]),
            torch.full((t * h * w // 4,), TOK.image_token_id),
            torch.tensor([TOK.vision_end_token_id]),
        ]
    ids = torch.cat(parts)
    n = ids.numel()
    grid = torch.tensor(grids, dtype=torch.int64).reshape(-1, 3)
    types = (ids == TOK.image_token_id).long()
    return {
        "__key__": key,
        "input_ids": ids,
        "loss_mask": torch.ones(n),
        "mm_token_type_ids": types,
        "mrope_position_ids": mrope_position_ids(types, grid, torch.tensor([0, n])),
        "pixel_values": torch.randn(int(grid.prod(-1).sum()), 1176, generator=g),
        "image_grid_thw": grid,
        "teacher_topk_log_probs": -torch.rand(n, topk, generator=g),
        "teacher_topk_ids": torch.randint(0, TOK.vocab_size, (n, topk), generator=g),
    }


def test_oversize_samples_with_media_are_skipped_not_truncated():
    """Oversize.TRUNCATE cuts text-only samples but leaves out (counted, warned, named) a sample
    that carries images: a cut would split its image tokens from its pixel_values /
    image_grid_thw."""
    import dataclasses

    from prealign.loaders import (
        BadSampleError,
        BadSampleWarning,
        IndexOptions,
        PackedLoader,
        PlannerConfig,
        build_index,
        plan_microbatches,
    )
    from prealign.loaders.loader import truncate_sample

    schema, layout = vlm_schema(topk=4, vocab_size=TOK.vocab_size), ParallelLayout(tp=2, cp=2)
    samples = [
        vlm_sample("short", 20),
        vlm_sample("long_image", 100, seed=1),  # 108 tokens, image at 100..107
        vlm_sample("long_text", 150, grids=()),
        vlm_sample("tail", 30, seed=2),
    ]
    source = _Samples(samples)
    index = build_index(source, schema)
    assert index.media.tolist() == [True, True, False, True]
    for idx in (
        index,
        dataclasses.replace(index, media=None),
    ):  # flags missing: the loader finds them
        with pytest.warns(BadSampleWarning) as warned:
            loader = PackedLoader(
                source,
                schema=schema,
                layout=layout,
                token_budget=64,
                indexing=IndexOptions(prebuilt=idx),
                planner=PlannerConfig(oversize="truncate"),
            ).prepare()
        said = [str(w.message) for w in warned]
        assert any("1 sample(s) truncated" in m for m in said) and any(
            "oversize_media" in m for m in said
        )
        assert loader.report.counts == {"oversize_truncated": 1, "oversize_media": 1}
        assert [(e.where, e.reason) for e in loader.report.examples] == [
            ("ListSource[1]", "oversize_media")
        ]
        seen = []
        for b in loader:
            validate_vlm_batch(b, schema, layout)  # every batch's media consistent with its tokens
            seen += b["sample_index"].tolist()
        assert sorted(seen) == [0, 2, 3]
    plan = plan_microbatches(
        [28, 108, 150, 38],
        layout=layout,
        token_budget=64,
        oversize="truncate",
        has_media=[True, True, False, True],
    )
    assert (
        plan.skipped_media == (1,)
        and plan.truncated == {2: 64}
        and plan.stats.num_skipped_media == 1
    )
    with pytest.raises(BadSampleError, match="never cut") as err:
        truncate_sample(samples[1], schema, 64)
    assert err.value.reason == "oversize_media"
    assert truncate_sample(samples[1], schema, 200)["input_ids"].numel() == 108  # no cut: fine


@pytest.mark.parametrize("cp, defer", [(1, False), (2, False), (2, True)])
def test_filler_microbatches_from_a_vlm_sample_validate_and_carry_no_images(cp, defer):
    from prealign.loaders import PackedLoader

    schema, layout = vlm_schema(topk=4, vocab_size=TOK.vocab_size), ParallelLayout(tp=2, cp=cp)
    source = _Samples(
        [vlm_sample("a", 9, grids=((1, 4, 6), (1, 2, 2))), vlm_sample("b", 3, seed=1)]
    )
    fillers = 0
    for r in range(
        4
    ):  # 4 DP ranks, 2 samples: two ranks get a filler copied from the epoch's first sample
        for cp_rank in range(cp):
            loader = PackedLoader(
                source,
                schema=schema,
                layout=layout,
                token_budget=64,
                dp_rank=r,
                dp_size=4,
                cp_rank=cp_rank if cp > 1 else None,
                collator=THDCollator(
                    schema=schema,
                    layout=layout,
                    cp_rank=cp_rank if cp > 1 else None,
                    defer_cp_shard=defer,
                ),
            )
            (b,) = list(loader)
            validate_vlm_batch(b, schema, layout)
            if not b["is_filler"]:
                continue
            fillers += 1
            assert b["sample_index"].numel() == 0 and int(b["cu_seqlens"][-1]) > 0
            assert b["pixel_values"].shape == (0, 1176) and b["image_grid_thw"].shape == (0, 3)
            assert float(b["loss_mask"].sum()) == 0 and bool(
                (b["labels"] == schema.ignore_index).all()
            )
            assert not bool(b["mm_token_type_ids"].any()) and not bool(
                b["mrope_position_ids"].any()
            )
            assert not bool(b["teacher_topk_log_probs"].any())
    assert fillers == 2 * cp


def _tiny_hf_tokenizer():
    """A word-level Hugging Face tokenizer built in memory, with Qwen2-VL's special tokens."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = [
        "<unk>",
        "<|im_start|>",
        "<|im_end|>",
        "<|vision_start|>",
        "<|vision_end|>",
        "<|image_pad|>",
    ]
    words = ["user", "assistant", "\n", " ", "look", "at", "this", "Fine", ".", "?"]
    tok = Tokenizer(
        models.WordLevel({w: i for i, w in enumerate(specials + words)}, unk_token="<unk>")
    )
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\n|[.?]| +"), behavior="isolated")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", additional_special_tokens=specials[1:]
    )


def test_a_hugging_face_tokenizer_drives_the_transform():
    from prealign.loaders.media.chat_tokenizer import HFChatTokenizer

    hf = _tiny_hf_tokenizer()
    tok = HFChatTokenizer(hf)
    assert (tok.image_token_id, tok.vision_start_token_id, tok.vocab_size) == (5, 3, len(hf))
    raw = {
        "__key__": "h",
        "json": chat("look at this <image> ?", images=["0.png"]),
        "0.png": image_bytes(64, 96),
    }
    out = pickle.loads(pickle.dumps(VLMSampleTransform(tokenizer=tok)))(raw)
    n_img = int(out["image_grid_thw"].prod() // 4)
    ids = out["input_ids"]
    assert int((ids == tok.image_token_id).sum()) == n_img and n_img > 0
    assert torch.equal(out["mm_token_type_ids"], (ids == tok.image_token_id).long())
    assert hf.decode(ids[out["loss_mask"].bool()].tolist()).replace(" ", "") == "Fine.<|im_end|>"
    with pytest.raises(ValueError, match="no '<\\|video_pad\\|>' token"):
        HFChatTokenizer(hf, image_pad="<|video_pad|>")
