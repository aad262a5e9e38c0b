"""A VLM mixture (issue #30): text-only, image and video-frame components packed together into
Qwen2.5-VL THD batches under cp=2 equal each sample collated alone (positions, placeholders,
pixels)."""

from __future__ import annotations

import json

import pytest
import torch

from prealign.collate import THDCollator
from prealign.loaders import Mixture, PackedLoader, PlannerConfig
from prealign.loaders.media.vlm import VLMSampleTransform
from prealign.loaders.sources.source import Source
from prealign.schemas import ParallelLayout, validate_vlm_batch, vlm_schema
from tests.loaders.media.test_vlm_video import png, video_raw
from tests.vlm_families import TOK, tiny_config

SCHEMA = vlm_schema()
LAYOUT = ParallelLayout(cp=2)


class _Rows(Source):
    """Raw samples held in a list (a real source: scan / read by location), one shard."""

    def __init__(self, rows: list[dict], transform):
        self.rows, self.transform = rows, transform

    num_shards = 1

    def scan(self, shard: int):
        for i, row in enumerate(self.rows):
            yield (i,), row

    def read(self, location):
        return self.rows[int(location[0])]

    def describe(self) -> dict:
        return {"kind": "rows", "n": len(self.rows)}


def _chat(key: str, text: str, image: bool) -> dict:
    meta = {
        "messages": [
            {"role": "user", "content": ("<image> " if image else "") + text},
            {"role": "assistant", "content": "an answer " * (1 + len(key) % 3)},
        ],
        **({"images": ["0.png"]} if image else {}),
    }
    return {
        "__key__": key,
        "json": json.dumps(meta).encode(),
        **({"0.png": png(32 + 8 * (len(key) % 4), 40, seed=len(key))} if image else {}),
    }


@pytest.fixture(scope="module")
def mixture():
    vlm = VLMSampleTransform(
        tokenizer=TOK, model_config=tiny_config("qwen2_5_vl"), video_processor_config={}
    )
    text = [
        _chat(f"t{i}" + "x" * i, "say something " * (1 + i % 4), image=False) for i in range(10)
    ]
    images = [_chat(f"i{i}" + "y" * i, "what is shown?", image=True) for i in range(6)]
    videos = [video_raw(f"v{i}", 2 + i % 3, 32, 32, 2.0, image=False) for i in range(4)]
    return Mixture(
        {
            "text": (_Rows(text, vlm), 0.4),
            "images": (_Rows(images, vlm), 0.4),
            "video": (_Rows(videos, vlm), 0.2),
        }
    )


def _alone(sample: dict) -> dict:
    return THDCollator(schema=SCHEMA, layout=LAYOUT, cp_rank=None)([sample])


def test_vlm_mixture_batches_equal_each_sample_collated_alone(mixture):
    def loader(cp_rank):
        return PackedLoader(
            mixture,
            schema=SCHEMA,
            layout=LAYOUT,
            token_budget=2048,
            cp_rank=cp_rank,
            seed=1,
            planner=PlannerConfig(chunk_size=64),
        )

    whole, ranks = list(loader(None)), [list(loader(r)) for r in range(2)]
    assert len(whole) == len(ranks[0]) == len(ranks[1]) >= 2
    comps = {int(c) for b in whole for c in b["sample_component"]}
    assert comps == {0, 1, 2}
    mixed = [b for b in whole if len(set(b["sample_component"].tolist())) > 1]
    assert mixed, "no micro-batch packs two components together"
    seen_video = False
    for b, *shards in zip(whole, *ranks):
        samples = [
            mixture.load(tuple(mixture_loc))
            for mixture_loc in loader(None).index.locations[b["sample_index"].numpy()].tolist()
        ]
        cu = b["cu_seqlens_padded"].tolist()
        pix = vids = 0
        for i, sample in enumerate(samples):
            alone = _alone(sample)
            assert "mrope_position_ids" in alone and "pixel_values" in alone
            n = alone["cu_seqlens_padded"][1].item()
            assert cu[i + 1] - cu[i] == n
            for key in ("input_ids", "labels", "mrope_position_ids", "mm_token_type_ids"):
                if key in alone:
                    got, want = b[key][..., cu[i] : cu[i] + n], alone[key][..., :n]
                    assert torch.equal(got, want), (key, i)
            p = alone["pixel_values"].shape[0]
            assert torch.equal(b["pixel_values"][pix : pix + p], alone["pixel_values"])
            pix += p
            if "pixel_values_videos" in alone:
                v = alone["pixel_values_videos"].shape[0]
                assert torch.equal(
                    b["pixel_values_videos"][vids : vids + v], alone["pixel_values_videos"]
                )
                vids += v
        assert pix == b["pixel_values"].shape[0]
        seen_video = seen_video or vids > 0
        validate_vlm_batch(b, SCHEMA, LAYOUT)  # (its cp_size: the layout's)
        for r, shard in enumerate(shards):  # each CP rank: the same samples, its zigzag shard
            assert torch.equal(shard["sample_index"], b["sample_index"])
            want = THDCollator(schema=SCHEMA, layout=LAYOUT, cp_rank=r)(samples)
            for key in ("input_ids", "labels", "mrope_position_ids", "pixel_values"):
                if key in want:
                    assert torch.equal(shard[key], want[key]), (key, r)
            assert shard["input_ids"].shape[-1] * 2 == b["input_ids"].shape[-1]
    assert seen_video
